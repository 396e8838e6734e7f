//! The sans-IO tracker: tasks, deadlines, zombie ops, fences, per-request bookkeeping.
//!
//! The files of this module, one idea each: `types` (the public types), `stages` (a task's
//! stage machine: submit, hand ops out, complete, time out, terminate), `ordering` (who may
//! touch an engine block when: per-block queues and fences), `lifecycle` (a request's life:
//! preempt, finish, release, reset), `requests` (a request's list of live tasks; a detached
//! task, see [`Tracker::submit_detached`], is in none), and the data
//! structures: `slab` (where tasks, ops and requests live), `task_index`, `engine_set`,
//! `holders` and `deadlines`.
//!
//! Tasks, ops and requests live in slabs and refer to each other by slot, so the hot path
//! (submit → op out → completion → verdict) hashes only the request id; a task id finds its
//! slot through a window over recent ids, and an op id carries its slot. A one-block task allocates only the
//! vector of its verdict's block reports.

mod deadlines;
mod engine_set;
mod holders;
mod lifecycle;
mod ordering;
mod requests;
mod slab;
mod stages;
mod task_index;
mod types;

use std::collections::VecDeque;
use std::time::Instant;

use rustc_hash::FxHashMap;

use crate::ids::{BackendId, Direction, EngineBlockId, OpId, RequestId, TaskId};
use crate::op::OpBlock;
use crate::task::BlockReport;
use deadlines::Deadlines;
use engine_set::EngineSet;
use holders::Holders;
use slab::Slab;
use task_index::TaskIndex;
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
    /// An op (by slot) is with a backend.
    InFlight(u32),
    /// Its last op returned; it is being given its verdict.
    Finishing,
}

/// Whether a task is part of its request's life.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub(crate) enum Bond {
    /// In its request's list: preemption, finish and the request's release see it.
    Request,
    /// Detached ([`Tracker::submit_detached`]): in no request's list, names no engine block.
    Detached,
}

/// Where some blocks of a task sit in its spec: the first `n` positions in order (the common
/// case: every block of the task together), or a list.
#[derive(Debug, Clone)]
enum Positions {
    Leading(usize),
    List(Vec<usize>),
}

impl Positions {
    /// Position in the spec of the `i`th block.
    fn at(&self, i: usize) -> usize {
        match self {
            Positions::Leading(_) => i,
            Positions::List(v) => v[i],
        }
    }

    fn len(&self) -> usize {
        match self {
            Positions::Leading(n) => *n,
            Positions::List(v) => v.len(),
        }
    }
}

/// A live task.
struct TaskEntry {
    id: TaskId,
    request: RequestId,
    /// Its request's slot, and its neighbours in that request's list of tasks.
    req_slot: u32,
    prev: u32,
    next: u32,
    dir: Direction,
    route: Vec<BackendId>,
    stage: usize,
    deadline: Instant,
    phase: Phase,
    deferred: bool,
    /// Blocks not with a backend right now, and where they sit in the spec.
    waiting: Vec<OpBlock>,
    waiting_at: Positions,
    /// Where the blocks of the op in flight sit in the spec.
    in_op_at: Positions,
    /// The verdict's block reports in spec order, key and engine block filled in at submit; a
    /// block's result and buffer are written when it leaves the task for good.
    reports: Vec<BlockReport>,
    engine_blocks: EngineSet,
    span: tracing::Span,
}

/// An op out with a backend, for a live task or as a zombie.
struct OpEntry {
    id: OpId,
    task: TaskId,
    task_slot: u32,
    request: RequestId,
    req_slot: u32,
    backend: BackendId,
    zombie: bool,
    /// Its task's deadline: a copy out past it (a zombie's) is overdue.
    deadline: Instant,
    bytes: u64,
    /// Engine blocks a zombie op may still touch (taken over from its task when it ended;
    /// empty while the task lives, or when the backend does not touch engine memory).
    engine_blocks: EngineSet,
}

/// A request with live tasks or engine-memory zombies.
struct RequestEntry {
    id: RequestId,
    /// Its live tasks in submission order: a list threaded through the task slab.
    first_task: u32,
    last_task: u32,
    tasks: usize,
    /// Slots of its zombie ops that may still touch engine memory.
    zombies: Vec<u32>,
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
    tasks: Slab<TaskEntry>,
    task_slots: TaskIndex,
    ops: Slab<OpEntry>,
    requests: Slab<RequestEntry>,
    request_slots: FxHashMap<RequestId, u32>,
    holders: Holders,
    deadlines: Deadlines,
    /// Scratch space for the entries `handle_timeout` drains.
    due: Vec<deadlines::Entry>,
    /// Scratch space for lists of task slots.
    scratch: Vec<u32>,
    /// Tasks (slot and id) waiting for `start_step`, and waiting for their engine blocks.
    deferred: Vec<(u32, TaskId)>,
    blocked: Vec<(u32, TaskId)>,
    commands: VecDeque<BackendCommand>,
    events: VecDeque<Event>,
    next_task: u64,
    /// Ops handed out so far: the upper half of an op id (the lower half is its slot).
    ops_issued: u64,
    late: u64,
    timed_out: u64,
}

impl Tracker {
    /// An empty tracker.
    pub fn new(cfg: TrackerConfig) -> Tracker {
        Tracker {
            cfg,
            backends: Vec::new(),
            tasks: Slab::default(),
            task_slots: TaskIndex::default(),
            ops: Slab::default(),
            requests: Slab::default(),
            request_slots: FxHashMap::default(),
            holders: Holders::default(),
            deadlines: Deadlines::default(),
            due: Vec::new(),
            scratch: Vec::new(),
            deferred: Vec::new(),
            blocked: Vec::new(),
            commands: VecDeque::new(),
            events: VecDeque::new(),
            next_task: 1,
            ops_issued: 0,
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
    #[inline]
    pub fn poll_backend_command(&mut self) -> Option<BackendCommand> {
        self.commands.pop_front()
    }

    /// Next thing the engine needs to know.
    #[inline]
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When `handle_timeout` must be called next.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        let tasks = &self.tasks;
        self.deadlines.peek(|e| deadline_is_live(tasks, e))
    }

    /// Engine blocks that an op out with a backend may still read or write (sorted).
    pub(crate) fn engine_blocks_out(&self) -> Vec<EngineBlockId> {
        let mut blocks: Vec<EngineBlockId> = Vec::new();
        for (_, o) in self.ops.iter() {
            if o.zombie {
                blocks.extend_from_slice(&o.engine_blocks);
            } else if self.backends[o.backend.0 as usize].touches_engine {
                if let Some(t) = self.tasks.get(o.task_slot) {
                    blocks.extend_from_slice(&t.engine_blocks);
                }
            }
        }
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

/// True while the task a deadline entry was made for is still live.
fn deadline_is_live(tasks: &Slab<TaskEntry>, e: &deadlines::Entry) -> bool {
    tasks
        .get(e.2)
        .is_some_and(|t| t.id == e.1 && t.deadline == e.0)
}

#[cfg(test)]
mod tests;
