//! Starting and stopping a whole sidecar in-process: the client listener, the
//! admin listener and the engine readiness probe, all owned by one
//! [`SidecarHandle`]. The binary, the tests, the bench and the demo all start
//! kvmesh this way.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::Arc;

use http::{Request, Response};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{oneshot, Semaphore};
use tokio::task::JoinSet;

use crate::admin::Admin;
use crate::app::App;
use crate::body::{IncomingBody, ResponseBody};
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
    /// The Valkey index (`index.backend: valkey`).
    index: Option<Arc<crate::valkey::Valkey>>,
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
        req: Request<IncomingBody>,
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
        // Each subsystem registers its families as it is built, then the
        // request families join them.
        let mut registry = crate::metrics::registry();
        let routing = Arc::new(Routing::from_config(&config, &mut registry)?);
        let fleet = Arc::new(Fleet::new(crate::routing::local_pod(&config, addr)));
        fleet.ranks().set_size(config.engine.data_parallel_size);
        // Fresh as of start with its load unknown: the scraper takes over at
        // once, and until then the local pod is not filtered out as stale.
        fleet.set_load(
            fleet.local_id(),
            crate::fleet::EngineLoad::default(),
            tokio::time::Instant::now(),
        );
        let prefix = Arc::new(crate::prefix::PrefixState::new(
            &config,
            fleet.local_id(),
            &mut registry,
        )?);
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
            &config,
            &fleet,
            &prefix,
            mesh_addr,
            mesh_tls,
            &mut registry,
        ));
        let pd_metrics = Arc::new(crate::pd::metrics::PdMetrics::register(&mut registry));
        let autoscale = Arc::new(crate::autoscale::Hook::new(
            &config.autoscale,
            &mut registry,
        ));
        let flow = Arc::new(crate::flow::Gate::new(&mut registry));
        let (tracer, exporter) = match &config.tracing {
            Some(t) => {
                let (tracer, exporter) = crate::otel::build(t, fleet.local_id())?;
                (Some(tracer), Some(exporter))
            }
            None => (None, None),
        };
        let config = Arc::new(config);
        let index = (config.index.backend == crate::config::index::Backend::Valkey)
            .then(|| Arc::new(crate::valkey::Valkey::new(&config, &mut registry)));
        // Subscribed before the KV-event feed starts, so no batch is missed.
        let index_kv = index.as_ref().map(|_| prefix.subscribe_local());
        let app = Arc::new(App {
            client: crate::upstream::build(&config),
            engine: crate::upstream::engine_pool(&config),
            config: config.clone(),
            metrics: Arc::new(Metrics::with_registry(registry)),
            routing: routing.clone(),
            fleet: fleet.clone(),
            engine_block_size: Arc::new(AtomicU32::new(0)),
            prefix: prefix.clone(),
            engine_ready: Arc::new(AtomicBool::new(false)),
            mesh: mesh.clone(),
            tracer,
            index: index.clone(),
            pd_metrics,
            autoscale: autoscale.clone(),
            flow,
        });
        let app_index = index.clone();
        let shutdown = Shutdown::new();
        let t = &config.timeouts;
        let mut tasks = JoinSet::new();
        let client_opts = ServeOpts {
            name: "client",
            tls,
            tls_handshake: t.tls_handshake.get(),
            slots: Arc::new(Semaphore::new(config.limits.max_connections)),
            drain: t.shutdown_drain.get(),
            request_head: t.request_head.get(),
            thread: 0,
            metrics: Some(app.metrics.clone()),
        };
        let client = client.into_std()?;
        // 1..=1024 as the config file's check allows.
        let threads = config.runtime.worker_threads.clamp(1, 1024) as u16;
        // Every thread's series from the start, so a scrape sees a thread
        // that has accepted nothing yet as 0.
        for n in 0..threads {
            let _ = app.metrics.clients.connections(n);
        }
        let first = TcpListener::from_std(client.try_clone()?)?;
        for n in 1..threads {
            let opts = ServeOpts {
                thread: n,
                ..client_opts.clone()
            };
            match serving_thread(&client, app.clone(), opts, shutdown.clone()) {
                Ok(stopped) => {
                    tasks.spawn(async move {
                        let _ = stopped.await;
                    });
                }
                Err(e) => {
                    shutdown.trigger(); // the threads already started stop
                    return Err(e.into());
                }
            }
        }
        drop(client);
        tasks.spawn(serve(
            first,
            Proxy(app.clone()),
            client_opts,
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
                slots: Arc::new(Semaphore::new(64)),
                drain: t.shutdown_drain.get(),
                request_head: t.request_head.get(),
                thread: 0,
                metrics: None,
            },
            shutdown.clone(),
        ));
        let scrape = crate::scrape::Scrape {
            config: config.clone(),
            client: app.client.clone(),
            fleet: fleet.clone(),
            engine_block_size: app.engine_block_size.clone(),
            routing: routing.clone(),
        };
        tasks.spawn(crate::scrape::scrape_engine(scrape, shutdown.clone()));
        let fleet_source = crate::autoscale::FleetSource {
            config: config.clone(),
            fleet: fleet.clone(),
            index: app.index.clone(),
        };
        tasks.spawn(crate::autoscale::run(
            autoscale,
            fleet_source,
            shutdown.clone(),
        ));
        tasks.spawn(crate::routing::reload::watch(
            routing.clone(),
            config.clone(),
            shutdown.clone(),
        ));
        let ingest = crate::kvevents::Ingest {
            config: config.clone(),
            prefix: prefix.clone(),
            engine_block_size: app.engine_block_size.clone(),
        };
        tasks.spawn(crate::kvevents::run(ingest, shutdown.clone()));
        if let (Some(valkey), Some(local_kv)) = (index, index_kv) {
            let t = crate::valkey::Tasks {
                valkey,
                config: config.clone(),
                fleet: fleet.clone(),
                prefix: prefix.clone(),
                local_kv,
                mesh_addr,
            };
            tasks.spawn(crate::valkey::run(t, shutdown.clone()));
        }
        if let Some(l) = mesh_listener {
            let t = crate::mesh::Tasks {
                config: config.clone(),
                mesh: mesh.clone(),
                fleet: fleet.clone(),
                prefix: prefix.clone(),
                metrics: app.metrics.clone(),
                pd: app.pd_metrics.clone(),
            };
            tasks.spawn(crate::mesh::run(t, l, Proxy(app.clone()), shutdown.clone()));
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
            index: app_index,
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
        let client = if config.runtime.worker_threads > 1 {
            shared_port(l.client).map_err(|source| StartError::Bind {
                what: "client",
                addr: l.client,
                source,
            })?
        } else {
            bind("client", l.client).await?
        };
        let admin = bind("admin", l.admin).await?;
        Self::start(config, client, admin).await
    }
}

/// Another thread serving the client listener (`runtime.worker_threads`
/// above 1), as nginx's worker processes and Envoy's worker threads do: its
/// own single-threaded runtime accepts and serves each connection it took
/// wholly on that thread, through an engine pool of its own, so a request
/// never wakes another thread. The admin port, the mesh, scrapes and probes
/// stay on the first thread. The receiver resolves once the thread has
/// drained and stopped.
fn serving_thread(
    first: &std::net::TcpListener,
    app: Arc<App>,
    opts: ServeOpts,
    shutdown: Shutdown,
) -> std::io::Result<oneshot::Receiver<()>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let listener = {
        let _in_rt = rt.enter();
        listener_beside(first)?
    };
    let (done, stopped) = oneshot::channel();
    std::thread::Builder::new()
        .name(format!("kvmesh-worker-{}", opts.thread))
        .spawn(move || {
            rt.block_on(async move {
                let app = Arc::new(app.for_thread());
                serve(listener, Proxy(app), opts, shutdown).await;
            });
            drop(rt);
            let _ = done.send(());
        })?;
    Ok(stopped)
}

/// A listening socket of its own on `first`'s address when `first` has
/// `SO_REUSEPORT` ([`Sidecar::bind`] sets it for several threads): the
/// kernel then spreads new connections over the threads by a hash of each
/// client's address and port. Otherwise (a caller bound `first` without it)
/// `first` itself, shared: each connection then goes to whichever thread
/// wakes first.
fn listener_beside(first: &std::net::TcpListener) -> std::io::Result<TcpListener> {
    let addr = first.local_addr()?;
    match shared_port(addr) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            TcpListener::from_std(first.try_clone()?)
        }
        Err(e) => Err(e),
    }
}

/// A client listener the serving threads each bind again (`SO_REUSEPORT`).
/// Only with several threads: on one, a second process given the same port
/// by mistake fails to start instead of silently taking half the clients.
fn shared_port(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// The pending-connection queue of a listening socket (tokio's own default).
const LISTEN_BACKLOG: u32 = 1024;

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

    /// The Valkey index, with `index.backend: valkey`.
    pub fn index(&self) -> Option<&Arc<crate::valkey::Valkey>> {
        self.index.as_ref()
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
