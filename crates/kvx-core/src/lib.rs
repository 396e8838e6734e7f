//! kvx-core (work in progress).
#![warn(missing_docs)]
pub mod ids;
pub use ids::*;
