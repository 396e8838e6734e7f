//! Tasks: what the engine asks for, and the verdict it gets back.

use std::time::Instant;

use crate::buffer::Buf;
use crate::ids::{BackendId, BlockKey, Direction, EngineBlockId, RequestId, TaskId};
use crate::op::{BlockError, OpBlock};

/// A transfer the engine asks for: one request, one direction, one or more blocks, a deadline.
///
/// `route` names the backends the blocks go through, in order; each stage hands its buffers
/// to the next (a load from a file is `[posix, host]`: file → staging buffer → engine memory).
#[derive(Debug)]
pub struct TaskSpec {
    /// Request the task belongs to (a detached task runs on its behalf, outside its life: see
    /// [`Tracker::submit_detached`](crate::Tracker::submit_detached)).
    pub request: RequestId,
    /// Load (into engine memory) or store (out of it).
    pub dir: Direction,
    /// Backends in the order the blocks pass through them.
    pub route: Vec<BackendId>,
    /// The blocks, each with its buffer.
    pub blocks: Vec<OpBlock>,
    /// Absolute monotonic deadline.
    pub deadline: Instant,
    /// Hold the task until the next `start_step` (deferred stores).
    pub deferred: bool,
}

/// Why a task failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailReason {
    /// One or more blocks failed; the block reports say which and why.
    Blocks,
    /// A backend on the route has too many zombie ops; new work fails fast.
    ZombieBudget {
        /// The backend over budget.
        backend: BackendId,
    },
    /// The request already finished; no new tasks are accepted for it.
    RequestFinished,
    /// The spec was malformed.
    Invalid(String),
}

/// The state of a task. A task reaches exactly one of the last four.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskState {
    /// Accepted; waiting for the next step, or for a fence on its engine blocks.
    Queued,
    /// An op of this task is with a backend.
    InFlight,
    /// Every block arrived.
    Done,
    /// At least one block failed (see the block reports), or the task was refused.
    Failed(FailReason),
    /// The deadline passed first.
    TimedOut,
    /// Cancelled by preemption, finish or an explicit cancel.
    Cancelled,
}

impl TaskState {
    /// True for Done, Failed, TimedOut and Cancelled.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, TaskState::Queued | TaskState::InFlight)
    }
}

/// The verdict on one block of a finished task.
#[derive(Debug)]
pub struct BlockReport {
    /// Block key.
    pub key: BlockKey,
    /// Engine block, if the task named one.
    pub engine: Option<EngineBlockId>,
    /// Ok if the block fully arrived.
    pub result: Result<(), BlockError>,
    /// The buffer, when it came back with the task (None if a zombie op still holds it).
    pub buf: Option<Buf>,
}

/// The verdict on a finished task.
#[derive(Debug)]
pub struct TaskReport {
    /// The task.
    pub task: TaskId,
    /// Its request.
    pub request: RequestId,
    /// Its direction.
    pub dir: Direction,
    /// Terminal state.
    pub state: TaskState,
    /// One report per block, in the order of the spec.
    pub blocks: Vec<BlockReport>,
    /// Cut short while a backend that touches engine memory had an op of it out: that op, a
    /// zombie now, may still read or write the task's engine blocks and keeps them until it
    /// returns (a fence on them holds after that). False when the op still out only fills a
    /// kvx buffer (a file read), or none is out.
    pub engine_blocks_held: bool,
    /// When the tracker decided (the `now` it was given).
    pub finished_at: Instant,
}

impl TaskReport {
    /// Engine blocks that did not arrive.
    pub fn failed_engine_blocks(&self) -> Vec<EngineBlockId> {
        self.blocks
            .iter()
            .filter(|b| b.result.is_err())
            .filter_map(|b| b.engine)
            .collect()
    }

    /// True when every block arrived.
    pub fn is_ok(&self) -> bool {
        self.state == TaskState::Done
    }
}
