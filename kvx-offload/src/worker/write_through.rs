//! Write-through: blocks just stored in the host tier are written to the file tier as a task
//! of an internal request that never touches engine memory. Write-back (a shared mount) writes
//! blocks the same way as they leave the host tier.

use std::sync::Arc;

use kvx_core::{
    BlockError, BlockKey, Buf, Direction, OpBlock, PoolBuf, RequestId, TaskReport, TaskSpec,
};
use tracing::warn;

use super::Role;
use super::WorkerSide;
use super::store::StoreState;
use crate::meta::{JobId, JobPart, WriteBackJob};

/// Internal request ids (file write-through) live at the top of the id space.
pub(super) const INTERNAL_BASE: u64 = 1 << 62;

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
                let mut failed = self
                    .stores
                    .remove(&job)
                    .map(|s| s.file_failed)
                    .unwrap_or_default();
                if route.is_none() {
                    failed.extend(
                        blocks
                            .into_iter()
                            .map(|(k, _)| (k, BlockError::Unavailable("no file tier".into()))),
                    );
                }
                self.report_store(job, request, JobPart::StoreFile, Vec::new(), failed);
                return;
            }
        };
        let internal = RequestId(self.next_internal);
        self.next_internal += 1;
        let keys: Vec<BlockKey> = blocks.iter().map(|b| b.0).collect();
        let spec = TaskSpec {
            request: internal,
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
        match self.driver.submit(spec) {
            Ok(task) => {
                self.tasks.insert(task, (job, Role::StoreFile, Vec::new()));
                if self.driver.finish(internal).is_ok() {
                    self.internal.insert(internal);
                }
            }
            Err(e) => {
                warn!(error = %e, "write-through not submitted");
                let mut failed = self
                    .stores
                    .remove(&job)
                    .map(|s| s.file_failed)
                    .unwrap_or_default();
                failed.extend(
                    keys.into_iter()
                        .map(|k| (k, BlockError::Unavailable(e.to_string()))),
                );
                self.report_store(job, request, JobPart::StoreFile, Vec::new(), failed);
            }
        }
    }

    /// Write host-tier blocks into the file tier (they are about to leave the host tier; the
    /// write holds their buffers until it ends). A key the host tier lacks fails.
    pub(super) fn write_back(&mut self, job: WriteBackJob) {
        let request = RequestId(self.next_internal);
        let mut blocks = Vec::with_capacity(job.keys.len());
        let mut failed = Vec::new();
        for key in job.keys {
            match self.host.get(&key) {
                Some(buf) => blocks.push((key, buf)),
                None => failed.push((key, BlockError::Invalid("not in the host tier".into()))),
            }
        }
        self.stores
            .insert(job.job, StoreState::file_only(request, failed));
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
        self.report_store(job, st.request, JobPart::StoreFile, ok, failed);
    }
}
