//! Steady load for the chaos suite: a fixed number of client workers, each
//! sending one request at a time at a paced rate to the front sidecars
//! (seeded choice), every request under its own deadline, and every outcome
//! recorded with the phase it started in. A refused connection to a sidecar
//! goes to the next one, as a Service's load balancer would do.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use kvmesh_tests::route::MODEL;
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The client's deadline for one request; the sidecars' overall deadline
/// (15 s) is shorter, so a request that ends by this deadline ended by the
/// sidecar's doing, never the client's.
pub const DEADLINE: Duration = Duration::from_secs(25);

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A complete response (`data: [DONE]` for a stream, choices otherwise).
    Complete,
    /// An OpenAI-style error: a JSON error body before streaming, or an SSE
    /// error event after.
    CleanError(String),
    /// The connection broke with no error said (a sidecar killed under it).
    Cut(String),
    /// Nothing ended it within [`DEADLINE`].
    Hung,
    /// The client went away on purpose (the disconnect fault).
    Abandoned,
    /// No front sidecar accepted the connection.
    NoSidecar,
}

impl Outcome {
    pub fn failed(&self) -> bool {
        matches!(
            self,
            Self::CleanError(_) | Self::Cut(_) | Self::Hung | Self::NoSidecar
        )
    }
}

#[derive(Debug, Clone)]
pub struct Record {
    pub phase: usize,
    pub outcome: Outcome,
}

/// splitmix64: a seeded, dependency-free generator.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Shared control of the running load.
#[derive(Default)]
pub struct Control {
    pub phase: AtomicUsize,
    pub stop: AtomicBool,
    /// Percent of requests whose client disconnects at a random point.
    pub disconnect_pct: AtomicU32,
    pub records: Mutex<Vec<Record>>,
    /// Requests started and not yet recorded.
    pub open: AtomicUsize,
    /// Fronts (bit i: `fronts[i]`) taken out of the load balancer's rotation,
    /// as Kubernetes takes a terminating pod out of its Service's endpoints
    /// before the SIGTERM (after its preStop hook).
    pub excluded: AtomicU64,
    /// What the clients have sent each front (`fronts[i]`), as they count it.
    pub sent: [FrontCount; MAX_FRONTS],
}

/// The most fronts [`start`] takes.
pub const MAX_FRONTS: usize = 8;

/// The clients' own count of one front's requests. A sidecar's in-flight
/// gauge misses what it has not yet read off its sockets (a request sent
/// while it is scraped, or just before it dies), so a bound on what a killed
/// sidecar may lose takes these as well.
#[derive(Default)]
pub struct FrontCount {
    /// Attempts on this front begun.
    pub begun: AtomicU64,
    /// Attempts on this front not yet ended (a refused connection ends one).
    pub open: AtomicUsize,
}

/// One attempt on a front, counted open until dropped (also when its
/// request's deadline cancels it).
struct Attempt<'a>(&'a FrontCount);

impl<'a> Attempt<'a> {
    fn begin(c: &'a FrontCount) -> Self {
        c.begun.fetch_add(1, Ordering::AcqRel);
        c.open.fetch_add(1, Ordering::AcqRel);
        Self(c)
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Control {
    /// Takes front `i` out of rotation (a drain is coming).
    pub fn exclude(&self, i: usize) {
        self.excluded.fetch_or(1 << i, Ordering::AcqRel);
    }

    /// Puts front `i` back.
    pub fn include(&self, i: usize) {
        self.excluded.fetch_and(!(1 << i), Ordering::AcqRel);
    }
}

/// Stops the load: every worker ends (each request within its deadline),
/// and the requests' records come back.
pub async fn stop(control: &Control, workers: Vec<JoinHandle<()>>) -> Vec<Record> {
    control.stop.store(true, Ordering::Release);
    for w in workers {
        tokio::time::timeout(DEADLINE * 2, w)
            .await
            .expect("every worker stops")
            .expect("worker");
    }
    control.records.lock().expect("records").clone()
}

/// Starts `workers` client loops at `rate` requests per second in all
/// against `fronts`.
pub fn start(
    fronts: Vec<SocketAddr>,
    workers: usize,
    rate: f64,
    seed: u64,
    control: Arc<Control>,
) -> Vec<JoinHandle<()>> {
    assert!(fronts.len() <= MAX_FRONTS, "at most {MAX_FRONTS} fronts");
    let period = Duration::from_secs_f64(workers as f64 / rate.max(0.1));
    (0..workers)
        .map(|w| {
            let fronts = fronts.clone();
            let control = control.clone();
            tokio::spawn(async move {
                let client = kvmesh_tests::client::http1();
                let mut rng = Rng::new(seed ^ ((w as u64 + 1) << 32));
                // Stagger the workers over one period.
                tokio::time::sleep(period.mul_f64(w as f64 / workers as f64)).await;
                let mut next = Instant::now();
                // Bounded: at most a million requests per worker.
                for n in 0..1_000_000u64 {
                    if control.stop.load(Ordering::Acquire) {
                        return;
                    }
                    tokio::time::sleep_until(next).await;
                    next += period;
                    let phase = control.phase.load(Ordering::Acquire);
                    let first = rng.below(fronts.len() as u64) as usize;
                    let disconnect =
                        rng.below(100) < u64::from(control.disconnect_pct.load(Ordering::Acquire));
                    let cut_at = rng.below(4) as usize;
                    let body = request_body(&mut rng, w, n);
                    control.open.fetch_add(1, Ordering::AcqRel);
                    let excluded = control.excluded.load(Ordering::Acquire);
                    let outcome = tokio::time::timeout(
                        DEADLINE,
                        one(
                            &client,
                            &fronts,
                            &control.sent,
                            excluded,
                            first,
                            body,
                            disconnect.then_some(cut_at),
                        ),
                    )
                    .await
                    .unwrap_or(Outcome::Hung);
                    if let Ok(mut r) = control.records.lock() {
                        r.push(Record { phase, outcome });
                    }
                    control.open.fetch_sub(1, Ordering::AcqRel);
                }
            })
        })
        .collect()
}

/// A completion body: most share one of a few long system prefixes (so
/// prefix routing spreads them), one in four is a long unique prompt (split
/// into prefill and decode), one in five is not streamed.
fn request_body(rng: &mut Rng, worker: usize, n: u64) -> String {
    let long = rng.below(4) == 0;
    let group = rng.below(6);
    let prompt = if long {
        (0..420)
            .map(|k| format!("w{worker}n{n}t{k} "))
            .collect::<String>()
    } else {
        let system: String = (0..40).map(|k| format!("group{group} rule{k} ")).collect();
        format!("{system} question {worker} {n}")
    };
    let stream = rng.below(5) != 0;
    let max_tokens = 32 + rng.below(128);
    serde_json::json!({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
        "stream": stream, "ignore_eos": true,
    })
    .to_string()
}

async fn one(
    client: &kvmesh_tests::client::TestClient,
    fronts: &[SocketAddr],
    sent: &[FrontCount],
    excluded: u64,
    first: usize,
    body: String,
    disconnect_after: Option<usize>,
) -> Outcome {
    let stream = body.contains("\"stream\":true");
    for k in 0..fronts.len() {
        let i = (first + k) % fronts.len();
        if excluded & (1 << i) != 0 {
            continue;
        }
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("http://{}/v1/completions", fronts[i]))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())));
        let Ok(req) = req else {
            return Outcome::CleanError("bad test request".into());
        };
        let _attempt = Attempt::begin(&sent[i]);
        match client.request(req).await {
            Ok(resp) => return read(resp, stream, disconnect_after).await,
            Err(e) if e.is_connect() => continue,
            Err(e) => return Outcome::Cut(format!("{e:?}")),
        }
    }
    Outcome::NoSidecar
}

async fn read(
    resp: http::Response<Incoming>,
    stream: bool,
    disconnect_after: Option<usize>,
) -> Outcome {
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut text = Vec::new();
    let mut frames = 0usize;
    loop {
        if disconnect_after.is_some_and(|k| frames >= k) {
            return Outcome::Abandoned;
        }
        match body.frame().await {
            None => break,
            Some(Ok(f)) => {
                if let Some(d) = f.data_ref() {
                    text.extend_from_slice(d);
                    frames += 1;
                }
            }
            Some(Err(e)) => {
                let t = String::from_utf8_lossy(&text);
                if let Some(err) = sse_error(&t) {
                    return Outcome::CleanError(err);
                }
                return Outcome::Cut(format!("status {status}: {e}"));
            }
        }
    }
    let t = String::from_utf8_lossy(&text);
    if status != 200 {
        let msg = serde_json::from_str::<Value>(&t)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_owned));
        return match msg {
            Some(m) => Outcome::CleanError(format!("{status}: {m}")),
            None => Outcome::Cut(format!("status {status} without an OpenAI error: {t}")),
        };
    }
    if stream {
        if let Some(err) = sse_error(&t) {
            return Outcome::CleanError(err);
        }
        if t.contains("data: [DONE]") {
            Outcome::Complete
        } else {
            Outcome::Cut("stream ended without [DONE] or an error event".into())
        }
    } else {
        match serde_json::from_str::<Value>(&t) {
            Ok(v) if v["choices"].is_array() => Outcome::Complete,
            _ => Outcome::Cut(format!("200 without choices: {t}")),
        }
    }
}

/// The message of an SSE error event in `text`, if any.
fn sse_error(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v["error"]["message"].as_str().map(str::to_owned))
}
