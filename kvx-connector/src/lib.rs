//! The engine-facing core of kvx's connectors. Here so far: [`codec`], the compact encoding of
//! what crosses an engine's process boundary each step (the scheduler side's [`StepMsg`] and
//! [`kvx_offload::StepMeta`], the workers' job results), with property tests under `cargo test`.

pub mod codec;
mod step;

pub use step::StepMsg;
