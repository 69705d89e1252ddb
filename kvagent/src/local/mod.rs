//! The local API for engine connectors: framing with descriptor passing, messages, the server.

pub mod msg;
pub(crate) mod server;
pub mod wire;
