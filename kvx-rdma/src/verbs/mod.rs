//! The verbs transport (feature `verbs`): RC queue pairs set up over the TCP side channel,
//! per-request memory regions on the producer, one-sided RDMA READ into the consumer's
//! registered buffers, completion-queue polling, and on a deadline the queue pair moved to the
//! error state so outstanding reads are flushed before their buffers are handed back.
//!
//! Leases: a consumer asks for a grant of a request's blocks over the side channel; the
//! producer answers only while the lease is active, registering the request's memory then.
//! When the lease ends, the producer deregisters those regions *before* the engine hears of
//! the release, so a late one-sided read fails at the NIC instead of returning memory that
//! now belongs to another request.

mod client;
mod msg;
mod server;
mod sys;

pub use client::VerbsTransport;
pub use server::VerbsServer;

/// Settings of the verbs transport, both sides.
#[derive(Debug, Clone, Default)]
pub struct VerbsConfig {
    /// RDMA device name (default: the first device).
    pub device: Option<String>,
    /// GID index for RoCE (default 0).
    pub gid_index: i32,
}

/// Open the configured device and close it again: `Ok` where verbs can run, otherwise the
/// reason (`NoRdmaDevice` on machines without RDMA).
pub fn probe(cfg: &VerbsConfig) -> Result<(), crate::RdmaError> {
    sys::Context::open(cfg.device.as_deref(), cfg.gid_index).map(|_| ())
}
