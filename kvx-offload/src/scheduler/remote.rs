//! The scheduler side's part of the remote tier: exporting a finished request (producer) and
//! planning a load from a remote producer (consumer). Bookkeeping only, as the rest of it.

use std::sync::Arc;

use kvx_core::{BlockKey, EngineBlockId, RequestId};

use super::{JobInfo, SchedulerSide};
use crate::meta::{ExportJob, JobId, RemoteLoadJob};
use crate::remote::RemoteSource;

impl SchedulerSide {
    /// The engine is done with `req` and sends its `blocks` to a remote reader under `export`:
    /// the worker exports them this step, and the engine frees them only once `req` is
    /// reported in `finished_sending` (the lease ended: read, expired or aborted; with engine
    /// memory on a GPU, once the blocks were copied into staging buffers). Always true: the
    /// freeing is delayed.
    pub fn export_finished(
        &mut self,
        req: RequestId,
        export: u64,
        blocks: &[(BlockKey, EngineBlockId)],
    ) -> bool {
        if !self.request_finished(req) {
            self.meta.delayed_free.push(req);
        }
        self.meta.exports.push(ExportJob {
            request: req,
            export,
            blocks: blocks.to_vec(),
        });
        true
    }

    /// Load the blocks of `source` at the given indices into `req`'s engine blocks this step;
    /// the result comes back as a load job's. Nothing enters the tier index: a remote block is
    /// the engine's once loaded.
    pub fn remote_load(
        &mut self,
        req: RequestId,
        source: Arc<RemoteSource>,
        blocks: &[(u32, EngineBlockId)],
    ) -> JobId {
        let job = self.job_id();
        self.meta.remote_loads.push(RemoteLoadJob {
            job,
            request: req,
            source,
            blocks: blocks.to_vec(),
        });
        self.jobs.insert(job, (req, JobInfo::Remote));
        self.admit(req).active += 1;
        job
    }
}
