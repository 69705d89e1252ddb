//! A one-line progress display on stderr (`\r`-rewritten every half second)
//! for long runs: stage, requests sent, done, errors, in flight, elapsed.

use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Counters shared by the runner's tasks.
#[derive(Debug, Default)]
pub struct Counters {
    pub sent: AtomicU64,
    pub done: AtomicU64,
    pub errors: AtomicU64,
    pub stage: AtomicUsize,
}

/// The running display; [`Progress::finish`] stops it and ends the line.
#[derive(Debug)]
pub struct Progress {
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Progress {
    /// Starts a display of `counters` when `enabled` (otherwise does nothing).
    pub fn start(enabled: bool, counters: Arc<Counters>, stage_labels: Vec<String>) -> Progress {
        let stop = CancellationToken::new();
        let task = enabled.then(|| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let t0 = Instant::now();
                let mut tick = tokio::time::interval(Duration::from_millis(500));
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tick.tick() => {}
                    }
                    let line = render(&counters, &stage_labels, t0.elapsed());
                    let mut err = std::io::stderr().lock();
                    // A failed progress write must not fail the run.
                    let _ = write!(err, "\r{line}\x1b[K");
                    let _ = err.flush();
                }
                let _ = writeln!(
                    std::io::stderr(),
                    "\r{}",
                    render(&counters, &stage_labels, t0.elapsed())
                );
            })
        });
        Progress { stop, task }
    }

    /// Stops the display and waits for its last line.
    pub async fn finish(mut self) {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn render(c: &Counters, labels: &[String], elapsed: Duration) -> String {
    let sent = c.sent.load(Ordering::Relaxed);
    let done = c.done.load(Ordering::Relaxed);
    let stage = c.stage.load(Ordering::Relaxed);
    format!(
        "stage {}/{} [{}] sent {sent} done {done} errors {} in-flight {} {:.1}s",
        stage + 1,
        labels.len(),
        labels.get(stage).map(String::as_str).unwrap_or("-"),
        c.errors.load(Ordering::Relaxed),
        sent.saturating_sub(done),
        elapsed.as_secs_f64()
    )
}
