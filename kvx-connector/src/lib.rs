//! The engine-facing core of kvx's connectors. Here so far: [`codec`], the compact encoding of
//! what crosses an engine's process boundary each step (the scheduler side's [`StepMsg`] and
//! [`kvx_offload::StepMeta`], the workers' job results), with property tests under `cargo test`;
//! and [`keys`], block keys from an engine's block hashes under a [`Namespace`].

pub mod codec;
pub mod keys;
mod step;

pub use keys::{KEY_BYTES, Namespace};
pub use step::StepMsg;
