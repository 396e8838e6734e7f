//! Errors of kvx-core.

use crate::ids::{BackendId, EngineBlockId, TaskId};

/// What went wrong in kvx-core.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// An alignment that is not a power of two, or a size too large for it.
    #[error("cannot allocate {size} bytes aligned to {align}: alignment must be a power of two")]
    BadAlignment {
        /// Requested alignment.
        align: usize,
        /// Requested size.
        size: usize,
    },
    /// The allocator refused.
    #[error("out of memory allocating {bytes} bytes")]
    OutOfMemory {
        /// Requested size.
        bytes: usize,
    },
    /// A memory layout that makes no sense.
    #[error("invalid KV layout: {0}")]
    BadLayout(String),
    /// A block id beyond the registered pool.
    #[error("engine block {block} is outside the registered pool of {num_blocks} blocks")]
    BlockOutOfRange {
        /// The block asked for.
        block: EngineBlockId,
        /// Blocks in the pool.
        num_blocks: u32,
    },
    /// A task id given twice.
    #[error("{0} is already in use")]
    DuplicateTask(TaskId),
    /// A backend id never registered.
    #[error("{0} is not registered")]
    UnknownBackend(BackendId),
    /// A backend needs memory of a kind it cannot reach.
    #[error("backend {backend} cannot access {what}")]
    UnsupportedMemory {
        /// Backend name.
        backend: String,
        /// The memory it was given.
        what: String,
    },
    /// The driver stopped: shut down, or its thread (a backend on it) panicked. Every call after
    /// that returns this error at once; see [`crate::DriverHandle::stopped`] for the engine
    /// blocks an op may still touch.
    #[error("the kvx driver has stopped: {reason}")]
    DriverStopped {
        /// `stopped` after a shutdown, or the panic message.
        reason: String,
    },
    /// The task was forgotten by [`crate::DriverHandle::reset`] before it reported.
    #[error("{0} was dropped by a reset")]
    DroppedByReset(TaskId),
}
