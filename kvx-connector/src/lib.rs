//! The engine-facing core of kvx's connectors. [`scheduler::Scheduler`] is a connector's
//! scheduler side as an engine adapter drives it, requests named by the engine's id: the
//! request table ([`requests`]), each request's block keys ([`keys`], under a [`Namespace`] per
//! KV cache group), hybrid models' KV cache groups ([`groups`]: the hit every group can serve,
//! what each group stores, the sliding-window blocks to fence), over kvx-offload's scheduler
//! side. [`codec`] is the compact encoding of what crosses an engine's process boundary each
//! step (the scheduler side's [`StepMsg`] and [`kvx_offload::StepMeta`], the workers' job
//! results), with property tests under `cargo test`. [`worker::WorkerRequests`] is a worker's
//! side of the request table: the engine's id of each request a step names, until it is
//! reported. [`disagg::Consumer`] is a decode engine's remote requests under prefill/decode
//! disaggregation: the producer's source checked, its lease kept, the offer and the load, the
//! lease released once.

pub mod codec;
pub mod disagg;
pub mod groups;
pub mod keys;
pub mod requests;
pub mod scheduler;
mod step;
#[cfg(test)]
mod test_support;
pub mod worker;

pub use keys::{KEY_BYTES, Namespace};
pub use step::StepMsg;
