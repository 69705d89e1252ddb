//! `kvmesh-kvagent`: run the agent (`run`) or measure it against the machine's ceilings (`bench`).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvmesh_kvagent::config::Faults;
use kvmesh_kvagent::rdma::RdmaConfig;
use kvmesh_kvagent::{bind_local, Agent, AgentConfig, Listeners, SocketConfig};

#[derive(Parser)]
#[command(name = "kvmesh-kvagent", about = "kvmesh per-node KV transfer agent")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the local API, the peer protocol and metrics.
    Run(Box<RunArgs>),
    /// Measure memcpy and TCP ceilings, then kvagent throughput against them.
    Bench {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Bytes moved per path and block size.
        #[arg(long, default_value_t = 256 << 20)]
        bytes: u64,
    },
    /// (internal) The receiving process of the raw TCP ceiling.
    #[command(hide = true)]
    BenchSink,
}

#[derive(Parser)]
struct RunArgs {
    /// Unix socket of the local API.
    #[arg(
        long,
        env = "KVAGENT_SOCKET",
        default_value = "/run/kvmesh/kvagent.sock"
    )]
    socket: PathBuf,
    /// Group id allowed on the socket (mode 0660); default owner only (0600).
    #[arg(long, env = "KVAGENT_SOCKET_GROUP")]
    socket_group: Option<u32>,
    /// Agent-to-agent listen address.
    #[arg(long, env = "KVAGENT_LISTEN", default_value = "0.0.0.0:7600")]
    listen: String,
    /// Admin (metrics) listen address; empty to disable.
    #[arg(long, env = "KVAGENT_ADMIN", default_value = "0.0.0.0:7601")]
    admin: String,
    /// Agent id (default: the host name).
    #[arg(long, env = "KVAGENT_ID")]
    agent_id: Option<String>,
    /// Address peers use to reach this agent (default: the bound address).
    #[arg(long, env = "KVAGENT_ADVERTISE")]
    advertise: Option<String>,
    /// TCP data streams per peer.
    #[arg(long, default_value_t = 4)]
    data_streams: usize,
    /// Seconds arrived blocks wait for their client before they are freed.
    #[arg(long, default_value_t = 60)]
    hold_ttl_s: u64,
    /// Use RDMA when built with the `rdma` feature and a device opens (`off` forces TCP).
    #[arg(long, env = "KVAGENT_RDMA", default_value = "on", value_parser = ["on", "off"])]
    rdma: String,
    /// RDMA device name (default: the first one).
    #[arg(long, env = "KVAGENT_RDMA_DEVICE")]
    rdma_device: Option<String>,
    /// RDMA port number on the device.
    #[arg(long, env = "KVAGENT_RDMA_PORT", default_value_t = 1)]
    rdma_port: u8,
    /// GID table index (RoCE v2: usually 1 or 3; InfiniBand: 0).
    #[arg(long, env = "KVAGENT_RDMA_GID_INDEX", default_value_t = 0)]
    rdma_gid_index: u8,
    /// Print one JSON line with the bound addresses once serving (for scripts and tests).
    #[arg(long)]
    ready_json: bool,
    /// (testing) stall data streams after this many bytes of a transfer.
    #[arg(long, hide = true)]
    fault_stall_after_bytes: Option<u64>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run(args) => run(*args),
        Cmd::Bench { json, bytes } => kvmesh_kvagent::bench::run(json, bytes).map_err(Into::into),
        Cmd::BenchSink => kvmesh_kvagent::bench::sink().map_err(Into::into),
    }
}

fn run(args: RunArgs) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let agent_id = match args.agent_id {
            Some(id) => id,
            None => hostname(),
        };
        let cfg = AgentConfig {
            agent_id,
            advertise: args.advertise,
            data_streams: args.data_streams,
            hold_ttl: Duration::from_secs(args.hold_ttl_s),
            rdma: RdmaConfig {
                enabled: args.rdma == "on",
                device: args.rdma_device,
                port: args.rdma_port,
                gid_index: args.rdma_gid_index,
                ..RdmaConfig::default()
            },
            faults: Faults {
                stall_data_after_bytes: args.fault_stall_after_bytes,
            },
            ..AgentConfig::default()
        };
        let sock = SocketConfig {
            path: args.socket.clone(),
            group: args.socket_group,
        };
        let local =
            bind_local(&sock).with_context(|| format!("binding {}", args.socket.display()))?;
        let peer = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let admin = if args.admin.is_empty() {
            None
        } else {
            Some(
                tokio::net::TcpListener::bind(&args.admin)
                    .await
                    .with_context(|| format!("binding {}", args.admin))?,
            )
        };
        let handle = Agent::start(cfg, Listeners { local, peer, admin })?;
        if args.ready_json {
            let line = serde_json::json!({
                "socket": args.socket, "peer": handle.peer_addr.to_string(),
                "admin": handle.admin_addr.map(|a| a.to_string()),
            });
            let mut out = std::io::stdout().lock();
            writeln!(out, "{line}")?;
            out.flush()?;
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
        handle.shutdown().await;
        let _ = std::fs::remove_file(&args.socket);
        Ok(())
    })
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "kvagent".into())
}
