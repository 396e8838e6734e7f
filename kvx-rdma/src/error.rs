//! The one error type of kvx-rdma.

use std::net::SocketAddr;

use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_policy::ReleaseReason;

use crate::wire::ErrorCode;

/// What went wrong in kvx-rdma, naming the request, block, peer or setting involved.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// The exported memory layout cannot be served (device memory, empty layout).
    #[error("cannot export this layout: {0}")]
    BadLayout(String),
    /// A request was exported twice.
    #[error("{0} is already exported")]
    AlreadyExported(RequestId),
    /// The request is not exported (never, or already released).
    #[error("{0} is not exported")]
    UnknownRequest(RequestId),
    /// An exported block id is outside the engine's pool.
    #[error("{request}: engine block {block} is outside the pool of {num_blocks} blocks")]
    BlockOutOfRange {
        /// The request.
        request: RequestId,
        /// The bad block.
        block: EngineBlockId,
        /// Blocks in the pool.
        num_blocks: u32,
    },
    /// The lease of a request already ended.
    #[error("the lease of {request} ended: {reason}")]
    LeaseEnded {
        /// The request.
        request: RequestId,
        /// Why the lease ended.
        reason: ReleaseReason,
    },
    /// A lease setting or table call was rejected by kvx-policy.
    #[error("lease of {request}: {source}")]
    Lease {
        /// The request.
        request: RequestId,
        /// What kvx-policy said.
        source: kvx_policy::PolicyError,
    },
    /// A block key was given to the importer twice within one descriptor, or is unknown.
    #[error("block {key} of {request}: {what}")]
    BadBlock {
        /// The request.
        request: RequestId,
        /// The key.
        key: BlockKey,
        /// What is wrong with it.
        what: String,
    },
    /// A descriptor that makes no sense (no blocks, zero block size, bad intervals).
    #[error("invalid descriptor of {request}: {what}")]
    BadDescriptor {
        /// The request.
        request: RequestId,
        /// What is wrong.
        what: String,
    },
    /// A request is not registered with the importer.
    #[error("{0} is not registered with this importer")]
    NotRegistered(RequestId),
    /// Socket setup or I/O failed.
    #[error("{what} {addr}: {source}")]
    Io {
        /// What we were doing.
        what: &'static str,
        /// The address involved.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The peer answered with an error frame.
    #[error("peer {addr} refused: {code:?}: {message}")]
    Remote {
        /// The peer.
        addr: SocketAddr,
        /// The error code it sent.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// The peer broke the protocol (bad frame, wrong tag, oversize length).
    #[error("protocol error with {addr}: {what}")]
    Protocol {
        /// The peer.
        addr: SocketAddr,
        /// What it did.
        what: String,
    },
    /// An operation did not finish in time.
    #[error("{what} with {addr} timed out")]
    TimedOut {
        /// What timed out.
        what: &'static str,
        /// The peer.
        addr: SocketAddr,
    },
    /// A thread or runtime could not be started, or has stopped.
    #[error("runtime: {0}")]
    Runtime(String),
    /// No RDMA device is usable on this machine (`ibv_get_device_list` failed or is empty).
    #[error("no RDMA device: {0}")]
    NoRdmaDevice(String),
    /// An ibverbs call failed.
    #[error("ibverbs {call}: {source}")]
    Verbs {
        /// The verbs call.
        call: &'static str,
        /// The OS error it returned.
        source: std::io::Error,
    },
    /// The descriptor names a transport this build or this importer does not have.
    #[error("transport {0} is not available in this build or importer")]
    TransportUnavailable(String),
}
