//! The kvmesh scheduling core. Pure: no sockets, no spawned tasks, no clocks it
//! does not take as an argument, so every decision can be unit-tested and
//! benchmarked alone.
//!
//! * [`sched`]: the request and endpoint views, the Filter / Scorer / Picker
//!   plugins, profile handlers, the plugin registry and the filter config file.
//! * [`prefix`]: turning a prompt into block keys (tokenization, chained block
//!   hashes), decoding the engines' KV events, and the prefix index that says
//!   which pod holds how much of a request's prefix.
//! * [`yaml`]: where a field path is written in YAML text, for config errors
//!   that name file, line and field.

pub mod prefix;
pub mod sched;
pub mod yaml;
