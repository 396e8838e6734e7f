//! The sans-IO tracker: tasks, deadlines, zombie ops, fences, per-request bookkeeping.
//!
//! The files of this module, one idea each: `types` (the public types), `stages` (a task's
//! stage machine: submit, hand ops out, complete, time out, terminate), `ordering` (who may
//! touch an engine block when: per-block queues and fences), `lifecycle` (a request's life:
//! preempt, finish, release, reset), `holders` and `deadlines` (the two data structures).

mod deadlines;
mod holders;
mod lifecycle;
mod ordering;
mod stages;
mod types;

use std::collections::VecDeque;
use std::time::Instant;

use rustc_hash::FxHashMap;

use crate::ids::{BackendId, BlockKey, Direction, EngineBlockId, OpId, RequestId, TaskId};
use crate::op::OpBlock;
use crate::task::BlockReport;
use deadlines::Deadlines;
use holders::Holders;
pub use types::{BackendCommand, Event, Fence, TrackerConfig, TrackerStats};

/// What the tracker keeps per backend: whether it touches engine memory, and its zombies.
#[derive(Debug, Default)]
struct BackendSlot {
    touches_engine: bool,
    zombie_ops: usize,
    zombie_bytes: u64,
}

/// Where a live task is in its stage machine.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Phase {
    /// Waiting for `start_step`.
    Deferred,
    /// Waiting to be first in line on its engine blocks.
    Blocked,
    /// An op is with a backend.
    InFlight(OpId),
    /// Its last op returned; it is being given its verdict.
    Finishing,
}

/// A live task.
struct TaskEntry {
    request: RequestId,
    dir: Direction,
    route: Vec<BackendId>,
    stage: usize,
    deadline: Instant,
    phase: Phase,
    deferred: bool,
    /// Blocks not with a backend right now, with their position in the spec.
    waiting: Vec<(usize, OpBlock)>,
    /// Position (in the spec), key and engine block of each block of the op in flight.
    in_op: Vec<(usize, BlockKey, Option<EngineBlockId>)>,
    reports: Vec<Option<BlockReport>>,
    engine_blocks: Vec<EngineBlockId>,
    span: tracing::Span,
}

/// An op out with a backend, for a live task or as a zombie.
struct OpEntry {
    task: TaskId,
    request: RequestId,
    backend: BackendId,
    zombie: bool,
    bytes: u64,
    engine_blocks: Vec<EngineBlockId>,
}

/// A request with live tasks or engine-memory zombies.
#[derive(Default)]
struct RequestEntry {
    tasks: Vec<TaskId>,
    zombies: Vec<OpId>,
    /// No new task is accepted (the engine finished it, or a reset dropped it).
    finished: bool,
    /// The engine finished it: report [`Event::RequestReleased`] once nothing of it is out.
    report_release: bool,
}

/// The task/deadline/preemption state machine.
///
/// Modelled on quinn-proto: it never reads a clock and never blocks. Time comes in as `now`;
/// work comes out through [`Tracker::poll_backend_command`] (ops to hand to backends, cancels)
/// and [`Tracker::poll_event`] (task verdicts, released requests). A driver owns the clock and
/// the backends and shuttles between them (see [`crate::Driver`]).
pub struct Tracker {
    cfg: TrackerConfig,
    backends: Vec<BackendSlot>,
    tasks: FxHashMap<TaskId, TaskEntry>,
    ops: FxHashMap<OpId, OpEntry>,
    requests: FxHashMap<RequestId, RequestEntry>,
    holders: Holders,
    deadlines: Deadlines,
    /// Scratch space for the entries `handle_timeout` drains.
    due: Vec<(Instant, TaskId)>,
    deferred: Vec<TaskId>,
    blocked: Vec<TaskId>,
    commands: VecDeque<BackendCommand>,
    events: VecDeque<Event>,
    next_task: u64,
    next_op: u64,
    late: u64,
    timed_out: u64,
}

impl Tracker {
    /// An empty tracker.
    pub fn new(cfg: TrackerConfig) -> Tracker {
        Tracker {
            cfg,
            backends: Vec::new(),
            tasks: FxHashMap::default(),
            ops: FxHashMap::default(),
            requests: FxHashMap::default(),
            holders: Holders::default(),
            deadlines: Deadlines::default(),
            due: Vec::new(),
            deferred: Vec::new(),
            blocked: Vec::new(),
            commands: VecDeque::new(),
            events: VecDeque::new(),
            next_task: 1,
            next_op: 1,
            late: 0,
            timed_out: 0,
        }
    }

    /// Register a backend; `touches_engine` as its `Backend::touches_engine_memory` says.
    pub fn add_backend(&mut self, touches_engine: bool) -> BackendId {
        self.backends.push(BackendSlot {
            touches_engine,
            ..Default::default()
        });
        BackendId((self.backends.len() - 1) as u16)
    }

    /// Next piece of work for the driver.
    pub fn poll_backend_command(&mut self) -> Option<BackendCommand> {
        self.commands.pop_front()
    }

    /// Next thing the engine needs to know.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When `handle_timeout` must be called next.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        let tasks = &self.tasks;
        self.deadlines
            .peek(|t, at| tasks.get(&t).is_some_and(|e| e.deadline == at))
    }

    /// Engine blocks that an op out with a backend may still read or write (sorted).
    pub(crate) fn engine_blocks_out(&self) -> Vec<EngineBlockId> {
        let mut blocks: Vec<EngineBlockId> = self
            .ops
            .values()
            .flat_map(|o| o.engine_blocks.iter().copied())
            .collect();
        blocks.sort_unstable();
        blocks.dedup();
        blocks
    }

    /// Counters and sizes.
    pub fn stats(&self) -> TrackerStats {
        let zombie_ops = self.backends.iter().map(|b| b.zombie_ops).sum();
        TrackerStats {
            live_tasks: self.tasks.len(),
            active_ops: self.ops.len() - zombie_ops,
            zombie_ops,
            zombie_bytes: self.backends.iter().map(|b| b.zombie_bytes).sum(),
            late_completions: self.late,
            timed_out: self.timed_out,
            requests: self.requests.len(),
            timers: self.deadlines.len(),
            held_blocks: self.holders.len(),
        }
    }

    /// True when the tracker holds nothing: no task, op, request, timer, holder or queued work.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
            && self.ops.is_empty()
            && self.requests.is_empty()
            && self.holders.is_empty()
            && self.deadlines.len() == 0
            && self.deferred.is_empty()
            && self.blocked.is_empty()
            && self.commands.is_empty()
            && self.events.is_empty()
    }
}

#[cfg(test)]
mod tests;
