//! Submitting an op: admission (stuck I/Os, queue room, breakers), then one job per block
//! handed to the I/O engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvx_core::{BlockError, BlockKey, Buf, Direction, Op, SubmitError, SubmitErrorKind};
use kvx_policy::Admission;
use rustc_hash::FxHashMap;

use super::{BlockSlot, OpState, PosixStore};
use crate::config::IoEngine;
use crate::job::{BlockJob, FileOp, JobParams};

impl PosixStore {
    /// [`Backend::submit`]: refuse the op whole, or take it and start a job per admitted block.
    pub(super) fn submit_op(&mut self, mut op: Op) -> Result<(), SubmitError> {
        let io_engine = &self.state.io_engine;
        let stuck = io_engine.snapshot().written_off;
        if stuck >= self.cfg.max_stuck {
            return Err(SubmitError {
                op,
                kind: SubmitErrorKind::Busy(format!(
                    "busy: {} ({} engine): {stuck} I/Os stuck in the kernel (limit {})",
                    self.name,
                    io_engine.name(),
                    self.cfg.max_stuck
                )),
            });
        }
        let room = io_engine.room();
        if op.blocks.len() > room {
            return Err(SubmitError {
                kind: SubmitErrorKind::Busy(format!(
                    "busy: {} ({} engine): job queue full ({} blocks, room for {room}, max_queued {})",
                    self.name,
                    io_engine.name(),
                    op.blocks.len(),
                    self.cfg.max_queued
                )),
                op,
            });
        }
        let now = Instant::now();
        let layout = &self.state.layout;
        let mut admission: FxHashMap<usize, Admission> = FxHashMap::default();
        for b in &op.blocks {
            let root = layout.root_of(b.key);
            admission
                .entry(root)
                .or_insert_with(|| self.state.health.admit(root, now));
        }
        if !op.blocks.is_empty() && admission.values().all(|a| *a == Admission::Rejected) {
            self.state
                .counters
                .rejected
                .fetch_add(op.blocks.len() as u64, Ordering::Relaxed);
            let roots: Vec<String> = admission
                .keys()
                .map(|r| layout.roots()[*r].display().to_string())
                .collect();
            return Err(SubmitError {
                op,
                kind: SubmitErrorKind::Unavailable(format!("breaker open on {}", roots.join(", "))),
            });
        }
        let cancel = Arc::new(AtomicBool::new(false));
        let blocks = std::mem::take(&mut op.blocks);
        let mut slots = Vec::with_capacity(blocks.len());
        let mut jobs = Vec::new();
        for (i, b) in blocks.into_iter().enumerate() {
            let root = layout.root_of(b.key);
            let mut slot = BlockSlot {
                key: b.key,
                engine_block: b.engine,
                root,
                buf: None,
                result: None,
                ticket: None,
                did_io: false,
            };
            let refuse = if admission.get(&root) == Some(&Admission::Rejected) {
                self.state.counters.rejected.fetch_add(1, Ordering::Relaxed);
                Some(BlockError::Unavailable(format!(
                    "breaker open on {}",
                    layout.roots()[root].display()
                )))
            } else if op.dir == Direction::Load && matches!(b.buf, Buf::Shared(_)) {
                Some(BlockError::Invalid(
                    "a load needs an owned destination buffer".into(),
                ))
            } else {
                let order = &self.state.key_order;
                match op.dir {
                    Direction::Load => {
                        slot.ticket = Some(order.load_started(b.key));
                        None
                    }
                    Direction::Store => match order.store_started(b.key) {
                        Some(t) => {
                            slot.ticket = Some(t);
                            None
                        }
                        None => Some(BlockError::Unavailable(
                            "a remove of this block is still in flight".into(),
                        )),
                    },
                }
            };
            if let Some(e) = refuse {
                slot.buf = Some(b.buf);
                slot.result = Some(Err(e));
                slots.push(slot);
                continue;
            }
            let action = match op.dir {
                Direction::Load => FileOp::Load,
                Direction::Store => FileOp::Store,
            };
            let params = self.params(root, b.key, op.dir, op.deadline, &cancel);
            let paths = layout.paths(b.key, action == FileOp::Store);
            let mut job = Box::new(BlockJob::new(
                op.id,
                i,
                action,
                b.key,
                Some(b.buf),
                paths,
                params,
            ));
            if let (Some(len), Some(spares)) = (job.store_file_len(), &self.state.spares)
                && let Some(spare) = spares.take(root, len)
            {
                job.use_spare(spare);
            }
            job.compute_payload_crc();
            jobs.push(job);
            slots.push(slot);
        }
        let mut roots: Vec<usize> = admission
            .iter()
            .filter(|(_, a)| **a != Admission::Rejected)
            .map(|(r, _)| *r)
            .collect();
        roots.sort_unstable();
        let id = op.id;
        let mut st = OpState {
            op,
            slots,
            pending: 0,
            cancel,
            submitted: now,
            roots,
            health_recorded: false,
        };
        for job in jobs {
            let index = job.core.index;
            let key = job.core.key;
            match self.state.io_engine.submit(job) {
                Ok(()) => {
                    st.pending += 1;
                    st.slots[index].did_io = true;
                    if let (Some(r), Direction::Load) = (&mut self.recycling, st.op.dir) {
                        r.load_started(key);
                    }
                }
                Err(r) => {
                    let mut job = r.job;
                    if let Some(t) = st.slots[index].ticket.take() {
                        self.state.key_order.job_ended(key, t, None);
                    }
                    self.state.give_back_spare(&mut job);
                    st.slots[index].buf = job.core.buf.take();
                    st.slots[index].result = Some(Err(BlockError::Unavailable(r.reason)));
                }
            }
        }
        let immediate = st.pending == 0;
        self.ops.insert(id, st);
        if immediate {
            self.finish(id, now);
            self.notifier.notify();
        }
        Ok(())
    }

    fn params(
        &self,
        root: usize,
        key: BlockKey,
        dir: Direction,
        deadline: Instant,
        cancel: &Arc<AtomicBool>,
    ) -> JobParams {
        JobParams {
            direct: self.direct.get(root).copied().unwrap_or(false),
            inline: self.inline.get(root).copied().unwrap_or(false),
            crc_off_ring: self.cfg.io_engine == IoEngine::Uring,
            fdatasync: self.cfg.fdatasync,
            make_dirs: dir == Direction::Store && !self.dirs.contains(&(root, Self::prefix(key))),
            deadline,
            cancel: cancel.clone(),
            margin: self.cfg.visibility_margin,
            nonce: (dir == Direction::Store).then(|| self.state.layout.nonce()),
        }
    }
}
