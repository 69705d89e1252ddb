//! Knowing where each prefix is cached: tokenization, block keys, KV events and
//! the prefix index.

pub mod approx;
pub mod hash;
pub mod index;
pub mod kvevents;
mod lru;
pub mod predicted;
pub mod tokenize;
