//! The sidecar's own spans, exported over OTLP to an in-process receiver
//! (`kvmesh_tests::otlp`): a request that crosses the mesh and a P/D split
//! each make one trace under the client's span, with the stage spans and
//! their attributes, one client span per upstream call, and every engine
//! (or peer sidecar) receiving the `traceparent` of the span that called it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::net::SocketAddr;

use kvmesh_engine_sim::{ReceivedRequest, Role as SimRole, SimConfig, SimHandle};
use kvmesh_proxy::config::{OtlpProtocol, Tracing};
use kvmesh_proxy::SidecarHandle;
use kvmesh_tests::client::{fetch, http1, request};
use kvmesh_tests::mesh::{
    forwarded, indexes_converged, kv_sim, mesh_config, shared_prefix_body, start_on, write_peers,
};
use kvmesh_tests::otlp::{Collector, Received};
use kvmesh_tests::route::{add_peer, config, eventually, only_pod, pd_sim, sim, sim_with, MODEL};
use kvmesh_tests::sidecar::{refused_addr, start};

const TRACESTATE: &str = "vendor=abc,other=1";

fn tracing(c: &Collector, protocol: OtlpProtocol, sample_ratio: f64) -> Option<Tracing> {
    Some(Tracing {
        otlp_endpoint: c.endpoint().parse().unwrap(),
        protocol,
        sample_ratio,
    })
}

/// The client's trace id and span id for request `i`, and its `traceparent`.
fn client_span(i: usize) -> (String, String, String) {
    let (t, s) = (
        format!("{:032x}", 0xfeed_0000 + i),
        format!("{:016x}", 0x7ace + i),
    );
    let tp = format!("00-{t}-{s}-01");
    (t, s, tp)
}

async fn complete(addr: SocketAddr, body: &str, id: &str, tp: Option<&str>) {
    let mut headers = vec![("content-type", "application/json"), ("x-request-id", id)];
    if let Some(tp) = tp {
        headers.push(("traceparent", tp));
        headers.push(("tracestate", TRACESTATE));
    }
    let r = fetch(
        &http1(),
        request("POST", addr, "/v1/completions", body.to_owned(), &headers),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

fn inference(e: &SimHandle) -> Vec<ReceivedRequest> {
    let mut v = e.received_requests();
    v.retain(|r| r.path.starts_with("/v1/"));
    v
}

/// The spans of one trace, by span id.
struct Trace {
    spans: Vec<Received>,
}

impl Trace {
    fn of(all: &[Received], trace_id: &str) -> Self {
        Self {
            spans: all
                .iter()
                .filter(|s| s.trace_id() == trace_id)
                .cloned()
                .collect(),
        }
    }

    fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Received> + 'a {
        self.spans.iter().filter(move |s| s.name() == name)
    }

    fn children<'a>(&'a self, parent: &'a Received) -> impl Iterator<Item = &'a Received> + 'a {
        let id = parent.span_id();
        self.spans.iter().filter(move |s| s.parent_id() == id)
    }

    /// The one child of `parent` named `name`.
    fn child(&self, parent: &Received, name: &str) -> Received {
        let c: Vec<_> = self.children(parent).filter(|s| s.name() == name).collect();
        assert_eq!(
            c.len(),
            1,
            "{name} under {}: {:?}",
            parent.name(),
            self.names()
        );
        c[0].clone()
    }

    /// Every span hangs off the client's span `client`, directly or through
    /// spans of this trace: none is orphaned.
    fn assert_rooted(&self, client: &str, what: &str) {
        for s in &self.spans {
            assert!(
                s.parent_id() == client || self.by_id(&s.parent_id()).is_some(),
                "{what}: orphan {:?}",
                s.name()
            );
        }
    }

    fn by_id(&self, id: &str) -> Option<&Received> {
        self.spans.iter().find(|s| s.span_id() == id)
    }

    fn names(&self) -> Vec<(String, String, String)> {
        self.spans
            .iter()
            .map(|s| (s.name().to_owned(), s.span_id(), s.parent_id()))
            .collect()
    }
}

/// `traceparent` of the span `s` (sampled).
fn traceparent_of(s: &Received) -> String {
    format!("00-{}-{}-01", s.trace_id(), s.span_id())
}

/// The stage spans under a sidecar's `kvmesh.request` span, checked, and its
/// execute span.
/// `decided`: the reason of a request whose route came with it (a peer's
/// `routed_by_peer`, an llm-d EPP's `prefiller_header`), which skips the
/// prefix stage; `None` for a request this sidecar schedules.
fn stages(t: &Trace, request: &Received, decided: Option<&str>) -> Received {
    t.child(request, "kvmesh.classify");
    let schedule = t.child(request, "kvmesh.schedule");
    assert!(
        schedule.attr("kvmesh.schedule.reason").is_some(),
        "{schedule:?}"
    );
    if let Some(reason) = decided {
        assert_eq!(
            schedule.attr("kvmesh.schedule.reason").as_deref(),
            Some(reason)
        );
        assert_eq!(
            t.children(request)
                .filter(|s| s.name() == "kvmesh.prefix")
                .count(),
            0
        );
    } else {
        let prefix = t.child(request, "kvmesh.prefix");
        let blocks: u64 = prefix
            .attr("kvmesh.prefix.blocks")
            .unwrap()
            .parse()
            .unwrap();
        assert!(blocks > 0, "{prefix:?}");
        assert!(
            prefix.attr("kvmesh.prefix.matched_blocks").is_some(),
            "{prefix:?}"
        );
        assert!(
            schedule.attr("kvmesh.schedule.pod").is_some(),
            "{schedule:?}"
        );
        let top = schedule.attr("kvmesh.schedule.top_scores").unwrap();
        assert!(top.contains('='), "{top}");
    }
    t.child(request, "kvmesh.execute")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_across_the_mesh_is_one_trace_over_grpc() {
    let collector = Collector::start().await;
    let peers = tempfile::NamedTempFile::new().unwrap();
    let mut engines = Vec::new();
    let mut sidecars: Vec<SidecarHandle> = Vec::new();
    for _ in 0..2 {
        let e = kv_sim().await;
        let mut c = mesh_config(&e, peers.path());
        c.tracing = tracing(&collector, OtlpProtocol::Grpc, 1.0);
        sidecars.push(start_on(c, None).await);
        engines.push(e);
    }
    let addrs: Vec<SocketAddr> = sidecars.iter().map(|s| s.mesh_addr().unwrap()).collect();
    write_peers(peers.path(), &addrs);
    for s in &sidecars {
        eventually("both pods known", || async {
            (s.fleet().snapshot(tokio::time::Instant::now()).len() == 2).then_some(())
        })
        .await;
    }
    // As in trace_propagation.rs: prefixes land on some pod through either
    // sidecar; sent again through the other one, some cross the mesh.
    let mut sent = HashMap::new();
    let mut i = 0;
    for round in 0..3 {
        for group in 0..6 {
            let via = sidecars[(round + group) % 2].addr();
            let id = format!("req-{i}");
            let (t, s, tp) = client_span(i);
            complete(via, &shared_prefix_body(group, round), &id, Some(&tp)).await;
            sent.insert(id, (t, s));
            i += 1;
        }
        indexes_converged(&sidecars).await;
    }
    assert!(
        forwarded(&sidecars).await > 0.0,
        "no request crossed the mesh"
    );
    let received: HashMap<String, ReceivedRequest> = engines
        .iter()
        .flat_map(inference)
        .map(|r| (r.header("x-request-id").unwrap().to_owned(), r))
        .collect();
    // Shutdown flushes the span pipelines.
    for s in sidecars {
        s.shutdown().await;
    }
    let all = collector.spans();
    assert!(all.iter().all(|s| s.protocol == "grpc"));
    let mut crossed = 0;
    for (id, (trace_id, client)) in &sent {
        let t = Trace::of(&all, trace_id);
        let entry: Vec<&Received> = t
            .named("kvmesh.request")
            .filter(|s| &s.parent_id() == client)
            .collect();
        assert_eq!(entry.len(), 1, "{id}: {:?}", t.names());
        let entry = entry[0];
        let execute = stages(&t, entry, None);
        // These pods tokenize (the approximate mode of the P/D test does not).
        let prefix = t.child(entry, "kvmesh.prefix");
        assert!(prefix.attr("kvmesh.prefix.tokens").is_some(), "{prefix:?}");
        let hop = t.child(&execute, "kvmesh.forward");
        assert_eq!(hop.attr("kvmesh.attempt").as_deref(), Some("1"));
        let engine_hop = match hop.attr("kvmesh.upstream").as_deref() {
            Some("engine") => hop,
            Some("peer") => {
                crossed += 1;
                // The peer's server span is the child of the forward span.
                let far = t.child(&hop, "kvmesh.request");
                assert_ne!(
                    far.instance, entry.instance,
                    "{id}: both spans from one pod"
                );
                assert_eq!(far.attr("kvmesh.reason").as_deref(), Some("routed_by_peer"));
                let execute = stages(&t, &far, Some("routed_by_peer"));
                let hop = t.child(&execute, "kvmesh.forward");
                assert_eq!(hop.attr("kvmesh.upstream").as_deref(), Some("engine"));
                hop
            }
            other => panic!("{id}: upstream {other:?}"),
        };
        let r = &received[id];
        assert_eq!(
            r.header("traceparent"),
            Some(traceparent_of(&engine_hop).as_str()),
            "{id}"
        );
        assert_eq!(r.header("tracestate"), Some(TRACESTATE), "{id}");
        assert_eq!(
            engine_hop.attr("http.response.status_code").as_deref(),
            Some("200")
        );
        t.assert_rooted(client, id);
    }
    assert!(crossed > 0, "no trace crossed the mesh");
    for e in engines {
        e.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pd_split_is_one_trace_with_a_span_per_leg_over_http() {
    let collector = Collector::start().await;
    let prefill = pd_sim(SimRole::Prefill).await;
    let decode = pd_sim(SimRole::Decode).await;
    let mut c = config(&decode, &[], None);
    c.pd.allowed_prefillers = vec![prefill.addr().to_string()];
    c.tracing = tracing(&collector, OtlpProtocol::Http, 1.0);
    let sidecar = start(c).await;
    let body = serde_json::json!({
        "model": MODEL,
        "prompt": "the quick brown fox jumps over the lazy dog ".repeat(40),
        "max_tokens": 4,
        "stream": true,
    });
    let (trace_id, client, tp) = client_span(1);
    let p = prefill.addr().to_string();
    let req = request(
        "POST",
        sidecar.addr(),
        "/v1/completions",
        body.to_string(),
        &[
            ("content-type", "application/json"),
            ("x-prefiller-host-port", &p),
            ("traceparent", &tp),
            ("tracestate", TRACESTATE),
        ],
    );
    let r = fetch(&http1(), req).await;
    assert_eq!(r.status, 200, "{}", r.text());
    sidecar.shutdown().await;
    let all = collector.spans();
    assert!(all.iter().all(|s| s.protocol == "http"));
    let t = Trace::of(&all, &trace_id);
    let root: Vec<&Received> = t.named("kvmesh.request").collect();
    assert_eq!(root.len(), 1, "{:?}", t.names());
    assert_eq!(root[0].parent_id(), client);
    assert_eq!(
        root[0].attr("http.response.status_code").as_deref(),
        Some("200")
    );
    let execute = stages(&t, root[0], Some("prefiller_header"));
    assert_eq!(
        execute.attr("kvmesh.pd.outcome").as_deref(),
        Some("disaggregated")
    );
    for (name, e) in [
        ("kvmesh.pd.prefill", &prefill),
        ("kvmesh.pd.decode", &decode),
    ] {
        let leg = t.child(&execute, name);
        assert_eq!(
            leg.attr("kvmesh.upstream").as_deref(),
            Some("engine"),
            "{name}"
        );
        let got = inference(e);
        assert_eq!(got.len(), 1, "{name}");
        assert_eq!(
            got[0].header("traceparent"),
            Some(traceparent_of(&leg).as_str()),
            "{name}"
        );
        assert_eq!(got[0].header("tracestate"), Some(TRACESTATE), "{name}");
        // A leg ends after its response: the decode leg when the stream did.
        assert!(leg.span.end_time_unix_nano >= leg.span.start_time_unix_nano);
        assert!(
            leg.span.end_time_unix_nano <= root[0].span.end_time_unix_nano,
            "{name}"
        );
    }
    let ids: Vec<String> = t.spans.iter().map(Received::span_id).collect();
    let unique: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "span ids repeat: {:?}", t.names());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_follows_the_parent_and_the_ratio_for_new_traces() {
    let collector = Collector::start().await;
    let engine = sim_with(SimConfig::new(MODEL).with_time_scale(10.0)).await;
    let mut c = config(&engine, &[], None);
    c.tracing = tracing(&collector, OtlpProtocol::Http, 0.0);
    let sidecar = start(c).await;
    let body =
        serde_json::json!({"model": MODEL, "prompt": "hello there", "max_tokens": 2}).to_string();
    // A new trace at ratio 0: not recorded, but the engine still gets this
    // sidecar's (unsampled) span as its parent.
    complete(sidecar.addr(), &body, "root", None).await;
    // A sampled parent is followed whatever the ratio; an unsampled one is not.
    let (sampled, _, tp) = client_span(7);
    complete(sidecar.addr(), &body, "sampled", Some(&tp)).await;
    let (unsampled, _, tp) = client_span(8);
    let tp = tp.replace("-01", "-00");
    complete(sidecar.addr(), &body, "unsampled", Some(&tp)).await;
    sidecar.shutdown().await;
    let got: HashMap<String, ReceivedRequest> = inference(&engine)
        .into_iter()
        .map(|r| (r.header("x-request-id").unwrap().to_owned(), r))
        .collect();
    let root_tp = got["root"].header("traceparent").unwrap().to_owned();
    assert!(
        root_tp.starts_with("00-") && root_tp.ends_with("-00"),
        "{root_tp}"
    );
    let un_tp = got["unsampled"].header("traceparent").unwrap();
    assert!(
        un_tp.starts_with(&format!("00-{unsampled}-")) && un_tp.ends_with("-00"),
        "{un_tp}"
    );
    assert_ne!(
        un_tp, tp,
        "the unsampled parent was passed through, not replaced"
    );
    let all = collector.spans();
    let traces: std::collections::HashSet<String> = all.iter().map(Received::trace_id).collect();
    assert_eq!(
        traces,
        [sampled.clone()].into_iter().collect(),
        "{traces:?}"
    );
    let t = Trace::of(&all, &sampled);
    let hop = t.named("kvmesh.forward").next().unwrap();
    assert_eq!(
        got["sampled"].header("traceparent"),
        Some(traceparent_of(hop).as_str())
    );
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_does_not_affect_requests() {
    let engine = sim_with(SimConfig::new(MODEL).with_time_scale(10.0)).await;
    for protocol in [OtlpProtocol::Grpc, OtlpProtocol::Http] {
        let mut c = config(&engine, &[], None);
        c.tracing = Some(Tracing {
            otlp_endpoint: format!("http://{}", refused_addr().await).parse().unwrap(),
            protocol,
            sample_ratio: 1.0,
        });
        let sidecar = start(c).await;
        let body = serde_json::json!({"model": MODEL, "prompt": "hello there", "max_tokens": 2})
            .to_string();
        for i in 0..3 {
            let (_, _, tp) = client_span(i);
            complete(
                sidecar.addr(),
                &body,
                &format!("{protocol:?}-{i}"),
                Some(&tp),
            )
            .await;
        }
        // The flush at shutdown fails, bounded, and shutdown still returns.
        sidecar.shutdown().await;
    }
    assert_eq!(inference(&engine).len(), 6);
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_target_and_its_fallback_are_two_forward_spans() {
    let collector = Collector::start().await;
    let (ea, eb) = (sim().await, sim().await);
    let mut c = config(&ea, &[], None);
    c.tracing = tracing(&collector, OtlpProtocol::Http, 1.0);
    let a = start(c).await;
    let b = start(config(&eb, &[], None)).await;
    add_peer(&a, &b, &[]);
    // The peer's sidecar goes away but stays in A's fleet: requests the
    // scheduler sends there are refused, and the local engine takes them.
    b.shutdown().await;
    let mut sent = Vec::new();
    for i in 0..16 {
        let body = serde_json::json!({
            "model": MODEL,
            "prompt": format!("request {i}: {}", "a distinct prompt ".repeat(8)),
            "max_tokens": 2,
        });
        let (t, _, tp) = client_span(100 + i);
        complete(a.addr(), &body.to_string(), &format!("fb-{i}"), Some(&tp)).await;
        sent.push((format!("fb-{i}"), t));
    }
    a.shutdown().await;
    let got: HashMap<String, ReceivedRequest> = inference(&ea)
        .into_iter()
        .map(|r| (r.header("x-request-id").unwrap().to_owned(), r))
        .collect();
    let all = collector.spans();
    let mut fell_back = 0;
    for (id, trace_id) in &sent {
        let t = Trace::of(&all, trace_id);
        let request = t.named("kvmesh.request").next().unwrap();
        let execute = t.child(request, "kvmesh.execute");
        let mut hops: Vec<&Received> = t
            .children(&execute)
            .filter(|s| s.name() == "kvmesh.forward")
            .collect();
        hops.sort_by_key(|s| s.attr("kvmesh.attempt"));
        let last = *hops.last().unwrap();
        assert_eq!(
            last.attr("kvmesh.upstream").as_deref(),
            Some("engine"),
            "{id}"
        );
        assert_eq!(
            got[id].header("traceparent"),
            Some(traceparent_of(last).as_str()),
            "{id}"
        );
        if hops.len() == 2 {
            fell_back += 1;
            let refused = hops[0];
            assert_eq!(
                refused.attr("kvmesh.upstream").as_deref(),
                Some("peer"),
                "{id}"
            );
            assert_eq!(refused.attr("kvmesh.fallback").as_deref(), Some("false"));
            let status = refused.span.status.as_ref().unwrap();
            assert_eq!(
                status.code, 2,
                "{id}: the refused call is an error: {status:?}"
            );
            assert_eq!(last.attr("kvmesh.attempt").as_deref(), Some("2"));
            assert_eq!(last.attr("kvmesh.fallback").as_deref(), Some("true"));
            assert_eq!(request.attr("kvmesh.attempts").as_deref(), Some("2"));
        } else {
            assert_eq!(hops.len(), 1, "{id}: {:?}", t.names());
        }
    }
    assert!(
        fell_back > 0,
        "no request was scheduled to the refusing peer"
    );
    ea.shutdown().await;
    eb.shutdown().await;
}

/// The whole path in one trace: a client request to sidecar A,
/// which the scheduler splits (prefill on pod B, decode on A's own engine);
/// the prefill leg crosses the mesh to B's sidecar, which runs it on its
/// engine. One trace: A's request span with its stages, the prefill leg's
/// client span with B's request span (and its forward to B's engine) under
/// it, the decode leg's client span; each engine received the
/// `traceparent` of the span that called it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_split_through_a_peer_sidecar_is_one_trace() {
    let collector = Collector::start().await;
    let prefill = pd_sim(SimRole::Prefill).await;
    let decode = pd_sim(SimRole::Decode).await;
    let mut b = config(&prefill, &[], None);
    b.pod.role = kvmesh_filters::sched::Role::Prefill;
    b.tracing = tracing(&collector, OtlpProtocol::Http, 1.0);
    let b = start(b).await;
    // `--role decode --pd-min-uncached-tokens 64`: the built-in P/D config.
    let mut a = config(&decode, &[], None);
    a.pod.role = kvmesh_filters::sched::Role::Decode;
    a.pd.min_uncached_tokens = Some(64);
    a.tracing = tracing(&collector, OtlpProtocol::Http, 1.0);
    let a = start(a).await;
    a.fleet()
        .upsert_peer(kvmesh_proxy::fleet::PodInfo {
            id: b.addr().to_string(),
            sidecar_addr: Some(b.addr()),
            role: kvmesh_filters::sched::Role::Prefill,
            models: vec![MODEL.to_owned()],
            lora_adapters: vec![],
            labels: Default::default(),
        })
        .unwrap();
    a.fleet().set_load(
        &b.addr().to_string(),
        kvmesh_proxy::fleet::EngineLoad::default(),
        tokio::time::Instant::now(),
    );
    let (trace_id, client, tp) = client_span(7);
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(130);
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 4});
    complete(a.addr(), &body.to_string(), "split-1", Some(&tp)).await;
    let p_got = inference(&prefill);
    let d_got = inference(&decode);
    assert_eq!((p_got.len(), d_got.len()), (1, 1), "one leg on each engine");
    a.shutdown().await;
    b.shutdown().await;
    let all = collector.spans();
    let t = Trace::of(&all, &trace_id);
    let root: Vec<&Received> = t
        .named("kvmesh.request")
        .filter(|s| s.parent_id() == client)
        .collect();
    assert_eq!(root.len(), 1, "{:?}", t.names());
    let execute = stages(&t, root[0], None);
    assert_eq!(
        execute.attr("kvmesh.pd.outcome").as_deref(),
        Some("disaggregated")
    );
    // Prefill: A's leg span, B's request span under it, B's forward to its engine.
    let leg = t.child(&execute, "kvmesh.pd.prefill");
    assert_eq!(leg.attr("kvmesh.upstream").as_deref(), Some("peer"));
    let far = t.child(&leg, "kvmesh.request");
    assert_ne!(far.instance, root[0].instance, "B's span comes from B");
    let far_execute = stages(&t, &far, Some("routed_by_peer"));
    let hop = t.child(&far_execute, "kvmesh.forward");
    assert_eq!(
        p_got[0].header("traceparent"),
        Some(traceparent_of(&hop).as_str())
    );
    // Decode: A's leg span called its own engine.
    let leg = t.child(&execute, "kvmesh.pd.decode");
    assert_eq!(leg.attr("kvmesh.upstream").as_deref(), Some("engine"));
    assert_eq!(
        d_got[0].header("traceparent"),
        Some(traceparent_of(&leg).as_str())
    );
    t.assert_rooted(&client, "split-1");
}

/// A stream that goes on on another pod stays one trace: under A's execute
/// span, the failed call's `kvmesh.forward`, the count of the output so far
/// (`kvmesh.migration.count`, whose context both of the next pod's
/// `/tokenize` calls carry), and the continuation's `kvmesh.forward`, whose
/// context the next engine receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_stream_is_one_trace_with_its_count_and_continuation() {
    let collector = Collector::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (ea, eb) = (sim().await, sim().await);
    // A routes to its own engine only; B, a peer, is where the stream goes on.
    let mut c = config(&ea, &[("pod", "a")], Some(&only_pod(dir.path(), "a")));
    c.tracing = tracing(&collector, OtlpProtocol::Http, 1.0);
    let a = start(c).await;
    let b = start(config(&eb, &[("pod", "b")], None)).await;
    add_peer(&a, &b, &[("pod", "b")]);
    ea.faults().die_after_chunks(Some(3));
    let (trace_id, _, tp) = client_span(300);
    let body = serde_json::json!({"model": MODEL, "stream": true, "max_tokens": 12,
        "temperature": 0, "messages": [{"role": "user", "content": "tell me about rivers"}]});
    let r = fetch(
        &http1(),
        request(
            "POST",
            a.addr(),
            "/v1/chat/completions",
            body.to_string(),
            &[
                ("content-type", "application/json"),
                ("x-request-id", "migrated-1"),
                ("traceparent", &tp),
            ],
        ),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.text();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(!text.contains("\"error\""), "{text}");
    a.shutdown().await;
    b.shutdown().await;

    let t = Trace::of(&collector.spans(), &trace_id);
    t.assert_rooted(&client_span(300).1, "migrated stream");
    let request_span = t.named("kvmesh.request").next().unwrap().clone();
    let execute = t.child(&request_span, "kvmesh.execute");
    let mut hops: Vec<&Received> = t
        .children(&execute)
        .filter(|s| s.name() == "kvmesh.forward")
        .collect();
    hops.sort_by_key(|s| s.attr("kvmesh.attempt"));
    assert_eq!(hops.len(), 2, "{:?}", t.names());
    assert_eq!(hops[0].attr("kvmesh.upstream").as_deref(), Some("engine"));
    assert_eq!(hops[1].attr("kvmesh.upstream").as_deref(), Some("peer"));
    let count = t.child(&execute, "kvmesh.migration.count");
    assert_eq!(count.attr("kvmesh.upstream").as_deref(), Some("peer"));
    let counted: u64 = count
        .attr("kvmesh.migration.counted_tokens")
        .expect("the count's outcome")
        .parse()
        .unwrap();
    assert!(counted >= 3, "{count:?}");
    // B's engine: two `/tokenize` calls under the count's span, then the
    // continuation under the second forward span (B's sidecar records no
    // spans and passes the context on).
    let got = eb.received_requests();
    let tokenize: Vec<_> = got.iter().filter(|r| r.path == "/tokenize").collect();
    assert_eq!(tokenize.len(), 2);
    for r in tokenize {
        assert_eq!(
            r.header("traceparent"),
            Some(traceparent_of(&count).as_str())
        );
    }
    let continued: Vec<_> = got
        .iter()
        .filter(|r| r.path == "/v1/chat/completions")
        .collect();
    assert_eq!(continued.len(), 1);
    assert_eq!(
        continued[0].header("traceparent"),
        Some(traceparent_of(hops[1]).as_str())
    );
    ea.shutdown().await;
    eb.shutdown().await;
}
