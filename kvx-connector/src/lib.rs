//! The engine-facing core of kvx's connectors. Here so far: [`codec`], the compact encoding of
//! what crosses an engine's process boundary each step (the scheduler side's [`StepMsg`] and
//! [`kvx_offload::StepMeta`], the workers' job results), with property tests under `cargo test`;
//! [`keys`], block keys from an engine's block hashes under a [`Namespace`]; and [`groups`],
//! hybrid models' KV cache groups (the hit every group can serve, what each group stores, the
//! sliding-window blocks to fence).

pub mod codec;
pub mod groups;
pub mod keys;
mod step;

pub use keys::{KEY_BYTES, Namespace};
pub use step::StepMsg;
