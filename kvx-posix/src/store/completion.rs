//! Completions: finished jobs folded into their ops (visibility of late stores, the index,
//! counters, breakers), and finished ops handed to the tracker.

use std::sync::atomic::Ordering;
use std::time::Instant;

use kvx_core::{BlockError, OpCompletion, OpId, WaitOutcome};

use super::PosixStore;
use crate::job::{BlockJob, FileOp};

impl PosixStore {
    /// [`Backend::poll`]: fold in what the engine finished, hand out the finished ops.
    pub(super) fn take_completions(&mut self, out: &mut Vec<OpCompletion>) {
        self.absorb_finished();
        out.append(&mut self.ready);
    }

    /// Fold in every job the engine finished so far.
    fn absorb_finished(&mut self) {
        let mut jobs = Vec::new();
        self.state.board.drain(&mut jobs);
        if !jobs.is_empty() {
            self.absorb(jobs);
        }
    }

    /// [`Backend::wait`]: fold in finished jobs until `ops` are done or `until` passes.
    pub(super) fn wait_for(&mut self, ops: &[OpId], until: Instant) -> WaitOutcome {
        loop {
            self.absorb_finished();
            if ops.iter().all(|o| !self.ops.contains_key(o)) {
                return WaitOutcome::Completed;
            }
            let now = Instant::now();
            if now >= until {
                return WaitOutcome::TimedOut;
            }
            let jobs = self.state.board.take_or_wait(until - now);
            self.absorb(jobs);
        }
    }

    /// Fold finished jobs into their ops; finished ops go to `ready`.
    fn absorb(&mut self, jobs: Vec<Box<BlockJob>>) {
        let now = Instant::now();
        for mut job in jobs {
            if job.action() == FileOp::Probe {
                if let Some(t) = &self.state.probes {
                    t.answered(job.core.key, &job.core.result, now, &self.state.health);
                }
                continue;
            }
            self.state.give_back_spare(&mut job);
            if let (Some(r), Some(spares)) = (&mut self.recycling, &self.state.spares) {
                r.job_returned(&mut job, spares, &self.state.counters.recycled);
            }
            if job.action() == FileOp::Remove {
                if job.nonce().is_none() {
                    self.state.key_order.remove_ended(job.core.key);
                }
                if let Err(e) = &job.core.result {
                    tracing::warn!(key = %job.core.key, error = %e, "posix: remove failed");
                }
                continue;
            }
            let Some(st) = self.ops.get_mut(&job.core.op) else {
                tracing::error!(op = %job.core.op, "posix: completion of an unknown op");
                continue;
            };
            if job.made_dirs() {
                self.dirs
                    .insert((job.core.root, Self::prefix(job.core.key)));
            }
            let key = job.core.key;
            let mut ticket = st
                .slots
                .get_mut(job.core.index)
                .and_then(|s| s.ticket.take());
            let order = &self.state.key_order;
            // Into the index, unless a remove of the key overtook the job (see `key_order`).
            let mut index_unless_overtaken = || match ticket.take() {
                Some(t) => order.job_ended(key, t, Some(&self.state.index)),
                None => true,
            };
            let mut result = std::mem::replace(&mut job.core.result, Ok(()));
            if job.action() == FileOp::Load && result.is_ok() {
                result = job.check_payload();
            }
            let c = &self.state.counters;
            match (job.action(), &result) {
                (FileOp::Store, Ok(())) => {
                    let cancelled = st.cancel.load(Ordering::Acquire);
                    if cancelled || now + self.cfg.visibility_margin >= st.op.deadline {
                        // The tracker may already have ended the task: never leave it visible.
                        result = Err(if cancelled {
                            BlockError::Cancelled
                        } else {
                            BlockError::TimedOut
                        });
                        c.undone.fetch_add(1, Ordering::Relaxed);
                        self.state.remove_own(key, job.nonce());
                    } else if index_unless_overtaken() {
                        // The remove may have run after the rename (the file is gone) or
                        // before it (the file must go): the block is not stored either way.
                        result = Err(BlockError::Unavailable(
                            "a remove of this block overtook its store".into(),
                        ));
                        self.state.remove_own(key, job.nonce());
                    } else {
                        c.stored.fetch_add(1, Ordering::Relaxed);
                    }
                }
                (FileOp::Load, Ok(())) => {
                    index_unless_overtaken();
                    if let Some(t) = &self.state.touch {
                        t.touch(&job.block_path(), crate::shared_mount::touch::Stamp::Now);
                    }
                    if st.cancel.load(Ordering::Acquire) {
                        result = Err(BlockError::Cancelled);
                    } else if now >= st.op.deadline {
                        // The read finished, but after the deadline: not in time.
                        result = Err(BlockError::TimedOut);
                    } else {
                        c.loaded.fetch_add(1, Ordering::Relaxed);
                    }
                }
                (FileOp::Load, Err(BlockError::NotFound)) => {
                    self.state.index.remove(job.core.key);
                    if let Some(t) = &self.state.probes {
                        t.forget(job.core.key);
                    }
                }
                (FileOp::Load, Err(BlockError::Corrupt(m))) => {
                    tracing::warn!(key = %job.core.key, error = %m, "posix: corrupt block");
                    c.corrupt.fetch_add(1, Ordering::Relaxed);
                    self.state.index.remove(job.core.key);
                    if let Some(t) = &self.state.probes {
                        t.forget(job.core.key);
                    }
                }
                (FileOp::Store, Err(BlockError::TimedOut | BlockError::Cancelled))
                    if job.undone() =>
                {
                    c.undone.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
            if let Some(t) = ticket {
                order.job_ended(key, t, None);
            }
            let Some(slot) = st.slots.get_mut(job.core.index) else {
                continue;
            };
            slot.buf = job.core.buf.take();
            slot.result = Some(result);
            st.pending -= 1;
            if st.pending == 0 {
                let id = job.core.op;
                self.finish(id, now);
            }
        }
    }

    /// Report an op's health to its roots' breakers (once), then queue its completion.
    pub(super) fn finish(&mut self, id: OpId, now: Instant) {
        let Some(mut st) = self.ops.remove(&id) else {
            return;
        };
        if !st.health_recorded {
            let late = now >= st.op.deadline;
            for &root in &st.roots {
                let mut failed = late;
                let mut only_cancelled = true;
                // A block failed before any I/O (a remove of it in flight, a full queue) says
                // nothing about the root.
                for s in st.slots.iter().filter(|s| s.root == root && s.did_io) {
                    match &s.result {
                        Some(Err(BlockError::Io(_) | BlockError::TimedOut)) => failed = true,
                        Some(Err(BlockError::Cancelled)) => {}
                        _ => only_cancelled = false,
                    }
                }
                if failed {
                    self.state.health.failure(root, now);
                } else if !only_cancelled {
                    self.state.health.success(
                        root,
                        now,
                        now.saturating_duration_since(st.submitted),
                    );
                }
            }
        }
        let mut results = Vec::with_capacity(st.slots.len());
        let mut blocks = Vec::with_capacity(st.slots.len());
        for s in st.slots.drain(..) {
            let Some(buf) = s.buf else {
                // Unreachable by construction: every slot gets its buffer back before pending
                // reaches zero. Dropping the block would lose a buffer, so keep going loudly.
                tracing::error!(op = %id, key = %s.key, "posix: block finished without its buffer");
                continue;
            };
            results.push(s.result.unwrap_or(Err(BlockError::Io("no result".into()))));
            blocks.push(kvx_core::OpBlock {
                key: s.key,
                engine: s.engine_block,
                buf,
            });
        }
        st.op.blocks = blocks;
        self.ready.push(OpCompletion { op: st.op, results });
    }
}
