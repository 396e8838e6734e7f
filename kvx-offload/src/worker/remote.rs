//! The worker side's part of the remote tier: exports of finished requests (producer: a lease
//! per request, the blocks the engine's until it ends, or a GPU engine's blocks copied into
//! staging buffers first, `staging.rs`) and loads from remote producers (consumer: read into
//! staging buffers by kvx-rdma's importer, then copied into engine blocks).

use std::time::{Duration, Instant};

use kvx_core::{BackendId, BlockError, Buf, OpBlock, RequestId};
use kvx_policy::LeaseConfig;
use kvx_rdma::{Exporter, ImporterHandle};
use rustc_hash::FxHashMap;
use tracing::warn;

use super::load::{LoadState, LoadedBlock, Source};
use super::{Staging, WorkerSide};
use crate::error::OffloadError;
use crate::meta::{ExportJob, JobId, RemoteLoadJob};

/// Export `blocks` (engine blocks of the exporter's memory) as `job`'s export id and start its
/// lease; false, with a warning, when the exporter refuses (an export under that id already,
/// a block outside its memory): the request is then left to the driver's release alone, and
/// its readers hear at once that there is nothing to read.
pub(super) fn start_lease(
    exporter: &Exporter,
    job: &ExportJob,
    blocks: &[(kvx_core::BlockKey, kvx_core::EngineBlockId)],
    lease: &LeaseConfig,
) -> bool {
    let id = RequestId(job.export);
    match exporter
        .export(id, blocks, lease)
        .and_then(|()| exporter.ready(id))
    {
        Ok(()) => true,
        Err(e) => {
            // Not another export's id: that one stays as it is.
            if !matches!(e, kvx_rdma::RdmaError::AlreadyExported(_)) {
                let _ = exporter.abort(id);
                exporter.refuse(id);
            }
            warn!(request = %job.request, export = job.export, error = %e, "kvx: export refused");
            false
        }
    }
}

/// The remote tier on one worker: what the builder set up, and what is in flight.
pub(crate) struct RemotePart {
    /// The producer's exporter (its server lives in the runtime); `None` on a consumer only.
    pub(crate) exporter: Option<Exporter>,
    /// The consumer's importer and its backend in the driver.
    pub(crate) importer: ImporterHandle,
    pub(crate) importer_backend: BackendId,
    /// This worker's rank: it reads from the producer rank of the same number.
    pub(crate) rank: u32,
    /// The lease of every export.
    pub(crate) lease: LeaseConfig,
    /// A remote load's deadline.
    pub(crate) load_timeout: Duration,
    /// Exported requests whose lease has not ended, and their export ids.
    pub(crate) exported: FxHashMap<RequestId, u64>,
    pub(crate) by_export: FxHashMap<u64, RequestId>,
    /// Remote loads in flight, with the export id each registered with the importer.
    pub(crate) registered: FxHashMap<JobId, u64>,
    /// A GPU engine's exports, staged in pinned host buffers; `None`: the server reads engine
    /// memory (a host engine's).
    pub(crate) staging: Option<Staging>,
}

impl RemotePart {
    /// A remote part with nothing in flight.
    pub(crate) fn new(
        exporter: Option<Exporter>,
        importer: ImporterHandle,
        importer_backend: BackendId,
        rank: u32,
        lease: LeaseConfig,
        load_timeout: Duration,
        staging: Option<Staging>,
    ) -> RemotePart {
        RemotePart {
            exporter,
            importer,
            importer_backend,
            rank,
            lease,
            load_timeout,
            exported: FxHashMap::default(),
            by_export: FxHashMap::default(),
            registered: FxHashMap::default(),
            staging,
        }
    }
}

impl WorkerSide {
    /// Export a finished request's blocks; its lease starts now (a GPU engine's once its copy
    /// into staging buffers is done, [`WorkerSide::stage_export`]). A request that cannot be
    /// exported (no server here, an id exported twice, a block outside the pool) is left to
    /// the driver's release alone: the engine frees it once its stores are done, and a reader
    /// of it fails.
    pub(super) fn export(&mut self, job: ExportJob) {
        let Some(remote) = self.remote.as_mut() else {
            warn!(request = %job.request, "kvx: an export on a worker without a remote tier");
            return;
        };
        let Some(exporter) = &remote.exporter else {
            warn!(request = %job.request, "kvx: an export on a worker with no remote.listen");
            return;
        };
        if remote.staging.is_some() {
            return self.stage_export(job);
        }
        if start_lease(exporter, &job, &job.blocks, &remote.lease) {
            remote.exported.insert(job.request, job.export);
            remote.by_export.insert(job.export, job.request);
        }
    }

    /// Engine requests whose export was released since the last call (all readers done, the
    /// lease expired, or aborted). Never blocks.
    pub(super) fn released_exports(&mut self) -> Vec<RequestId> {
        let Some(remote) = self.remote.as_mut() else {
            return Vec::new();
        };
        let Some(exporter) = &remote.exporter else {
            return Vec::new();
        };
        let mut out = Vec::new();
        while let Some(r) = exporter.poll_released() {
            if let Some(staging) = remote.staging.as_mut() {
                // The engine heard of the request when its copy was done.
                staging.released(r.request.0);
                continue;
            }
            if let Some(req) = remote.by_export.remove(&r.request.0) {
                remote.exported.remove(&req);
                out.push(req);
            }
        }
        out
    }

    /// True while `req`'s blocks are exported (its lease has not ended).
    pub(super) fn is_exported(&self, req: RequestId) -> bool {
        self.remote
            .as_ref()
            .is_some_and(|r| r.exported.contains_key(&req))
    }

    /// Start a load from a remote producer: register the source's descriptor for this rank
    /// with the importer, then at most [`crate::remote::REMOTE_TASKS`] tasks reading into
    /// staging buffers and copying into the engine's blocks. A block that cannot be read (no
    /// remote tier, a bad source, no buffer) fails at once; the load's verdict comes as any
    /// load's.
    pub(super) fn start_remote_load(&mut self, job: RemoteLoadJob) -> Result<(), OffloadError> {
        let source = job.source.clone();
        let blocks: Vec<LoadedBlock> = job
            .blocks
            .iter()
            .map(|(index, engine)| LoadedBlock {
                key: source
                    .keys
                    .get(*index as usize)
                    .copied()
                    .unwrap_or(kvx_core::BlockKey(0)),
                engine: *engine,
                from: Source::Remote,
                promote: false,
                result: None,
            })
            .collect();
        let mut st = LoadState::new(job.request, blocks);
        let registered = match self.remote.as_mut() {
            None => Err("this worker has no remote tier (no `remote` in its config)".to_string()),
            Some(remote) => source
                .descriptor(remote.rank, self.cfg.block_bytes as u64)
                .map_err(|e| e.to_string())
                .and_then(|d| {
                    remote
                        .importer
                        .register_for(job.request, d)
                        .map_err(|e| e.to_string())
                })
                .map(|()| {
                    remote.registered.insert(job.job, source.export);
                }),
        };
        let mut part = Vec::new();
        for ((index, _), loaded) in job.blocks.iter().zip(&mut st.blocks) {
            let problem = if let Err(why) = &registered {
                Some(why.clone())
            } else if *index as usize >= source.keys.len() {
                Some(format!(
                    "block index {index} is outside the source's {} blocks",
                    source.keys.len()
                ))
            } else {
                None
            };
            let buf = match problem {
                Some(why) => Err(why),
                None => self
                    .pool
                    .take()
                    .ok_or_else(|| "no staging buffer for a remote block".to_string()),
            };
            match buf {
                Ok(buf) => part.push(OpBlock {
                    key: loaded.key,
                    engine: Some(loaded.engine),
                    buf: Buf::Owned(buf),
                }),
                Err(why) => loaded.result = Some(Err(BlockError::Unavailable(why))),
            }
        }
        if let Some(remote) = &self.remote {
            let route = vec![remote.importer_backend, self.routes.engine];
            let deadline = Instant::now() + remote.load_timeout;
            // Several tasks, so that reading some blocks overlaps copying others into engine
            // memory (one task would read all before copying any), each on a connection of
            // its own.
            let per_task = crate::remote::remote_task_blocks(part.len());
            let mut rest = part.into_iter().peekable();
            while rest.peek().is_some() {
                let chunk: Vec<OpBlock> = rest.by_ref().take(per_task).collect();
                self.submit_load_part(job.job, &mut st, chunk, route.clone(), deadline)?;
            }
        }
        self.loads.insert(job.job, st);
        self.try_finish_load(job.job);
        Ok(())
    }

    /// A load ended: a remote one no longer needs its source registered.
    pub(super) fn remote_load_ended(&mut self, job: JobId) {
        if let Some(remote) = self.remote.as_mut()
            && let Some(export) = remote.registered.remove(&job)
        {
            let _ = remote.importer.forget(RequestId(export));
        }
    }

    /// A reset: end every export's lease now (a host engine's request is still reported in
    /// `finished_sending` once no read holds it; a GPU engine's was reported when its copy was
    /// done), and forget every source registered for a load.
    pub(super) fn reset_remote(&mut self) {
        let Some(remote) = self.remote.as_mut() else {
            return;
        };
        let staged = remote.staging.as_mut().map(Staging::reset);
        if let Some(exporter) = &remote.exporter {
            for export in remote.by_export.keys().chain(staged.iter().flatten()) {
                let _ = exporter.abort(RequestId(*export));
            }
        }
        for (_, export) in remote.registered.drain() {
            let _ = remote.importer.forget(RequestId(export));
        }
    }

    /// Exports and remote loads in flight.
    pub(super) fn remote_in_flight(&self) -> usize {
        self.remote.as_ref().map_or(0, |r| {
            r.exported.len() + r.registered.len() + r.staging.as_ref().map_or(0, Staging::in_flight)
        })
    }
}
