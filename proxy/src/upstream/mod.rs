//! The pooled HTTP clients for upstreams: keep-alive HTTP/1.1 by default or
//! h2c, TCP_NODELAY (a missing one costs tens of milliseconds per streamed
//! chunk), and the connect deadline from config.
//!
//! | client | file | serves |
//! |---|---|---|
//! | [`EnginePool`] | `engine.rs` | requests to the local engine over HTTP/1.1 (the hot path) |
//! | [`UpstreamClient`] | here | peers, llm-d's prefiller, h2c, probes and scrapes |

pub mod engine;
pub mod mesh;

pub use engine::{EngineError, EnginePool, ReplyBody};

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::body::UpstreamBody;
use crate::config::Config;

pub type UpstreamClient = Client<HttpConnector, UpstreamBody>;

pub fn build(config: &Config) -> UpstreamClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(config.timeouts.connect.get()));
    http.enforce_http(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(config.upstream.max_idle_per_host)
        .pool_idle_timeout(config.upstream.idle_timeout.get())
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .http2_only(config.upstream.http2)
        .build(http)
}

/// The lean pool for the local engine, unless upstreams speak h2c (then the
/// general client multiplexes one connection).
pub fn engine_pool(config: &Config) -> Option<EnginePool> {
    (!config.upstream.http2).then(|| {
        EnginePool::new(
            config.engine.url.authority().clone(),
            config.timeouts.connect.get(),
            config.upstream.max_idle_per_host,
            config.upstream.idle_timeout.get(),
        )
    })
}
