//! Store jobs: engine blocks copied into host-tier buffers (deferred to the next step), and the
//! host part's verdict.

use kvx_core::{BlockError, BlockKey, Buf, Direction, OpBlock, RequestId, TaskReport, TaskSpec};
use rustc_hash::FxHashSet;

use super::{Role, WorkerSide};
use crate::error::OffloadError;
use crate::meta::{JobId, JobPart, JobResult, StoreJob};

/// A store in flight (its host part, then its write-through).
pub(super) struct StoreState {
    pub(super) request: RequestId,
    write_file: FxHashSet<BlockKey>,
    /// Blocks that failed before their task ran (no buffer), reported with the task's result.
    host_failed: Vec<(BlockKey, BlockError)>,
    /// Write-through blocks that failed before the file task ran.
    pub(super) file_failed: Vec<(BlockKey, BlockError)>,
}

impl StoreState {
    /// A store with no host part: a write-back of host-tier blocks (`failed` had no buffer).
    pub(super) fn file_only(request: RequestId, failed: Vec<(BlockKey, BlockError)>) -> Self {
        StoreState {
            request,
            write_file: FxHashSet::default(),
            host_failed: Vec::new(),
            file_failed: failed,
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
        let file_failed: Vec<(BlockKey, BlockError)> = failed
            .iter()
            .filter(|(k, _)| write_file.contains(k))
            .cloned()
            .collect();
        if blocks.is_empty() {
            // One result per part, as the scheduler expects.
            self.report_store(job.job, job.request, JobPart::StoreHost, Vec::new(), failed);
            if !write_file.is_empty() {
                self.report_store(
                    job.job,
                    job.request,
                    JobPart::StoreFile,
                    Vec::new(),
                    file_failed,
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
                host_failed: failed,
                file_failed,
            },
        );
        Ok(())
    }

    /// The host part of a store ended: stored blocks enter the host tier, the new ones are
    /// written through to the file tier.
    pub(super) fn on_store_report(&mut self, job: JobId, r: TaskReport) {
        let Some(st) = self.stores.get_mut(&job) else {
            return;
        };
        let request = st.request;
        let mut ok = Vec::new();
        let mut failed = std::mem::take(&mut st.host_failed);
        let mut to_file = Vec::new();
        for b in r.blocks {
            match (b.result, b.buf) {
                (Ok(()), Some(buf)) => {
                    let arc = buf.into_shared();
                    if st.write_file.contains(&b.key) {
                        to_file.push((b.key, arc.clone()));
                    }
                    self.host.insert(b.key, arc);
                    ok.push(b.key);
                }
                (res, _) => {
                    let e = res.err().unwrap_or(BlockError::Invalid("no buffer".into()));
                    if st.write_file.contains(&b.key) {
                        st.file_failed.push((b.key, e.clone()));
                    }
                    failed.push((b.key, e));
                }
            }
        }
        let expect_file = !st.write_file.is_empty();
        self.report_store(job, request, JobPart::StoreHost, ok, failed);
        if expect_file {
            self.write_through(job, request, to_file);
        } else {
            self.stores.remove(&job);
        }
    }

    /// One part of a store ended.
    pub(super) fn report_store(
        &mut self,
        job: JobId,
        request: RequestId,
        part: JobPart,
        ok: Vec<BlockKey>,
        failed: Vec<(BlockKey, BlockError)>,
    ) {
        let tier = if part == JobPart::StoreFile {
            "file"
        } else {
            "host"
        };
        let (n_ok, n_failed) = (ok.len() as u64, failed.len() as u64);
        let bytes = n_ok * self.cfg.block_bytes as u64;
        kvx_core::metrics::record_tier_job(tier, Direction::Store, n_ok, n_failed, bytes, None);
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
