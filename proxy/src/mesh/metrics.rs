//! The mesh's metrics: peers known and fresh, stream lag, resyncs, frames,
//! subscribers served and dropped, requests by where they ran, and failed TLS
//! handshakes; held by [`super::Mesh`] and registered into the sidecar's one
//! registry when it is built. Label values are `&'static str` from closed sets, except
//! `target`, a pod id (bounded by the fleet's size limit).

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use crate::metrics::StaticSeries;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WhereLabels {
    served: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SideLabels {
    side: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TargetLabels {
    target: String,
}

/// Handles to the mesh metrics.
pub struct MeshMetrics {
    peers: Family<StateLabels, Gauge>,
    lag_ms: Gauge,
    resyncs: Family<ReasonLabels, Counter>,
    frames_in: Counter<u64, AtomicU64>,
    frames_out: Counter<u64, AtomicU64>,
    subscribers: Gauge,
    dropped: Family<ReasonLabels, Counter>,
    requests: StaticSeries<1, WhereLabels, Counter>,
    forwarded: Family<TargetLabels, Counter>,
    tls_failures: Family<SideLabels, Counter>,
    /// Requests the local engine served (`local` + `received`), for `stat`.
    served: AtomicU64,
}

impl MeshMetrics {
    /// Creates the metrics and registers them in `r` (prefix `kvmesh`).
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            peers: Family::default(),
            lag_ms: Gauge::default(),
            resyncs: Family::default(),
            frames_in: Counter::default(),
            frames_out: Counter::default(),
            subscribers: Gauge::default(),
            dropped: Family::default(),
            requests: StaticSeries::new(|[served]| WhereLabels { served }),
            forwarded: Family::default(),
            tls_failures: Family::default(),
            served: AtomicU64::new(0),
        };
        r.register(
            "mesh_peers",
            "Peers by state: known (discovered and followed), fresh (stream in sync, heard within stale_after), other_models (discovered, serving none of this pod's models, not followed under mesh.follow: same-models)",
            m.peers.clone(),
        );
        r.register_with_unit(
            "mesh_stream_lag",
            "Longest time since any fresh peer's last frame",
            Unit::Other("milliseconds".to_owned()),
            m.lag_ms.clone(),
        );
        r.register(
            "mesh_resyncs",
            "Snapshots applied from a peer, by why the stream (re)started: connect, gap, stale, reconnect (the peer ended it), error",
            m.resyncs.clone(),
        );
        r.register(
            "mesh_frames_received",
            "Frames applied from peers",
            m.frames_in.clone(),
        );
        r.register(
            "mesh_frames_sent",
            "Frames queued to subscribers",
            m.frames_out.clone(),
        );
        r.register(
            "mesh_subscribers",
            "Peers subscribed to this sidecar's stream now",
            m.subscribers.clone(),
        );
        r.register(
            "mesh_subscribers_dropped",
            "Subscribers dropped by this sidecar: slow (queue full), over the limit, or other_models (a subscriber with follow: same-models that serves none of this pod's models)",
            m.dropped.clone(),
        );
        r.register(
            "mesh_requests",
            "Inference requests by where they ran: local (routed here), forwarded (to a peer), received (a peer routed it here)",
            m.requests.family(),
        );
        r.register(
            "mesh_forwarded",
            "Inference requests forwarded to a peer sidecar, by target pod, counted when sent (a request lost with its peer too)",
            m.forwarded.clone(),
        );
        r.register(
            "mesh_tls_handshake_failures",
            "Mutual-TLS handshakes that failed (mesh.tls): accept (a peer subscribing here) or connect (subscribing to a peer)",
            m.tls_failures.clone(),
        );
        // Series of the closed label sets start at 0, so alerts and rates see
        // them before the first event (and with the mesh off).
        m.peers(0, 0, 0);
        for reason in ["connect", "gap", "stale", "reconnect", "error"] {
            let _ = m.resyncs.get_or_create(&ReasonLabels { reason });
        }
        for reason in ["slow", "over_limit", "other_models"] {
            let _ = m.dropped.get_or_create(&ReasonLabels { reason });
        }
        m
    }

    /// A mesh TLS handshake failed on `side` (`accept` or `connect`).
    pub fn tls_failure(&self, side: &'static str) {
        self.tls_failures.get_or_create(&SideLabels { side }).inc();
    }

    /// [`Self::tls_failure`] on `side`, for a caller that cannot name the
    /// mesh (the forwarding client); the series appears at the first failure.
    pub fn tls_failures(&self, side: &'static str) -> impl Fn() + Send + Sync + 'static {
        let family = self.tls_failures.clone();
        move || {
            family.get_or_create(&SideLabels { side }).inc();
        }
    }

    /// Peers followed (`known`), of them in sync and heard from within
    /// `stale_after` (`fresh`), and peers not followed because they serve
    /// none of this pod's models (`other_models`).
    pub fn peers(&self, known: usize, fresh: usize, other_models: usize) {
        let n = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        for (state, v) in [
            ("known", known),
            ("fresh", fresh),
            ("other_models", other_models),
        ] {
            self.peers.get_or_create(&StateLabels { state }).set(n(v));
        }
    }

    pub fn lag_ms(&self, ms: u64) {
        self.lag_ms.set(i64::try_from(ms).unwrap_or(i64::MAX));
    }

    pub fn resync(&self, reason: &'static str) {
        self.resyncs.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub fn frame_in(&self) {
        self.frames_in.inc();
    }

    pub fn frames_out(&self, n: u64) {
        self.frames_out.inc_by(n);
    }

    pub fn subscribers(&self, n: usize) {
        self.subscribers.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn dropped(&self, reason: &'static str) {
        self.dropped.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// `served`: `local`, `forwarded` or `received`.
    pub fn request(&self, served: &'static str) {
        if served != "forwarded" {
            self.served.fetch_add(1, Ordering::Relaxed);
        }
        self.requests.get([served]).inc();
    }

    /// Inference requests the local engine served so far (routed here by this
    /// sidecar or by a peer).
    pub fn served_total(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    pub fn forwarded(&self, target: &str) {
        self.forwarded
            .get_or_create(&TargetLabels {
                target: target.to_owned(),
            })
            .inc();
    }
}
