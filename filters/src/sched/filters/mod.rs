//! Built-in filters: each removes candidates that must not serve the request.
//! See each module for its type name, parameters and a YAML example.

pub mod health;
pub mod label;
pub mod load_ceiling;
pub mod model;
pub mod role;
