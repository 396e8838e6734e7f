//! Load jobs: from the tiers into engine blocks, and their verdict for the engine.

use kvx_core::{
    BlockError, BlockKey, Buf, Direction, EngineBlockId, FenceHandle, OpBlock, PoolBuf, RequestId,
    TaskReport, TaskSpec,
};
use kvx_policy::{BlockOutcome, LoadDecision};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Role, WorkerSide};
use crate::error::OffloadError;
use crate::meta::{JobId, JobPart, JobResult, LoadJob};
use crate::tier::Tier;
use kvx_core::metrics;

/// Longest a cut-short load's verdict waits for the fence on its blocks (which normally holds
/// within one pass of the driver); after that the verdict goes out with the blocks a copy may
/// still write listed in `WorkerOutput::blocks_in_use`.
pub(super) const LOAD_FENCE_GRACE: Duration = Duration::from_millis(5);

/// Where a block of a load comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// A host-tier buffer.
    Host,
    /// A file, read into a staging buffer first.
    File,
    /// A remote producer, read into a staging buffer first.
    Remote,
}

impl Source {
    fn name(self) -> &'static str {
        match self {
            Source::Host => "host",
            Source::File => "file",
            Source::Remote => "remote",
        }
    }
}

/// One block of a load in flight, in the job's order.
pub(super) struct LoadedBlock {
    pub(super) key: BlockKey,
    pub(super) engine: EngineBlockId,
    pub(super) from: Source,
    /// Keep it in the host tier once read from its file.
    pub(super) promote: bool,
    /// Its verdict, once its task ended (or it failed before one ran).
    pub(super) result: Option<Result<(), BlockError>>,
}

/// A load in flight.
pub(super) struct LoadState {
    pub(super) request: RequestId,
    pub(super) blocks: Vec<LoadedBlock>,
    promoted: Vec<(BlockKey, Arc<PoolBuf>)>,
    tasks_left: u32,
    /// A task of it was cut short with an engine copy out: that copy may still write.
    dirty: bool,
    /// The fence on its blocks once it was cut short, and when it was asked for.
    fence: Option<(FenceHandle, Instant)>,
    /// The request was preempted or finished: report to the scheduler only.
    pub(super) abandoned: bool,
    /// When the load was started (for its latency metric).
    started: Instant,
}

impl LoadState {
    /// A load of `blocks` for `request`, no task submitted yet.
    pub(super) fn new(request: RequestId, blocks: Vec<LoadedBlock>) -> LoadState {
        LoadState {
            request,
            blocks,
            promoted: Vec::new(),
            tasks_left: 0,
            dirty: false,
            fence: None,
            abandoned: false,
            started: Instant::now(),
        }
    }
}

impl WorkerSide {
    /// Start a load: one task per source tier (host buffers are shared with the host tier;
    /// file blocks are read into staging buffers, then copied).
    pub(super) fn start_load(&mut self, job: LoadJob) -> Result<(), OffloadError> {
        let blocks = job
            .blocks
            .iter()
            .map(|b| LoadedBlock {
                key: b.key,
                engine: b.engine,
                from: if b.tier == Tier::File {
                    Source::File
                } else {
                    Source::Host
                },
                promote: b.promote,
                result: None,
            })
            .collect();
        let mut st = LoadState::new(job.request, blocks);
        let (mut host_part, mut file_part) = (Vec::new(), Vec::new());
        for (b, loaded) in job.blocks.iter().zip(&mut st.blocks) {
            let buf = match b.tier {
                Tier::Host => self.host.get(&b.key).map(Buf::Shared),
                Tier::File if self.routes.file.is_some() => self.pool.take().map(Buf::Owned),
                Tier::File => None,
            };
            let Some(buf) = buf else {
                loaded.result = Some(Err(BlockError::Unavailable(format!(
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
            part.push(OpBlock {
                key: b.key,
                engine: Some(b.engine),
                buf,
            });
        }
        let deadline = self.deadline(Direction::Load);
        let file_route = self
            .routes
            .file
            .map_or_else(Vec::new, |f| vec![f, self.routes.engine]);
        self.submit_load_part(
            job.job,
            &mut st,
            host_part,
            vec![self.routes.engine],
            deadline,
        )?;
        self.submit_load_part(job.job, &mut st, file_part, file_route, deadline)?;
        self.loads.insert(job.job, st);
        self.try_finish_load(job.job);
        Ok(())
    }

    /// Submit one task of a load (nothing when `blocks` is empty).
    pub(super) fn submit_load_part(
        &mut self,
        job: JobId,
        st: &mut LoadState,
        blocks: Vec<OpBlock>,
        route: Vec<kvx_core::BackendId>,
        deadline: Instant,
    ) -> Result<(), OffloadError> {
        if blocks.is_empty() {
            return Ok(());
        }
        let task = self.driver.submit(TaskSpec {
            request: st.request,
            dir: Direction::Load,
            route,
            blocks,
            deadline,
            deferred: false,
        })?;
        self.tasks.insert(task, (job, Role::Load));
        st.tasks_left += 1;
        Ok(())
    }

    /// A task of a load ended. Its report names each block's engine block, which is how the
    /// block finds its place in the job (a job fills each engine block once, and a task's
    /// blocks keep the job's order).
    pub(super) fn on_load_report(&mut self, job: JobId, r: TaskReport) {
        let Some(st) = self.loads.get_mut(&job) else {
            return;
        };
        st.tasks_left -= 1;
        // Cut short with an engine copy still out: it may write the blocks yet. A file read
        // still out fills a staging buffer only, and no copy starts after it.
        if r.engine_blocks_held {
            st.dirty = true;
        }
        let mut rest = st.blocks.iter_mut();
        for b in r.blocks {
            let Some(loaded) = rest.find(|l| Some(l.engine) == b.engine) else {
                break;
            };
            if loaded.from == Source::File
                && loaded.promote
                && b.result.is_ok()
                && let Some(buf) = b.buf
            {
                st.promoted.push((b.key, buf.into_shared()));
            }
            loaded.result = Some(b.result);
        }
    }

    /// Report a load once all its tasks ended and, if any was cut short, once no engine copy
    /// of it can still write (a fence on its blocks holds).
    pub(super) fn try_finish_load(&mut self, job: JobId) {
        let Some(st) = self.loads.get_mut(&job) else {
            return;
        };
        if st.tasks_left > 0 {
            return;
        }
        // An abandoned load needs no fence here: the preemption fence or the request's delayed
        // release already covers any engine copy still running.
        let mut in_use = None;
        if st.dirty && !st.abandoned {
            if st.fence.is_none() {
                let blocks: Vec<EngineBlockId> = st.blocks.iter().map(|b| b.engine).collect();
                match self.driver.fence_blocks(&blocks) {
                    Ok(f) => st.fence = Some((f, Instant::now())),
                    Err(_) => st.dirty = false, // the driver stopped: every call reports it
                }
            }
            if let Some((f, since)) = &st.fence
                && !f.is_ready()
            {
                if since.elapsed() < LOAD_FENCE_GRACE {
                    return;
                }
                in_use = Some(f.clone());
            }
        }
        let Some(st) = self.loads.remove(&job) else {
            return;
        };
        self.remote_load_ended(job);
        let outcomes: Vec<BlockOutcome> = st
            .blocks
            .iter()
            .map(|b| BlockOutcome {
                block: b.engine,
                ok: matches!(b.result, Some(Ok(()))),
            })
            .collect();
        let total = st.blocks.len() as u64 * self.cfg.block_tokens as u64;
        let decision = self
            .cfg
            .policy
            .decide(&outcomes, self.cfg.block_tokens, total);
        self.record_load_metrics(&st);
        let mut ok = Vec::new();
        let mut failed = Vec::new();
        for b in st.blocks {
            match b.result {
                Some(Ok(())) => ok.push(b.key),
                Some(Err(e)) => failed.push((b.key, e)),
                None => failed.push((b.key, BlockError::Cancelled)),
            }
        }
        let mut promoted = Vec::new();
        for (k, buf) in st.promoted {
            // The scheduler reserved this host place for the load: nobody else fills it.
            self.host.insert(k, buf);
            promoted.push(k);
        }
        if let Some(fence) = in_use {
            // The verdict goes out now; the blocks a cut-short copy may still write stay out
            // of use until their fence holds.
            let blocks: Vec<EngineBlockId> =
                outcomes.iter().filter(|o| !o.ok).map(|o| o.block).collect();
            self.out.blocks_in_use.extend_from_slice(&blocks);
            self.held.push((fence, blocks));
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
            part: JobPart::Load,
            ok,
            failed,
            promoted,
        });
    }

    /// Blocks, bytes and latency of a finished load, per source tier: kvx's metrics and this
    /// worker's [`TransferStats`](crate::TransferStats).
    fn record_load_metrics(&mut self, st: &LoadState) {
        let took = st.started.elapsed();
        let bytes = self.cfg.block_bytes as u64;
        for from in [Source::Host, Source::File, Source::Remote] {
            let mut ok = 0u64;
            let mut failed = Vec::new();
            for b in st.blocks.iter().filter(|b| b.from == from) {
                match &b.result {
                    Some(Ok(())) => ok += 1,
                    Some(Err(e)) => failed.push(metrics::failure_reason(e)),
                    None => failed.push(metrics::block_error_label(&BlockError::Cancelled)),
                }
            }
            if ok + failed.len() as u64 > 0 {
                metrics::record_tier_job(
                    from.name(),
                    Direction::Load,
                    ok,
                    failed.len() as u64,
                    ok * bytes,
                    Some(took),
                );
                self.stats
                    .record(Direction::Load, from.name(), ok, failed, ok * bytes);
            }
        }
        self.stats.load_took(took);
    }
}
