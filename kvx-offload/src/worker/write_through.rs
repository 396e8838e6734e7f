//! Write-through: blocks just stored in the host tier are written to the file tier as a
//! detached task (`DriverHandle::submit_detached`): it names no engine block, so the request's
//! preemption and release never wait for it. Write-back (a shared mount) writes blocks the same
//! way as they leave the host tier.

use std::sync::Arc;

use kvx_core::{
    BlockError, BlockKey, Buf, Direction, OpBlock, PoolBuf, RequestId, TaskReport, TaskSpec,
};
use rustc_hash::FxHashSet;
use tracing::warn;

use super::Role;
use super::WorkerSide;
use super::store::StoreState;
use crate::meta::{JobId, JobPart, NO_REQUEST, WriteBackJob};

impl WorkerSide {
    /// Write stored host blocks through to the file tier. Blocks that failed earlier are
    /// reported with it.
    pub(super) fn write_through(
        &mut self,
        job: JobId,
        request: RequestId,
        blocks: Vec<(BlockKey, Arc<PoolBuf>)>,
    ) {
        let file = match (self.routes.file, blocks.is_empty()) {
            (Some(f), false) => f,
            (route, _) => {
                let keys = blocks
                    .into_iter()
                    .map(|(k, _)| k)
                    .filter(|_| route.is_none());
                self.file_part_failed(job, request, keys, "no file tier");
                return;
            }
        };
        let keys: Vec<BlockKey> = blocks.iter().map(|b| b.0).collect();
        let spec = TaskSpec {
            request,
            dir: Direction::Store,
            route: vec![file],
            blocks: blocks
                .into_iter()
                .map(|(key, buf)| OpBlock {
                    key,
                    engine: None,
                    buf: Buf::Shared(buf),
                })
                .collect(),
            deadline: self.deadline(Direction::Store),
            deferred: false,
        };
        match self.driver.submit_detached(spec) {
            Ok(task) => {
                self.tasks.insert(task, (job, Role::StoreFile));
            }
            Err(e) => {
                warn!(error = %e, "write-through not submitted");
                self.file_part_failed(job, request, keys, &e.to_string());
            }
        }
    }

    /// The file part of store `job` ends without a write: `keys` fail (`Unavailable`, for
    /// `why`), reported with the blocks that failed before it.
    fn file_part_failed(
        &mut self,
        job: JobId,
        request: RequestId,
        keys: impl IntoIterator<Item = BlockKey>,
        why: &str,
    ) {
        let (mut failed, in_host): (_, FxHashSet<BlockKey>) = self
            .stores
            .remove(&job)
            .map(|s| (s.file_failed, s.in_host))
            .unwrap_or_default();
        failed.extend(
            keys.into_iter()
                .map(|k| (k, BlockError::Unavailable(why.to_string()))),
        );
        self.report_store(
            job,
            request,
            JobPart::StoreFile,
            Vec::new(),
            failed,
            &in_host,
        );
    }

    /// Write host-tier blocks into the file tier (they are about to leave the host tier; the
    /// write holds their buffers until it ends). A key the host tier lacks fails. A write-back
    /// serves no request: its task and its result name [`NO_REQUEST`].
    pub(super) fn write_back(&mut self, job: WriteBackJob) {
        let request = NO_REQUEST;
        let mut blocks = Vec::with_capacity(job.keys.len());
        let mut failed = Vec::new();
        for key in job.keys {
            match self.host.get(&key) {
                Some(buf) => blocks.push((key, buf)),
                None => failed.push((key, BlockError::Invalid("not in the host tier".into()))),
            }
        }
        // The host tier drops these blocks once written back: a failed write loses them.
        let in_host = FxHashSet::default();
        self.stores
            .insert(job.job, StoreState::write_back(request, in_host, failed));
        self.write_through(job.job, request, blocks);
    }

    /// The write-through of a store ended.
    pub(super) fn on_write_through_report(&mut self, job: JobId, r: TaskReport) {
        let Some(st) = self.stores.remove(&job) else {
            return;
        };
        let mut ok = Vec::new();
        let mut failed = st.file_failed;
        for b in r.blocks {
            match b.result {
                Ok(()) => ok.push(b.key),
                Err(e) => failed.push((b.key, e)),
            }
        }
        self.report_store(job, st.request, JobPart::StoreFile, ok, failed, &st.in_host);
    }
}
