//! The scheduler half of the connector: decides what to load and store each step, and keeps
//! the tier index in step with what the worker half reports.

use kvx_core::{BlockError, BlockKey, EngineBlockId, RequestId};
use rustc_hash::FxHashMap;
use tracing::debug;

use crate::error::OffloadError;
use crate::eviction::EvictionKind;
use crate::manager::{Lookup, OffloadManager};
use crate::meta::{JobId, JobKind, LoadBlock, LoadJob, StepMeta, StoreJob, WorkerOutput};
use crate::tier::Tier;

/// Settings of the scheduler half.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Tokens per block.
    pub block_tokens: u32,
    /// Host tier capacity in blocks.
    pub host_blocks: usize,
    /// File tier capacity in blocks (`None`: no file tier).
    pub file_blocks: Option<usize>,
    /// Eviction order of both tiers.
    pub eviction: EvictionKind,
}

enum JobInfo {
    Load {
        keys: Vec<BlockKey>,
        tiers: Vec<Tier>,
        promote: Vec<bool>,
    },
    Store {
        file_pending: bool,
        host_pending: bool,
    },
}

#[derive(Default)]
struct Req {
    pending_load: Option<(Vec<BlockKey>, Vec<Tier>)>,
    /// Jobs whose engine-memory part is not reported yet.
    active: u32,
    finished: bool,
}

/// The scheduler half.
pub struct SchedulerSide {
    mgr: OffloadManager,
    block_tokens: u32,
    next_job: u64,
    reqs: FxHashMap<RequestId, Req>,
    jobs: FxHashMap<JobId, (RequestId, JobInfo)>,
    meta: StepMeta,
}

impl SchedulerSide {
    /// A scheduler half with empty tiers.
    pub fn new(cfg: SchedulerConfig) -> Result<SchedulerSide, OffloadError> {
        if cfg.block_tokens == 0 || cfg.host_blocks == 0 {
            return Err(OffloadError::Config(
                "block_tokens and host_blocks must be positive".into(),
            ));
        }
        Ok(SchedulerSide {
            mgr: OffloadManager::new(cfg.host_blocks, cfg.file_blocks, cfg.eviction),
            block_tokens: cfg.block_tokens,
            next_job: 1,
            reqs: FxHashMap::default(),
            jobs: FxHashMap::default(),
            meta: StepMeta::default(),
        })
    }

    /// The tier index.
    pub fn manager(&self) -> &OffloadManager {
        &self.mgr
    }

    /// The tier index, mutable (e.g. to adopt a file tier's startup scan).
    pub fn manager_mut(&mut self) -> &mut OffloadManager {
        &mut self.mgr
    }

    fn job_id(&mut self) -> JobId {
        let j = JobId(self.next_job);
        self.next_job += 1;
        j
    }

    /// Tokens of `req` (whose full blocks have `keys`) that can be loaded beyond the
    /// `num_computed_tokens` the engine already has; `None` means "ask again later" (a block
    /// that would extend the hit is being stored or loaded right now).
    pub fn get_num_new_matched_tokens(
        &mut self,
        req: RequestId,
        keys: &[BlockKey],
        num_computed_tokens: u64,
    ) -> Option<u64> {
        let skip = (num_computed_tokens / self.block_tokens as u64) as usize;
        let rest = keys.get(skip..).unwrap_or(&[]);
        match self.mgr.lookup(rest) {
            Lookup::Retry => None,
            Lookup::Hit(tiers) => {
                let n = tiers.len();
                let entry = self.reqs.entry(req).or_default();
                entry.pending_load = (n > 0).then(|| (rest[..n].to_vec(), tiers));
                Some(n as u64 * self.block_tokens as u64)
            }
        }
    }

    /// The engine allocated `engine_blocks` for the tokens matched by the last
    /// `get_num_new_matched_tokens`: the load is queued for this step.
    pub fn update_state_after_alloc(
        &mut self,
        req: RequestId,
        engine_blocks: &[EngineBlockId],
    ) -> Result<Option<JobId>, OffloadError> {
        let Some((keys, tiers)) = self.reqs.get_mut(&req).and_then(|r| r.pending_load.take())
        else {
            return Ok(None);
        };
        if engine_blocks.len() != keys.len() {
            return Err(OffloadError::BlockCountMismatch {
                request: req,
                keys: keys.len(),
                blocks: engine_blocks.len(),
            });
        }
        let (promote, evicted) = self.mgr.prepare_load(&keys, &tiers);
        self.meta.evict_host.extend(evicted);
        let job = self.job_id();
        let blocks = keys
            .iter()
            .zip(&tiers)
            .zip(engine_blocks)
            .zip(&promote)
            .map(|(((k, t), e), p)| LoadBlock {
                key: *k,
                engine: *e,
                tier: *t,
                promote: *p,
            })
            .collect();
        self.meta.loads.push(LoadJob {
            job,
            request: req,
            blocks,
        });
        self.jobs.insert(
            job,
            (
                req,
                JobInfo::Load {
                    keys,
                    tiers,
                    promote,
                },
            ),
        );
        self.reqs.entry(req).or_default().active += 1;
        Ok(Some(job))
    }

    /// Save computed blocks of `req` (full blocks, keyed). Blocks already offloaded are
    /// skipped; if the host tier cannot make room, nothing is stored.
    pub fn save_blocks(
        &mut self,
        req: RequestId,
        blocks: &[(BlockKey, EngineBlockId)],
    ) -> Option<JobId> {
        let keys: Vec<BlockKey> = blocks.iter().map(|b| b.0).collect();
        self.mgr.touch(&keys);
        let d = match self.mgr.prepare_store(&keys) {
            Ok(d) => d,
            Err(e) => {
                debug!(request = %req, error = %e, "store skipped");
                return None;
            }
        };
        self.meta.evict_host.extend(d.evicted_host);
        self.meta.evict_file.extend(d.evicted_file);
        if d.host.is_empty() {
            return None;
        }
        let job = self.job_id();
        let chosen: Vec<(BlockKey, EngineBlockId)> = blocks
            .iter()
            .copied()
            .filter(|(k, _)| d.host.contains(k))
            .collect();
        let file_pending = !d.file.is_empty();
        self.meta.stores.push(StoreJob {
            job,
            request: req,
            blocks: chosen,
            write_file: d.file,
        });
        self.jobs.insert(
            job,
            (
                req,
                JobInfo::Store {
                    file_pending,
                    host_pending: true,
                },
            ),
        );
        self.reqs.entry(req).or_default().active += 1;
        Some(job)
    }

    /// The engine preempted `req`: its pending (not yet allocated) load is dropped.
    pub fn request_preempted(&mut self, req: RequestId) {
        if let Some(r) = self.reqs.get_mut(&req) {
            r.pending_load = None;
        }
        self.meta.preempted.push(req);
    }

    /// The engine is done with `req`; true when freeing its blocks must wait until the worker
    /// reports it in `finished_sending`.
    pub fn request_finished(&mut self, req: RequestId) -> bool {
        self.meta.finished.push(req);
        let Some(r) = self.reqs.get_mut(&req) else {
            return false;
        };
        r.finished = true;
        r.pending_load = None;
        let delay = r.active > 0;
        if delay {
            self.meta.delayed_free.push(req);
        } else {
            self.reqs.remove(&req);
        }
        delay
    }

    /// Instructions for the worker for this step.
    pub fn build_meta(&mut self) -> StepMeta {
        let mut m = std::mem::take(&mut self.meta);
        m.flush = self.reqs.values().all(|r| r.finished);
        m
    }

    /// Take in what the worker reported.
    pub fn update_from_worker(&mut self, out: &WorkerOutput) {
        for r in &out.jobs {
            let Some((req, info)) = self.jobs.get_mut(&r.job) else {
                continue; // a job from before a reset
            };
            let req = *req;
            let failed: Vec<BlockKey> = r.failed.iter().map(|f| f.0).collect();
            let mut engine_part_done = false;
            let mut job_done = false;
            match (info, r.kind) {
                (
                    JobInfo::Load {
                        keys,
                        tiers,
                        promote,
                    },
                    JobKind::Load,
                ) => {
                    let corrupt: Vec<BlockKey> = r
                        .failed
                        .iter()
                        .filter(|(_, e)| matches!(e, BlockError::Corrupt(_) | BlockError::NotFound))
                        .map(|f| f.0)
                        .collect();
                    let removed =
                        self.mgr
                            .complete_load(keys, tiers, promote, &corrupt, &r.promoted);
                    self.meta.evict_file.extend(removed);
                    engine_part_done = true;
                    job_done = true;
                }
                (
                    JobInfo::Store {
                        host_pending,
                        file_pending,
                    },
                    JobKind::StoreHost,
                ) => {
                    self.mgr.complete_store(Tier::Host, &r.ok, true);
                    self.mgr.complete_store(Tier::Host, &failed, false);
                    *host_pending = false;
                    engine_part_done = true;
                    job_done = !*file_pending;
                }
                (
                    JobInfo::Store {
                        host_pending,
                        file_pending,
                    },
                    JobKind::StoreFile,
                ) => {
                    self.mgr.complete_store(Tier::File, &r.ok, true);
                    self.mgr.complete_store(Tier::File, &failed, false);
                    *file_pending = false;
                    job_done = !*host_pending;
                }
                _ => {}
            }
            if job_done {
                self.jobs.remove(&r.job);
            }
            if engine_part_done && let Some(q) = self.reqs.get_mut(&req) {
                q.active = q.active.saturating_sub(1);
                if q.finished && q.active == 0 {
                    self.reqs.remove(&req);
                }
            }
        }
    }

    /// Forget every job in flight (their late results will be ignored); keep stored blocks.
    pub fn reset(&mut self) {
        self.mgr.reset_in_flight();
        self.jobs.clear();
        self.reqs.clear();
        self.meta = StepMeta::default();
        // The worker drops every host buffer the index no longer holds.
        self.meta.retain_host = Some(self.mgr.host().stored_keys());
    }

    /// Requests with state here.
    pub fn request_count(&self) -> usize {
        self.reqs.len()
    }

    /// Jobs not yet fully reported.
    pub fn job_count(&self) -> usize {
        self.jobs.len()
    }
}
