//! kvmesh's own HTTP/1.1 codec, for the two connections nearly every request
//! uses: the client's, served by `server/h1.rs`, and the local engine's,
//! driven by `upstream/engine.rs`. hyper still serves everything else:
//! HTTP/2, TLS, the mesh port, peers, probes and scrapes.
//!
//! Why not hyper there too: a small request through the sidecar ran about
//! 62 k instructions, 33 k of them in hyper's two HTTP/1 state machines
//! (dispatchers, body channels, header maps built twice), and a paced
//! request (one at a time, caches cold) paid for that code path at every
//! wake-up. A prototype with a hand codec on `httparse` used 0.77x nginx's
//! CPU per paced request where a minimal hyper proxy used 1.11x
//! (docs/bench-tool.md, "Paced: the floor, hyper, and kvmesh's own work").
//!
//! This module is the codec alone, with no sockets: parse a head into `http`
//! types and decide how its body is framed ([`head`], RFC 9112 §6), decode a
//! body from a read buffer ([`decode`], §7.1 for chunked), write heads and
//! frame bodies ([`encode`]), and the `Date` header ([`date`]). Every parser
//! is bounded (head bytes, header count, chunk-size digits, extension and
//! trailer bytes) and strict where leniency lets two parties read one
//! message two ways: a request with both `Content-Length` and
//! `Transfer-Encoding`, differing lengths, or a bare LF in chunk framing is
//! refused. Fuzzed in `proxy/tests/fuzz_inputs.rs` (docs/robustness.md).

pub mod date;
pub mod decode;
pub mod encode;
pub mod head;
pub mod io;

pub use decode::{BodyError, Decoded, Decoder};
pub use head::{Framing, HeadError, RequestHead, ResponseHead};
