//! [`Leases`]: what the connector core asks of a consumer's lease keeper (kvx-rdma's renews
//! leases over the network; the core only starts, reads and ends them).

use kvx_offload::RemoteSource;

/// A kept lease, as the keeper last heard of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseState {
    /// Not confirmed by the producer yet.
    Pending,
    /// Confirmed and renewed.
    Live,
    /// Given up, and why.
    Lost(String),
}

/// A consumer's lease keeper. No call may wait on the network.
pub trait Leases {
    /// Start keeping the lease of `source` under `id`; an error says why not (an id kept
    /// already).
    fn keep(&mut self, id: u64, source: &RemoteSource) -> Result<(), String>;
    /// The lease kept under `id`; `None` when it is not kept.
    fn state(&self, id: u64) -> Option<LeaseState>;
    /// Stop keeping `id`'s lease; with `done`, tell the producers they may free the blocks.
    fn release(&mut self, id: u64, done: bool);
    /// Leases kept now.
    fn kept(&self) -> usize;
}
