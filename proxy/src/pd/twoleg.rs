//! The two-leg protocol of vLLM's `NixlConnector` (and of the kvagent
//! connector, which adds its own parameters): prefill first with
//! `do_remote_decode`, then decode with the `kv_transfer_params` prefill
//! returned (docs/wire-formats.md §4.1). Both legs carry the same
//! `X-Request-Id`.

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::body;
use super::metrics::Outcome;
use super::{Pd, PdPlan};
use super::{DECODE, PREFILL};
use crate::backoff::Backoff;
use crate::body::{ResponseBody, UpstreamBody};
use crate::config::OnPrefillFailure;
use crate::error::ProxyError;
use crate::error::UpstreamName;
use crate::otel::Hop;
use crate::request::migrate::KvResend;
use crate::request::ClientRequest;
use crate::request::RequestCtx;
use crate::request::{relay, send, Upstream};
use crate::upstream::ReplyBody;

/// Largest prefill response read (it holds one token and the parameters).
const MAX_PREFILL_RESPONSE: usize = 4 << 20;

/// Statuses after which another prefill attempt may succeed.
fn retryable(status: StatusCode) -> bool {
    matches!(status.as_u16(), 429 | 502 | 503 | 504)
}

pub async fn run(
    h: Pd<'_>,
    ctx: &mut RequestCtx,
    plan: &mut PdPlan,
    req: &ClientRequest,
    client: &Map<String, Value>,
    connector: &'static str,
    extra: &Map<String, Value>,
) -> Result<Response<ResponseBody>, ProxyError> {
    let (up, metrics) = (h.up, h.metrics);
    let prefill_body = body::prefill_leg(client, req.head.uri.path(), extra)?;
    let (decode_body, outcome) = match prefill(h, ctx, plan, req, prefill_body).await {
        Ok(Some(params)) => (
            body::decode_leg(client, Some(&params))?,
            Outcome::Disaggregated,
        ),
        Ok(None) => {
            tracing::warn!(
                request_id = ctx.id(),
                "prefill returned no kv_transfer_params; decode recomputes the prompt"
            );
            (body::decode_leg(client, None)?, Outcome::Recompute)
        }
        Err(e) => match up.pd.on_prefill_failure {
            OnPrefillFailure::Aggregated => {
                tracing::warn!(request_id = ctx.id(), error = %e, "prefill failed; serving aggregated on the decode pod");
                (body::decode_leg(client, None)?, Outcome::FallbackAggregated)
            }
            OnPrefillFailure::Error => {
                metrics.outcome(connector, Outcome::Failed);
                super::traced(ctx, connector, Outcome::Failed);
                return Err(e);
            }
        },
    };
    // The prefill pod holds the blocks for a decode from its answer until
    // its lease passes (`migration.pd_kv_lease`, docs/pd.md).
    let lease_ends = Instant::now() + h.lease;
    let resendable = outcome == Outcome::Disaggregated && connector == "nixl";
    let mut to = plan.decode.clone();
    loop {
        let sent = Instant::now();
        let failure = match decode_once(h, ctx, &to, req, decode_body.clone()).await {
            Ok((resp, name, hop)) => {
                metrics.leg("decode", sent.elapsed().as_secs_f64());
                let outcome = if plan.failed.is_empty() {
                    outcome
                } else {
                    Outcome::DecodeResent
                };
                metrics.outcome(connector, outcome);
                super::traced(ctx, connector, outcome);
                plan.decode = to;
                // Its stream may still fail before its first token: then the
                // same leg goes again while the lease holds.
                plan.kv_resend = resendable.then(|| KvResend {
                    body: decode_body.clone(),
                    until: lease_ends,
                });
                return Ok(relay(&up, ctx, name, resp, hop));
            }
            Err(f) => f,
        };
        // Refused (failed before any byte reached the client): another pod
        // may serve it, with the same blocks while the lease holds.
        let next = match Outcome::of_decode_error(&failure.error) {
            Outcome::DecodeRefused => {
                plan.failed.push(to);
                if resendable {
                    resend_to(h, plan, &failure, lease_ends)
                } else {
                    Err(Outcome::DecodeRefused)
                }
            }
            end => Err(end),
        };
        match next {
            Ok(next) => {
                tracing::info!(request_id = ctx.id(), error = %failure.error, ?next, "the decode pod failed before any byte; re-sending the decode leg with the same kv_transfer_params");
                ctx.attempts = ctx.attempts.saturating_add(1);
                to = next;
            }
            Err(end) => {
                if outcome == Outcome::Disaggregated {
                    // Prefill holds blocks for this decode; nobody fetches them now.
                    metrics.abandoned(connector);
                }
                metrics.outcome(connector, end);
                super::traced(ctx, connector, end);
                return Err(failure.error);
            }
        }
    }
}

/// How a decode leg failed: the error, and the status of a 5xx head.
struct DecodeFailure {
    error: ProxyError,
    status: Option<StatusCode>,
}

/// One decode leg to `to`; a 5xx head (before any byte reached the
/// client) is a failure, as a refusal is.
async fn decode_once(
    h: Pd<'_>,
    ctx: &RequestCtx,
    to: &Upstream,
    req: &ClientRequest,
    body: Bytes,
) -> Result<(Response<ReplyBody>, UpstreamName, Hop), DecodeFailure> {
    let body = UpstreamBody::full(body);
    match send(&h.up, ctx, to, &req.head, body, DECODE, ctx.attempts).await {
        // The decode pod failed after accepting. The execute stage gives
        // the request to its next fallback whole, as for a refusal, unless
        // the decode leg is sent again ([`resend_to`]).
        Ok((resp, name, _hop)) if resp.status().is_server_error() => Err(DecodeFailure {
            status: Some(resp.status()),
            error: ProxyError::UpstreamFailed {
                upstream: name,
                reason: format!("the decode leg answered {} before any byte", resp.status()),
            },
        }),
        Ok(ok) => Ok(ok),
        Err(error) => Err(DecodeFailure {
            error,
            status: None,
        }),
    }
}

/// Where the decode leg goes again, with the same `kv_transfer_params`,
/// after `plan.failed`'s last pod failed before any byte: another
/// decode-capable pod, while the prefill pod's lease holds (`lease_ends`)
/// and within `migration.max_migrations` re-sends. `Err` is why not: the
/// execute stage then serves the request whole (the prompt recomputed).
///
/// A re-send answered 500 ends it: vLLM answers a request whose KV it could
/// not load with 500 (`kv_load_failure_policy: fail`), so the blocks may
/// be gone. A refusal, 502-504, or a connection broken before the head
/// says nothing of the blocks.
fn resend_to(
    h: Pd<'_>,
    plan: &PdPlan,
    failure: &DecodeFailure,
    lease_ends: Instant,
) -> Result<Upstream, Outcome> {
    let resends = plan.failed.len() - 1;
    if resends > 0 && failure.status == Some(StatusCode::INTERNAL_SERVER_ERROR) {
        return Err(Outcome::DecodeKvGone);
    }
    if resends >= usize::from(h.max_resends) {
        return Err(Outcome::DecodeRefused);
    }
    if Instant::now() >= lease_ends {
        return Err(Outcome::DecodeLeaseExpired);
    }
    (h.next_decode)(&plan.failed).ok_or(Outcome::DecodeRefused)
}

/// The prefill leg, retried on the plan's prefill pods in turn: the transfer
/// parameters it returned (`None` when it sent none), or why it failed.
async fn prefill(
    h: Pd<'_>,
    ctx: &RequestCtx,
    plan: &PdPlan,
    req: &ClientRequest,
    body: Bytes,
) -> Result<Option<Value>, ProxyError> {
    let up = h.up;
    let pd = &up.pd;
    let attempts = pd.prefill_retries as usize + 1;
    // Doubling from `retry_backoff` with jitter; the cap only bounds a
    // configuration with many retries (each attempt has its own deadline).
    let start = pd.retry_backoff.get();
    let mut backoff = Backoff::new(start, start.saturating_mul(1 << attempts.min(16)));
    let mut last = None;
    for attempt in 0..attempts {
        if attempt > 0 {
            h.metrics.prefill_retry();
            tokio::time::sleep(backoff.next_delay()).await;
        }
        let upstream = &plan.prefill[attempt % plan.prefill.len()];
        let leg = tokio::time::timeout(
            pd.prefill_timeout.get(),
            prefill_once(h, ctx, upstream, req, body.clone(), attempt_no(attempt)),
        )
        .await
        .unwrap_or_else(|_| {
            Err(ProxyError::PrefillFailed {
                upstream: upstream.name(up.engine_url),
                status: StatusCode::GATEWAY_TIMEOUT.as_u16(),
                message: format!("no prefill response within {}", pd.prefill_timeout),
                retryable: true,
            })
        })
        .map_err(|e| as_prefill_failure(e, || upstream.name(up.engine_url)));
        match leg {
            Ok(params) => return Ok(params),
            Err(e) if prefill_retryable(&e) => {
                tracing::debug!(request_id = ctx.id(), attempt, error = %e, "prefill attempt failed");
                last = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| ProxyError::Internal("no prefill attempt was made".to_owned())))
}

/// A prefill leg that failed without a response (connection refused or reset, body unreadable) is
/// a prefill failure too: with `on_prefill_failure: error` the client gets 502 `prefill_failed`
/// naming the prefill pod (docs/pd.md), not an error that reads as if its own engine were down.
fn as_prefill_failure(
    e: ProxyError,
    upstream: impl FnOnce() -> crate::error::UpstreamName,
) -> ProxyError {
    match e {
        other @ (ProxyError::Connect { .. }
        | ProxyError::FirstByteTimeout { .. }
        | ProxyError::UpstreamFailed { .. }) => ProxyError::PrefillFailed {
            upstream: upstream(),
            status: StatusCode::BAD_GATEWAY.as_u16(),
            retryable: other.retry() != crate::error::Retry::Never,
            message: other.to_string(),
        },
        e => e,
    }
}

fn prefill_retryable(e: &ProxyError) -> bool {
    match e {
        ProxyError::PrefillFailed { retryable, .. } => *retryable,
        other => other.retry() != crate::error::Retry::Never,
    }
}

/// A prefill attempt's number for its span (1-based).
fn attempt_no(attempt: usize) -> u8 {
    u8::try_from(attempt + 1).unwrap_or(u8::MAX)
}

async fn prefill_once(
    h: Pd<'_>,
    ctx: &RequestCtx,
    upstream: &Upstream,
    req: &ClientRequest,
    body: Bytes,
    attempt: u8,
) -> Result<Option<Value>, ProxyError> {
    let up = h.up;
    // The prefill pod counts this leg until it ends, so the mesh's
    // schedulers see its queue (the decode pod counts the request: the
    // execute stage tracks it there).
    let pod = upstream.pod(h.fleet);
    let _queued = h.fleet.begin(&pod);
    // And its prompt tokens, until the leg's one token: what the pod has
    // to prefill (token-cost-scorer's pending prefill, mesh-wide).
    let _prefill = h.fleet.begin_priced_prefill(&pod, &ctx.uncached_tokens);
    let sent = Instant::now();
    let (resp, name, hop) = send(
        &up,
        ctx,
        upstream,
        &req.head,
        UpstreamBody::full(body),
        PREFILL,
        attempt,
    )
    .await?;
    let status = resp.status();
    let bytes = Limited::new(resp.into_body(), MAX_PREFILL_RESPONSE)
        .collect()
        .await
        .map_err(|e| {
            let e = ProxyError::UpstreamFailed {
                upstream: name.clone(),
                reason: format!("reading the prefill response: {e}"),
            };
            hop.fail(&e);
            e
        })?
        .to_bytes();
    drop(hop);
    h.metrics.leg("prefill", sent.elapsed().as_secs_f64());
    if !status.is_success() {
        return Err(ProxyError::PrefillFailed {
            upstream: name,
            status: status.as_u16(),
            message: String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned(),
            retryable: retryable(status),
        });
    }
    Ok(body::transfer_params(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::UpstreamName;

    #[test]
    fn a_refused_prefill_is_a_prefill_failure() {
        let name = || UpstreamName::Engine("127.0.0.1:9".into());
        let refused = ProxyError::Connect {
            upstream: name(),
            reason: "connection refused".into(),
        };
        match as_prefill_failure(refused, name) {
            ProxyError::PrefillFailed {
                status,
                retryable,
                message,
                ..
            } => {
                assert_eq!(status, 502);
                assert!(retryable, "a refused connection is worth another attempt");
                assert!(message.contains("refused"), "{message}");
            }
            other => panic!("not a prefill failure: {other:?}"),
        }
        let deadline = ProxyError::OverallTimeout {
            upstream: name(),
            after: std::time::Duration::from_secs(1),
        };
        assert!(matches!(
            as_prefill_failure(deadline, name),
            ProxyError::OverallTimeout { .. }
        ));
    }
}
