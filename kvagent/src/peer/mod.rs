//! The agent-to-agent protocol: wire format, the sending link, the receiving server.

pub mod link;
pub mod proto;
pub(crate) mod server;
