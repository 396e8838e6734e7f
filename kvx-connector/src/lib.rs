//! The engine-facing core of kvx's connectors. Here so far: [`codec`], the compact encoding of
//! what crosses an engine's process boundary each step (the scheduler side's [`StepMsg`] and
//! [`kvx_offload::StepMeta`], the workers' job results), with property tests under `cargo test`;
//! [`keys`], block keys from an engine's block hashes under a [`Namespace`]; and [`disagg`],
//! prefill/decode disaggregation's lifecycle on the scheduler side (P's exports, D's remote
//! requests and their leases, behind [`Leases`]).

pub mod codec;
pub mod disagg;
pub mod keys;
pub mod leases;
mod step;

pub use disagg::{Allocated, Asking, Disagg, DisaggConfig, RemoteMatch};
pub use leases::{LeaseState, Leases};

pub use keys::{KEY_BYTES, Namespace};
pub use step::StepMsg;
