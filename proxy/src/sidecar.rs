//! Starting and stopping a whole sidecar in-process: the client listener, the
//! admin listener and the engine readiness probe, all owned by one
//! [`SidecarHandle`]. The binary, the tests, the bench and the demo all start
//! kvmesh this way.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::admin::Admin;
use crate::app::App;
use crate::body::ResponseBody;
use crate::config::Config;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::routing::{FiltersError, Routing};
use crate::server::{serve, Handler, ServeOpts};
use crate::shutdown::Shutdown;
use crate::tls::TlsError;

/// Entry point of the library.
#[derive(Debug)]
pub struct Sidecar;

/// A running sidecar. Dropping it does not stop it; call [`SidecarHandle::shutdown`].
#[derive(Debug)]
pub struct SidecarHandle {
    addr: SocketAddr,
    admin_addr: SocketAddr,
    shutdown: Shutdown,
    tasks: JoinSet<()>,
    fleet: Arc<Fleet>,
    routing: Arc<Routing>,
    prefix: Arc<crate::prefix::PrefixState>,
    mesh: Arc<crate::mesh::Mesh>,
    /// The OTLP span pipeline, flushed once the tasks stopped.
    exporter: Option<crate::otel::Exporter>,
}

/// Why a sidecar could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("binding {what} listener {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The filter config (`scheduling.filters`) cannot be used.
    #[error("filter config: {0}")]
    Filters(#[from] FiltersError),
    /// The tokenizer (`prefix.tokenizer`) cannot be loaded.
    #[error("prefix: {0}")]
    Prefix(#[from] crate::prefix::PrefixError),
    /// The OTLP exporter (`tracing`) cannot be built.
    #[error("tracing: {0}")]
    Otel(#[from] crate::otel::OtelError),
    #[error("reading a listener's address: {0}")]
    Io(#[from] std::io::Error),
}

#[derive(Clone)]
struct Proxy(Arc<App>);

impl Handler for Proxy {
    fn handle(
        self,
        req: Request<Incoming>,
    ) -> impl std::future::Future<Output = Response<ResponseBody>> + Send + 'static {
        crate::path::handle(self.0, req)
    }
}

impl Sidecar {
    /// Starts on listeners the caller bound (tests bind port 0 and pass them in).
    pub async fn start(
        config: Config,
        client: TcpListener,
        admin: TcpListener,
    ) -> Result<SidecarHandle, StartError> {
        let tls = config
            .listeners
            .tls
            .as_ref()
            .map(crate::tls::acceptor)
            .transpose()?;
        let addr = client.local_addr()?;
        let admin_addr = admin.local_addr()?;
        let routing = Arc::new(Routing::from_config(&config)?);
        let fleet = Arc::new(Fleet::new(crate::routing::local_pod(&config, addr)));
        // Fresh as of start with its load unknown: the scraper takes over at
        // once, and until then the local pod is not filtered out as stale.
        fleet.set_load(
            fleet.local_id(),
            crate::fleet::EngineLoad::default(),
            tokio::time::Instant::now(),
        );
        let prefix = Arc::new(crate::prefix::PrefixState::new(&config, fleet.local_id())?);
        let mesh_listener =
            crate::mesh::bind(&config)
                .await
                .map_err(|source| StartError::Bind {
                    what: "mesh",
                    addr: config.mesh.listen.unwrap_or(addr),
                    source,
                })?;
        let mesh_addr = crate::mesh::local_addr(&mesh_listener);
        let mesh_tls = config
            .mesh
            .tls
            .as_ref()
            .map(crate::tls::MeshTls::load)
            .transpose()?;
        let mesh = Arc::new(crate::mesh::Mesh::new(
            &config, &fleet, &prefix, mesh_addr, mesh_tls,
        ));
        let (tracer, exporter) = match &config.tracing {
            Some(t) => {
                let (tracer, exporter) = crate::otel::build(t, fleet.local_id())?;
                (Some(tracer), Some(exporter))
            }
            None => (None, None),
        };
        let config = Arc::new(config);
        let app = Arc::new(App {
            client: crate::upstream::build(&config),
            engine: crate::upstream::engine_pool(&config),
            config: config.clone(),
            metrics: Arc::new(Metrics::new()),
            routing: routing.clone(),
            fleet: fleet.clone(),
            engine_block_size: Arc::new(AtomicU32::new(0)),
            prefix: prefix.clone(),
            engine_ready: Arc::new(AtomicBool::new(false)),
            mesh: mesh.clone(),
            tracer,
        });
        let shutdown = Shutdown::new();
        let t = &config.timeouts;
        let mut tasks = JoinSet::new();
        tasks.spawn(serve(
            client,
            Proxy(app.clone()),
            ServeOpts {
                name: "client",
                tls,
                tls_handshake: t.tls_handshake.get(),
                max_connections: config.limits.max_connections,
                drain: t.shutdown_drain.get(),
                request_head: t.request_head.get(),
                rejected: Some(app.metrics.clone()),
            },
            shutdown.clone(),
        ));
        tasks.spawn(serve(
            admin,
            Admin::new(app.clone()),
            ServeOpts {
                name: "admin",
                tls: None,
                tls_handshake: t.tls_handshake.get(),
                // Scrapers and probes only; a small bound keeps them from crowding out clients.
                max_connections: 64,
                drain: t.shutdown_drain.get(),
                request_head: t.request_head.get(),
                rejected: None,
            },
            shutdown.clone(),
        ));
        tasks.spawn(crate::fleet::scrape::scrape_engine(
            app.clone(),
            shutdown.clone(),
        ));
        tasks.spawn(crate::routing::reload::watch(app.clone(), shutdown.clone()));
        tasks.spawn(crate::kvevents::run(app.clone(), shutdown.clone()));
        if let Some(l) = mesh_listener {
            tasks.spawn(crate::mesh::run(
                app.clone(),
                l,
                Proxy(app.clone()),
                shutdown.clone(),
            ));
        }
        tasks.spawn(crate::ready::probe_engine(app, shutdown.clone()));
        tracing::info!(%addr, %admin_addr, engine = %config.engine.url, tls = config.listeners.tls.is_some(), "sidecar started");
        Ok(SidecarHandle {
            addr,
            admin_addr,
            shutdown,
            tasks,
            fleet,
            routing,
            prefix,
            mesh,
            exporter,
        })
    }

    /// Binds the addresses of `config.listeners` and starts.
    pub async fn bind(config: Config) -> Result<SidecarHandle, StartError> {
        let l = &config.listeners;
        let bind = |what, addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Bind { what, addr, source })
        };
        let client = bind("client", l.client).await?;
        let admin = bind("admin", l.admin).await?;
        Self::start(config, client, admin).await
    }
}

impl SidecarHandle {
    /// The client (OpenAI) address actually bound.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The pods this sidecar routes to (add peers with [`Fleet::upsert_peer`]).
    pub fn fleet(&self) -> &Arc<Fleet> {
        &self.fleet
    }

    /// The prefix index and tokenizer (tests read what was ingested).
    pub fn prefix(&self) -> &Arc<crate::prefix::PrefixState> {
        &self.prefix
    }

    /// The mesh state stream (its mesh port, subscribers, decisions).
    pub fn mesh(&self) -> &Arc<crate::mesh::Mesh> {
        &self.mesh
    }

    /// The bound mesh port, if the mesh is on.
    pub fn mesh_addr(&self) -> Option<SocketAddr> {
        self.mesh.mesh_addr()
    }

    /// The active filter config ([`Routing::install`] replaces it).
    pub fn routing(&self) -> &Arc<Routing> {
        &self.routing
    }

    /// A trigger that stops this sidecar from elsewhere (a signal handler).
    pub fn shutdown_handle(&self) -> Shutdown {
        self.shutdown.clone()
    }

    /// Stops accepting, drains in-flight requests (bounded by
    /// `timeouts.shutdown_drain`) and returns when everything has stopped.
    pub async fn shutdown(mut self) {
        self.shutdown.trigger();
        while self.tasks.join_next().await.is_some() {}
        self.flush_spans().await;
    }

    /// Waits until the sidecar stops through its [`Shutdown`] handle.
    pub async fn wait(mut self) {
        self.shutdown.triggered().await;
        while self.tasks.join_next().await.is_some() {}
        self.flush_spans().await;
    }

    /// Exports the spans still queued (the drained requests' last ones);
    /// bounded by `otel::FLUSH_TIMEOUT`.
    async fn flush_spans(&mut self) {
        if let Some(exporter) = self.exporter.take() {
            let _ = tokio::task::spawn_blocking(move || exporter.shutdown()).await;
        }
    }
}
