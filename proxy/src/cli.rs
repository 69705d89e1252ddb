//! The sidecar's command line: `run` (the default) and `check-config`.
//! `main.rs` only calls [`main`]; this module turns arguments into a config
//! and a running sidecar, and errors into exit codes. Everything else an
//! operator runs (`inject`, `stat`, `prefix`, `demo`, the benchmarks) is the
//! `kvmesh` CLI crate, so this binary stays the data plane alone.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::config::{self, Config, ConfigError, EngineUrl};
use crate::sidecar::Sidecar;

#[derive(Debug, Parser)]
#[command(
    name = "kvmesh-proxy",
    version,
    about = "kvmesh sidecar: an OpenAI-compatible proxy beside each vLLM/SGLang pod"
)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// With no subcommand, `run` is implied.
    #[command(flatten)]
    pub run: RunArgs,
}

// Parsed once per process: the size of `Run` does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the sidecar in front of the local engine.
    Run(Box<RunArgs>),
    /// Validate a proxy.yaml (and a filters.yaml) without starting; exits non-zero
    /// with the file, line and field of the first error.
    CheckConfig {
        /// proxy.yaml; without it only the filter config is checked.
        file: Option<PathBuf>,
        /// filters.yaml; default: the one proxy.yaml names in `scheduling.filters`.
        #[arg(long)]
        filters: Option<PathBuf>,
    },
}

/// Flags override the file; flags alone are enough to run beside an engine.
#[derive(Debug, Clone, Default, Args)]
pub struct RunArgs {
    /// proxy.yaml; without it, defaults plus the flags below.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Client (OpenAI) listener, e.g. 0.0.0.0:8000.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Admin listener (/health, /ready, /metrics, /config).
    #[arg(long, value_name = "ADDR")]
    pub admin: Option<SocketAddr>,
    /// The local engine's base URL, e.g. http://127.0.0.1:8200.
    #[arg(long, value_name = "URL", value_parser = EngineUrl::parse)]
    pub engine: Option<EngineUrl>,
    /// filters.yaml (scheduling plugins and profiles).
    #[arg(long, value_name = "FILE")]
    pub filters: Option<PathBuf>,
    /// The engine's KV event PUB endpoint, as given to the engine (e.g.
    /// tcp://*:5557: the sidecar connects; tcp://HOST:PORT: it binds).
    #[arg(long, value_name = "URL")]
    pub engine_kv_events: Option<String>,
    /// How prompts are tokenized: a model directory, builtin, engine or none.
    #[arg(long, value_name = "DIR|builtin|engine|none", value_parser = config::TokenizerChoice::parse)]
    pub tokenizer: Option<config::TokenizerChoice>,
    /// The mesh port other sidecars subscribe to, e.g. 0.0.0.0:7000.
    #[arg(long, value_name = "ADDR")]
    pub mesh_listen: Option<SocketAddr>,
    /// Peers' mesh addresses, HOST:PORT,... (added to `mesh.peers`).
    #[arg(long, value_name = "HOST:PORT,...", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// This pod's identity as peers reach its client port, HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    pub advertise: Option<String>,
    /// The IP of this pod's node, where its kvagent listens (`pod.node_ip`;
    /// in Kubernetes `status.hostIP` through the downward API).
    #[arg(long, value_name = "IP")]
    pub node_ip: Option<std::net::IpAddr>,
    /// The model the local engine serves (replaces `pod.models`).
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// The local engine's role: prefill, decode or both.
    #[arg(long, value_name = "ROLE", value_parser = parse_role)]
    pub role: Option<kvmesh_filters::sched::Role>,
    /// How prefill hands KV to decode when a request is split.
    #[arg(long, value_name = "nixl|sglang|kvagent", value_parser = parse_connector)]
    pub pd_connector: Option<config::PdConnector>,
    /// Split a request into prefill + decode when the decode pod lacks at
    /// least this many of its prompt tokens (turns P/D on).
    #[arg(long, value_name = "N")]
    pub pd_min_uncached_tokens: Option<u32>,
    /// Threads serving requests (`runtime.worker_threads`; default 1).
    #[arg(long, value_name = "N")]
    pub worker_threads: Option<usize>,
    /// Where the fleet's prefix index and load live (`index.backend`):
    /// every sidecar following every peer (mesh), or a shared Valkey.
    #[arg(long, value_name = "mesh|valkey", value_parser = parse_backend)]
    pub index_backend: Option<config::index::Backend>,
    /// A Valkey server, redis://HOST:PORT (repeatable; added to
    /// `index.valkey.urls`): one server, a primary and its replicas, or a
    /// cluster's seeds with --valkey-cluster.
    #[arg(long = "valkey-url", value_name = "URL")]
    pub valkey_urls: Vec<String>,
    /// The Valkey URLs are seeds of a Valkey cluster (`index.valkey.cluster`).
    #[arg(long)]
    pub valkey_cluster: bool,
    /// A Valkey Sentinel, redis://HOST:26379 (repeatable; added to
    /// `index.valkey.sentinel.urls`): the sentinels name the primary.
    #[arg(long = "valkey-sentinel", value_name = "URL")]
    pub valkey_sentinels: Vec<String>,
    /// The name the sentinels monitor the primary under
    /// (`index.valkey.sentinel.master`).
    #[arg(long, value_name = "NAME")]
    pub valkey_master: Option<String>,
}

fn parse_connector(s: &str) -> Result<config::PdConnector, String> {
    match s {
        "nixl" => Ok(config::PdConnector::Nixl),
        "sglang" => Ok(config::PdConnector::Sglang),
        "kvagent" => Ok(config::PdConnector::Kvagent),
        _ => Err(format!("{s:?} is not nixl, sglang or kvagent")),
    }
}

fn parse_backend(s: &str) -> Result<config::index::Backend, String> {
    use config::index::Backend;
    match s {
        "mesh" => Ok(Backend::Mesh),
        "valkey" => Ok(Backend::Valkey),
        _ => Err(format!("{s:?} is not mesh or valkey")),
    }
}

fn parse_role(s: &str) -> Result<kvmesh_filters::sched::Role, String> {
    use kvmesh_filters::sched::Role;
    match s {
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        "both" => Ok(Role::Both),
        _ => Err(format!("{s:?} is not prefill, decode or both")),
    }
}

/// Runs the command line; the binary's whole `main`.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        None => run(cli.run),
        Some(Command::Run(args)) => run(*args),
        Some(Command::CheckConfig { file, filters }) => {
            check_config(file.as_deref(), filters.as_deref())
        }
    }
}

/// The effective config: the file (or defaults), then the flags, validated.
pub fn effective_config(args: &RunArgs) -> Result<Config, ConfigError> {
    let mut c = match &args.config {
        Some(path) => config::load_file(path)?,
        None => Config::default(),
    };
    if let Some(a) = args.listen {
        c.listeners.client = a;
    }
    if let Some(a) = args.admin {
        c.listeners.admin = a;
    }
    if let Some(u) = &args.engine {
        c.engine.url = u.clone();
    }
    if let Some(f) = &args.filters {
        c.scheduling.filters = Some(f.clone());
    }
    if let Some(ep) = &args.engine_kv_events {
        let kv = c
            .engine
            .kv_events
            .get_or_insert_with(config::KvEvents::default);
        kv.endpoint = ep.clone();
    }
    if let Some(t) = &args.tokenizer {
        c.prefix.tokenizer = t.clone();
    }
    if let Some(a) = args.mesh_listen {
        c.mesh.listen = Some(a);
    }
    c.mesh.peers.extend(args.peers.iter().cloned());
    if let Some(a) = &args.advertise {
        c.mesh.advertise = Some(a.clone());
    }
    if let Some(ip) = args.node_ip {
        c.pod.node_ip = Some(ip);
    }
    if let Some(m) = &args.model {
        c.pod.models = vec![m.clone()];
    }
    if let Some(r) = args.role {
        c.pod.role = r;
    }
    if let Some(k) = args.pd_connector {
        c.pd.connector = k;
    }
    if let Some(n) = args.pd_min_uncached_tokens {
        c.pd.min_uncached_tokens = Some(n);
    }
    if let Some(n) = args.worker_threads {
        c.runtime.worker_threads = n;
    }
    if let Some(b) = args.index_backend {
        c.index.backend = b;
    }
    c.index.valkey.urls.extend(args.valkey_urls.iter().cloned());
    if args.valkey_cluster {
        c.index.valkey.cluster = true;
    }
    if !args.valkey_sentinels.is_empty() || args.valkey_master.is_some() {
        let s = c.index.valkey.sentinel.get_or_insert_with(Default::default);
        s.urls.extend(args.valkey_sentinels.iter().cloned());
        if let Some(m) = &args.valkey_master {
            s.master = m.clone();
        }
    }
    config::load::validate_built(&c, "<flags>")?;
    Ok(c)
}

fn run(args: RunArgs) -> ExitCode {
    let config = match effective_config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvmesh-proxy: invalid config: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(f) = &config.scheduling.filters {
        if let Err(e) = crate::routing::load_filters(f) {
            eprintln!("kvmesh-proxy: invalid filter config: {e}");
            return ExitCode::from(2);
        }
    }
    crate::logging::init(&config.logging);
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvmesh-proxy: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        let handle = match Sidecar::bind(config).await {
            Ok(h) => h,
            Err(e) => {
                tracing::error!(error = %e, "cannot start");
                return ExitCode::FAILURE;
            }
        };
        let stop = handle.shutdown_handle();
        tokio::select! {
            _ = termination() => tracing::info!("termination signal: draining"),
            _ = stop.triggered() => {}
        }
        handle.shutdown().await;
        tracing::info!("stopped");
        ExitCode::SUCCESS
    })
}

/// The first thread's runtime, single-threaded: it serves the client port
/// (with the threads `runtime.worker_threads` adds, each its own runtime:
/// `Sidecar::start`), the admin port, the mesh, scrapes and probes. On one
/// thread a request's tasks wake each other where they run; on tokio's
/// work-stealing scheduler a task woken while it runs (hyper's body channels
/// do that several times a request) is queued as a yield, and a yield wakes a
/// parked worker to steal it: a futex wake and a context switch per request,
/// about a fifth of the proxy's CPU per small request (docs/bench-tool.md,
/// "One thread").
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name("kvmesh-blocking")
        .build()
}

/// Ctrl-C or SIGTERM (what Kubernetes sends).
async fn termination() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// `check-config`: validates a proxy.yaml (its TLS files loaded too) and a
/// filters.yaml; prints `FILE: ok` per file, or the first error with file,
/// line and field and exits 2. Shared with `kvmesh check-config`.
pub fn check_config(file: Option<&Path>, filters: Option<&Path>) -> ExitCode {
    let report = check_files(file, filters);
    for line in &report.ok {
        println!("{line}");
    }
    match report.error {
        Some(e) => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
        None => ExitCode::SUCCESS,
    }
}

/// What `check-config` prints: a line per file that passed (stdout), then
/// the first error, if any (stderr, exit code 2).
#[derive(Debug, Default)]
pub struct CheckReport {
    pub ok: Vec<String>,
    pub error: Option<String>,
}

/// [`check_config`] without the printing.
pub fn check_files(file: Option<&Path>, filters: Option<&Path>) -> CheckReport {
    let mut report = CheckReport::default();
    if file.is_none() && filters.is_none() {
        report.error =
            Some("check-config: name a proxy.yaml, a --filters file, or both".to_owned());
        return report;
    }
    let mut named_filters = None;
    if let Some(file) = file {
        let config = match config::load_file(file) {
            Ok(c) => c,
            Err(e) => {
                report.error = Some(e.to_string());
                return report;
            }
        };
        let client_tls = config.listeners.tls.as_ref().map(crate::tls::acceptor);
        let mesh_tls = config.mesh.tls.as_ref().map(crate::tls::MeshTls::load);
        let tls_errors = [
            client_tls.and_then(Result::err),
            mesh_tls.and_then(Result::err),
        ];
        if let Some(e) = tls_errors.into_iter().flatten().next() {
            let field = e.field();
            let src = std::fs::read_to_string(file).unwrap_or_default();
            let loc = config::load::locate(&src, field)
                .map(|(l, c)| format!(":{l}:{c}"))
                .unwrap_or_default();
            report.error = Some(format!("{}{loc}: {field}: {e}", file.display()));
            return report;
        }
        named_filters = config.scheduling.filters;
        report.ok.push(format!("{}: ok", file.display()));
    }
    if let Some(f) = filters.map(Path::to_path_buf).or(named_filters) {
        match crate::routing::load_filters(&f) {
            Ok(active) => {
                let profiles: Vec<&str> = active.scheduler.profile_names().collect();
                report.ok.push(format!(
                    "{}: ok (profiles: {})",
                    f.display(),
                    profiles.join(", ")
                ));
                for note in &active.prefix.notes {
                    report.ok.push(format!("{}: note: {note}", f.display()));
                }
            }
            Err(e) => report.error = Some(e.to_string()),
        }
    }
    report
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::config::index::Backend;

    fn run_args(flags: &[&str]) -> RunArgs {
        let argv = ["kvmesh-proxy", "run"].iter().chain(flags);
        match Cli::try_parse_from(argv).unwrap().command {
            Some(Command::Run(args)) => *args,
            other => panic!("{other:?}"),
        }
    }

    fn write(dir: &Path, text: &str) -> PathBuf {
        let p = dir.join("proxy.yaml");
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn index_flags_set_the_index_section() {
        let c = effective_config(&run_args(&[
            "--index-backend",
            "valkey",
            "--valkey-url",
            "redis://valkey-0.valkey:6379",
            "--valkey-url=redis://valkey-1.valkey:6379",
            "--valkey-cluster",
        ]))
        .unwrap();
        assert_eq!(c.index.backend, Backend::Valkey);
        assert_eq!(
            c.index.valkey.urls,
            [
                "redis://valkey-0.valkey:6379",
                "redis://valkey-1.valkey:6379"
            ]
        );
        assert!(c.index.valkey.cluster);

        let plain = effective_config(&run_args(&[])).unwrap();
        assert_eq!(plain.index, config::Index::default());
        assert!(Cli::try_parse_from(["kvmesh-proxy", "run", "--index-backend", "redis"]).is_err());
    }

    #[test]
    fn index_flags_add_to_the_file_and_are_validated_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(
            dir.path(),
            "index:\n  valkey:\n    urls: [redis://a:6379]\n    stripes: 4\n",
        );
        let file = file.to_str().unwrap();
        let c = effective_config(&run_args(&[
            "--config",
            file,
            "--index-backend=valkey",
            "--valkey-url=redis://b:6379",
        ]))
        .unwrap();
        assert_eq!(c.index.valkey.urls, ["redis://a:6379", "redis://b:6379"]);
        assert_eq!(c.index.valkey.stripes, 4, "the file's other keys stay");
        assert!(!c.index.valkey.cluster);

        // Flags are checked as the file is: valkey needs a URL, and refuses
        // the mesh's peer discovery.
        let e = effective_config(&run_args(&["--index-backend", "valkey"])).unwrap_err();
        assert_eq!(e.path, "index.valkey.urls", "{e}");
        assert!(
            e.to_string().starts_with("<flags>: index.valkey.urls: "),
            "{e}"
        );
        let e = effective_config(&run_args(&[
            "--index-backend=valkey",
            "--valkey-url=redis://a:6379",
            "--peers=10.0.0.2:7000",
            "--mesh-listen=0.0.0.0:7000",
        ]))
        .unwrap_err();
        assert_eq!(e.path, "mesh.peers", "{e}");
    }

    #[test]
    fn sentinel_flags_set_the_sentinels_and_the_master() {
        let c = effective_config(&run_args(&[
            "--index-backend=valkey",
            "--valkey-sentinel=redis://s-0:26379",
            "--valkey-sentinel",
            "redis://s-1:26379",
            "--valkey-master=kvmesh",
        ]))
        .unwrap();
        let s = c.index.valkey.sentinel.unwrap();
        assert_eq!(s.urls, ["redis://s-0:26379", "redis://s-1:26379"]);
        assert_eq!(s.master, "kvmesh");
        // Checked as the file is: a master name is needed.
        let e = effective_config(&run_args(&[
            "--index-backend=valkey",
            "--valkey-sentinel=redis://s-0:26379",
        ]))
        .unwrap_err();
        assert!(e.path.ends_with("sentinel.master"), "{e}");
    }

    #[test]
    fn check_config_names_the_index_field_at_fault() {
        let dir = tempfile::tempdir().unwrap();
        for (text, want) in [
            ("index:\n  backend: valkey\n", ": index.valkey.urls: backend valkey needs"),
            (
                "index:\n  backend: valkey\n  valkey:\n    urls: [http://a:6379]\n",
                ":4:5: index.valkey.urls: \"http://a:6379\" must start with",
            ),
            (
                "index:\n  backend: valkey\n  valkey:\n    urls: [redis://a:6379]\n    lease_ttl: 200ms\n",
                ":5:5: index.valkey.lease_ttl: 200ms must be longer than lease_interval",
            ),
            (
                "index:\n  valkey:\n    stripe: 2\n",
                ":3:5: index.valkey.stripe: unknown field `stripe`",
            ),
            ("index:\n  backend: redis\n", ":2:12: index.backend: unknown variant"),
            (
                "mesh:\n  listen: 0.0.0.0:7000\n  dns: {name: kvmesh-mesh, port: 7000}\nindex:\n  backend: valkey\n  valkey: {urls: [redis://a:6379]}\n",
                ":3:3: mesh.dns: with index.backend valkey",
            ),
        ] {
            let f = write(dir.path(), text);
            let report = check_files(Some(&f), None);
            let err = report.error.unwrap_or_else(|| panic!("{text} passed"));
            let want = format!("{}{want}", f.display());
            assert!(err.starts_with(&want), "{text}\n{err}\nwant {want}");
            assert!(report.ok.is_empty());
        }
        let f = write(
            dir.path(),
            "index:\n  backend: valkey\n  valkey:\n    urls: [redis://a:6379, valkey://b:6379]\n",
        );
        let report = check_files(Some(&f), None);
        assert_eq!(report.error, None);
        assert_eq!(report.ok, [format!("{}: ok", f.display())]);
    }
}
