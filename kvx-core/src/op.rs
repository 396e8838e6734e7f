//! Ops: what a backend executes, and what it hands back.

use std::time::Instant;

use crate::buffer::Buf;
use crate::ids::{BlockKey, Direction, EngineBlockId, OpId, RequestId, TaskId};

/// One block of an op: its key, the engine block (if the op touches engine memory) and the
/// kvx-owned buffer that is the op's source (store) or destination (load).
#[derive(Debug)]
pub struct OpBlock {
    /// Content key of the block.
    pub key: BlockKey,
    /// Engine block it comes from (store) or goes to (load), when there is one.
    pub engine: Option<EngineBlockId>,
    /// The block's bytes, owned by the op until it completes.
    pub buf: Buf,
}

/// An operation a backend executes for one stage of a task.
#[derive(Debug)]
pub struct Op {
    /// Op id: unique among the ops out with backends (a tracker reuses an id only after 2^32
    /// further ops).
    pub id: OpId,
    /// Task this op works for.
    pub task: TaskId,
    /// Request of that task.
    pub request: RequestId,
    /// Direction of the task (load: towards engine memory; store: away from it).
    pub dir: Direction,
    /// The task's deadline; a backend may use it to abandon work early.
    pub deadline: Instant,
    /// Blocks to move.
    pub blocks: Vec<OpBlock>,
}

impl Op {
    /// Bytes held in this op's buffers (what stays quarantined if it becomes a zombie).
    pub(crate) fn buffer_bytes(&self) -> u64 {
        self.blocks.iter().map(|b| b.buf.capacity() as u64).sum()
    }
}

/// Why one block of an op failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// The block is not in this tier.
    #[error("block not found")]
    NotFound,
    /// The stored bytes failed verification (header, key, length or checksum).
    #[error("corrupt block: {0}")]
    Corrupt(String),
    /// An I/O error from the operating system or device.
    #[error("I/O error: {0}")]
    Io(String),
    /// The task's deadline passed first.
    #[error("timed out")]
    TimedOut,
    /// The task was cancelled (preemption, finish, reset or explicit cancel).
    #[error("cancelled")]
    Cancelled,
    /// The backend refused without trying (breaker open, budget exhausted, shutting down).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The op was malformed for this backend (bad block id, buffer too small, wrong buffer kind).
    #[error("invalid op: {0}")]
    Invalid(String),
    /// A remote peer reported an error.
    #[error("remote error: {0}")]
    Remote(String),
}

/// A finished op, its buffers given back, and one result per block (same order as `op.blocks`).
#[derive(Debug)]
pub struct OpCompletion {
    /// The op, with its buffers.
    pub op: Op,
    /// Result of each block.
    pub results: Vec<Result<(), BlockError>>,
}

impl OpCompletion {
    /// A completion where every block got the same result.
    #[inline]
    pub fn all(op: Op, result: Result<(), BlockError>) -> OpCompletion {
        // Clones for all blocks but the last, which takes `result` itself (no clone and no
        // drop for the common one-block op).
        let n = op.blocks.len();
        if n == 1 {
            return OpCompletion {
                op,
                results: vec![result],
            };
        }
        let mut results = Vec::with_capacity(n);
        if n > 0 {
            results.extend(std::iter::repeat_n(&result, n - 1).cloned());
            results.push(result);
        }
        OpCompletion { op, results }
    }
}
