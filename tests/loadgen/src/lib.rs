//! kvmesh-loadgen: the instruments that show how much faster kvmesh serves.
//!
//! A load generator for OpenAI-compatible endpoints. The pieces, in the order
//! a benchmark uses them:
//!
//! * [`workload`]: deterministic request lists modelled on the field's
//!   routing benchmarks (shared prefix, multi-turn chat, P/D, long bodies,
//!   tiny requests), each with a small (CI) and a full size;
//! * [`load`]: open loop (Poisson, rate ladders) or closed loop (fixed
//!   concurrency, concurrency ladders), each stage bounded;
//! * [`runner::run`]: sends a workload to a set of base URLs and records per
//!   request TTFT, inter-token latencies, end-to-end latency, tokens and
//!   `cached_tokens` ([`client`] does the measuring);
//! * [`stats::Summary`] and [`report`]: percentiles and rates, then a text
//!   table with ratios to a baseline, JSON, and a PNG plot;
//! * [`fake::FastEngine`]: an instant fake engine for proxy-overhead runs,
//!   and [`overhead`]: the direct / kvmesh / nginx comparison;
//! * [`valkey`]: real `valkey-server` processes (one, a primary with a
//!   replica, a cluster of three) for the Valkey index's tests and benches.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvmesh_loadgen::LoadgenError> {
//! use kvmesh_loadgen::{report::Report, runner, workload::{Size, Workload}, RunConfig};
//! let (workload, load) = Workload::named("shared-prefix", Size::Small, 7)?;
//! let cfg = RunConfig::new(&["http://127.0.0.1:8000".to_string()], "sim")?;
//! let result = runner::run(&cfg, &workload, &load).await?;
//! let mut report = Report::new("round-robin");
//! report.add(&workload.name, "round-robin", &result);
//! println!("{}", report.table());
//! # Ok(()) }
//! ```

pub mod client;
pub mod error;
pub mod fake;
pub mod load;
pub mod overhead;
pub mod progress;
pub mod record;
pub mod report;
pub mod runner;
pub mod soak;
pub mod sse;
pub mod stats;
pub mod valkey;
pub mod workload;

pub use client::{Client, ClientConfig, Target};
pub use error::LoadgenError;
pub use load::{Arrival, Load, Stage};
pub use record::RequestRecord;
pub use runner::{run, RunConfig, RunResult, Spread};
pub use stats::Summary;
pub use workload::{Size, Workload};
