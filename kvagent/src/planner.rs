//! The transfer planner: picks how a transfer moves (same-node copy, RDMA GPU-direct, RDMA through
//! pinned host memory, or TCP) from where the two ends are and what both agents can do, and says
//! why. Pure: the agent logs and counts the choice.

use serde::{Deserialize, Serialize};

/// Capability bits an agent announces in the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Caps(pub u32);

impl Caps {
    /// TCP data streams (every agent).
    pub const TCP: u32 = 1;
    /// RDMA RC queue pairs over host memory.
    pub const RDMA: u32 = 2;
    /// RDMA with GPU memory registered (GPU-direct).
    pub const GPU_DIRECT: u32 = 4;
    /// CUDA device memory (IPC handles, device-to-host copies).
    pub const CUDA: u32 = 8;

    /// Whether every bit of `bit` is set.
    pub fn has(self, bit: u32) -> bool {
        self.0 & bit == bit
    }

    /// Names of the set bits, for logs and the status call.
    pub fn names(self) -> Vec<&'static str> {
        [
            (Self::TCP, "tcp"),
            (Self::RDMA, "rdma"),
            (Self::GPU_DIRECT, "gpu_direct"),
            (Self::CUDA, "cuda"),
        ]
        .into_iter()
        .filter(|(b, _)| self.has(*b))
        .map(|(_, n)| n)
        .collect()
    }
}

/// Where a region's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemKind {
    /// Host memory (a memfd).
    Host,
    /// GPU memory (a CUDA IPC handle).
    Gpu,
}

/// How a transfer moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Path {
    /// Both ends on this node: copy between registered regions.
    SameNode,
    /// Both ends on this node in GPU memory: CUDA peer copy.
    CudaPeer,
    /// RDMA straight from and to GPU memory.
    RdmaGpuDirect,
    /// RDMA through pinned host memory.
    RdmaHost,
    /// TCP streams through host memory.
    Tcp,
}

impl Path {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Path::SameNode => "same_node",
            Path::CudaPeer => "cuda_peer",
            Path::RdmaGpuDirect => "rdma_gpu_direct",
            Path::RdmaHost => "rdma_host",
            Path::Tcp => "tcp",
        }
    }
}

/// What the planner knows about one transfer.
#[derive(Debug, Clone, Copy)]
pub struct PlanInput {
    /// The destination agent is this agent.
    pub same_node: bool,
    /// Where the source blocks live.
    pub src: MemKind,
    /// Where the destination blocks live, when known (same node).
    pub dst: Option<MemKind>,
    /// This agent's capabilities.
    pub local: Caps,
    /// The peer's capabilities (None on the same node).
    pub peer: Option<Caps>,
}

/// The planner's choice and its reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// The path.
    pub path: Path,
    /// Why (a fixed phrase, also a metric label).
    pub reason: &'static str,
}

/// Choose the path for a transfer.
pub fn plan(input: &PlanInput) -> Plan {
    if input.same_node {
        let both_gpu = input.src == MemKind::Gpu && input.dst == Some(MemKind::Gpu);
        return if both_gpu && input.local.has(Caps::CUDA) {
            Plan {
                path: Path::CudaPeer,
                reason: "same node, both regions in GPU memory",
            }
        } else {
            Plan {
                path: Path::SameNode,
                reason: "same node, copy between registered regions",
            }
        };
    }
    let peer = input.peer.unwrap_or_default();
    if !input.local.has(Caps::RDMA) {
        return Plan {
            path: Path::Tcp,
            reason: "no RDMA on this node",
        };
    }
    if !peer.has(Caps::RDMA) {
        return Plan {
            path: Path::Tcp,
            reason: "peer has no RDMA",
        };
    }
    if input.src == MemKind::Gpu && input.local.has(Caps::GPU_DIRECT) && peer.has(Caps::GPU_DIRECT)
    {
        return Plan {
            path: Path::RdmaGpuDirect,
            reason: "both ends register GPU memory for RDMA",
        };
    }
    Plan {
        path: Path::RdmaHost,
        reason: "RDMA on both ends, staged through pinned host memory",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(same: bool, src: MemKind, local: u32, peer: Option<u32>) -> PlanInput {
        PlanInput {
            same_node: same,
            src,
            dst: Some(src),
            local: Caps(local),
            peer: peer.map(Caps),
        }
    }

    #[test]
    fn same_node_copies() {
        let p = plan(&input(true, MemKind::Host, Caps::TCP | Caps::RDMA, None));
        assert_eq!(p.path, Path::SameNode);
        let p = plan(&input(true, MemKind::Gpu, Caps::TCP | Caps::CUDA, None));
        assert_eq!(p.path, Path::CudaPeer);
        let p = plan(&input(true, MemKind::Gpu, Caps::TCP, None));
        assert_eq!(p.path, Path::SameNode, "no CUDA here: plain copy");
    }

    #[test]
    fn remote_paths_follow_both_ends_capabilities() {
        let all = Caps::TCP | Caps::RDMA | Caps::GPU_DIRECT | Caps::CUDA;
        assert_eq!(
            plan(&input(false, MemKind::Gpu, all, Some(all))).path,
            Path::RdmaGpuDirect
        );
        assert_eq!(
            plan(&input(false, MemKind::Host, all, Some(all))).path,
            Path::RdmaHost
        );
        let p = plan(&input(
            false,
            MemKind::Gpu,
            all,
            Some(Caps::TCP | Caps::RDMA),
        ));
        assert_eq!(
            p.path,
            Path::RdmaHost,
            "peer without GPU-direct stages through host"
        );
        let p = plan(&input(false, MemKind::Host, all, Some(Caps::TCP)));
        assert_eq!((p.path, p.reason), (Path::Tcp, "peer has no RDMA"));
        let p = plan(&input(false, MemKind::Host, Caps::TCP, Some(all)));
        assert_eq!((p.path, p.reason), (Path::Tcp, "no RDMA on this node"));
        assert_eq!(Caps(all).names(), vec!["tcp", "rdma", "gpu_direct", "cuda"]);
    }
}
