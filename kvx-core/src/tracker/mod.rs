//! The sans-IO tracker: tasks, deadlines, zombie ops, fences, per-request bookkeeping.
//!
//! Modelled on quinn-proto: it never reads a clock and never blocks. Time comes in as `now`;
//! work comes out through [`Tracker::poll_backend_command`] (ops to hand to backends, cancels) and
//! [`Tracker::poll_event`] (task verdicts, released requests). A driver owns the clock and the
//! backends and shuttles between them (see [`crate::driver`]).

mod deadlines;
mod holders;

use std::collections::VecDeque;
use std::time::Instant;

use rustc_hash::FxHashMap;
use tracing::{debug, info, warn};

use crate::backend::SubmitError;
use crate::error::CoreError;
use crate::ids::{BackendId, BlockKey, Direction, EngineBlockId, OpId, RequestId, TaskId};
use crate::op::{BlockError, Op, OpBlock, OpCompletion};
use crate::task::{BlockReport, FailReason, TaskReport, TaskSpec, TaskState};
use deadlines::Deadlines;
use holders::{Holder, Holders};

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
/// fence was made (or was queued to) is still outstanding. Check it with [`Tracker::fence_holds`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    blocks: Vec<EngineBlockId>,
    seq: u64,
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

#[derive(Debug, Default)]
struct BackendSlot {
    touches_engine: bool,
    zombie_ops: usize,
    zombie_bytes: u64,
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Phase {
    /// Waiting for `start_step`.
    Deferred,
    /// Waiting to be first in line on its engine blocks.
    Blocked,
    /// An op is with a backend.
    InFlight(OpId),
    /// Between ops (its last op just completed).
    Idle,
}

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

struct OpEntry {
    task: TaskId,
    request: RequestId,
    backend: BackendId,
    zombie: bool,
    bytes: u64,
    engine_blocks: Vec<EngineBlockId>,
}

#[derive(Default)]
struct RequestEntry {
    tasks: Vec<TaskId>,
    zombies: Vec<OpId>,
    /// No new task is accepted (the engine finished it, or a reset dropped it).
    finished: bool,
    /// The engine finished it: report [`Event::RequestReleased`] once nothing of it is out.
    report_release: bool,
}

/// The task/deadline/preemption state machine. See the module docs.
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

    /// Submit a task under a fresh id. Never fails: a task that cannot run ends at once with a
    /// `Failed` or `TimedOut` report (its buffers given back in the report).
    pub fn submit(&mut self, spec: TaskSpec, now: Instant) -> TaskId {
        let id = TaskId(self.next_task);
        self.next_task += 1;
        self.insert(id, spec, now);
        id
    }

    /// Submit under an id chosen by the caller (a driver hands ids out without a round trip).
    /// Ids must be unique among live tasks.
    pub fn submit_as(&mut self, id: TaskId, spec: TaskSpec, now: Instant) -> Result<(), CoreError> {
        if self.tasks.contains_key(&id) {
            return Err(CoreError::DuplicateTask(id));
        }
        self.next_task = self.next_task.max(id.0 + 1);
        self.insert(id, spec, now);
        Ok(())
    }

    fn insert(&mut self, id: TaskId, spec: TaskSpec, now: Instant) {
        let TaskSpec {
            request,
            dir,
            route,
            blocks,
            deadline,
            deferred,
        } = spec;
        let n = blocks.len();
        let mut engine_blocks: Vec<EngineBlockId> =
            blocks.iter().filter_map(|b| b.engine).collect();
        engine_blocks.sort_unstable();
        engine_blocks.dedup();
        let span = tracing::debug_span!("kvx_task", task = %id, request = %request, dir = %dir, blocks = n);
        let mut entry = TaskEntry {
            request,
            dir,
            route,
            stage: 0,
            deadline,
            phase: Phase::Blocked,
            deferred,
            waiting: blocks.into_iter().enumerate().collect(),
            in_op: Vec::new(),
            reports: (0..n).map(|_| None).collect(),
            engine_blocks,
            span,
        };
        // Refusals: the task ends at once, buffers handed back.
        let refuse = if n == 0 {
            Some(TaskState::Failed(FailReason::Invalid(
                "task has no blocks".into(),
            )))
        } else if entry.route.is_empty() {
            Some(TaskState::Failed(FailReason::Invalid(
                "task has an empty route".into(),
            )))
        } else if let Some(b) = entry
            .route
            .iter()
            .find(|b| b.0 as usize >= self.backends.len())
        {
            Some(TaskState::Failed(FailReason::Invalid(format!(
                "{b} is not registered"
            ))))
        } else if self.requests.get(&request).is_some_and(|r| r.finished) {
            Some(TaskState::Failed(FailReason::RequestFinished))
        } else if let Some(b) = entry.route.iter().find(|b| self.over_budget(**b)) {
            Some(TaskState::Failed(FailReason::ZombieBudget { backend: *b }))
        } else if deadline <= now {
            Some(TaskState::TimedOut)
        } else {
            None
        };
        if let Some(state) = refuse {
            let err = match &state {
                TaskState::TimedOut => BlockError::TimedOut,
                TaskState::Failed(FailReason::ZombieBudget { backend }) => {
                    BlockError::Unavailable(format!("{backend} is over its zombie budget"))
                }
                TaskState::Failed(r) => BlockError::Invalid(format!("{r:?}")),
                _ => BlockError::Cancelled,
            };
            entry.span.in_scope(|| debug!(?state, "task refused"));
            if state == TaskState::TimedOut {
                self.timed_out += 1;
            }
            let blocks = entry
                .waiting
                .drain(..)
                .map(|(_, b)| BlockReport {
                    key: b.key,
                    engine: b.engine,
                    result: Err(err.clone()),
                    buf: Some(b.buf),
                })
                .collect();
            self.events.push_back(Event::TaskFinished(TaskReport {
                task: id,
                request,
                dir,
                state,
                blocks,
                finished_at: now,
            }));
            return;
        }
        let first = self
            .holders
            .register(&entry.engine_blocks, Holder::Task(id));
        self.requests.entry(request).or_default().tasks.push(id);
        self.deadlines.push(now, deadline, id);
        entry
            .span
            .in_scope(|| debug!(?deadline, deferred, first, "task submitted"));
        if !first {
            entry.phase = Phase::Blocked;
            self.tasks.insert(id, entry);
            self.blocked.push(id);
            // Whatever is ahead of us must not wait for a step that may never come.
            self.flush_ahead(id);
        } else if deferred {
            entry.phase = Phase::Deferred;
            self.tasks.insert(id, entry);
            self.deferred.push(id);
        } else {
            self.tasks.insert(id, entry);
            self.start_stage(id);
        }
    }

    fn over_budget(&self, b: BackendId) -> bool {
        let s = &self.backends[b.0 as usize];
        s.zombie_ops >= self.cfg.zombie_budget_ops || s.zombie_bytes >= self.cfg.zombie_budget_bytes
    }

    /// Hand the task's waiting blocks to the backend of its current stage.
    fn start_stage(&mut self, id: TaskId) {
        let Some(t) = self.tasks.get_mut(&id) else {
            return;
        };
        let op_id = OpId(self.next_op);
        self.next_op += 1;
        let backend = t.route[t.stage];
        let mut blocks = Vec::with_capacity(t.waiting.len());
        t.in_op.clear();
        for (pos, b) in t.waiting.drain(..) {
            t.in_op.push((pos, b.key, b.engine));
            blocks.push(b);
        }
        t.phase = Phase::InFlight(op_id);
        let op = Op {
            id: op_id,
            task: id,
            request: t.request,
            dir: t.dir,
            deadline: t.deadline,
            blocks,
        };
        let touches = self.backends[backend.0 as usize].touches_engine;
        self.ops.insert(
            op_id,
            OpEntry {
                task: id,
                request: t.request,
                backend,
                zombie: false,
                bytes: op.buffer_bytes(),
                engine_blocks: if touches {
                    t.engine_blocks.clone()
                } else {
                    Vec::new()
                },
            },
        );
        self.commands
            .push_back(BackendCommand::Submit { backend, op });
    }

    /// Submit every deferred task now (call at the start of each engine step).
    pub fn start_step(&mut self) {
        for id in std::mem::take(&mut self.deferred) {
            if let Some(t) = self.tasks.get_mut(&id) {
                t.deferred = false;
                if t.phase == Phase::Deferred {
                    self.start_stage(id);
                }
            }
        }
    }

    /// Stop deferring `id` and, if it is blocked, everything ahead of it.
    fn flush_ahead(&mut self, id: TaskId) {
        let mut work = vec![id];
        while let Some(t) = work.pop() {
            let Some(e) = self.tasks.get_mut(&t) else {
                continue;
            };
            e.deferred = false;
            match e.phase {
                Phase::Deferred => {
                    self.deferred.retain(|x| *x != t);
                    self.start_stage(t);
                }
                Phase::Blocked => {
                    let blocks = e.engine_blocks.clone();
                    for h in self.holders.ahead_of(&blocks, Holder::Task(t)) {
                        if let Holder::Task(a) = h {
                            work.push(a);
                        }
                    }
                }
                Phase::InFlight(_) | Phase::Idle => {}
            }
        }
    }

    /// Start blocked tasks that are now first in line.
    fn recheck_blocked(&mut self) {
        if self.blocked.is_empty() {
            return;
        }
        let blocked = std::mem::take(&mut self.blocked);
        for id in blocked {
            let Some(t) = self.tasks.get_mut(&id) else {
                continue;
            };
            if !self.holders.is_first(&t.engine_blocks, Holder::Task(id)) {
                self.blocked.push(id);
                continue;
            }
            if t.deferred {
                t.phase = Phase::Deferred;
                self.deferred.push(id);
            } else {
                self.start_stage(id);
            }
        }
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

    /// End every task whose deadline is at or before `now` as `TimedOut`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut due = std::mem::take(&mut self.due);
        self.deadlines.drain_due(now, &mut due);
        // Earliest first, so verdicts come out in deadline order.
        due.sort_unstable();
        for (at, id) in due.drain(..) {
            if self.tasks.get(&id).is_some_and(|t| t.deadline == at) {
                self.terminate(id, TaskState::TimedOut, now);
            }
        }
        self.due = due;
        let tasks = &self.tasks;
        self.deadlines.compact(tasks.len(), |t, at| {
            tasks.get(&t).is_some_and(|e| e.deadline == at)
        });
    }

    /// A backend refused an op: its blocks fail with the backend's reason.
    pub fn handle_submit_error(&mut self, err: SubmitError, now: Instant) {
        let result = Err(match err.kind {
            crate::backend::SubmitErrorKind::Unavailable(m) => BlockError::Unavailable(m),
            crate::backend::SubmitErrorKind::Busy(m) => BlockError::Unavailable(m),
            crate::backend::SubmitErrorKind::Invalid(m) => BlockError::Invalid(m),
        });
        self.handle_completion(OpCompletion::all(err.op, result), now);
    }

    /// A backend finished an op. A completion handed in before the task's timer fired counts,
    /// even if `now` is already past the deadline: the data really arrived (or the block really
    /// became visible), so the verdict matches what happened. The driver polls backends before
    /// it fires timers for the same reason.
    pub fn handle_completion(&mut self, c: OpCompletion, now: Instant) {
        let OpCompletion { op, mut results } = c;
        let Some(entry) = self.ops.remove(&op.id) else {
            self.late += 1;
            debug!(op = %op.id, "completion of an unknown op dropped");
            return;
        };
        if entry.zombie {
            self.late += 1;
            let slot = &mut self.backends[entry.backend.0 as usize];
            slot.zombie_ops -= 1;
            slot.zombie_bytes -= entry.bytes;
            debug!(op = %op.id, task = %entry.task, bytes = entry.bytes, "late completion: buffers released");
            if !entry.engine_blocks.is_empty() {
                self.holders.remove(&entry.engine_blocks, Holder::Op(op.id));
                if let Some(r) = self.requests.get_mut(&entry.request) {
                    r.zombies.retain(|z| *z != op.id);
                }
                self.maybe_release(entry.request);
                self.recheck_blocked();
            }
            return; // `op` drops here: its buffers go back to their pools.
        }
        let id = entry.task;
        let Some(t) = self.tasks.get_mut(&id) else {
            return;
        };
        if results.len() != op.blocks.len() {
            let msg = format!(
                "backend returned {} results for {} blocks",
                results.len(),
                op.blocks.len()
            );
            results = vec![Err(BlockError::Io(msg)); op.blocks.len()];
        }
        let positions = std::mem::take(&mut t.in_op);
        let mut ok = Vec::new();
        for ((&(pos, _, _), blk), res) in positions.iter().zip(op.blocks).zip(results) {
            match res {
                Ok(()) => ok.push((pos, blk)),
                Err(e) => {
                    t.reports[pos] = Some(BlockReport {
                        key: blk.key,
                        engine: blk.engine,
                        result: Err(e),
                        buf: Some(blk.buf),
                    })
                }
            }
        }
        if t.stage + 1 < t.route.len() && !ok.is_empty() {
            t.stage += 1;
            t.waiting = ok;
            self.start_stage(id);
            return;
        }
        for (pos, blk) in ok {
            t.reports[pos] = Some(BlockReport {
                key: blk.key,
                engine: blk.engine,
                result: Ok(()),
                buf: Some(blk.buf),
            });
        }
        t.phase = Phase::Idle;
        let all_ok = t
            .reports
            .iter()
            .all(|r| r.as_ref().is_some_and(|r| r.result.is_ok()));
        let state = if all_ok {
            TaskState::Done
        } else {
            TaskState::Failed(FailReason::Blocks)
        };
        self.terminate(id, state, now);
    }

    /// End a live task in `state`; its outstanding op, if any, becomes a zombie.
    fn terminate(&mut self, id: TaskId, state: TaskState, now: Instant) {
        let Some(mut t) = self.tasks.remove(&id) else {
            return;
        };
        let _g = t.span.enter();
        let block_err = match state {
            TaskState::TimedOut => BlockError::TimedOut,
            _ => BlockError::Cancelled,
        };
        if state == TaskState::TimedOut {
            self.timed_out += 1;
            warn!(deadline = ?t.deadline, "task timed out");
        } else {
            debug!(?state, "task finished");
        }
        let mut zombie_engine = None;
        if let Phase::InFlight(op_id) = t.phase {
            if let Some(e) = self.ops.get_mut(&op_id) {
                e.zombie = true;
                let slot = &mut self.backends[e.backend.0 as usize];
                slot.zombie_ops += 1;
                slot.zombie_bytes += e.bytes;
                info!(op = %op_id, bytes = e.bytes, "op quarantined as zombie");
                self.commands.push_back(BackendCommand::Cancel {
                    backend: e.backend,
                    op: op_id,
                });
                if !e.engine_blocks.is_empty() {
                    zombie_engine = Some(op_id);
                }
            }
            // Blocks inside the op: their buffers stay with the op.
            for (pos, key, engine) in std::mem::take(&mut t.in_op) {
                t.reports[pos] = Some(BlockReport {
                    key,
                    engine,
                    result: Err(block_err.clone()),
                    buf: None,
                });
            }
        }
        for (pos, blk) in t.waiting.drain(..) {
            t.reports[pos] = Some(BlockReport {
                key: blk.key,
                engine: blk.engine,
                result: Err(block_err.clone()),
                buf: Some(blk.buf),
            });
        }
        drop(_g);
        let blocks: Vec<BlockReport> = t.reports.into_iter().flatten().collect();
        match zombie_engine {
            Some(op) => self
                .holders
                .replace(&t.engine_blocks, Holder::Task(id), Holder::Op(op)),
            None => self.holders.remove(&t.engine_blocks, Holder::Task(id)),
        }
        if t.phase == Phase::Deferred {
            self.deferred.retain(|x| *x != id);
        }
        if let Some(r) = self.requests.get_mut(&t.request) {
            r.tasks.retain(|x| *x != id);
            if let Some(op) = zombie_engine {
                r.zombies.push(op);
            }
        }
        self.events.push_back(Event::TaskFinished(TaskReport {
            task: id,
            request: t.request,
            dir: t.dir,
            state,
            blocks,
            finished_at: now,
        }));
        self.maybe_release(t.request);
        self.recheck_blocked();
        let tasks = &self.tasks;
        self.deadlines.compact(tasks.len(), |t, at| {
            tasks.get(&t).is_some_and(|e| e.deadline == at)
        });
    }

    /// Drop a finished request's entry once nothing of it is outstanding.
    fn maybe_release(&mut self, req: RequestId) {
        let Some(r) = self.requests.get(&req) else {
            return;
        };
        if r.finished && r.tasks.is_empty() && r.zombies.is_empty() {
            let report = r.report_release;
            self.requests.remove(&req);
            if report {
                debug!(request = %req, "request released");
                self.events.push_back(Event::RequestReleased(req));
            }
        }
    }

    /// Cancel one task (no-op if it already ended).
    pub fn cancel(&mut self, task: TaskId, now: Instant) {
        self.terminate(task, TaskState::Cancelled, now);
    }

    /// Preempt a request: its loads are cancelled, its deferred stores are submitted now. The
    /// returned fence holds once no op of the request touches its engine blocks any more (its
    /// stores ended, its loads' engine copies returned).
    pub fn preempt(&mut self, req: RequestId, now: Instant) -> Fence {
        let Some(r) = self.requests.get(&req) else {
            return Fence {
                blocks: Vec::new(),
                seq: self.holders.seq(),
            };
        };
        let tasks = r.tasks.clone();
        let zombies = r.zombies.clone();
        let mut blocks: Vec<EngineBlockId> = Vec::new();
        for z in &zombies {
            if let Some(o) = self.ops.get(z) {
                blocks.extend_from_slice(&o.engine_blocks);
            }
        }
        let seq = self.holders.seq();
        for id in tasks {
            let Some(t) = self.tasks.get(&id) else {
                continue;
            };
            blocks.extend_from_slice(&t.engine_blocks);
            match t.dir {
                Direction::Load => self.cancel(id, now),
                Direction::Store => self.flush_ahead(id),
            }
        }
        blocks.sort_unstable();
        blocks.dedup();
        info!(request = %req, blocks = blocks.len(), "preempt: fence created");
        Fence { blocks, seq }
    }

    /// A fence over `blocks`: holds once every op queued on them before now has ended. Queued
    /// stores on them are flushed. (The engine calls this before handing blocks to someone else.)
    pub fn fence_blocks(&mut self, blocks: &[EngineBlockId]) -> Fence {
        let mut blocks = blocks.to_vec();
        blocks.sort_unstable();
        blocks.dedup();
        let seq = self.holders.seq();
        let live: Vec<TaskId> = self
            .tasks
            .iter()
            .filter(|(_, t)| {
                t.engine_blocks
                    .iter()
                    .any(|b| blocks.binary_search(b).is_ok())
            })
            .map(|(id, _)| *id)
            .collect();
        for id in live {
            self.flush_ahead(id);
        }
        Fence { blocks, seq }
    }

    /// True once the fence holds.
    pub fn fence_holds(&self, fence: &Fence) -> bool {
        self.holders.clear_up_to(&fence.blocks, fence.seq)
    }

    /// The engine is done with a request. Its loads are cancelled, its queued stores flushed.
    /// The request always comes back once as [`Event::RequestReleased`]: at once when nothing
    /// of it is out, else once its stores ended and its engine copies returned. Returns true
    /// when something of it was still out (the release comes later).
    pub fn finish(&mut self, req: RequestId, now: Instant) -> bool {
        let Some(r) = self.requests.get(&req) else {
            self.events.push_back(Event::RequestReleased(req));
            return false;
        };
        let loads: Vec<TaskId> = r
            .tasks
            .iter()
            .copied()
            .filter(|t| self.tasks.get(t).is_some_and(|t| t.dir == Direction::Load))
            .collect();
        for t in loads {
            self.cancel(t, now);
        }
        let Some(r) = self.requests.get_mut(&req) else {
            return false;
        };
        r.finished = true;
        r.report_release = true;
        let delay = !r.tasks.is_empty() || !r.zombies.is_empty();
        let stores = r.tasks.clone();
        for t in stores {
            self.flush_ahead(t);
        }
        self.maybe_release(req);
        delay
    }

    /// Forget every live task without reporting it; their ops become zombies whose late
    /// completions are dropped. Engine-memory zombies still hold their blocks until they return.
    ///
    /// The returned fence holds once every engine-memory op that is out now (zombies included)
    /// has returned. Requests the engine had finished are not forgotten: each still comes back
    /// once as [`Event::RequestReleased`], when its own engine-memory ops have returned (at once
    /// when it has none).
    pub fn reset(&mut self, now: Instant) -> Fence {
        let ids: Vec<TaskId> = self.tasks.keys().copied().collect();
        for id in ids {
            self.terminate(id, TaskState::Cancelled, now);
        }
        // Queued submits stay: their ops are zombies now and must still reach their backend so
        // that they complete and give their buffers back.
        self.events
            .retain(|e| matches!(e, Event::RequestReleased(_)));
        self.requests.retain(|_, r| {
            r.finished = true;
            !r.zombies.is_empty()
        });
        self.deferred.clear();
        self.blocked.clear();
        self.deadlines.clear();
        Fence {
            blocks: self.holders.blocks(),
            seq: self.holders.seq(),
        }
    }

    /// Engine blocks that an op out with a backend may still read or write (sorted).
    pub fn engine_blocks_out(&self) -> Vec<EngineBlockId> {
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

    /// Zombie ops and bytes of one backend.
    pub fn zombies_of(&self, backend: BackendId) -> (usize, u64) {
        self.backends
            .get(backend.0 as usize)
            .map_or((0, 0), |b| (b.zombie_ops, b.zombie_bytes))
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

    /// State of a live task (`None` once it ended).
    pub fn task_state(&self, task: TaskId) -> Option<TaskState> {
        self.tasks.get(&task).map(|t| match t.phase {
            Phase::InFlight(_) => TaskState::InFlight,
            _ => TaskState::Queued,
        })
    }

    /// True if the op is with a backend (active or zombie).
    pub fn op_outstanding(&self, op: OpId) -> bool {
        self.ops.contains_key(&op)
    }
}

#[cfg(test)]
mod tests;
