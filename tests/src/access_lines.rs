//! Access lines captured in memory: the sidecar's `AccessLayer` writing into
//! a buffer the test reads. A test runs on one thread, so the thread's
//! default subscriber sees every event of the sidecar's tasks.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvmesh_proxy::logging::AccessLayer;
use serde_json::Value;
use tracing_subscriber::layer::SubscriberExt;

/// See the module docs.
#[derive(Clone, Default)]
pub struct AccessLines(Arc<Mutex<Vec<u8>>>);

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl AccessLines {
    /// Captures this thread's access lines until the guard drops.
    pub fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let buf = self.0.clone();
        let layer = AccessLayer::new(move || Sink(buf.clone()));
        tracing::subscriber::set_default(tracing_subscriber::registry().with(layer))
    }

    /// Every line written so far, parsed.
    pub fn all(&self) -> Vec<Value> {
        let bytes = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let text = String::from_utf8(bytes).expect("access lines are UTF-8");
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    /// Waits (bounded) until `n` lines were written.
    pub async fn wait_for(&self, n: usize) -> Vec<Value> {
        for _ in 0..250 {
            let lines = self.all();
            if lines.len() >= n {
                return lines;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("{n} access lines not written within 5 s: {:?}", self.all());
    }
}
