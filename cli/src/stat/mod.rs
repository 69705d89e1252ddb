//! `kvmesh stat`: the client side of the fleet table. Two samples of a
//! sidecar's `GET /debug/stat` (served by `kvmesh_proxy::stat`) become one
//! row per pod: [`fetch`] reads the document, [`table`] turns samples into
//! rows, [`command`] is the subcommand.

pub mod command;
pub mod fetch;
pub mod table;

pub use kvmesh_proxy::stat::{IndexEntry, PeerEntry, PodEntry, PodStats, Report, FORMAT, PATH};

#[cfg(test)]
mod tests;
