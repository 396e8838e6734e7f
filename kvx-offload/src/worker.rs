//! The worker half of the connector: turns step metadata into kvx-core tasks on the driver,
//! holds the host tier's buffers, and reports what finished.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{
    BackendId, BlockError, BlockKey, Buf, BufferPool, Direction, DriverHandle, EngineBlockId,
    FenceHandle, OpBlock, PoolBuf, RequestId, TaskId, TaskReport, TaskSpec, TaskState,
};
use kvx_policy::{BlockOutcome, LoadDecision, LoadFailurePolicy, TimeoutConfig};
use rustc_hash::{FxHashMap, FxHashSet};
use tracing::warn;

use crate::error::OffloadError;
use crate::meta::{JobId, JobKind, JobResult, LoadJob, StepMeta, StoreJob, WorkerOutput};
use crate::tier::Tier;

/// Removes blocks from a file tier (kvx-posix's handle does this without blocking).
pub trait FileTierHook: Send + Sync {
    /// Forget `key` and remove its file; must not block on the device.
    fn remove(&self, key: BlockKey);
}

/// Settings of the worker half.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Tokens per block (for the failure policy).
    pub block_tokens: u32,
    /// Deadlines of loads and stores.
    pub timeouts: TimeoutConfig,
    /// What to do when a load is incomplete.
    pub policy: LoadFailurePolicy,
}

/// The backends of the tiers, as registered with the driver.
#[derive(Debug, Clone, Copy)]
pub struct TierRoutes {
    /// The backend that copies between engine memory and kvx buffers.
    pub engine: BackendId,
    /// The file tier's backend, if any.
    pub file: Option<BackendId>,
}

enum Role {
    LoadHost,
    LoadFile,
    StoreHost,
    StoreFile,
}

struct LoadState {
    request: RequestId,
    blocks: Vec<(BlockKey, EngineBlockId)>,
    ok: Vec<Option<Result<(), BlockError>>>,
    promote: Vec<bool>,
    promoted: Vec<(BlockKey, Arc<PoolBuf>)>,
    tasks_left: u32,
    dirty: bool,
    fence: Option<FenceHandle>,
    /// The request was preempted or finished: report to the scheduler only.
    abandoned: bool,
}

struct StoreState {
    request: RequestId,
    write_file: FxHashSet<BlockKey>,
    /// Blocks that failed before their task ran (no buffer), reported with the task's result.
    host_failed: Vec<(BlockKey, BlockError)>,
    /// Write-through blocks that failed before the file task ran.
    file_failed: Vec<(BlockKey, BlockError)>,
}

/// The worker half.
pub struct WorkerSide {
    driver: DriverHandle,
    routes: TierRoutes,
    pool: BufferPool,
    file_hook: Option<Arc<dyn FileTierHook>>,
    cfg: WorkerConfig,
    host_data: FxHashMap<BlockKey, Arc<PoolBuf>>,
    tasks: FxHashMap<TaskId, (JobId, Role, Vec<usize>)>,
    loads: FxHashMap<JobId, LoadState>,
    stores: FxHashMap<JobId, StoreState>,
    finishing: FxHashSet<RequestId>,
    internal: FxHashSet<RequestId>,
    next_internal: u64,
    out: WorkerOutput,
}

/// Internal request ids (file write-through) live at the top of the id space.
const INTERNAL_BASE: u64 = 1 << 62;

impl WorkerSide {
    /// A worker half over a running driver. `pool` lends the host tier's buffers and the
    /// staging buffers of file loads; its buffer size must hold one block.
    pub fn new(
        driver: DriverHandle,
        routes: TierRoutes,
        pool: BufferPool,
        file_hook: Option<Arc<dyn FileTierHook>>,
        cfg: WorkerConfig,
    ) -> WorkerSide {
        WorkerSide {
            driver,
            routes,
            pool,
            file_hook,
            cfg,
            host_data: FxHashMap::default(),
            tasks: FxHashMap::default(),
            loads: FxHashMap::default(),
            stores: FxHashMap::default(),
            finishing: FxHashSet::default(),
            internal: FxHashSet::default(),
            next_internal: INTERNAL_BASE,
            out: WorkerOutput::default(),
        }
    }

    /// Before the engine may overwrite anything this step: flush the preempted requests'
    /// stores and fence their loads. Blocks until the fences hold or `until` passes (the
    /// stores' own deadlines bound it); returns false if some fence did not hold in time.
    pub fn handle_preemptions(&mut self, preempted: &[RequestId], until: Instant) -> bool {
        self.abandon_loads(preempted);
        let mut held = true;
        let mut fences = Vec::with_capacity(preempted.len());
        for r in preempted {
            match self.driver.preempt(*r) {
                Ok(f) => fences.push(f),
                Err(_) => held = false, // no driver: nothing can be promised
            }
        }
        held && fences.iter().all(|f| f.wait(until))
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
    /// queue this step's stores, pass finished requests on.
    pub fn start_step(&mut self, meta: StepMeta) -> Result<(), OffloadError> {
        self.driver.start_step()?;
        if let Some(keep) = meta.retain_host {
            let keep: FxHashSet<BlockKey> = keep.into_iter().collect();
            self.host_data.retain(|k, _| keep.contains(k));
        }
        for k in &meta.evict_host {
            self.host_data.remove(k);
        }
        if let Some(h) = &self.file_hook {
            for k in &meta.evict_file {
                h.remove(*k);
            }
        }
        // Loads and stores of this step first, so that a preemption below cancels or flushes
        // them too before the engine reuses any block.
        for job in meta.loads {
            self.start_load(job)?;
        }
        for job in meta.stores {
            self.queue_store(job)?;
        }
        let mut unsafe_reqs = Vec::new();
        if !meta.preempted.is_empty() {
            let until = Instant::now() + self.cfg.timeouts.timeout(Direction::Store);
            if !self.handle_preemptions(&meta.preempted, until) {
                warn!("a preemption fence did not hold before the store deadline");
                unsafe_reqs = meta.preempted.clone();
            }
        }
        self.abandon_loads(&meta.finished);
        let delayed: FxHashSet<RequestId> = meta.delayed_free.iter().copied().collect();
        for req in meta.finished {
            // The driver reports every finished request as released once no op of it is out;
            // the engine only hears about the requests whose freeing it delayed.
            self.driver.finish(req)?;
            if delayed.contains(&req) {
                self.finishing.insert(req);
            }
        }
        if meta.flush {
            self.driver.start_step()?;
        }
        if unsafe_reqs.is_empty() {
            Ok(())
        } else {
            Err(OffloadError::FenceNotHeld(unsafe_reqs))
        }
    }

    fn deadline(&self, dir: Direction) -> Instant {
        self.cfg.timeouts.deadline(dir, Instant::now(), None)
    }

    fn start_load(&mut self, job: LoadJob) -> Result<(), OffloadError> {
        let n = job.blocks.len();
        let mut st = LoadState {
            request: job.request,
            blocks: job.blocks.iter().map(|b| (b.key, b.engine)).collect(),
            ok: vec![None; n],
            promote: job.blocks.iter().map(|b| b.promote).collect(),
            promoted: Vec::new(),
            tasks_left: 0,
            dirty: false,
            fence: None,
            abandoned: false,
        };
        let mut host_part = (Vec::new(), Vec::new());
        let mut file_part = (Vec::new(), Vec::new());
        for (i, b) in job.blocks.iter().enumerate() {
            let buf = match b.tier {
                Tier::Host => self.host_data.get(&b.key).cloned().map(Buf::Shared),
                Tier::File if self.routes.file.is_some() => self.pool.take().map(Buf::Owned),
                Tier::File => None,
            };
            let Some(buf) = buf else {
                st.ok[i] = Some(Err(BlockError::Unavailable(format!(
                    "no {:?}-tier buffer for {}",
                    b.tier, b.key
                ))));
                continue;
            };
            let part = if b.tier == Tier::Host {
                &mut host_part
            } else {
                &mut file_part
            };
            part.0.push(i);
            part.1.push(OpBlock {
                key: b.key,
                engine: Some(b.engine),
                buf,
            });
        }
        let deadline = self.deadline(Direction::Load);
        for (role, (positions, blocks), route) in [
            (Role::LoadHost, host_part, vec![self.routes.engine]),
            (
                Role::LoadFile,
                file_part,
                self.routes
                    .file
                    .map_or_else(Vec::new, |f| vec![f, self.routes.engine]),
            ),
        ] {
            if blocks.is_empty() {
                continue;
            }
            let task = self.driver.submit(TaskSpec {
                request: job.request,
                dir: Direction::Load,
                route,
                blocks,
                deadline,
                deferred: false,
            })?;
            self.tasks.insert(task, (job.job, role, positions));
            st.tasks_left += 1;
        }
        self.loads.insert(job.job, st);
        self.try_finish_load(job.job);
        Ok(())
    }

    fn queue_store(&mut self, job: StoreJob) -> Result<(), OffloadError> {
        let mut blocks = Vec::with_capacity(job.blocks.len());
        let mut positions = Vec::new();
        let mut failed = Vec::new();
        for (i, (key, engine)) in job.blocks.iter().enumerate() {
            match self.pool.take() {
                Some(b) => {
                    positions.push(i);
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
            self.report_store(job.job, job.request, JobKind::StoreHost, Vec::new(), failed);
            if !write_file.is_empty() {
                self.report_store(
                    job.job,
                    job.request,
                    JobKind::StoreFile,
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
        self.tasks
            .insert(task, (job.job, Role::StoreHost, positions));
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

    fn report_store(
        &mut self,
        job: JobId,
        request: RequestId,
        kind: JobKind,
        ok: Vec<BlockKey>,
        failed: Vec<(BlockKey, BlockError)>,
    ) {
        self.out.jobs.push(JobResult {
            job,
            request,
            kind,
            ok,
            failed,
            promoted: Vec::new(),
        });
    }

    /// Everything that finished since the last call. Never blocks.
    pub fn get_finished(&mut self) -> WorkerOutput {
        let f = self.driver.get_finished();
        for r in f.reports {
            self.on_report(r);
        }
        for req in f.released {
            if self.internal.remove(&req) {
                continue;
            }
            if self.finishing.remove(&req) {
                self.out.finished_sending.push(req);
            }
        }
        let waiting: Vec<JobId> = self.loads.keys().copied().collect();
        for j in waiting {
            self.try_finish_load(j);
        }
        std::mem::take(&mut self.out)
    }

    fn on_report(&mut self, r: TaskReport) {
        let Some((job, role, positions)) = self.tasks.remove(&r.task) else {
            return; // a task from before a reset
        };
        match role {
            Role::LoadHost | Role::LoadFile => {
                let Some(st) = self.loads.get_mut(&job) else {
                    return;
                };
                st.tasks_left -= 1;
                if matches!(r.state, TaskState::TimedOut | TaskState::Cancelled) {
                    st.dirty = true; // an engine copy may still be running
                }
                for (pos, b) in positions.into_iter().zip(r.blocks) {
                    if matches!(role, Role::LoadFile)
                        && st.promote[pos]
                        && b.result.is_ok()
                        && let Some(buf) = b.buf
                    {
                        st.promoted.push((b.key, buf.into_shared()));
                    }
                    st.ok[pos] = Some(b.result);
                }
            }
            Role::StoreHost => {
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
                            self.host_data.insert(b.key, arc);
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
                self.report_store(job, request, JobKind::StoreHost, ok, failed);
                if expect_file {
                    self.write_through(job, request, to_file);
                } else {
                    self.stores.remove(&job);
                }
            }
            Role::StoreFile => {
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
                self.report_store(job, st.request, JobKind::StoreFile, ok, failed);
            }
        }
    }

    /// Write stored host blocks through to the file tier, as a task of an internal request
    /// that never touches engine memory. Blocks that failed earlier are reported with it.
    fn write_through(
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
                self.report_store(job, request, JobKind::StoreFile, Vec::new(), failed);
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
                self.report_store(job, request, JobKind::StoreFile, Vec::new(), failed);
            }
        }
    }

    /// Report a load once all its tasks ended and, if any was cut short, once no engine copy
    /// of it can still write (a fence on its blocks holds).
    fn try_finish_load(&mut self, job: JobId) {
        let Some(st) = self.loads.get_mut(&job) else {
            return;
        };
        if st.tasks_left > 0 {
            return;
        }
        // An abandoned load needs no fence here: the preemption fence or the request's delayed
        // release already covers any engine copy still running.
        if st.dirty && !st.abandoned {
            match &st.fence {
                None => {
                    let blocks: Vec<EngineBlockId> = st.blocks.iter().map(|b| b.1).collect();
                    match self.driver.fence_blocks(&blocks) {
                        Ok(f) => st.fence = Some(f),
                        Err(_) => st.dirty = false,
                    }
                    if st.fence.as_ref().is_some_and(|f| !f.is_ready()) {
                        return;
                    }
                }
                Some(f) if !f.is_ready() => return,
                Some(_) => {}
            }
        }
        let Some(st) = self.loads.remove(&job) else {
            return;
        };
        let outcomes: Vec<BlockOutcome> = st
            .blocks
            .iter()
            .zip(&st.ok)
            .map(|((_, e), ok)| BlockOutcome {
                block: *e,
                ok: matches!(ok, Some(Ok(()))),
            })
            .collect();
        let total = st.blocks.len() as u64 * self.cfg.block_tokens as u64;
        let decision = self
            .cfg
            .policy
            .decide(&outcomes, self.cfg.block_tokens, total);
        let mut ok = Vec::new();
        let mut failed = Vec::new();
        for ((k, _), r) in st.blocks.iter().zip(st.ok) {
            match r {
                Some(Ok(())) => ok.push(*k),
                Some(Err(e)) => failed.push((*k, e)),
                None => failed.push((*k, BlockError::Cancelled)),
            }
        }
        let mut promoted = Vec::new();
        for (k, buf) in st.promoted {
            // The scheduler reserved this host place for the load: nobody else fills it.
            self.host_data.insert(k, buf);
            promoted.push(k);
        }
        if !st.abandoned {
            if decision != LoadDecision::AllLoaded {
                self.out
                    .invalid_blocks
                    .extend_from_slice(decision.invalid_blocks());
                self.out.decisions.push((st.request, decision));
            }
            self.out.finished_recving.push(st.request);
        }
        self.out.jobs.push(JobResult {
            job,
            request: st.request,
            kind: JobKind::Load,
            ok,
            failed,
            promoted,
        });
    }

    /// Drop every job in flight; their late results are ignored. Host-tier buffers stay
    /// until the scheduler's next metadata says which to keep.
    pub fn reset(&mut self) -> Result<(), OffloadError> {
        // The reset's fence is not waited for here (kvx-offload's own reset does not fence yet).
        let _fence = self.driver.reset()?;
        self.tasks.clear();
        self.loads.clear();
        self.stores.clear();
        self.finishing.clear();
        self.internal.clear();
        self.out = WorkerOutput::default();
        Ok(())
    }

    /// Blocks held in the host tier.
    pub fn host_blocks(&self) -> usize {
        self.host_data.len()
    }

    /// Keys held in the host tier.
    pub fn host_keys(&self) -> Vec<BlockKey> {
        self.host_data.keys().copied().collect()
    }

    /// Jobs and requests in flight here (0 when idle).
    pub fn in_flight(&self) -> usize {
        self.tasks.len()
            + self.loads.len()
            + self.stores.len()
            + self.finishing.len()
            + self.internal.len()
    }

    /// The buffer pool (host tier + staging).
    pub fn pool(&self) -> &BufferPool {
        &self.pool
    }

    /// Wait (up to `timeout`) until nothing is in flight, collecting output meanwhile.
    pub fn drain(&mut self, timeout: Duration) -> WorkerOutput {
        let end = Instant::now() + timeout;
        let mut all = WorkerOutput::default();
        let _ = self.driver.start_step();
        loop {
            all.merge(self.get_finished());
            if self.in_flight() == 0 || Instant::now() >= end {
                return all;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
