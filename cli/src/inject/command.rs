//! The `inject` and `uninject` subcommands: read manifests (a file, a
//! directory's `*.yaml`/`*.yml` in name order, or stdin), run the pure
//! transformation, print the result. Output is written only once everything
//! succeeded, so a pipe into `kubectl apply -f -` never gets half a stream:
//! any error goes to stderr with a non-zero exit and nothing on stdout.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use serde_yaml_ng::Value;

use super::index::IndexFlags;
use super::{yaml, InjectOptions, Outcome, Ports};
use kvmesh_proxy::config::index::Backend;
use kvmesh_proxy::config::PdConnector;

/// Largest input read (all files together, or stdin).
const MAX_INPUT: u64 = 64 * 1024 * 1024;

/// The proxy.yaml used without `--config`: the kustomize Component's.
const DEFAULT_PROXY_YAML: &str = include_str!("../../assets/deploy/sidecar/proxy.yaml");

/// Arguments of `kvmesh inject`.
#[derive(Debug, Clone, Args)]
pub struct InjectArgs {
    /// A manifest file, a directory (its *.yaml and *.yml, in name order), or - for stdin.
    #[arg(default_value = "-", value_name = "FILE|DIR|-")]
    pub input: String,
    /// The pods' role in P/D.
    #[arg(long, value_enum, value_name = "ROLE")]
    pub role: Option<RoleArg>,
    /// The P/D connector.
    #[arg(long, value_enum, value_name = "CONNECTOR")]
    pub pd_connector: Option<ConnectorArg>,
    /// The model the engines serve (vLLM's --served-model-name); required without --config.
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// proxy.yaml for the sidecars (validated; default: deploy/sidecar/proxy.yaml).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// filters.yaml for the sidecars (validated).
    #[arg(long, value_name = "FILE")]
    pub filters: Option<PathBuf>,
    /// The sidecar image.
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,
    /// Where the fleet's prefix index lives (`index.backend` in the
    /// ConfigMap's proxy.yaml). valkey also leaves out the mesh's peer
    /// discovery and its headless Service (and the mesh port, unless mesh.tls).
    #[arg(long, value_enum, value_name = "BACKEND")]
    pub index: Option<IndexArg>,
    /// A Valkey server, redis://HOST:PORT (repeatable; added to
    /// `index.valkey.urls`): one server, or a primary and its replicas.
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

impl Default for InjectArgs {
    /// stdin, no flags (as `kvmesh inject` with no arguments).
    fn default() -> Self {
        Self {
            input: "-".to_owned(),
            role: None,
            pd_connector: None,
            model: None,
            config: None,
            filters: None,
            image: None,
            index: None,
            valkey_urls: Vec::new(),
            valkey_cluster: false,
            valkey_sentinels: Vec::new(),
            valkey_master: None,
        }
    }
}

/// Arguments of `kvmesh uninject`.
#[derive(Debug, Clone, Args)]
pub struct UninjectArgs {
    /// A manifest file, a directory (its *.yaml and *.yml, in name order), or - for stdin.
    #[arg(default_value = "-", value_name = "FILE|DIR|-")]
    pub input: String,
}

/// `--role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    Both,
    Prefill,
    Decode,
}

/// `--pd-connector`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConnectorArg {
    Nixl,
    Sglang,
    Kvagent,
}

/// `--index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IndexArg {
    Mesh,
    Valkey,
}

impl IndexArg {
    fn backend(self) -> Backend {
        match self {
            Self::Mesh => Backend::Mesh,
            Self::Valkey => Backend::Valkey,
        }
    }
}

/// Why the command failed (printed on stderr; exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("{0}: {1}")]
    Read(String, std::io::Error),
    #[error("{0}: more than {MAX_INPUT} bytes of input")]
    TooLarge(String),
    #[error("{0}: no *.yaml or *.yml files")]
    EmptyDir(String),
    #[error(transparent)]
    Parse(#[from] yaml::ParseError),
    #[error("invalid config: {0}")]
    Config(#[from] kvmesh_proxy::config::ConfigError),
    #[error("invalid filter config: {0}")]
    Filters(String),
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Index(#[from] super::index::IndexError),
    #[error(transparent)]
    Inject(#[from] super::InjectError),
    #[error("writing the output: {0}")]
    Emit(#[from] yaml::EmitError),
}

/// `kvmesh inject`.
pub fn inject_main(args: &InjectArgs) -> ExitCode {
    finish(
        "inject",
        options(args).and_then(|(opts, notes)| {
            let docs = read_input(&args.input)?;
            let mut out = super::inject(docs, &opts)?;
            out.notes.splice(0..0, notes);
            Ok(out)
        }),
    )
}

/// `kvmesh uninject`.
pub fn uninject_main(args: &UninjectArgs) -> ExitCode {
    finish(
        "uninject",
        read_input(&args.input).and_then(|docs| Ok(super::uninject(docs)?)),
    )
}

fn finish(name: &str, result: Result<Outcome, CommandError>) -> ExitCode {
    let printed = result.and_then(|out| Ok((yaml::emit_stream(&out.docs)?, out.notes)));
    match printed {
        Ok((text, notes)) => {
            for n in notes {
                eprintln!("kvmesh {name}: {n}");
            }
            let mut stdout = std::io::stdout().lock();
            match stdout
                .write_all(text.as_bytes())
                .and_then(|()| stdout.flush())
            {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("kvmesh {name}: writing stdout: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Err(e) => {
            eprintln!("kvmesh {name}: {e}");
            ExitCode::from(2)
        }
    }
}

/// The sidecar settings from the flags, validated as the sidecar will load
/// them (the file, then the flags its `run` gets), and notes for stderr.
pub fn options(args: &InjectArgs) -> Result<(InjectOptions, Vec<String>), CommandError> {
    let mut notes = Vec::new();
    let (proxy_yaml, origin) = match &args.config {
        Some(p) => (read_file(p)?, p.display().to_string()),
        None => {
            if args.model.is_none() {
                return Err(CommandError::Usage(
                    "name the served model with --model (vLLM's --served-model-name), or give --config".to_owned(),
                ));
            }
            (
                DEFAULT_PROXY_YAML.to_owned(),
                "deploy/sidecar/proxy.yaml (built in)".to_owned(),
            )
        }
    };
    let file = kvmesh_proxy::config::load::from_yaml_str(&proxy_yaml, &origin)?;
    let (proxy_yaml, file) = index_flags(args, proxy_yaml, file, &origin, &mut notes)?;
    if file.scheduling.filters.is_some() && args.filters.is_none() {
        return Err(CommandError::Usage(format!(
            "{origin} names scheduling.filters; pass that file with --filters so it goes into the ConfigMap"
        )));
    }
    if file.mesh.tls.is_some() || file.listeners.tls.is_some() {
        notes.push(format!(
            "{origin} names TLS files: mount them into the {} container from a Secret (inject does not)",
            super::CONTAINER
        ));
    }
    let filters_yaml = match &args.filters {
        Some(p) => {
            kvmesh_proxy::routing::load_filters(p)
                .map_err(|e| CommandError::Filters(e.to_string()))?;
            Some(read_file(p)?)
        }
        None => None,
    };
    // The sidecar runs with the file and these flags (which override it, as
    // `run`'s flags do): check the combination now.
    let mut effective = file;
    let mut extra_args = Vec::new();
    if let Some(m) = &args.model {
        extra_args.push(format!("--model={m}"));
        effective.pod.models = vec![m.clone()];
    }
    if let Some(r) = args.role {
        use kvmesh_filters::sched::Role;
        let (name, role) = match r {
            RoleArg::Both => ("both", Role::Both),
            RoleArg::Prefill => ("prefill", Role::Prefill),
            RoleArg::Decode => ("decode", Role::Decode),
        };
        extra_args.push(format!("--role={name}"));
        effective.pod.role = role;
    }
    if let Some(c) = args.pd_connector {
        let (name, connector) = match c {
            ConnectorArg::Nixl => ("nixl", PdConnector::Nixl),
            ConnectorArg::Sglang => ("sglang", PdConnector::Sglang),
            ConnectorArg::Kvagent => ("kvagent", PdConnector::Kvagent),
        };
        extra_args.push(format!("--pd-connector={name}"));
        effective.pd.connector = connector;
    }
    kvmesh_proxy::config::load::validate_built(&effective, &format!("{origin} with the flags"))?;
    let version = env!("CARGO_PKG_VERSION").to_owned();
    let opts = InjectOptions {
        image: args
            .image
            .clone()
            .unwrap_or_else(|| format!("ghcr.io/kvmesh/kvmesh-proxy:{version}")),
        proxy_yaml,
        filters_yaml,
        ports: Ports {
            client: effective.listeners.client.port(),
            admin: effective.listeners.admin.port(),
            mesh: effective.mesh.listen.map(|a| a.port()),
        },
        mesh_service: effective.index.backend == Backend::Mesh,
        extra_args,
        version,
    };
    Ok((opts, notes))
}

/// proxy.yaml with `--index` and the `--valkey-*` flags applied
/// (`inject/index.rs`), and its config; unchanged without them.
fn index_flags(
    args: &InjectArgs,
    text: String,
    file: kvmesh_proxy::config::Config,
    origin: &str,
    notes: &mut Vec<String>,
) -> Result<(String, kvmesh_proxy::config::Config), CommandError> {
    let flags = IndexFlags {
        backend: args.index.map(IndexArg::backend),
        urls: args.valkey_urls.clone(),
        cluster: args.valkey_cluster,
        sentinels: args.valkey_sentinels.clone(),
        master: args.valkey_master.clone(),
    };
    let Some(rewritten) = super::index::apply(&text, &file, &flags, origin)? else {
        return Ok((text, file));
    };
    let config = kvmesh_proxy::config::load::from_yaml_str(
        &rewritten.text,
        &format!("{origin} with the index flags"),
    )?;
    if args.config.is_some() && !rewritten.dropped.is_empty() {
        notes.push(format!(
            "{origin}: {} left out of the sidecars' proxy.yaml: with index.backend valkey pods find each other through Valkey",
            rewritten.dropped.join(", ")
        ));
    }
    let m = &config.mesh;
    let discovers = !m.peers.is_empty() || m.dns.is_some() || m.file.is_some();
    if config.index.backend == Backend::Mesh && !discovers {
        notes.push(format!(
            "{origin} discovers no mesh peers (mesh.dns, mesh.peers or mesh.file): each sidecar will route to its own engine only"
        ));
    }
    Ok((rewritten.text, config))
}

/// All documents of the input, in order.
pub fn read_input(input: &str) -> Result<Vec<Value>, CommandError> {
    if input == "-" {
        let mut text = String::new();
        std::io::stdin()
            .lock()
            .take(MAX_INPUT + 1)
            .read_to_string(&mut text)
            .map_err(|e| CommandError::Read("<stdin>".to_owned(), e))?;
        if text.len() as u64 > MAX_INPUT {
            return Err(CommandError::TooLarge("<stdin>".to_owned()));
        }
        return Ok(yaml::parse_stream(&text, "<stdin>")?);
    }
    let path = Path::new(input);
    let files = if path.is_dir() {
        let mut files = Vec::new();
        let entries =
            std::fs::read_dir(path).map_err(|e| CommandError::Read(input.to_owned(), e))?;
        for entry in entries {
            let p = entry
                .map_err(|e| CommandError::Read(input.to_owned(), e))?
                .path();
            let yaml_ext = p
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| e == "yaml" || e == "yml");
            if yaml_ext && p.is_file() {
                files.push(p);
            }
        }
        if files.is_empty() {
            return Err(CommandError::EmptyDir(input.to_owned()));
        }
        files.sort();
        files
    } else {
        vec![path.to_path_buf()]
    };
    let mut docs = Vec::new();
    let mut total = 0u64;
    for f in files {
        let text = read_file(&f)?;
        total += text.len() as u64;
        if total > MAX_INPUT {
            return Err(CommandError::TooLarge(input.to_owned()));
        }
        docs.extend(yaml::parse_stream(&text, &f.display().to_string())?);
    }
    Ok(docs)
}

fn read_file(path: &Path) -> Result<String, CommandError> {
    let name = path.display().to_string();
    let meta = std::fs::metadata(path).map_err(|e| CommandError::Read(name.clone(), e))?;
    if meta.len() > MAX_INPUT {
        return Err(CommandError::TooLarge(name));
    }
    std::fs::read_to_string(path).map_err(|e| CommandError::Read(name, e))
}
