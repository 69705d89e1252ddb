//! The engine's KV side: block hashing, the block pool with its prefix cache,
//! KV-cache events in vLLM's wire format and the ZMQ publisher, plus a small
//! ZMQ client (SUB and replay DEALER) for tests and tools.

pub mod cache;
pub mod client;
pub mod events;
pub mod hash;
pub mod publisher;
