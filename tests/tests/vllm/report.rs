//! Timing report: how long set-up and each case took.
//!
//! Lines go straight to the process's stderr, not through `eprintln!`, because the test harness
//! captures `print!`/`eprint!` output of passing tests and these figures should be seen on every run.

use std::io::Write;
use std::time::{Duration, Instant};

/// Writes one line to stderr, bypassing the test harness's output capture.
pub fn note(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "[vllm_e2e] {line}");
}

/// Times the steps of one group (set-up, engine start, each case) and prints a summary at the end.
#[derive(Debug)]
pub struct Timings {
    group: &'static str,
    started: Instant,
    steps: Vec<(String, Duration, bool)>,
}

impl Timings {
    pub fn new(group: &'static str) -> Self {
        note(&format!("{group}: starting"));
        Timings {
            group,
            started: Instant::now(),
            steps: Vec::new(),
        }
    }

    /// Runs one named step, prints its duration and outcome, and passes its result on.
    pub fn step<T>(
        &mut self,
        name: &str,
        f: impl FnOnce() -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        note(&format!("{}: {name} ...", self.group));
        let t = Instant::now();
        let out = f();
        let took = t.elapsed();
        let ok = out.is_ok();
        // A failure's reason on the same line: CI shows this line, not always the panic.
        let why = match &out {
            Ok(_) => String::new(),
            Err(e) => format!(": {e:#}"),
        };
        note(&format!(
            "{}: {name}: {} in {:.1} s{why}",
            self.group,
            if ok { "ok" } else { "FAILED" },
            took.as_secs_f64()
        ));
        self.steps.push((name.to_string(), took, ok));
        out.map_err(|e| e.context(format!("{}: {name}", self.group)))
    }
}

impl Drop for Timings {
    fn drop(&mut self) {
        let mut lines = vec![format!(
            "{}: summary ({:.1} s in all)",
            self.group,
            self.started.elapsed().as_secs_f64()
        )];
        for (name, took, ok) in &self.steps {
            lines.push(format!(
                "  {:>6.1} s  {}  {name}",
                took.as_secs_f64(),
                if *ok { "ok    " } else { "FAILED" }
            ));
        }
        note(&lines.join("\n"));
    }
}
