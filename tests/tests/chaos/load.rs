//! Steady load for the chaos suite: a fixed number of client workers, each
//! sending one request at a time at a paced rate to the front sidecars
//! (seeded choice), every request under its own deadline, and every outcome
//! recorded with the phase it started in. A refused connection to a sidecar
//! goes to the next one, as a Service's load balancer would do.
//!
//! Streams are greedy (`temperature: 0`) and ask for their token ids, some
//! of them long generations, so that a stream that migrated mid-way can be
//! checked token by token: it must hold exactly `max_tokens` tokens, end
//! with `finish_reason: "length"`, count them all in `usage`, and (checked
//! by the suite against an engine nobody interrupted) carry the ids and text
//! of an uninterrupted run. Each request has its own `x-request-id`, which
//! the sidecars' access lines repeat with their migrations.

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
    /// An OpenAI-style error body, before the response began.
    CleanError(String),
    /// An SSE error event: the stream began and then failed.
    StreamError(String),
    /// The connection broke with no error said (a sidecar killed under it).
    Cut(String),
    /// Nothing ended it within [`DEADLINE`].
    Hung,
    /// The client went away on purpose (the disconnect fault).
    Abandoned,
    /// No front sidecar accepted the connection.
    NoSidecar,
    /// A response that said it was complete but is not what was asked: a
    /// stream short of `max_tokens` without a finish, a stream or body whose
    /// token count, `usage` or `id` disagree (tokens lost or duplicated
    /// across a migration).
    Wrong(String),
}

impl Outcome {
    pub fn failed(&self) -> bool {
        matches!(
            self,
            Self::CleanError(_)
                | Self::StreamError(_)
                | Self::Cut(_)
                | Self::Hung
                | Self::NoSidecar
                | Self::Wrong(_)
        )
    }
}

#[derive(Debug, Clone)]
pub struct Record {
    pub phase: usize,
    pub outcome: Outcome,
    /// The request's `x-request-id`.
    pub id: String,
    /// The request's body (what a reference run sends again).
    pub body: String,
    /// The front that took the request (its index in the fronts), if any.
    pub front: Option<usize>,
    /// A stream's tokens as the client read them.
    pub read: Option<StreamRead>,
    /// When the request was sent, and when it ended.
    pub started: Instant,
    pub ended: Instant,
}

/// What the client read of a stream.
#[derive(Debug, Clone, Default)]
pub struct StreamRead {
    pub token_ids: Vec<u64>,
    pub text: String,
    /// The longest wait between two events that carried tokens, ms: for a
    /// stream that migrated, the gap the migration left in it.
    pub max_gap_ms: f64,
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
                    let id = format!("chaos-{seed}-{w}-{n}");
                    control.open.fetch_add(1, Ordering::AcqRel);
                    let excluded = control.excluded.load(Ordering::Acquire);
                    let front = std::sync::Mutex::new(None);
                    let started = Instant::now();
                    let ended = tokio::time::timeout(
                        DEADLINE,
                        one(
                            &client,
                            Ask {
                                fronts: &fronts,
                                sent: &control.sent,
                                excluded,
                                first,
                                id: &id,
                                body: &body,
                                disconnect_after: disconnect.then_some(cut_at),
                            },
                            &front,
                        ),
                    )
                    .await;
                    let (outcome, read) = ended.unwrap_or((Outcome::Hung, None));
                    let front = front.lock().ok().and_then(|f| *f);
                    if let Ok(mut r) = control.records.lock() {
                        r.push(Record {
                            phase,
                            outcome,
                            id,
                            body,
                            front,
                            read,
                            started,
                            ended: Instant::now(),
                        });
                    }
                    control.open.fetch_sub(1, Ordering::AcqRel);
                }
            })
        })
        .collect()
}

/// A completion body: most share one of a few long system prefixes (so
/// prefix routing spreads them), one in four is a long unique prompt (split
/// into prefill and decode), one in five is not streamed. Streams are
/// greedy and return their token ids; one in three is a long generation
/// (hundreds of tokens, a second or more), so that a fault finds streams
/// mid-way.
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
    let long_generation = rng.below(3) == 0;
    let max_tokens = 32 + rng.below(128);
    if !stream {
        return serde_json::json!({
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
            "stream": false, "ignore_eos": true, "temperature": 0,
        })
        .to_string();
    }
    let max_tokens = if long_generation {
        LONG_GENERATION.0 + rng.below(LONG_GENERATION.1 - LONG_GENERATION.0)
    } else {
        max_tokens
    };
    serde_json::json!({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
        "stream": true, "ignore_eos": true, "temperature": 0,
        "return_token_ids": true, "stream_options": {"include_usage": true},
    })
    .to_string()
}

/// The range of a long generation's `max_tokens`: about 0.5 to 1.5 s of
/// decoding at the fleet's time scale.
const LONG_GENERATION: (u64, u64) = (300, 900);

/// One request to send.
struct Ask<'a> {
    fronts: &'a [SocketAddr],
    sent: &'a [FrontCount],
    excluded: u64,
    first: usize,
    id: &'a str,
    body: &'a str,
    disconnect_after: Option<usize>,
}

/// Sends `ask` to the first front in rotation that takes the connection
/// (recorded in `front`, so that a request the deadline cancels still says
/// where it was).
async fn one(
    client: &kvmesh_tests::client::TestClient,
    ask: Ask<'_>,
    front: &std::sync::Mutex<Option<usize>>,
) -> (Outcome, Option<StreamRead>) {
    let want: Value = serde_json::from_str(ask.body).unwrap_or(Value::Null);
    let fronts = ask.fronts;
    for k in 0..fronts.len() {
        let i = (ask.first + k) % fronts.len();
        if ask.excluded & (1 << i) != 0 {
            continue;
        }
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("http://{}/v1/completions", fronts[i]))
            .header("content-type", "application/json")
            .header("x-request-id", ask.id)
            .body(Full::new(Bytes::from(ask.body.to_owned())));
        let Ok(req) = req else {
            return (Outcome::CleanError("bad test request".into()), None);
        };
        if let Ok(mut f) = front.lock() {
            *f = Some(i);
        }
        let _attempt = Attempt::begin(&ask.sent[i]);
        match client.request(req).await {
            Ok(resp) => return read(resp, &want, ask.disconnect_after).await,
            Err(e) if e.is_connect() => continue,
            Err(e) => return (Outcome::Cut(format!("{e:?}")), None),
        }
    }
    if let Ok(mut f) = front.lock() {
        *f = None;
    }
    (Outcome::NoSidecar, None)
}

async fn read(
    resp: http::Response<Incoming>,
    want: &Value,
    disconnect_after: Option<usize>,
) -> (Outcome, Option<StreamRead>) {
    let status = resp.status().as_u16();
    let stream = want["stream"] == true;
    let mut body = resp.into_body();
    let mut text = Vec::new();
    let mut frames = 0usize;
    let mut events = Events::default();
    loop {
        if disconnect_after.is_some_and(|k| frames >= k) {
            return (Outcome::Abandoned, None);
        }
        match body.frame().await {
            None => break,
            Some(Ok(f)) => {
                if let Some(d) = f.data_ref() {
                    text.extend_from_slice(d);
                    frames += 1;
                    if stream && status == 200 {
                        events.feed(d);
                    }
                }
            }
            Some(Err(e)) => {
                let t = String::from_utf8_lossy(&text);
                if let Some(err) = sse_error(&t) {
                    return (Outcome::StreamError(err), None);
                }
                return (Outcome::Cut(format!("status {status}: {e}")), None);
            }
        }
    }
    let t = String::from_utf8_lossy(&text);
    if status != 200 {
        let msg = serde_json::from_str::<Value>(&t)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_owned));
        let outcome = match msg {
            Some(m) => Outcome::CleanError(format!("{status}: {m}")),
            None => Outcome::Cut(format!("status {status} without an OpenAI error: {t}")),
        };
        return (outcome, None);
    }
    let max_tokens = want["max_tokens"].as_u64().unwrap_or(0);
    if stream {
        if let Some(err) = sse_error(&t) {
            return (Outcome::StreamError(err), None);
        }
        if !t.contains("data: [DONE]") {
            let outcome = Outcome::Cut("stream ended without [DONE] or an error event".into());
            return (outcome, None);
        }
        let outcome = match events.wrong(max_tokens) {
            Some(why) => Outcome::Wrong(why),
            None => Outcome::Complete,
        };
        return (outcome, Some(events.read));
    }
    let outcome = match serde_json::from_str::<Value>(&t) {
        Ok(v) if v["choices"].is_array() => {
            let c = &v["choices"][0];
            let n = v["usage"]["completion_tokens"].as_u64();
            if n != Some(max_tokens) || c["finish_reason"] != "length" {
                Outcome::Wrong(format!(
                    "{n:?} tokens of {max_tokens}, finish {}",
                    c["finish_reason"]
                ))
            } else {
                Outcome::Complete
            }
        }
        _ => Outcome::Cut(format!("200 without choices: {t}")),
    };
    (outcome, None)
}

/// A stream's events as they arrive: the tokens, when each came, and what a
/// complete stream must agree on.
#[derive(Default)]
struct Events {
    pending: Vec<u8>,
    read: StreamRead,
    last_token_at: Option<Instant>,
    ids: Vec<String>,
    finish: Option<String>,
    usage_tokens: Option<u64>,
    unparsed: usize,
}

impl Events {
    fn feed(&mut self, data: &[u8]) {
        self.pending.extend_from_slice(data);
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            let Some(payload) = event.strip_prefix(b"data: ") else {
                continue;
            };
            let payload = payload.trim_ascii();
            if payload == b"[DONE]" {
                continue;
            }
            match serde_json::from_slice::<Value>(payload) {
                Ok(v) => self.event(&v),
                Err(_) => self.unparsed += 1,
            }
        }
    }

    fn event(&mut self, v: &Value) {
        if let Some(id) = v["id"].as_str() {
            if self.ids.last().map(String::as_str) != Some(id) {
                self.ids.push(id.to_owned());
            }
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            self.usage_tokens = Some(n);
        }
        let c = &v["choices"][0];
        if let Some(f) = c["finish_reason"].as_str() {
            self.finish = Some(f.to_owned());
        }
        let ids: Vec<u64> = c["token_ids"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
            .collect();
        let text = c["text"].as_str().unwrap_or("");
        if ids.is_empty() && text.is_empty() {
            return;
        }
        let now = Instant::now();
        if let Some(prev) = self.last_token_at {
            let gap = (now - prev).as_secs_f64() * 1000.0;
            self.read.max_gap_ms = self.read.max_gap_ms.max(gap);
        }
        self.last_token_at = Some(now);
        self.read.token_ids.extend(ids);
        self.read.text.push_str(text);
    }

    /// Why a stream that ended with `[DONE]` is not the one asked for.
    fn wrong(&self, max_tokens: u64) -> Option<String> {
        let n = self.read.token_ids.len() as u64;
        let finish = self.finish.as_deref();
        if self.unparsed > 0 {
            return Some(format!("{} events that are not JSON", self.unparsed));
        }
        if self.ids.len() != 1 {
            return Some(format!(
                "{} ids in one stream: {:?}",
                self.ids.len(),
                self.ids
            ));
        }
        if n != max_tokens || finish != Some("length") {
            return Some(format!(
                "{n} tokens of {max_tokens}, finish {finish:?} (truncated or duplicated)"
            ));
        }
        if self.usage_tokens != Some(max_tokens) {
            return Some(format!(
                "usage counts {:?} tokens of {max_tokens}",
                self.usage_tokens
            ));
        }
        None
    }
}

/// The message of an SSE error event in `text`, if any.
fn sse_error(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v["error"]["message"].as_str().map(str::to_owned))
}
