//! A task's stage machine: submitted (or refused at once), deferred or blocked, an op with the
//! backend of each stage of its route in turn, then exactly one verdict; an op still out at
//! the verdict becomes a zombie that keeps its buffers (and its engine blocks) until it returns.

use std::time::Instant;

use tracing::{debug, info, warn};

use super::holders::Holder;
use super::{BackendCommand, Event, OpEntry, Phase, TaskEntry, Tracker};
use crate::backend::SubmitError;
use crate::error::CoreError;
use crate::ids::{BackendId, EngineBlockId, OpId, TaskId};
use crate::op::{BlockError, Op, OpCompletion};
use crate::task::{BlockReport, FailReason, TaskReport, TaskSpec, TaskState};

impl Tracker {
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
    pub(crate) fn submit_as(
        &mut self,
        id: TaskId,
        spec: TaskSpec,
        now: Instant,
    ) -> Result<(), CoreError> {
        if self.tasks.contains_key(&id) {
            return Err(CoreError::DuplicateTask(id));
        }
        self.next_task = self.next_task.max(id.0 + 1);
        self.insert(id, spec, now);
        Ok(())
    }

    pub(super) fn insert(&mut self, id: TaskId, spec: TaskSpec, now: Instant) {
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

    pub(super) fn over_budget(&self, b: BackendId) -> bool {
        let s = &self.backends[b.0 as usize];
        s.zombie_ops >= self.cfg.zombie_budget_ops || s.zombie_bytes >= self.cfg.zombie_budget_bytes
    }

    /// Hand the task's waiting blocks to the backend of its current stage.
    pub(super) fn start_stage(&mut self, id: TaskId) {
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
    pub(crate) fn handle_submit_error(&mut self, err: SubmitError, now: Instant) {
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
        t.phase = Phase::Finishing;
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
    pub(super) fn terminate(&mut self, id: TaskId, state: TaskState, now: Instant) {
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

    /// Cancel one task (no-op if it already ended).
    pub fn cancel(&mut self, task: TaskId, now: Instant) {
        self.terminate(task, TaskState::Cancelled, now);
    }
}
