//! The shared end-to-end harness of kvmesh: in-process fake upstreams built
//! with builders ([`fake_upstream`]), a fake engine in vLLM's shapes
//! ([`fake_vllm`]; the real vLLM is driven by `tests/tests/vllm/`), test clients for HTTP/1.1, h2c and TLS ([`client`]), a test
//! certificate ([`certs`]), sidecar start-up helpers ([`sidecar`]),
//! simulated engines as separate processes ([`simproc`]), two "nodes" as
//! network namespaces ([`netns`]), an OTLP trace receiver ([`otlp`]) and the
//! test venv's Python ([`python`]).
//!
//! Everything listens on `127.0.0.1:0` and waits on readiness, never on sleeps.
//! This is test support: a failed set-up step panics with its reason, which is
//! what a test should do.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod access_lines;
pub mod certs;
pub mod client;
pub mod fake_upstream;
pub mod fake_vllm;
pub mod mesh;
pub mod netns;
pub mod otlp;
pub mod prefix;
pub mod python;
pub mod route;
pub mod sidecar;
pub mod simproc;
pub mod tls_front;
pub mod workspace;
