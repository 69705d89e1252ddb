//! SGLang's P/D protocol: the same body, with `bootstrap_host`,
//! `bootstrap_port` and a fresh `bootstrap_room`, goes to the prefill and the
//! decode pod at once; the decode response is the client's
//! (docs/wire-formats.md §4.4). SGLang waits minutes for a missing half, so the
//! sidecar sends both or neither, and a prefill that fails fails the request at
//! once (dropping the decode leg cancels it).

use http::uri::Authority;
use http::Response;
use http_body_util::{BodyExt, Limited};
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::body;
use super::metrics::Outcome;
use super::{Pd, PdPlan};
use super::{DECODE, PREFILL};
use crate::body::{ResponseBody, UpstreamBody};
use crate::error::ProxyError;
use crate::request::RequestCtx;
use crate::request::{relay, send, Upstream};
use crate::request::{ClientRequest, Upstreams};

/// Largest prefill response drained (one token; streamed or not).
const MAX_PREFILL_RESPONSE: usize = 4 << 20;

pub async fn run(
    h: Pd<'_>,
    ctx: &mut RequestCtx,
    plan: &PdPlan,
    req: &ClientRequest,
    client: &Map<String, Value>,
) -> Result<Response<ResponseBody>, ProxyError> {
    let (up, metrics) = (h.up, h.metrics);
    let prefill = &plan.prefill[0];
    let rooms: Vec<u64> = (0..body::rooms_needed(client))
        // SGLang keeps rooms as int64: stay below 2^63.
        .map(|_| rand::random::<u64>() >> 1)
        .collect();
    let host = bootstrap_host(up, prefill);
    let legs = body::sglang_legs(client, &host, up.pd.sglang_bootstrap_port, &rooms)?;
    let sent = Instant::now();
    let prefill_leg = async {
        // The prefill pod counts this leg until it ends (the decode pod
        // counts the request: the execute stage tracks it there).
        let pod = prefill.pod(h.fleet);
        let _queued = h.fleet.begin(&pod);
        let _prefill = h.fleet.begin_priced_prefill(&pod, &ctx.uncached_tokens);
        let (resp, name, hop) =
            send(&up, ctx, prefill, &req.head, full(legs.clone()), PREFILL, 1).await?;
        let status = resp.status();
        let bytes = tokio::time::timeout(
            up.pd.prefill_timeout.get(),
            Limited::new(resp.into_body(), MAX_PREFILL_RESPONSE).collect(),
        )
        .await
        .map_err(|_| ProxyError::PrefillFailed {
            upstream: name.clone(),
            status: 504,
            message: "the prefill response did not end in time".to_owned(),
            retryable: false,
        })?
        .map_err(|e| ProxyError::UpstreamFailed {
            upstream: name.clone(),
            reason: format!("reading the prefill response: {e}"),
        })?
        .to_bytes();
        drop(hop);
        if !status.is_success() {
            return Err(ProxyError::PrefillFailed {
                upstream: name,
                status: status.as_u16(),
                message: String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned(),
                retryable: false,
            });
        }
        metrics.leg("prefill", sent.elapsed().as_secs_f64());
        Ok(())
    };
    let decode_leg = send(
        &up,
        ctx,
        &plan.decode,
        &req.head,
        full(legs.clone()),
        DECODE,
        ctx.attempts,
    );
    tokio::pin!(prefill_leg, decode_leg);
    let (mut prefilled, mut decoded) = (false, None);
    while !(prefilled && decoded.is_some()) {
        tokio::select! {
            r = &mut prefill_leg, if !prefilled => {
                if let Err(e) = r {
                    metrics.outcome("sglang", Outcome::Failed);
                    super::traced(ctx, "sglang", Outcome::Failed);
                    return Err(e);
                }
                prefilled = true;
            }
            r = &mut decode_leg, if decoded.is_none() => {
                match r {
                    Ok(head) => decoded = Some(head),
                    Err(e) => {
                        metrics.outcome("sglang", Outcome::of_decode_error(&e));
                        super::traced(ctx, "sglang", Outcome::of_decode_error(&e));
                        return Err(e);
                    }
                }
            }
        }
    }
    let Some((resp, name, hop)) = decoded else {
        return Err(ProxyError::Internal(
            "the decode leg ended without a response".to_owned(),
        ));
    };
    metrics.leg("decode", sent.elapsed().as_secs_f64());
    metrics.outcome("sglang", Outcome::Disaggregated);
    super::traced(ctx, "sglang", Outcome::Disaggregated);
    Ok(relay(&up, ctx, name, resp, hop))
}

fn full(b: bytes::Bytes) -> UpstreamBody {
    UpstreamBody::full(b)
}

/// Where the decode engine finds the prefill engine's bootstrap server: the
/// prefill pod's address (its engine, not its sidecar, serves bootstrap).
fn bootstrap_host(up: Upstreams<'_>, prefill: &Upstream) -> String {
    match prefill {
        Upstream::Engine => host_of(up.engine_url.authority()),
        Upstream::Peer(addr) => addr.ip().to_string(),
        Upstream::Direct(a) => host_of(a),
    }
}

fn host_of(a: &Authority) -> String {
    a.host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned()
}
