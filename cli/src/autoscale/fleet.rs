//! A fleet that grows and shrinks while it serves: simulated engine pods with
//! their kvmesh sidecars, started and stopped the way a Deployment's
//! ReplicaSet does it.
//!
//! - **Start.** A new pod is billed from the moment it is asked for. It
//!   loads its model for `startup` (simulated) while its engine and sidecar
//!   start; once both are done and the sidecar reports ready, the pod joins
//!   the mesh (the peers file every sidecar follows, as a headless Service
//!   lists ready pods) and the client Service's endpoints.
//! - **Stop.** The newest pod goes first, a starting one before a ready
//!   one (the ReplicaSet deletes not-ready pods first). A ready pod leaves
//!   the endpoints and the mesh, waits `pre_stop` (a preStop hook, so that
//!   clients and peers see it gone), then its sidecar drains (in flight
//!   finishes, up to the drain timeout) and its engine stops. It is billed
//!   until then.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use http::Uri;
use kvmesh_filters::sched::{FilterConfig, Role};
use kvmesh_proxy::config::Config;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::demo::fleet::{peers_file_path, start_sidecar, wait_ready, DemoPod, FleetSpec, PodNet};
use crate::demo::{DemoError, Policy};
use kvmesh_engine_sim::Engine;

/// Converts between the simulated clock (the engines') and wall time.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    pub t0: Instant,
    /// Simulated seconds per wall second.
    pub scale: f64,
}

impl Clock {
    /// Simulated seconds since the start.
    pub fn now_s(&self) -> f64 {
        self.t0.elapsed().as_secs_f64() * self.scale
    }

    /// The wall duration of `sim` simulated time.
    pub fn wall(&self, sim: Duration) -> Duration {
        sim.div_f64(self.scale)
    }

    /// The wall instant at simulated second `s`.
    pub fn at(&self, s: f64) -> Instant {
        self.t0 + Duration::from_secs_f64(s.max(0.0) / self.scale)
    }
}

/// The client Service: the ready pods' sidecars, in order of readiness.
pub type Endpoints = Arc<RwLock<Vec<Uri>>>;

/// How the fleet's pods are made.
pub struct PodTemplate {
    pub spec: FleetSpec,
    pub policy: Policy,
    /// The sidecars' filter config (the policy says where prefix matches
    /// come from and whether the fleet is split).
    pub filters: FilterConfig,
    /// The sidecar config on top of the fleet's (autoscale section, drain).
    pub edit: Arc<dyn Fn(&mut Config) + Send + Sync>,
    /// Simulated model-load time before a pod serves.
    pub startup: Duration,
    /// Simulated time a leaving pod waits out of the endpoints before draining.
    pub pre_stop: Duration,
}

enum State {
    Starting(JoinHandle<Result<DemoPod, DemoError>>),
    Ready(Box<DemoPod>),
}

struct Pod {
    role: Role,
    state: State,
    /// Simulated second it was asked for.
    billed_from: f64,
}

/// One pod's bill: its role and the simulated seconds it held a GPU.
#[derive(Debug, Clone, Copy)]
pub struct Bill {
    pub role: Role,
    pub from_s: f64,
    pub to_s: f64,
}

/// See the module docs.
pub struct ElasticFleet {
    template: Arc<PodTemplate>,
    clock: Clock,
    peers_file: PathBuf,
    pods: Vec<Pod>,
    endpoints: Endpoints,
    /// Pods on their way out (draining): each task ends with the pod's
    /// bill, or `None` where it was billed already.
    leaving: Vec<JoinHandle<Option<Bill>>>,
    bills: Vec<Bill>,
    /// Starts that failed (an engine or sidecar that did not come up).
    pub failed_starts: usize,
}

impl ElasticFleet {
    /// An empty fleet; [`ElasticFleet::scale`] adds pods.
    pub fn new(template: PodTemplate, clock: Clock) -> Result<Self, DemoError> {
        let peers_file = peers_file_path();
        std::fs::write(&peers_file, b"").map_err(DemoError::Io)?;
        Ok(Self {
            template: Arc::new(template),
            clock,
            peers_file,
            pods: Vec::new(),
            endpoints: Arc::new(RwLock::new(Vec::new())),
            leaving: Vec::new(),
            bills: Vec::new(),
            failed_starts: 0,
        })
    }

    /// Restarts the clock (the trace begins): pods already there are
    /// billed from its start.
    pub fn set_clock(&mut self, clock: Clock) {
        self.clock = clock;
        for p in &mut self.pods {
            p.billed_from = 0.0;
        }
    }

    pub fn endpoints(&self) -> Endpoints {
        self.endpoints.clone()
    }

    /// Pods of `role` asked for and not stopped (starting or ready): the
    /// Deployment's replicas.
    pub fn replicas(&self, role: Role) -> usize {
        self.pods.iter().filter(|p| p.role == role).count()
    }

    /// Ready pods of `role`.
    pub fn ready(&self, role: Role) -> impl Iterator<Item = &DemoPod> {
        self.pods.iter().filter_map(move |p| match &p.state {
            State::Ready(d) if p.role == role => Some(&**d),
            _ => None,
        })
    }

    /// Every ready pod.
    pub fn all_ready(&self) -> impl Iterator<Item = &DemoPod> {
        self.pods.iter().filter_map(|p| match &p.state {
            State::Ready(d) => Some(&**d),
            _ => None,
        })
    }

    /// Brings the pods of `role` to `want`: starts new ones (each after
    /// `startup`) or stops the newest.
    pub fn scale(&mut self, role: Role, want: usize) {
        while self.replicas(role) < want {
            self.start(role, self.template.startup);
        }
        while self.replicas(role) > want {
            self.stop_newest(role);
        }
    }

    /// Starts `n` pods of `role` that serve at once (a fleet that was
    /// already running when the trace began).
    pub fn start_warm(&mut self, role: Role, n: usize) {
        for _ in 0..n {
            self.start(role, Duration::ZERO);
        }
    }

    fn start(&mut self, role: Role, startup: Duration) {
        let t = self.template.clone();
        let peers_file = self.peers_file.clone();
        let delay = self.clock.wall(startup);
        let task = tokio::spawn(async move {
            // The sidecar and the engine's process come up while the model
            // loads, as a pod's containers do: the pod serves `startup`
            // after it was asked for, not that plus this machine's time
            // to spawn them (a few tenths of a second of wall time, seconds
            // at the time scale).
            let (pod, ()) =
                tokio::join!(start_pod(&t, role, &peers_file), tokio::time::sleep(delay));
            pod
        });
        self.pods.push(Pod {
            role,
            state: State::Starting(task),
            billed_from: self.clock.now_s(),
        });
    }

    fn stop_newest(&mut self, role: Role) {
        // Not-ready pods go first, then the newest ready one.
        let idx = self
            .pods
            .iter()
            .rposition(|p| p.role == role && matches!(p.state, State::Starting(_)))
            .or_else(|| self.pods.iter().rposition(|p| p.role == role));
        let Some(i) = idx else {
            return;
        };
        let pod = self.pods.remove(i);
        let clock = self.clock;
        let from_s = pod.billed_from;
        let pre_stop = clock.wall(self.template.pre_stop);
        match pod.state {
            State::Starting(task) => {
                // Deleted while loading its model: its GPU is free now; what
                // the start task brought up is stopped when it finishes.
                self.bills.push(Bill {
                    role,
                    from_s,
                    to_s: clock.now_s(),
                });
                self.leaving.push(tokio::spawn(async move {
                    if let Ok(Ok(p)) = task.await {
                        stop_pod(p).await;
                    }
                    None
                }));
            }
            State::Ready(p) => {
                self.publish();
                self.leaving.push(tokio::spawn(async move {
                    tokio::time::sleep(pre_stop).await;
                    stop_pod(*p).await;
                    Some(Bill {
                        role,
                        from_s,
                        to_s: clock.now_s(),
                    })
                }));
            }
        }
    }

    /// Moves pods whose start finished to ready (into the mesh and the
    /// endpoints); a start that failed leaves the fleet (the Deployment
    /// will ask again).
    pub async fn promote(&mut self) {
        let mut changed = false;
        let mut i = 0;
        while i < self.pods.len() {
            let finished = matches!(&self.pods[i].state, State::Starting(t) if t.is_finished());
            if !finished {
                i += 1;
                continue;
            }
            let pod = self.pods.remove(i);
            let State::Starting(task) = pod.state else {
                unreachable!("checked above");
            };
            match task.await {
                Ok(Ok(p)) => {
                    self.pods.insert(
                        i,
                        Pod {
                            state: State::Ready(Box::new(p)),
                            ..pod
                        },
                    );
                    changed = true;
                    i += 1;
                }
                Ok(Err(e)) => {
                    eprintln!("autoscale: a pod did not start: {e}");
                    self.failed_starts += 1;
                    self.bills.push(Bill {
                        role: pod.role,
                        from_s: pod.billed_from,
                        to_s: self.clock.now_s(),
                    });
                }
                Err(e) => {
                    eprintln!("autoscale: a pod's start task failed: {e}");
                    self.failed_starts += 1;
                }
            }
        }
        if changed {
            self.publish();
        }
    }

    /// Writes the ready pods into the peers file and the endpoints.
    fn publish(&self) {
        let ready: Vec<&DemoPod> = self.all_ready().collect();
        let peers: String = ready
            .iter()
            .filter_map(|p| p.sidecar.mesh_addr())
            .map(|a| format!("{a}\n"))
            .collect();
        // Written beside and renamed over, as Kubernetes updates a mounted
        // ConfigMap: a sidecar re-reading the file mid-write would see its
        // peers gone (truncated) and forget them until the next read.
        let tmp = self.peers_file.with_extension("peers.tmp");
        if let Err(e) =
            std::fs::write(&tmp, peers).and_then(|()| std::fs::rename(&tmp, &self.peers_file))
        {
            eprintln!("autoscale: the peers file could not be written: {e}");
        }
        let uris: Vec<Uri> = ready
            .iter()
            .filter_map(|p| format!("{}/v1/completions", p.url()).parse().ok())
            .collect();
        // A poisoned lock: a client task panicked while reading; the list is whole.
        *self.endpoints.write().unwrap_or_else(|p| p.into_inner()) = uris;
    }

    /// Stops every pod (draining) and returns every bill, each ending when
    /// its pod stopped or at `end_s`, whichever came first.
    pub async fn shutdown(mut self, end_s: f64) -> Vec<Bill> {
        let now = self.clock.now_s();
        for pod in std::mem::take(&mut self.pods) {
            self.bills.push(Bill {
                role: pod.role,
                from_s: pod.billed_from,
                to_s: end_s.min(now),
            });
            match pod.state {
                State::Starting(task) => {
                    // Bounded: the model-load delay and the readiness deadline.
                    if let Ok(Ok(p)) = task.await {
                        stop_pod(p).await;
                    }
                }
                State::Ready(p) => stop_pod(*p).await,
            }
        }
        for h in std::mem::take(&mut self.leaving) {
            if let Ok(Some(mut b)) = h.await {
                b.to_s = b.to_s.min(end_s);
                self.bills.push(b);
            }
        }
        // Best effort: a leftover file in the temp directory harms nothing.
        let _ = std::fs::remove_file(&self.peers_file);
        self.bills
    }
}

async fn start_pod(
    t: &PodTemplate,
    role: Role,
    peers_file: &std::path::Path,
) -> Result<DemoPod, DemoError> {
    let ip = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
    let listener = tokio::net::TcpListener::bind((ip, 0))
        .await
        .map_err(DemoError::Io)?;
    let engine = Engine::start(t.spec.sim_config(role), listener).await?;
    let pod = PodNet {
        ip,
        bootstrap_port: engine.addr().port(),
    };
    let started = start_sidecar(&t.spec, t.policy, &engine, role, pod, peers_file, &*t.edit).await;
    let sidecar = match started {
        Ok(s) => s,
        Err(e) => {
            engine.shutdown().await;
            return Err(e);
        }
    };
    if let Err(e) = sidecar.routing().install(&t.filters) {
        sidecar.shutdown().await;
        engine.shutdown().await;
        return Err(DemoError::Config(e.to_string()));
    }
    if let Err(e) = wait_ready(sidecar.admin_addr()).await {
        sidecar.shutdown().await;
        engine.shutdown().await;
        return Err(e);
    }
    Ok(DemoPod {
        engine,
        sidecar,
        role,
    })
}

async fn stop_pod(p: DemoPod) {
    p.sidecar.shutdown().await;
    p.engine.shutdown().await;
}
