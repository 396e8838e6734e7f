//! The worker half of the connector: turns step metadata into kvx-core tasks on the driver,
//! holds the host tier's buffers, and reports what finished.

#[cfg(feature = "cuda")]
mod engine_order;
mod host_tier;
mod load;
mod preempt;
mod remote;
mod staging;
mod store;
mod write_through;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{
    BackendId, BufferPool, CoreError, Direction, DriverHandle, EngineBlockId, FenceHandle,
    RequestId, Stopped, TaskId, TaskReport,
};
use kvx_policy::{LoadFailurePolicy, TimeoutConfig};
use rustc_hash::{FxHashMap, FxHashSet};

use crate::error::OffloadError;
use crate::file_hook::FileTierHook;
use crate::meta::{JobId, StepMeta, WorkerOutput};
use host_tier::HostTier;
use load::LoadState;
use store::StoreState;

pub use preempt::PreemptionFence;
pub(crate) use remote::RemotePart;
pub(crate) use staging::Staging;

/// Settings of the worker half.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Tokens per block (for the failure policy); must equal the scheduler half's.
    pub block_tokens: u32,
    /// Bytes of one engine block: every buffer of the worker's pool must hold one.
    pub block_bytes: usize,
    /// Deadlines of loads and stores.
    pub timeouts: TimeoutConfig,
    /// What to do when a load is incomplete.
    pub policy: LoadFailurePolicy,
    /// Longest `start_step` waits for the fence of the requests preempted in its metadata;
    /// if the fence does not hold by then, `start_step` hands it back in
    /// [`StepStarted::FenceOutstanding`] (default 1 ms: see [`DEFAULT_PREEMPT_WAIT`]).
    pub preempt_wait: Duration,
}

/// The default [`WorkerConfig::preempt_wait`]: long enough for host copies in flight to
/// return, short enough to keep a step's overhead around a millisecond.
pub const DEFAULT_PREEMPT_WAIT: Duration = Duration::from_millis(1);

impl WorkerConfig {
    /// Check the settings; the error names the bad field.
    pub fn validate(&self) -> Result<(), OffloadError> {
        if self.block_tokens == 0 {
            return Err(OffloadError::config("block_tokens", "must be at least 1"));
        }
        if self.block_bytes == 0 {
            return Err(OffloadError::config("block_bytes", "must be at least 1"));
        }
        self.timeouts
            .validate()
            .map_err(|e| OffloadError::config("timeouts", e))?;
        self.policy
            .validate()
            .map_err(|e| OffloadError::config("policy", e))?;
        if self.preempt_wait > Duration::from_secs(1) {
            return Err(OffloadError::config(
                "preempt_wait",
                format!(
                    "{:?} would stall engine steps; poll the fence instead (at most 1 s)",
                    self.preempt_wait
                ),
            ));
        }
        Ok(())
    }
}

/// The backends of the tiers, as registered with the driver.
#[derive(Debug, Clone, Copy)]
pub struct TierRoutes {
    /// The backend that copies between engine memory and kvx buffers.
    pub engine: BackendId,
    /// The file tier's backend, if any.
    pub file: Option<BackendId>,
}

/// What a driver task does for a job (named after the [`JobPart`](crate::meta::JobPart) it
/// reports).
enum Role {
    /// Blocks of a load, from one source tier into engine memory.
    Load,
    /// A store's copy out of engine memory into host-tier buffers.
    StoreHost,
    /// Host-tier buffers written to the file tier: a detached task (a store's write-through,
    /// or a write-back), so the request's life never waits for it.
    StoreFile,
}

/// What [`WorkerSide::start_step`] hands back: the step started (everything its metadata asked
/// for was done), and whether the fence of the requests it preempted is still outstanding.
#[must_use = "reuse no preempted request's block before an outstanding fence holds"]
#[derive(Debug)]
pub enum StepStarted {
    /// No fence is outstanding: the blocks of the requests it preempted (if any) may be reused.
    Clear,
    /// The fence of the requests it preempted did not hold within
    /// [`WorkerConfig::preempt_wait`]: reuse none of their blocks until it holds.
    FenceOutstanding(PreemptionFence),
}

impl StepStarted {
    /// The outstanding fence, if any.
    pub fn fence(self) -> Option<PreemptionFence> {
        match self {
            StepStarted::Clear => None,
            StepStarted::FenceOutstanding(f) => Some(f),
        }
    }
}

/// What [`WorkerSide::reset`] hands back.
#[derive(Debug)]
#[must_use = "reuse no engine block before the reset's fence holds; free the delayed requests then"]
pub struct WorkerReset {
    /// Holds once every engine-memory op that was out at the reset has returned: reuse no
    /// engine block before it holds.
    pub fence: FenceHandle,
    /// Requests whose freeing was delayed (`request_finished` returned true) and which will
    /// not be reported in `finished_sending` any more: free their blocks once `fence` holds.
    pub delayed_free: Vec<RequestId>,
}

/// The worker half. No call waits for a backend or the driver thread beyond the time the
/// caller gives it (`preempt_wait`, a `budget`, a `timeout`); see the crate docs for the bound
/// of each call.
pub struct WorkerSide {
    driver: DriverHandle,
    routes: TierRoutes,
    pool: BufferPool,
    file_hook: Option<Arc<dyn FileTierHook>>,
    cfg: WorkerConfig,
    host: HostTier,
    tasks: FxHashMap<TaskId, (JobId, Role)>,
    loads: FxHashMap<JobId, LoadState>,
    stores: FxHashMap<JobId, StoreState>,
    finishing: FxHashSet<RequestId>,
    /// Engine blocks reported in `blocks_in_use`, with the fence that frees them.
    held: Vec<(FenceHandle, Vec<EngineBlockId>)>,
    /// The remote tier (exports and remote loads), if configured.
    remote: Option<RemotePart>,
    /// Orders copies after the engine's CUDA stream (CUDA engine memory only).
    #[cfg(feature = "cuda")]
    engine_order: Option<kvx_cuda::EngineOrder>,
    out: WorkerOutput,
    /// Blocks whose stores ended in no tier, by the kind of their last failure.
    skips: crate::store_skips::StoreSkips,
    /// What this worker moved since [`WorkerSide::take_stats`].
    stats: crate::TransferStats,
}

impl WorkerSide {
    /// A worker half over a running driver. `pool` lends the host tier's buffers and the
    /// staging buffers of file loads; a pool whose buffers cannot hold `cfg.block_bytes` is
    /// refused, as is an invalid `cfg`.
    pub fn new(
        driver: DriverHandle,
        routes: TierRoutes,
        pool: BufferPool,
        file_hook: Option<Arc<dyn FileTierHook>>,
        cfg: WorkerConfig,
    ) -> Result<WorkerSide, OffloadError> {
        cfg.validate()?;
        if pool.buf_size() < cfg.block_bytes {
            return Err(OffloadError::config(
                "pool",
                format!(
                    "buffers of {} bytes cannot hold a block of {} bytes (block_bytes)",
                    pool.buf_size(),
                    cfg.block_bytes
                ),
            ));
        }
        Ok(WorkerSide {
            driver,
            routes,
            pool,
            file_hook,
            cfg,
            host: HostTier::default(),
            tasks: FxHashMap::default(),
            loads: FxHashMap::default(),
            stores: FxHashMap::default(),
            finishing: FxHashSet::default(),
            held: Vec::new(),
            remote: None,
            #[cfg(feature = "cuda")]
            engine_order: None,
            out: WorkerOutput::default(),
            skips: Default::default(),
            stats: Default::default(),
        })
    }

    /// Give this worker its remote tier (the builder does, from `remote` in the config).
    pub(crate) fn set_remote(&mut self, remote: RemotePart) {
        self.remote = Some(remote);
    }

    /// The engine gave up on these requests' loads (preempted or finished): their results go to
    /// the scheduler only, never to the engine as finished or invalid blocks (the blocks may
    /// belong to another request by then).
    fn abandon_loads(&mut self, reqs: &[RequestId]) {
        for st in self.loads.values_mut() {
            if reqs.contains(&st.request) {
                st.abandoned = true;
            }
        }
    }

    /// Start this step: submit the stores queued last step, drop evicted blocks, start loads,
    /// queue this step's stores, flush and fence the preempted requests, pass finished
    /// requests on. [`StepStarted::FenceOutstanding`] means all of that was done, but the
    /// preemption's fence did not hold within `preempt_wait`: poll the fence it carries before
    /// reusing those requests' blocks. An error means the driver stopped.
    pub fn start_step(&mut self, meta: StepMeta) -> Result<StepStarted, OffloadError> {
        self.driver.start_step()?;
        if let Some(keep) = meta.retain_host {
            self.host.retain(keep);
        }
        // Written back first: the writes hold the buffers the eviction below lets go.
        for job in meta.write_back {
            self.write_back(job);
        }
        self.host.evict(&meta.evict_host);
        if let Some(h) = &self.file_hook {
            for k in &meta.evict_file {
                h.evict(*k);
            }
            for k in &meta.remove_file {
                h.remove(*k);
            }
        }
        // Loads and stores of this step first, so that a preemption below cancels or flushes
        // them too before the engine reuses any block.
        for job in meta.loads {
            self.start_load(job)?;
        }
        for job in meta.remote_loads {
            self.start_remote_load(job)?;
        }
        for job in meta.stores {
            self.queue_store(job)?;
        }
        let mut started = StepStarted::Clear;
        if !meta.preempted.is_empty() {
            let fence = self.handle_preemptions(&meta.preempted, self.cfg.preempt_wait)?;
            if !fence.is_ready() {
                started = StepStarted::FenceOutstanding(fence);
            }
        }
        self.abandon_loads(&meta.finished);
        // Exported requests are in `finished` and `delayed_free` too: reported once both their
        // stores and their lease ended, or (a GPU engine's, staged in host buffers) once their
        // copy out of engine memory is done, which starts here, before the request finishes.
        for job in meta.exports {
            self.export(job);
        }
        let delayed: FxHashSet<RequestId> = meta.delayed_free.iter().copied().collect();
        for req in meta.finished {
            // The driver reports every finished request as released once no op of it is out;
            // the engine only hears about the requests whose freeing it delayed.
            self.driver.finish(req)?;
            if delayed.contains(&req) {
                self.finishing.insert(req);
            }
        }
        if meta.submit_stores_now {
            self.driver.start_step()?;
        }
        Ok(started)
    }

    fn deadline(&self, dir: Direction) -> Instant {
        self.cfg.timeouts.deadline(dir, Instant::now(), None)
    }

    /// Everything that finished since the last call. Never blocks; an error once the driver
    /// stopped.
    pub fn get_finished(&mut self) -> Result<WorkerOutput, OffloadError> {
        if let Some(stop) = self.driver.stopped() {
            return Err(CoreError::DriverStopped {
                reason: stop.reason,
            }
            .into());
        }
        let f = self.driver.get_finished();
        for r in f.reports {
            self.on_report(r);
        }
        for req in f.released {
            if self.finishing.remove(&req) && !self.is_exported(req) {
                self.out.finished_sending.push(req);
            }
        }
        for req in self.released_exports() {
            if !self.finishing.contains(&req) {
                self.out.finished_sending.push(req);
            }
        }
        let waiting: Vec<JobId> = self.loads.keys().copied().collect();
        for j in waiting {
            self.try_finish_load(j);
        }
        let out = &mut self.out;
        self.held.retain(|(fence, blocks)| {
            let ready = fence.is_ready();
            if ready {
                out.blocks_released.extend_from_slice(blocks);
            }
            !ready
        });
        Ok(std::mem::take(&mut self.out))
    }

    /// Why the driver stopped and which engine blocks an op may still touch (never reuse
    /// those); `None` while it runs.
    pub fn stopped(&self) -> Option<Stopped> {
        self.driver.stopped()
    }

    fn on_report(&mut self, r: TaskReport) {
        if self.is_staging_copy(r.task) {
            return self.on_staged(r);
        }
        let Some((job, role)) = self.tasks.remove(&r.task) else {
            return; // a task from before a reset
        };
        match role {
            Role::Load => self.on_load_report(job, r),
            Role::StoreHost => self.on_store_report(job, r),
            Role::StoreFile => self.on_write_through_report(job, r),
        }
    }

    /// Drop every job in flight; their late results are ignored. Returns at once with a fence
    /// over every engine-memory op still out, and the requests whose delayed freeing will not
    /// be reported any more. Host-tier buffers stay until the scheduler's next metadata says
    /// which to keep.
    pub fn reset(&mut self) -> Result<WorkerReset, OffloadError> {
        let fence = self.driver.reset()?;
        self.reset_remote();
        self.tasks.clear();
        self.loads.clear();
        self.stores.clear();
        // An exported request stays: it is reported once its aborted lease lets go of it.
        let mut delayed_free: Vec<RequestId> = self.finishing.drain().collect();
        delayed_free.retain(|r| !self.is_exported(*r));
        delayed_free.sort();
        self.out = WorkerOutput::default();
        Ok(WorkerReset {
            fence,
            delayed_free,
        })
    }

    /// Blocks whose stores ended in no tier (their copy out of engine memory or their file
    /// write failed, and no other tier took them), by the kind of their last failure.
    pub fn store_skips(&self) -> &crate::StoreSkips {
        &self.skips
    }

    /// What this worker moved since the last call: blocks and bytes loaded and stored per
    /// tier, blocks that failed by reason, blocks stored in no tier, each load's latency.
    pub fn take_stats(&mut self) -> crate::TransferStats {
        self.stats.take()
    }

    /// Blocks held in the host tier.
    pub fn host_blocks(&self) -> usize {
        self.host.len()
    }

    /// Keys held in the host tier.
    pub fn host_keys(&self) -> Vec<kvx_core::BlockKey> {
        self.host.keys()
    }

    /// Jobs and requests in flight here (0 when idle).
    pub fn in_flight(&self) -> usize {
        self.tasks.len()
            + self.loads.len()
            + self.stores.len()
            + self.finishing.len()
            + self.held.len()
            + self.remote_in_flight()
    }

    /// The buffer pool (host tier + staging).
    pub fn pool(&self) -> &BufferPool {
        &self.pool
    }

    /// Wait (up to `timeout`) until nothing is in flight, collecting output meanwhile.
    pub fn drain(&mut self, timeout: Duration) -> Result<WorkerOutput, OffloadError> {
        let end = Instant::now() + timeout;
        let mut all = WorkerOutput::default();
        self.driver.start_step()?;
        loop {
            all.merge(self.get_finished()?);
            if self.in_flight() == 0 || Instant::now() >= end {
                return Ok(all);
            }
            std::thread::sleep(kvx_core::TICK);
        }
    }
}
