//! Admin endpoints that explain routing without sending anything upstream.
//!
//! `POST /debug/route` takes an inference body (chat when it has `messages`,
//! else completion; `?path=/v1/...` forces one) and the request headers that
//! matter (`x-session-id`, `x-request-id`, `x-kvmesh-routed`), runs one
//! scheduling cycle in dry-run mode (stateful plugins learn nothing) and
//! answers JSON: the decision, the chosen pod(s) and fallbacks, the targets
//! they map to, the error a client would get, every endpoint view, every
//! plugin's score per endpoint and the full decision trace.
//!
//! `GET /debug/fleet` lists the pods this sidecar knows, with load, age,
//! health and in-flight counts.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::app::App;
use crate::body::{IncomingBody, ResponseBody};
use crate::error::ProxyError;
use crate::request::view::Shape;
use crate::request::{Plan, RequestCtx, RequestView, Target};
use crate::respond::openai_error;
use crate::routing::plan::from_route;

/// Longest wait for a debug request's body.
const BODY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether `path` is one of these endpoints.
pub fn handles(path: &str) -> bool {
    matches!(path, "/debug/route" | "/debug/fleet")
}

/// Answers `/debug/route` or `/debug/fleet`.
pub async fn serve(app: Arc<App>, req: Request<IncomingBody>) -> Response<ResponseBody> {
    match (req.uri().path(), req.method()) {
        ("/debug/fleet", &Method::GET) => json_reply(StatusCode::OK, &fleet(&app)),
        ("/debug/route", &Method::POST) => match route(&app, req).await {
            Ok(v) => json_reply(StatusCode::OK, &v),
            Err(e) => {
                let r = openai_error(&e);
                let mut resp = Response::new(ResponseBody::full(r.json));
                *resp.status_mut() = r.status;
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                resp
            }
        },
        (path, _) => {
            let allow = if path == "/debug/route" {
                "POST"
            } else {
                "GET"
            };
            let mut resp = json_reply(
                StatusCode::METHOD_NOT_ALLOWED,
                &json!({"error": format!("{path} takes {allow}")}),
            );
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(allow));
            resp
        }
    }
}

fn fleet(app: &App) -> Value {
    let now = Instant::now();
    json!({
        "local": app.fleet.local_id(),
        "filters": app.routing.active().origin,
        "block_size": app.engine_block_size.load(std::sync::atomic::Ordering::Relaxed),
        "pods": app.fleet.snapshot(now),
    })
}

async fn route(app: &App, req: Request<IncomingBody>) -> Result<Value, ProxyError> {
    let (head, body) = req.into_parts();
    let limit = app.config.limits.max_body_bytes.0;
    let collected = tokio::time::timeout(
        BODY_DEADLINE,
        Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX)).collect(),
    )
    .await
    .map_err(|_| ProxyError::ClientTimeout {
        after: BODY_DEADLINE,
    })?;
    let bytes: Bytes = match collected {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(ProxyError::BodyTooLarge { limit })
        }
        Err(e) => return Err(ProxyError::ClientBody(e.to_string())),
    };
    let forced = head
        .uri
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("path=")))
        .map(str::to_owned);
    let path = forced.unwrap_or_else(|| {
        let body = serde_json::from_slice::<Value>(&bytes).ok();
        let has = |k: &str| body.as_ref().is_some_and(|v| v.get(k).is_some());
        if has("messages") {
            "/v1/chat/completions".to_owned()
        } else if has("input") && !has("prompt") {
            "/v1/responses".to_owned()
        } else {
            "/v1/completions".to_owned()
        }
    });
    // The context a client request to `path` with these headers would get.
    let mut as_client = Request::new(());
    *as_client.method_mut() = Method::POST;
    *as_client.uri_mut() = path
        .parse()
        .map_err(|e| ProxyError::ClientBody(format!("path {path:?}: {e}")))?;
    *as_client.headers_mut() = head.headers;
    let mut ctx = RequestCtx::new(&as_client, app.metrics.requests.in_flight());
    // Nothing is in flight: this request never goes upstream.
    ctx.in_flight = None;
    let shape = match path.as_str() {
        "/v1/chat/completions" => Shape::Chat,
        "/v1/responses" => Shape::Responses,
        "/v1/embeddings" => Shape::Embedding,
        _ => Shape::Completion,
    };
    let view = RequestView::parse(&bytes, shape).map_err(|source| ProxyError::MalformedJson {
        route: ctx.route.as_str(),
        source,
    })?;
    ctx.view = Some(view);
    // As the prefix stage does: a request a peer routed here is not tokenized.
    if !ctx.already_routed {
        app.prefix
            .compute(crate::path::handles::compute(app), &mut ctx)
            .await;
        // As the schedule stage does: the Valkey index names the candidates.
        if let (Some(index), Some(view)) = (&app.index, &ctx.view) {
            let model = app.prefix.request_model(view.model.as_deref());
            ctx.candidates = index
                .candidates(&app.fleet, app.mesh.routes(), model, &ctx.block_keys)
                .await;
        }
    }
    let mut out = explain(app, &ctx);
    out["index"] = match &app.index {
        Some(index) => json!({
            "backend": "valkey",
            "up": index.store().is_up(),
            // null: the lookup failed, and the decision was made among the
            // pods this sidecar knows (its own, recent lookups' and decisions').
            "candidates": ctx.candidates,
            "fallback": ctx.candidates.is_none(),
        }),
        None => json!({"backend": "mesh"}),
    };
    Ok(out)
}

/// One dry-run scheduling cycle, as JSON.
pub fn explain(app: &App, ctx: &RequestCtx) -> Value {
    let active = app.routing.active();
    if let Some(prefiller) = &ctx.epp_prefiller {
        let plan = crate::request::Plan::epp(prefiller.clone());
        return json!({
            "filters": active.origin,
            "decision": plan.decision(),
            "reason": "prefiller_header: an llm-d EPP split this request (x-prefiller-host-port), so this sidecar decodes it with that prefiller without scheduling",
            "target": describe(&plan.target),
            "fallbacks": [],
        });
    }
    if ctx.already_routed {
        let mut out = json!({
            "filters": active.origin,
            "decision": "local",
            "reason": "routed_by_peer: x-kvmesh-routed is set, so this sidecar serves it locally without scheduling",
            "target": describe(&Target::LocalEngine),
            "fallbacks": [],
        });
        if let Some(dp) =
            crate::routing::rank::explain(crate::path::handles::routing_inputs(app), ctx)
        {
            out["data_parallel"] = dp;
        }
        return out;
    }
    let Some(view) = &ctx.view else {
        return json!({"decision": "local", "reason": "passthrough"});
    };
    let now = Instant::now();
    let (req, endpoints) =
        crate::routing::request::build(crate::path::handles::routing_inputs(app), ctx, view, now);
    let (route, trace) = active.scheduler.explain(&req, &endpoints, rand::random());
    let mut out = json!({
        "filters": active.origin,
        "request": req,
        "endpoints": endpoints,
        "scores": scores(&trace),
        "trace": trace,
    });
    match route {
        Ok(route) => {
            let plan = from_route(&app.fleet, &route, &req, &endpoints);
            out["decision"] = json!(plan.as_ref().map_or("error", Plan::decision));
            out["chosen"] = match &route {
                kvmesh_filters::sched::Route::Aggregated { target } => json!([target.id]),
                kvmesh_filters::sched::Route::Disaggregated { prefill, decode } => {
                    json!({"prefill": prefill.id, "decode": decode.id})
                }
            };
            out["fallbacks"] = json!(route.primary().fallbacks);
            out["route"] = json!(route);
            if let Some(plan) = plan {
                // The rank the local engine's run gets (a peer picks its own).
                if plan.target == Target::LocalEngine {
                    if let Some(dp) = crate::routing::rank::explain(
                        crate::path::handles::routing_inputs(app),
                        ctx,
                    ) {
                        out["data_parallel"] = dp;
                    }
                }
                out["target"] = describe(&plan.target);
                out["fallback_targets"] = plan.fallbacks.iter().map(describe).collect();
            }
        }
        Err(e) => {
            let err = crate::routing::no_endpoint_error(&req.model, &endpoints, e);
            let reply = openai_error(&err);
            out["decision"] = json!("error");
            out["error"] = json!({
                "status": reply.status.as_u16(),
                "body": serde_json::from_slice::<Value>(&reply.json).unwrap_or(Value::Null),
            });
        }
    }
    out
}

/// Per profile, per endpoint: each scorer's raw score, weight applied in `total`.
fn scores(trace: &kvmesh_filters::sched::DecisionTrace) -> Value {
    #[derive(Serialize)]
    struct Row {
        scores: BTreeMap<String, f64>,
        total: Option<f64>,
    }
    let mut out = serde_json::Map::new();
    for p in &trace.profiles {
        let mut rows = BTreeMap::new();
        for id in &p.candidates {
            let scores = p
                .scorers
                .iter()
                .filter_map(|s| Some((s.scorer.clone(), p.score_of(&s.scorer, id)?)))
                .collect();
            rows.insert(
                id.clone(),
                Row {
                    scores,
                    total: p.total_of(id),
                },
            );
        }
        out.insert(p.profile.clone(), json!(rows));
    }
    Value::Object(out)
}

fn describe(t: &Target) -> Value {
    let leg = |l: &crate::request::Leg| match l {
        crate::request::Leg::LocalEngine => json!({"kind": "local"}),
        crate::request::Leg::Peer { sidecar_addr } => {
            json!({"kind": "peer", "sidecar_addr": sidecar_addr.to_string()})
        }
        crate::request::Leg::Direct(a) => json!({"kind": "engine", "authority": a.to_string()}),
    };
    match t {
        Target::LocalEngine => json!({"kind": "local"}),
        Target::Peer { sidecar_addr } => {
            json!({"kind": "peer", "sidecar_addr": sidecar_addr.to_string()})
        }
        Target::Disaggregated { prefill, decode } => {
            json!({"kind": "disaggregated", "prefill": leg(prefill), "decode": leg(decode)})
        }
    }
}

fn json_reply(status: StatusCode, v: &Value) -> Response<ResponseBody> {
    let body = serde_json::to_vec_pretty(v).unwrap_or_else(|_| b"{}".to_vec());
    let mut r = Response::new(ResponseBody::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}
