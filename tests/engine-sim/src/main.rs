//! `kvmesh-engine-sim`: a simulated vLLM/SGLang engine (see the library docs).

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = kvmesh_engine_sim::cli::Args::parse();
    kvmesh_engine_sim::cli::run(args).await?;
    Ok(())
}
