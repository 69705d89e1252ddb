//! `GET /debug/stat` ([`crate::stat`]): the document, from the whole sidecar.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use tokio::time::Instant;

use crate::app::App;
use crate::body::ResponseBody;
use crate::stat::{local_stats, millis, role_name, IndexEntry, PodEntry, Report, FORMAT};

/// This pod's counters now ([`local_stats`]).
pub fn local(app: &App) -> crate::stat::PodStats {
    let scraped = app
        .fleet
        .stats()
        .remove(app.fleet.local_id())
        .unwrap_or_default();
    local_stats(
        scraped,
        app.mesh.metrics.served_total(),
        app.pd_metrics.totals(),
    )
}

/// The `/debug/stat` document for the fleet as this sidecar sees it now.
pub fn report(app: &App) -> Report {
    let now = Instant::now();
    let local = app.fleet.local_id().to_owned();
    let peers = app.mesh.peers();
    let mut stats = app.fleet.stats();
    stats.insert(local.clone(), self::local(app));
    let pods = app
        .fleet
        .snapshot(now)
        .into_iter()
        .map(|p| {
            let is_local = p.info.id == local;
            let mesh = if is_local {
                "local".to_owned()
            } else {
                peers
                    .iter()
                    .find(|e| e.id.as_deref() == Some(p.info.id.as_str()))
                    .map_or_else(
                        // On Valkey a peer is known from the lookups.
                        || {
                            if app.index.is_some() {
                                "valkey"
                            } else {
                                "unfollowed"
                            }
                            .to_owned()
                        },
                        |e| e.state.clone(),
                    )
            };
            PodEntry {
                stats: stats.get(&p.info.id).copied().unwrap_or_default(),
                id: p.info.id,
                local: is_local,
                role: role_name(p.info.role).to_owned(),
                models: p.info.models,
                healthy: p.healthy,
                waiting: p.load.waiting,
                running: p.load.running,
                kv_usage: p.load.kv_usage,
                load_age_ms: p.load_age_ms,
                in_flight: p.in_flight_local.saturating_add(p.in_flight_mesh),
                mesh,
            }
        })
        .collect();
    let index = app.index.as_ref().map(|v| {
        let status = v.status();
        IndexEntry {
            backend: status.backend.to_owned(),
            up: status.up,
            server: status.server,
            lookups: v.metrics.lookups_answered(),
            fallbacks: v.metrics.lookups_failed(),
        }
    });
    Report {
        kvmesh_stat: FORMAT,
        local,
        mesh: app.mesh.mesh_addr().is_some(),
        stale_after_ms: millis(app.config.mesh.stale_after.get()),
        pods,
        peers,
        index,
    }
}

/// Answers `GET /debug/stat` (405 to any other method).
pub fn serve(app: &App, method: &http::Method) -> Response<ResponseBody> {
    if method != http::Method::GET {
        let mut r = Response::new(ResponseBody::full(Bytes::from_static(
            b"{\"error\":\"/debug/stat takes GET\"}",
        )));
        *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET"));
        return r;
    }
    let (status, body) = match serde_json::to_vec_pretty(&report(app)) {
        Ok(b) => (StatusCode::OK, Bytes::from(b)),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Bytes::from(format!("{{\"error\":\"stat: {e}\"}}")),
        ),
    };
    let mut r = Response::new(ResponseBody::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}
