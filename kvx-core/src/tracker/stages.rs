//! A task's stage machine: submitted (or refused at once), deferred or blocked, an op with the
//! backend of each stage of its route in turn, then exactly one verdict; an op still out at
//! the verdict becomes a zombie that keeps its buffers (and its engine blocks) until it returns.

use std::time::Instant;

use tracing::{debug, info, warn};

use super::engine_set::EngineSet;
use super::holders::Holder;
use super::slab::NIL;
use super::{
    BackendCommand, Bond, Event, OpEntry, Phase, Positions, TaskEntry, Tracker, deadline_is_live,
};
use crate::backend::SubmitError;
use crate::error::CoreError;
use crate::ids::{BackendId, OpId, TaskId};
use crate::op::{BlockError, Op, OpBlock, OpCompletion};
use crate::task::{BlockReport, FailReason, TaskReport, TaskSpec, TaskState};

/// The lower half of an op id: its slot in the op slab.
const OP_SLOT_BITS: u32 = 32;

impl Tracker {
    /// Submit a task under a fresh id. Never fails: a task that cannot run ends at once with a
    /// `Failed` or `TimedOut` report (its buffers given back in the report).
    pub fn submit(&mut self, spec: TaskSpec, now: Instant) -> TaskId {
        let id = TaskId(self.next_task);
        self.next_task += 1;
        self.insert(id, spec, Bond::Request, now);
        id
    }

    /// Submit a detached task under a fresh id: one that runs on behalf of `spec.request` (its
    /// report names it) but outside that request's life. It names no engine block (a spec that
    /// does is refused), so no fence waits for it: the request's preemption neither cancels
    /// nor flushes it, its release does not wait for it, and it is accepted after the request
    /// finished. A store of buffers kvx already holds (host memory written on to a file) is
    /// one; a reset drops it like any task.
    pub fn submit_detached(&mut self, spec: TaskSpec, now: Instant) -> TaskId {
        let id = TaskId(self.next_task);
        self.next_task += 1;
        self.insert(id, spec, Bond::Detached, now);
        id
    }

    /// Submit under an id chosen by the caller (a driver hands ids out without a round trip).
    /// Ids must be unique among live tasks.
    pub(crate) fn submit_as(
        &mut self,
        id: TaskId,
        spec: TaskSpec,
        bond: Bond,
        now: Instant,
    ) -> Result<(), CoreError> {
        if self.task_slots.contains(id) {
            return Err(CoreError::DuplicateTask(id));
        }
        self.next_task = self.next_task.max(id.0 + 1);
        self.insert(id, spec, bond, now);
        Ok(())
    }

    pub(super) fn insert(&mut self, id: TaskId, spec: TaskSpec, bond: Bond, now: Instant) {
        let TaskSpec {
            request,
            dir,
            route,
            blocks,
            deadline,
            deferred,
        } = spec;
        let n = blocks.len();
        let report = |b: &OpBlock| BlockReport {
            key: b.key,
            engine: b.engine,
            result: Ok(()),
            buf: None,
        };
        let mut reports: Vec<BlockReport> = match &blocks[..] {
            [b] => vec![report(b)],
            _ => blocks.iter().map(report).collect(),
        };
        let span = tracing::debug_span!("kvx_task", task = %id, request = %request, dir = %dir, blocks = n, ?bond);
        let req_slot = match bond {
            Bond::Request => self.request_slots.get(&request).copied(),
            Bond::Detached => None,
        };
        // Refusals: the task ends at once, buffers handed back.
        let refuse = if n == 0 {
            Some(TaskState::Failed(FailReason::Invalid(
                "task has no blocks".into(),
            )))
        } else if route.is_empty() {
            Some(TaskState::Failed(FailReason::Invalid(
                "task has an empty route".into(),
            )))
        } else if let Some(b) = route.iter().find(|b| b.0 as usize >= self.backends.len()) {
            Some(TaskState::Failed(FailReason::Invalid(format!(
                "{b} is not registered"
            ))))
        } else if bond == Bond::Detached && blocks.iter().any(|b| b.engine.is_some()) {
            Some(TaskState::Failed(FailReason::Invalid(
                "a detached task names no engine block".into(),
            )))
        } else if req_slot
            .and_then(|rs| self.requests.get(rs))
            .is_some_and(|r| r.finished)
        {
            Some(TaskState::Failed(FailReason::RequestFinished))
        } else if let Some(b) = route.iter().find(|b| self.over_budget(**b)) {
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
            span.in_scope(|| debug!(?state, "task refused"));
            if state == TaskState::TimedOut {
                self.timed_out += 1;
            }
            for (report, b) in reports.iter_mut().zip(blocks) {
                report.result = Err(err.clone());
                report.buf = Some(b.buf);
            }
            self.events.push_back(Event::TaskFinished(TaskReport {
                task: id,
                request,
                dir,
                state,
                blocks: reports,
                engine_blocks_held: false,
                finished_at: now,
            }));
            return;
        }
        let engine_blocks = EngineSet::of(&blocks);
        let slot = self.tasks.next_slot();
        let first = self.holders.register(&engine_blocks, Holder::Task(slot));
        let req_slot = match (req_slot, bond) {
            (Some(rs), _) => rs,
            (None, Bond::Request) => self.request_slot(request),
            // In no request's list: its `prev`, `next` and request slot stay NIL.
            (None, Bond::Detached) => NIL,
        };
        span.in_scope(|| debug!(?deadline, deferred, first, "task submitted"));
        let phase = match (first, deferred) {
            (false, _) => Phase::Blocked,
            (true, true) => Phase::Deferred,
            (true, false) => Phase::Finishing, // start_stage below sets InFlight
        };
        self.tasks.insert(TaskEntry {
            id,
            request,
            req_slot,
            prev: NIL,
            next: NIL,
            dir,
            route,
            stage: 0,
            deadline,
            phase,
            deferred,
            waiting: blocks,
            waiting_at: Positions::Leading(n),
            in_op_at: Positions::Leading(0),
            reports,
            engine_blocks,
            span,
        });
        self.task_slots.insert(id, slot);
        self.link_task(slot);
        self.deadlines.push(now, (deadline, id, slot));
        match phase {
            Phase::Blocked => {
                self.blocked.push((slot, id));
                // Whatever is ahead of us must not wait for a step that may never come.
                self.flush_ahead(slot);
            }
            Phase::Deferred => self.deferred.push((slot, id)),
            _ => self.start_stage(slot),
        }
    }

    pub(super) fn over_budget(&self, b: BackendId) -> bool {
        let s = &self.backends[b.0 as usize];
        s.zombie_ops >= self.cfg.zombie_budget_ops || s.zombie_bytes >= self.cfg.zombie_budget_bytes
    }

    /// Hand the waiting blocks of the task in `slot` to the backend of its current stage.
    pub(super) fn start_stage(&mut self, slot: u32) {
        let Some(t) = self.tasks.get_mut(slot) else {
            return;
        };
        let backend = t.route[t.stage];
        let blocks = std::mem::take(&mut t.waiting);
        t.in_op_at = std::mem::replace(&mut t.waiting_at, Positions::Leading(0));
        let op_slot = self.ops.next_slot();
        self.ops_issued += 1;
        let issued = u64::from(self.ops_issued as u32);
        let op_id = OpId((issued << OP_SLOT_BITS) | u64::from(op_slot));
        t.phase = Phase::InFlight(op_slot);
        let op = Op {
            id: op_id,
            task: t.id,
            request: t.request,
            dir: t.dir,
            deadline: t.deadline,
            blocks,
        };
        self.ops.insert(OpEntry {
            id: op_id,
            task: t.id,
            task_slot: slot,
            request: t.request,
            req_slot: t.req_slot,
            backend,
            zombie: false,
            deadline: t.deadline,
            bytes: op.buffer_bytes(),
            engine_blocks: EngineSet::default(),
        });
        self.commands
            .push_back(BackendCommand::Submit { backend, op });
    }

    /// Submit every deferred task now (call at the start of each engine step).
    pub fn start_step(&mut self) {
        let mut deferred = std::mem::take(&mut self.deferred);
        for &(slot, id) in &deferred {
            if let Some(t) = self.tasks.get_mut(slot).filter(|t| t.id == id) {
                t.deferred = false;
                if t.phase == Phase::Deferred {
                    self.start_stage(slot);
                }
            }
        }
        deferred.clear();
        // Keep the vector (and anything deferred meanwhile, though nothing is).
        deferred.append(&mut self.deferred);
        self.deferred = deferred;
    }

    /// End every task whose deadline is at or before `now` as `TimedOut`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut due = std::mem::take(&mut self.due);
        self.deadlines.drain_due(now, &mut due);
        // Earliest first, so verdicts come out in deadline order.
        due.sort_unstable();
        for e in due.drain(..) {
            if deadline_is_live(&self.tasks, &e) {
                self.terminate(e.2, TaskState::TimedOut, now);
            }
        }
        self.due = due;
        let tasks = &self.tasks;
        self.deadlines
            .compact(tasks.len(), |e| deadline_is_live(tasks, e));
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
        let op_slot = op.id.0 as u32;
        let entry = match self.ops.get(op_slot) {
            Some(e) if e.id == op.id => self.ops.remove(op_slot),
            _ => None,
        };
        let Some(entry) = entry else {
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
                self.holders
                    .remove(&entry.engine_blocks, Holder::Op(op_slot));
                if let Some(r) = self
                    .requests
                    .get_mut(entry.req_slot)
                    .filter(|r| r.id == entry.request)
                {
                    r.zombies.retain(|z| *z != op_slot);
                    self.maybe_release(entry.req_slot);
                }
                self.recheck_blocked();
            }
            return; // `op` drops here: its buffers go back to their pools.
        }
        let slot = entry.task_slot;
        let Some(t) = self.tasks.get_mut(slot).filter(|t| t.id == entry.task) else {
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
        let at = std::mem::replace(&mut t.in_op_at, Positions::Leading(0));
        let more_stages = t.stage + 1 < t.route.len();
        if results.iter().all(Result::is_ok) {
            if more_stages && !op.blocks.is_empty() {
                t.stage += 1;
                t.waiting = op.blocks;
                t.waiting_at = at;
                self.start_stage(slot);
                return;
            }
            let mut blocks = op.blocks;
            if blocks.len() == 1 {
                // The common one-block op: no iterator to set up and drop.
                if let Some(blk) = blocks.pop() {
                    t.reports[at.at(0)].buf = Some(blk.buf);
                }
            } else {
                for (i, blk) in blocks.into_iter().enumerate() {
                    t.reports[at.at(i)].buf = Some(blk.buf);
                }
            }
        } else {
            let (mut ok, mut ok_at) = (Vec::new(), Vec::new());
            for (i, (blk, res)) in op.blocks.into_iter().zip(results).enumerate() {
                let pos = at.at(i);
                match res {
                    Ok(()) => {
                        ok.push(blk);
                        ok_at.push(pos);
                    }
                    Err(e) => {
                        let r = &mut t.reports[pos];
                        r.result = Err(e);
                        r.buf = Some(blk.buf);
                    }
                }
            }
            if more_stages && !ok.is_empty() {
                t.stage += 1;
                t.waiting = ok;
                t.waiting_at = Positions::List(ok_at);
                self.start_stage(slot);
                return;
            }
            for (blk, pos) in ok.into_iter().zip(ok_at) {
                t.reports[pos].buf = Some(blk.buf);
            }
        }
        t.phase = Phase::Finishing;
        let state = if t.reports.iter().all(|r| r.result.is_ok()) {
            TaskState::Done
        } else {
            TaskState::Failed(FailReason::Blocks)
        };
        self.terminate(slot, state, now);
    }

    /// End the live task in `slot` in `state`; its outstanding op, if any, becomes a zombie.
    pub(super) fn terminate(&mut self, slot: u32, state: TaskState, now: Instant) {
        self.unlink_task(slot);
        // Worked on where it lies in the slab (a task entry is large), freed at the end.
        let Some(t) = self.tasks.get_mut(slot) else {
            return;
        };
        self.task_slots.remove(t.id);
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
        if let Phase::InFlight(op_slot) = t.phase {
            if let Some(e) = self.ops.get_mut(op_slot) {
                e.zombie = true;
                let b = &mut self.backends[e.backend.0 as usize];
                b.zombie_ops += 1;
                b.zombie_bytes += e.bytes;
                info!(op = %e.id, bytes = e.bytes, "op quarantined as zombie");
                self.commands.push_back(BackendCommand::Cancel {
                    backend: e.backend,
                    op: e.id,
                });
                if b.touches_engine && !t.engine_blocks.is_empty() {
                    // The op keeps the task's place on its engine blocks until it returns.
                    self.holders
                        .replace(&t.engine_blocks, Holder::Task(slot), Holder::Op(op_slot));
                    e.engine_blocks = std::mem::take(&mut t.engine_blocks);
                    zombie_engine = Some(op_slot);
                }
            }
            // Blocks inside the op: their buffers stay with the op.
            for i in 0..t.in_op_at.len() {
                t.reports[t.in_op_at.at(i)].result = Err(block_err.clone());
            }
        }
        for (i, blk) in std::mem::take(&mut t.waiting).into_iter().enumerate() {
            let r = &mut t.reports[t.waiting_at.at(i)];
            r.result = Err(block_err.clone());
            r.buf = Some(blk.buf);
        }
        drop(_g);
        if zombie_engine.is_none() {
            self.holders.remove(&t.engine_blocks, Holder::Task(slot));
        }
        let (task, request, dir, req_slot) = (t.id, t.request, t.dir, t.req_slot);
        let blocks = std::mem::take(&mut t.reports);
        if t.phase == Phase::Deferred {
            self.deferred.retain(|x| x.0 != slot);
        }
        self.tasks.free(slot);
        if let (Some(op), Some(r)) = (zombie_engine, self.requests.get_mut(req_slot)) {
            r.zombies.push(op);
        }
        self.events.push_back(Event::TaskFinished(TaskReport {
            task,
            request,
            dir,
            state,
            blocks,
            engine_blocks_held: zombie_engine.is_some(),
            finished_at: now,
        }));
        self.maybe_release(req_slot);
        self.recheck_blocked();
        let tasks = &self.tasks;
        self.deadlines
            .compact(tasks.len(), |e| deadline_is_live(tasks, e));
    }

    /// Cancel one task (no-op if it already ended).
    pub fn cancel(&mut self, task: TaskId, now: Instant) {
        if let Some(slot) = self.task_slots.get(task) {
            self.terminate(slot, TaskState::Cancelled, now);
        }
    }
}
