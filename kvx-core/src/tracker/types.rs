//! The tracker's public types: its limits, what it hands the driver (backend commands) and the
//! engine (events), fences, and its counters.

use crate::ids::{BackendId, EngineBlockId, OpId, RequestId};
use crate::op::Op;
use crate::task::TaskReport;

/// Limits of the tracker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrackerConfig {
    /// Zombie ops one backend may have before new tasks routed through it fail fast (default 1024).
    pub zombie_budget_ops: usize,
    /// Zombie buffer bytes one backend may hold before new tasks fail fast (default 1 GiB).
    pub zombie_budget_bytes: u64,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        TrackerConfig {
            zombie_budget_ops: 1024,
            zombie_budget_bytes: 1 << 30,
        }
    }
}

/// Work for the driver: hand an op to a backend, or ask a backend to abandon one.
#[derive(Debug)]
pub enum BackendCommand {
    /// Call `backend.submit(op)`.
    Submit {
        /// Target backend.
        backend: BackendId,
        /// The op, with its buffers.
        op: Op,
    },
    /// Call `backend.cancel(op)` (best effort; the op still completes later).
    Cancel {
        /// Target backend.
        backend: BackendId,
        /// The op to abandon.
        op: OpId,
    },
}

/// Something the engine needs to know.
#[derive(Debug)]
pub enum Event {
    /// A task reached its terminal state.
    TaskFinished(TaskReport),
    /// A finished request whose freeing was delayed may now free its blocks.
    RequestReleased(RequestId),
}

/// A promise about engine blocks: it holds once no op that was reading or writing them when the
/// fence was made (or was queued to) is still outstanding. Check it with
/// [`Tracker::fence_holds`](crate::Tracker::fence_holds).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "reuse no fenced engine block before the fence holds"]
pub struct Fence {
    pub(super) blocks: Vec<EngineBlockId>,
    /// Holders registered at or before this sequence number are waited for.
    pub(super) seq: u64,
}

impl Fence {
    /// The engine blocks this fence protects.
    pub fn blocks(&self) -> &[EngineBlockId] {
        &self.blocks
    }
}

/// Counters and sizes, for tests, metrics and budgets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrackerStats {
    /// Tasks not yet terminal.
    pub live_tasks: usize,
    /// Ops with a backend whose task is still live.
    pub active_ops: usize,
    /// Ops with a backend whose task already ended (their buffers are quarantined).
    pub zombie_ops: usize,
    /// Buffer bytes held by zombie ops.
    pub zombie_bytes: u64,
    /// Completions that came back after their task ended, or after a reset.
    pub late_completions: u64,
    /// Tasks that ended TimedOut so far.
    pub timed_out: u64,
    /// Requests with state in the tracker.
    pub requests: usize,
    /// Deadline entries held.
    pub timers: usize,
    /// Engine blocks with at least one holder.
    pub held_blocks: usize,
}
