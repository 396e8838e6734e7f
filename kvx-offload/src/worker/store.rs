//! Store jobs: engine blocks copied into pool buffers (deferred to the next step), kept in the
//! host tier (those it had room for) and written through to the file tier, and the host
//! part's verdict. A block that ends stored in no tier is counted in the worker's
//! [`StoreSkips`](crate::StoreSkips) by the kind of its last failure.

use kvx_core::{BlockError, BlockKey, Buf, Direction, OpBlock, RequestId, TaskReport, TaskSpec};
use rustc_hash::FxHashSet;

use super::{Role, WorkerSide};
use crate::error::OffloadError;
use crate::meta::{JobId, JobPart, JobResult, StoreJob};

/// A store in flight (its host part, then its write-through).
pub(super) struct StoreState {
    pub(super) request: RequestId,
    write_file: FxHashSet<BlockKey>,
    /// Blocks (of `write_file`) copied for the file write only, not kept in the host tier.
    file_only: FxHashSet<BlockKey>,
    /// Blocks that failed before their task ran (no buffer), reported with the task's result.
    host_failed: Vec<(BlockKey, BlockError)>,
    /// Write-through blocks that failed before the file task ran.
    pub(super) file_failed: Vec<(BlockKey, BlockError)>,
    /// Blocks this store put in the host tier (or, for a write-back, that are there): a failed
    /// file write of one of them loses nothing.
    pub(super) in_host: FxHashSet<BlockKey>,
}

impl StoreState {
    /// A store with no host part: a write-back of host-tier blocks (`failed` had no buffer).
    pub(super) fn write_back(
        request: RequestId,
        in_host: FxHashSet<BlockKey>,
        failed: Vec<(BlockKey, BlockError)>,
    ) -> Self {
        StoreState {
            request,
            write_file: FxHashSet::default(),
            file_only: FxHashSet::default(),
            host_failed: Vec::new(),
            file_failed: failed,
            in_host,
        }
    }
}

impl WorkerSide {
    /// Queue a store: a deferred task, submitted at the start of the next step.
    pub(super) fn queue_store(&mut self, job: StoreJob) -> Result<(), OffloadError> {
        let mut blocks = Vec::with_capacity(job.blocks.len());
        let mut failed = Vec::new();
        for (key, engine) in &job.blocks {
            match self.pool.take() {
                Some(b) => {
                    blocks.push(OpBlock {
                        key: *key,
                        engine: Some(*engine),
                        buf: Buf::Owned(b),
                    });
                }
                None => failed.push((*key, BlockError::Unavailable("host pool exhausted".into()))),
            }
        }
        let write_file: FxHashSet<BlockKey> = job.write_file.iter().copied().collect();
        let file_only: FxHashSet<BlockKey> = job.file_only.iter().copied().collect();
        let file_failed: Vec<(BlockKey, BlockError)> = failed
            .iter()
            .filter(|(k, _)| write_file.contains(k))
            .cloned()
            .collect();
        // The host part reports only the blocks the host tier was to keep.
        failed.retain(|(k, _)| !file_only.contains(k));
        if blocks.is_empty() {
            // One result per part, as the scheduler expects.
            let none = FxHashSet::default();
            self.report_store(
                job.job,
                job.request,
                JobPart::StoreHost,
                Vec::new(),
                failed,
                &write_file,
            );
            if !write_file.is_empty() {
                self.report_store(
                    job.job,
                    job.request,
                    JobPart::StoreFile,
                    Vec::new(),
                    file_failed,
                    &none,
                );
            }
            return Ok(());
        }
        let task = self.driver.submit(TaskSpec {
            request: job.request,
            dir: Direction::Store,
            route: vec![self.routes.engine],
            blocks,
            deadline: self.deadline(Direction::Store),
            deferred: true,
        })?;
        self.tasks.insert(task, (job.job, Role::StoreHost));
        self.stores.insert(
            job.job,
            StoreState {
                request: job.request,
                write_file,
                file_only,
                host_failed: failed,
                file_failed,
                in_host: FxHashSet::default(),
            },
        );
        Ok(())
    }

    /// The host part of a store ended: stored blocks enter the host tier (those it had room
    /// for), the new ones are written through to the file tier.
    pub(super) fn on_store_report(&mut self, job: JobId, r: TaskReport) {
        let Some(st) = self.stores.get_mut(&job) else {
            return;
        };
        let request = st.request;
        let mut ok = Vec::new();
        let mut failed = std::mem::take(&mut st.host_failed);
        let mut to_file = Vec::new();
        for b in r.blocks {
            let file_only = st.file_only.contains(&b.key);
            match (b.result, b.buf) {
                (Ok(()), Some(buf)) => {
                    let arc = buf.into_shared();
                    if st.write_file.contains(&b.key) {
                        to_file.push((b.key, arc.clone()));
                    }
                    if !file_only {
                        self.host.insert(b.key, arc);
                        st.in_host.insert(b.key);
                        ok.push(b.key);
                    }
                }
                (res, _) => {
                    let e = res.err().unwrap_or(BlockError::Invalid("no buffer".into()));
                    if st.write_file.contains(&b.key) {
                        st.file_failed.push((b.key, e.clone()));
                    }
                    if !file_only {
                        failed.push((b.key, e));
                    }
                }
            }
        }
        let expect_file = !st.write_file.is_empty();
        let to_write = std::mem::take(&mut st.write_file);
        self.report_store(job, request, JobPart::StoreHost, ok, failed, &to_write);
        if expect_file {
            self.write_through(job, request, to_file);
        } else {
            self.stores.remove(&job);
        }
    }

    /// One part of a store ended. Its failed blocks not in `elsewhere` (stored, or still to
    /// be stored, in the other tier) are stored in no tier: they are counted as skipped.
    pub(super) fn report_store(
        &mut self,
        job: JobId,
        request: RequestId,
        part: JobPart,
        ok: Vec<BlockKey>,
        failed: Vec<(BlockKey, BlockError)>,
        elsewhere: &FxHashSet<BlockKey>,
    ) {
        for (k, e) in &failed {
            if !elsewhere.contains(k) {
                self.skips.record_failure(e);
                self.stats.skipped(kvx_core::metrics::failure_reason(e), 1);
            }
        }
        let tier = if part == JobPart::StoreFile {
            "file"
        } else {
            "host"
        };
        let (n_ok, n_failed) = (ok.len() as u64, failed.len() as u64);
        let bytes = n_ok * self.cfg.block_bytes as u64;
        kvx_core::metrics::record_tier_job(tier, Direction::Store, n_ok, n_failed, bytes, None);
        let reasons = failed
            .iter()
            .map(|(_, e)| kvx_core::metrics::failure_reason(e));
        self.stats
            .record(Direction::Store, tier, n_ok, reasons, bytes);
        self.out.jobs.push(JobResult {
            job,
            request,
            part,
            ok,
            failed,
            promoted: Vec::new(),
        });
    }
}
