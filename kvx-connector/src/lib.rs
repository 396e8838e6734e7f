//! The engine-facing core of kvx's connectors.

pub mod codec;
