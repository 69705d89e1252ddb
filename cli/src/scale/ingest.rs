//! What one Valkey core takes: block changes written as fast as emulated
//! writers send them, and lookups as fast as a few routers ask, each with
//! the server's CPU measured over the same window. The per-core rates are
//! the measured rates divided by the share of its one core the server used
//! (the load generator shares this machine's two cores, so the server is
//! rarely saturated).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use kvmesh_loadgen::valkey::ValkeyServer;
use kvmesh_proxy::config::Duration as CfgDuration;
use kvmesh_proxy::valkey::metrics::IndexMetrics;
use kvmesh_proxy::valkey::Lookup;
use serde::Serialize;

use super::emulate::{prefix_tokens, Blocks, ValkeyFleet, BLOCK, MODEL};
use super::{pin, valkey_config, Cpus, ScaleOpts};

/// Writers in the ingest run.
const INGEST_PODS: usize = 64;
/// Pods registered for the lookup run.
const LOOKUP_PODS: usize = 1000;
/// Routers asking at once in the lookup run.
const LOOKUP_TASKS: usize = 8;

/// The saturation figures.
#[derive(Debug, Clone, Serialize)]
pub struct Saturation {
    /// Block changes written a second, and the server's share of a core.
    pub blocks_per_s: f64,
    pub ingest_core_share: f64,
    pub blocks_per_core_s: f64,
    pub cpu_us_per_block: f64,
    pub lookups_per_s: f64,
    pub lookup_core_share: f64,
    pub lookups_per_core_s: f64,
    pub cpu_us_per_lookup: f64,
    /// Pods registered while the lookups ran.
    pub lookup_pods: usize,
    /// Valkey's memory per (block, pod) entry with the lookup run's fleet.
    pub bytes_per_block: f64,
    /// Pods that registered again during the lookup run (a lease lapsed:
    /// the emulator fell behind; 0 when the figure is clean).
    pub lookup_reregistrations: u64,
}

pub async fn saturate(opts: &ScaleOpts, cpus: Cpus) -> Result<Saturation> {
    let (blocks_per_s, ingest_share) = ingest(opts, cpus).await?;
    let (lookups_per_s, lookup_share, bytes_per_block, lookup_reregistrations) =
        lookups(opts, cpus).await?;
    let per_core = |rate: f64, share: f64| if share > 0.0 { rate / share } else { f64::NAN };
    Ok(Saturation {
        blocks_per_s,
        ingest_core_share: ingest_share,
        blocks_per_core_s: per_core(blocks_per_s, ingest_share),
        cpu_us_per_block: ingest_share * 1e6 / blocks_per_s.max(1e-9),
        lookups_per_s,
        lookup_core_share: lookup_share,
        lookups_per_core_s: per_core(lookups_per_s, lookup_share),
        cpu_us_per_lookup: lookup_share * 1e6 / lookups_per_s.max(1e-9),
        lookup_pods: LOOKUP_PODS,
        bytes_per_block,
        lookup_reregistrations,
    })
}

/// Block changes a second the writers got written, and the server's share
/// of a core meanwhile.
async fn ingest(opts: &ScaleOpts, cpus: Cpus) -> Result<(f64, f64)> {
    let server = ValkeyServer::start().await?;
    if let Some(c) = cpus.measured {
        pin(server.pid(), c);
    }
    let cfg = valkey_config(vec![server.url()]);
    let blocks = Blocks {
        groups: 8,
        per_pod: 64,
        churn_per_pod: 0.0,
    };
    let mut fleet = ValkeyFleet::start(INGEST_PODS, &cfg, &blocks, false).await?;
    let written = |f: &ValkeyFleet| f.metrics.blocks_written() as f64;
    let (w0, c0, started) = (written(&fleet), server.cpu_seconds()?, Instant::now());
    let mut k = 0;
    while started.elapsed() < opts.saturate {
        // Each churn queues two changes; the writers' queues push back.
        fleet.churn(k % INGEST_PODS).await;
        k += 1;
    }
    fleet.drain().await;
    let secs = started.elapsed().as_secs_f64();
    let (w1, c1) = (written(&fleet), server.cpu_seconds()?);
    fleet.stop().await;
    Ok(((w1 - w0) / secs, (c1 - c0) / secs))
}

/// Lookups a second a few routers got answered against a 1000-pod fleet,
/// the server's share of a core (less what the pods' lease renewals took
/// over an equal window without lookups), and its memory per block entry.
async fn lookups(opts: &ScaleOpts, cpus: Cpus) -> Result<(f64, f64, f64, u64)> {
    let server = ValkeyServer::start().await?;
    if let Some(c) = cpus.measured {
        pin(server.pid(), c);
    }
    let mut cfg = valkey_config(vec![server.url()]);
    cfg.cache_ttl = CfgDuration::from_millis(1);
    let blocks = Blocks {
        groups: 32,
        per_pod: 64,
        churn_per_pod: 0.0,
    };
    // Memory per block: the seeding alone, every connection already open.
    let mut fleet = ValkeyFleet::connect(LOOKUP_PODS, &cfg, false).await?;
    let before = server.info_memory_used().await?;
    fleet.seed(&blocks).await?;
    let bytes = server.info_memory_used().await?.saturating_sub(before) as f64
        / (LOOKUP_PODS * blocks.per_pod) as f64;
    let keys: Vec<Vec<u64>> = (0..blocks.groups)
        .map(|g| prefix_tokens(g).map(|t| fleet.index.request_keys(MODEL, None, &t, BLOCK)))
        .collect::<Result<_>>()?;
    let keys = Arc::new(keys);
    let lookup = Arc::new(Lookup::new(fleet.store.clone()));
    let metrics = Arc::new(IndexMetrics::default());
    // The renewals alone, first.
    let (b0, quiet) = (server.cpu_seconds()?, Instant::now());
    tokio::time::sleep(opts.saturate.min(std::time::Duration::from_secs(3))).await;
    let renewals = (server.cpu_seconds()? - b0) / quiet.elapsed().as_secs_f64();
    let (c0, started) = (server.cpu_seconds()?, Instant::now());
    let r0 = fleet.metrics.registrations_total();
    let until = started + opts.saturate;
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..LOOKUP_TASKS {
        let (keys, lookup, metrics) = (keys.clone(), lookup.clone(), metrics.clone());
        tasks.spawn(async move {
            let mut n = 0u64;
            let mut i = t;
            while Instant::now() < until {
                // A last key nobody holds makes every prompt distinct, so
                // no answer comes from the cache.
                let mut k = keys[i % keys.len()].clone();
                k.push(rand::random());
                if lookup.find(&metrics, MODEL, &k).await.is_ok() {
                    n += 1;
                }
                i += LOOKUP_TASKS;
            }
            n
        });
    }
    let mut n = 0;
    while let Some(r) = tasks.join_next().await {
        n += r.unwrap_or(0);
    }
    let secs = started.elapsed().as_secs_f64();
    let c1 = server.cpu_seconds()?;
    let again = fleet.metrics.registrations_total() - r0;
    fleet.stop().await;
    Ok((
        n as f64 / secs,
        ((c1 - c0) / secs - renewals).max(0.0),
        bytes,
        again,
    ))
}
