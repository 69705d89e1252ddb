//! `kvmesh` arguments and dispatch. Each subcommand's logic lives in its own
//! module; this file only parses and maps results to exit codes.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "kvmesh",
    version,
    about = "kvmesh: inject the sidecar, see the fleet, check configs, run the demo and the benchmarks"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Add the kvmesh sidecar to the pod templates of Kubernetes manifests
    /// (file, directory or - for stdin); prints them on stdout.
    Inject(crate::inject::command::InjectArgs),
    /// Remove what `inject` added.
    Uninject(crate::inject::command::UninjectArgs),
    /// One table of the fleet (load, hit rate, requests/s, P/D, mesh state)
    /// from any sidecar's admin port.
    Stat(crate::stat::command::StatArgs),
    /// Validate a proxy.yaml (and a filters.yaml) without starting; exits non-zero
    /// with the file, line and field of the first error.
    CheckConfig {
        /// proxy.yaml; without it only the filter config is checked.
        file: Option<PathBuf>,
        /// filters.yaml; default: the one proxy.yaml names in `scheduling.filters`.
        #[arg(long)]
        filters: Option<PathBuf>,
    },
    /// Print the token ids and block hashes of a request body read on stdin.
    Prefix(crate::prefix::PrefixArgs),
    /// A local fleet of simulated engines with sidecars: shared prefix under
    /// cache pressure and long prompts with P/D, against round-robin and peers.
    #[cfg(feature = "lab")]
    Demo {
        /// A shorter workload.
        #[arg(long)]
        quick: bool,
        /// Print the result table as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Load generation and benchmarks: run, overhead, fake-engine, peers.
    #[cfg(feature = "lab")]
    #[command(subcommand)]
    Bench(crate::bench::BenchCmd),
    /// Not in this build: the demo needs the `lab` feature (a default build of kvmesh).
    #[cfg(not(feature = "lab"))]
    #[command(disable_help_flag = true)]
    Demo(WithoutLab),
    /// Not in this build: the benchmarks need the `lab` feature (a default build of kvmesh).
    #[cfg(not(feature = "lab"))]
    #[command(disable_help_flag = true)]
    Bench(WithoutLab),
}

/// Whatever follows `demo` or `bench` in a build without the lab: taken as is
/// (`--help` included), so that every such command line gets the one error
/// that says how to get the lab, not a usage error about its arguments.
#[cfg(not(feature = "lab"))]
#[derive(Debug, clap::Args)]
pub struct WithoutLab {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    args: Vec<String>,
}

/// Runs the command line; the binary's whole `main`.
pub fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Inject(args) => crate::inject::command::inject_main(&args),
        Command::Uninject(args) => crate::inject::command::uninject_main(&args),
        Command::Stat(args) => crate::stat::command::main(&args),
        Command::CheckConfig { file, filters } => {
            kvmesh_proxy::cli::check_config(file.as_deref(), filters.as_deref())
        }
        Command::Prefix(args) => crate::prefix::main(&args),
        #[cfg(feature = "lab")]
        Command::Demo { quick, json } => demo(quick, json),
        #[cfg(feature = "lab")]
        Command::Bench(cmd) => match crate::bench::main(cmd) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvmesh bench: {e:#}");
                ExitCode::FAILURE
            }
        },
        #[cfg(not(feature = "lab"))]
        Command::Demo(_) => without_lab("demo"),
        #[cfg(not(feature = "lab"))]
        Command::Bench(_) => without_lab("bench"),
    }
}

/// `kvmesh demo` and `kvmesh bench` in a build without the lab.
#[cfg(not(feature = "lab"))]
fn without_lab(command: &str) -> ExitCode {
    eprintln!(
        "kvmesh {command}: this kvmesh was built without the lab (cargo feature `lab`: the \
         engine simulator, the load generator and its plots), so it has only the ops commands \
         (inject, uninject, stat, check-config, prefix). `kvmesh {command}` needs a build with \
         default features: `cargo install --path cli` or, from a checkout, \
         `cargo run -p kvmesh -- {command}`."
    );
    ExitCode::FAILURE
}

#[cfg(feature = "lab")]
fn demo(quick: bool, json: bool) -> ExitCode {
    // Status lines and the progress line go to stderr, the table or JSON to
    // stdout, so `demo --json | jq` works.
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvmesh: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut opts = crate::demo::DemoOpts::new(quick);
    opts.progress = true;
    eprintln!(
        "kvmesh demo{}: {} simulated engines with a kvmesh sidecar each, on 127.0.0.1; \
         a fresh fleet per routing policy, same workload and seed",
        if quick { " --quick" } else { "" },
        opts.engines
    );
    let result = rt.block_on(crate::demo::run(&opts));
    rt.shutdown_timeout(std::time::Duration::from_secs(5));
    match result {
        Ok(report) => {
            print!("{}", crate::demo::render(&report, json));
            eprintln!("done in {:.0} s", report.wall_s);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvmesh demo: {e}");
            ExitCode::FAILURE
        }
    }
}
