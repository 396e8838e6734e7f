//! A GPU engine's exports: a finished request's blocks are copied out of device memory into
//! pinned host buffers, and the server serves readers from those. The engine's blocks are free
//! once the copy is done (the request is reported in `finished_sending` then, not at the end of
//! its lease); the buffers go back when the lease ends (all readers done, expiry or abort).

use kvx_core::{Buf, BufferPool, Direction, EngineBlockId, OpBlock, PoolBuf, RequestId};
use kvx_core::{TaskId, TaskReport, TaskSpec};
use rustc_hash::FxHashMap;
use tracing::warn;

use super::WorkerSide;
use crate::meta::ExportJob;

/// Exports of a GPU engine in flight: copies out of the device, and leases on their buffers.
pub(crate) struct Staging {
    /// Pinned host buffers (`remote.export_blocks` of them); the exporter serves their memory.
    pool: BufferPool,
    /// Copies out of engine memory in flight, by task.
    copies: FxHashMap<TaskId, ExportJob>,
    /// Exports whose lease has not ended, by export id, with the buffers they are read from.
    held: FxHashMap<u64, Vec<PoolBuf>>,
}

impl Staging {
    /// Exports staged in buffers of `pool` (the exporter must serve `pool.layout()`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn new(pool: BufferPool) -> Staging {
        Staging {
            pool,
            copies: FxHashMap::default(),
            held: FxHashMap::default(),
        }
    }

    /// Copies in flight and exports whose lease has not ended.
    pub(super) fn in_flight(&self) -> usize {
        self.copies.len() + self.held.len()
    }

    /// An export's lease ended: its buffers go back to the pool.
    pub(super) fn released(&mut self, export: u64) {
        self.held.remove(&export);
    }

    /// A reset: the copies in flight are dropped with their tasks; returns the exports whose
    /// lease must end now.
    pub(super) fn reset(&mut self) -> Vec<u64> {
        self.copies.clear();
        self.held.keys().copied().collect()
    }
}

/// Tell readers of `job`'s export that it will not come (see `Exporter::refuse`).
fn refuse(remote: Option<&super::RemotePart>, job: &ExportJob) {
    if let Some(exporter) = remote.and_then(|r| r.exporter.as_ref()) {
        exporter.refuse(RequestId(job.export));
    }
}

impl WorkerSide {
    /// Stage `job`: copy its blocks out of engine memory into buffers of the staging pool, at
    /// once (the export starts when the copy is done, [`WorkerSide::on_staged`]). Too few free
    /// buffers, or a copy the driver refuses: the export is refused, and its readers hear so at
    /// once (they compute the prompt themselves).
    ///
    /// Not deferred like a store: the request finished in an earlier step, so the kernels that
    /// wrote its blocks are done before this step started (`EngineMemory::cuda`'s ordering).
    pub(super) fn stage_export(&mut self, job: ExportJob) {
        let Some(staging) = self.remote.as_mut().and_then(|r| r.staging.as_mut()) else {
            return;
        };
        let (free, capacity) = (staging.pool.available(), staging.pool.capacity());
        let taken: Option<Vec<_>> = if free < job.blocks.len() {
            None
        } else {
            job.blocks
                .iter()
                .map(|(key, engine)| {
                    Some(OpBlock {
                        key: *key,
                        engine: Some(*engine),
                        buf: Buf::Owned(staging.pool.take()?),
                    })
                })
                .collect()
        };
        let Some(blocks) = taken else {
            refuse(self.remote.as_ref(), &job);
            warn!(
                request = %job.request,
                export = job.export,
                blocks = job.blocks.len(),
                free,
                capacity,
                "kvx: export refused: too few free staging buffers (remote.export_blocks)"
            );
            return;
        };
        let submitted = self.driver.submit(TaskSpec {
            request: job.request,
            dir: Direction::Store,
            route: vec![self.routes.engine],
            blocks,
            deadline: self.deadline(Direction::Store),
            deferred: false,
        });
        match submitted {
            Ok(task) => {
                if let Some(staging) = self.remote.as_mut().and_then(|r| r.staging.as_mut()) {
                    staging.copies.insert(task, job);
                }
            }
            Err(e) => {
                refuse(self.remote.as_ref(), &job);
                warn!(request = %job.request, export = job.export, error = %e, "kvx: export refused: its copy out of engine memory was not submitted");
            }
        }
    }

    /// Whether `task` is the copy of a staged export.
    pub(super) fn is_staging_copy(&self, task: TaskId) -> bool {
        self.remote
            .as_ref()
            .and_then(|r| r.staging.as_ref())
            .is_some_and(|s| s.copies.contains_key(&task))
    }

    /// A staged export's copy ended: every block copied, its lease starts on the buffers;
    /// otherwise the export is refused and the buffers go back.
    pub(super) fn on_staged(&mut self, r: TaskReport) {
        let Some(remote) = self.remote.as_mut() else {
            return;
        };
        let Some(job) = remote
            .staging
            .as_mut()
            .and_then(|s| s.copies.remove(&r.task))
        else {
            return;
        };
        let (Some(staging), Some(exporter)) = (remote.staging.as_mut(), &remote.exporter) else {
            return;
        };
        if !r.is_ok() {
            exporter.refuse(RequestId(job.export));
            let error = r.blocks.iter().find_map(|b| b.result.clone().err());
            warn!(request = %job.request, export = job.export, state = ?r.state, ?error, "kvx: export refused: its copy out of engine memory failed");
            return;
        }
        let mut bufs = Vec::with_capacity(r.blocks.len());
        let mut blocks = Vec::with_capacity(r.blocks.len());
        for b in r.blocks {
            let Some(Buf::Owned(buf)) = b.buf else {
                exporter.refuse(RequestId(job.export));
                warn!(request = %job.request, export = job.export, "kvx: export refused: a staging buffer did not come back with its copy");
                return;
            };
            blocks.push((b.key, EngineBlockId(buf.index() as u32)));
            bufs.push(buf);
        }
        if super::remote::start_lease(exporter, &job, &blocks, &remote.lease) {
            staging.held.insert(job.export, bufs);
        }
    }
}
