//! How requests are sent: open loop (Poisson arrivals at a rate, or a ladder
//! of rates) or closed loop (a fixed number of concurrent users, or a ladder
//! of concurrencies), each stage bounded by a count and/or a duration.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::LoadgenError;

/// Default cap on requests in flight in open loop. When reached, arrivals
/// wait (and are counted as late), so a stalled target cannot make the load
/// generator hold unbounded requests.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 4096;

/// Hard cap on the requests of one run (bounded memory for records).
pub const MAX_RUN_REQUESTS: usize = 2_000_000;

/// How arrivals are paced within a stage.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Arrival {
    /// Open loop: exponential gaps with mean `1 / rate` seconds, whatever the
    /// responses do.
    Poisson { rate: f64 },
    /// Closed loop: `concurrency` workers, each sending its next request when
    /// its previous one finished.
    Closed { concurrency: usize },
}

/// One stage of a load. At least one bound must be set; the stage ends at
/// whichever comes first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    pub arrival: Arrival,
    pub max_requests: Option<usize>,
    pub max_duration: Option<Duration>,
}

/// A sequence of stages run one after the other; workload requests are taken
/// in order across stages (cycling when the stages want more than the
/// workload has).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Load {
    pub stages: Vec<Stage>,
    pub max_in_flight: usize,
}

impl Stage {
    /// A short label for tables and plots: `5/s` or `c=32`.
    pub fn label(&self) -> String {
        match self.arrival {
            Arrival::Poisson { rate } => format!("{rate}/s"),
            Arrival::Closed { concurrency } => format!("c={concurrency}"),
        }
    }

    /// The rate or concurrency, as a number for plots.
    pub fn level(&self) -> f64 {
        match self.arrival {
            Arrival::Poisson { rate } => rate,
            Arrival::Closed { concurrency } => concurrency as f64,
        }
    }
}

impl Load {
    fn single(arrival: Arrival, requests: usize) -> Load {
        Load {
            stages: vec![Stage {
                arrival,
                max_requests: Some(requests),
                max_duration: None,
            }],
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
        }
    }

    /// `requests` Poisson arrivals at `rate` per second.
    pub fn poisson(rate: f64, requests: usize) -> Load {
        Load::single(Arrival::Poisson { rate }, requests)
    }

    /// `requests` requests from `concurrency` closed-loop workers.
    pub fn closed(concurrency: usize, requests: usize) -> Load {
        Load::single(Arrival::Closed { concurrency }, requests)
    }

    /// A Poisson rate ladder: `(rate, duration)` per stage.
    pub fn poisson_ladder(steps: &[(f64, Duration)]) -> Load {
        Load {
            stages: steps
                .iter()
                .map(|&(rate, d)| Stage {
                    arrival: Arrival::Poisson { rate },
                    max_requests: None,
                    max_duration: Some(d),
                })
                .collect(),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
        }
    }

    /// A concurrency ladder: `(concurrency, requests)` per stage.
    pub fn closed_ladder(steps: &[(usize, usize)]) -> Load {
        Load {
            stages: steps
                .iter()
                .map(|&(concurrency, n)| Stage {
                    arrival: Arrival::Closed { concurrency },
                    max_requests: Some(n),
                    max_duration: None,
                })
                .collect(),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
        }
    }

    /// Bounds every stage additionally by `d` (a time box for CI).
    pub fn with_stage_duration(mut self, d: Duration) -> Load {
        for s in &mut self.stages {
            s.max_duration = Some(s.max_duration.map_or(d, |x| x.min(d)));
        }
        self
    }

    /// Rejects loads that cannot run or would never end.
    pub fn validate(&self) -> Result<(), LoadgenError> {
        let bad = |m: String| Err(LoadgenError::BadLoad(m));
        if self.stages.is_empty() {
            return bad("no stage".into());
        }
        if self.max_in_flight == 0 {
            return bad("max_in_flight is 0".into());
        }
        for (i, s) in self.stages.iter().enumerate() {
            match s.arrival {
                Arrival::Poisson { rate } if !(rate > 0.0 && rate.is_finite()) => {
                    return bad(format!("stage {i}: rate {rate} is not a positive number"));
                }
                Arrival::Closed { concurrency: 0 } => {
                    return bad(format!("stage {i}: concurrency 0"));
                }
                _ => {}
            }
            if s.max_requests.is_none() && s.max_duration.is_none() {
                return bad(format!("stage {i}: neither a request count nor a duration"));
            }
        }
        Ok(())
    }
}
