//! The admin port: `/health` (the sidecar is up), `/ready` (the local engine
//! answers its health check), `/metrics` (Prometheus text), `/config` (the
//! effective config as JSON: paths of TLS files, never key material) and
//! `/autoscale` (how many pods each pool should run, [`crate::autoscale`]);
//! `/debug/stat` (the fleet for `kvmesh stat`, [`crate::stat`]; [`stat`]),
//! `/debug/route` and `/debug/fleet` (routing explained, [`route`]).
//!
//! The admin views read the whole sidecar, so they live here, beside the
//! wiring, and not in the subsystems they explain.

mod route;
mod stat;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};

use crate::app::App;
use crate::autoscale::Answer;
use crate::body::ResponseBody;
use crate::server::Handler;

#[derive(Clone)]
pub struct Admin {
    app: Arc<App>,
    config_json: Bytes,
}

impl Admin {
    pub fn new(app: Arc<App>) -> Self {
        let config_json = serde_json::to_vec_pretty(&*app.config)
            .map(Bytes::from)
            .unwrap_or_else(|e| Bytes::from(format!("{{\"error\":\"{e}\"}}")));
        Self { app, config_json }
    }

    /// Answers `path`; `autoscale` is the hook's answer, made beforehand
    /// (async: on Valkey it may read the fleet) for `/metrics` and
    /// `/autoscale`.
    fn answer(&self, path: &str, autoscale: Option<Answer>) -> Response<ResponseBody> {
        match path {
            "/health" => reply(StatusCode::OK, "text/plain", Bytes::from_static(b"ok\n")),
            "/ready" => {
                let reason = if !self.app.engine_ready.load(Ordering::Acquire) {
                    Some(format!(
                        "the engine at {} has not answered {}",
                        self.app.config.engine.url, self.app.config.engine.health_path
                    ))
                } else {
                    self.app.mesh.ready().err()
                };
                match reason {
                    None => reply(
                        StatusCode::OK,
                        "application/json",
                        Bytes::from_static(b"{\"ready\":true}\n"),
                    ),
                    Some(reason) => reply(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "application/json",
                        Bytes::from(format!(
                            "{}\n",
                            serde_json::json!({"ready": false, "reason": reason})
                        )),
                    ),
                }
            }
            "/metrics" => {
                let ready = self.app.engine_ready.load(Ordering::Acquire);
                self.app.metrics.engine_ready.set(i64::from(ready));
                let ejected = self.app.fleet.ejected_count(tokio::time::Instant::now());
                self.app
                    .metrics
                    .outliers
                    .ejected_pods
                    .set(i64::try_from(ejected).unwrap_or(i64::MAX));
                reply(
                    StatusCode::OK,
                    prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                    Bytes::from(self.app.metrics.encode()),
                )
            }
            "/autoscale" => match serde_json::to_vec_pretty(&autoscale.unwrap_or_default()) {
                Ok(body) => reply(StatusCode::OK, "application/json", Bytes::from(body)),
                Err(e) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    Bytes::from(format!("autoscale: {e}\n")),
                ),
            },
            "/config" => reply(StatusCode::OK, "application/json", self.config_json.clone()),
            "/debug/index" => {
                let status = match &self.app.index {
                    Some(v) => serde_json::to_value(v.status()).unwrap_or_default(),
                    None => serde_json::json!({"backend": "mesh", "peers": self.app.mesh.peers().len()}),
                };
                reply(
                    StatusCode::OK,
                    "application/json",
                    Bytes::from(format!("{status}\n")),
                )
            }
            _ => reply(
                StatusCode::NOT_FOUND,
                "text/plain",
                Bytes::from_static(b"admin endpoints: /health /ready /metrics /config /autoscale /debug/index /debug/fleet /debug/stat /debug/route (POST)\n"),
            ),
        }
    }
}

impl Admin {
    /// The autoscaling hook's answer for the fleet as this sidecar sees it
    /// now (see [`crate::autoscale::FleetSource`]).
    async fn autoscale(&self) -> Answer {
        let source = crate::autoscale::FleetSource {
            config: self.app.config.clone(),
            fleet: self.app.fleet.clone(),
            index: self.app.index.clone(),
        };
        let pods = source.pods().await;
        self.app
            .autoscale
            .answer(&pods, tokio::time::Instant::now())
    }
}

impl Handler for Admin {
    async fn handle(self, req: Request<crate::body::IncomingBody>) -> Response<ResponseBody> {
        if req.uri().path() == crate::stat::PATH {
            return stat::serve(&self.app, req.method());
        }
        if route::handles(req.uri().path()) {
            return route::serve(self.app.clone(), req).await;
        }
        let path = req.uri().path();
        let autoscale = match path {
            "/metrics" | "/autoscale" => Some(self.autoscale().await),
            _ => None,
        };
        self.answer(path, autoscale)
    }
}

fn reply(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<ResponseBody> {
    let mut r = Response::new(ResponseBody::full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}
