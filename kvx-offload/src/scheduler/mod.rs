//! The scheduler half of the connector: decides what to load and store each step, and keeps
//! the tier index in step with what the worker half reports.

use std::time::{Duration, Instant, SystemTime};

use kvx_core::{BlockError, BlockKey, EngineBlockId, RequestId};
use rustc_hash::{FxHashMap, FxHashSet};
use tracing::{debug, warn};

use crate::error::OffloadError;
use crate::eviction::EvictionKind;
use crate::file_hook::FileTierProbe;
use crate::manager::{Lookup, OffloadManager};
use crate::meta::{
    JobId, JobPart, JobResult, LoadBlock, LoadJob, StepMeta, StoreJob, WorkerOutput,
};
use crate::store_skips::StoreSkips;
use crate::tier::Tier;
use crate::transfer_stats::TransferStats;
use crate::worker::WorkerConfig;

/// Settings of the scheduler half.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens per block; must equal the worker half's (default 16).
    pub block_tokens: u32,
    /// Host tier capacity in blocks (default 4096).
    pub host_blocks: usize,
    /// File tier capacity in blocks (`None`, the default: no file tier; `Some(0)` is refused).
    pub file_blocks: Option<usize>,
    /// Eviction order of both tiers (default LRU).
    pub eviction: EvictionKind,
    /// State of a request that nothing names for this long is dropped with a warning: a lookup
    /// never allocated, or an admitted request never finished (default 10 minutes).
    pub request_idle: Duration,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            block_tokens: 16,
            host_blocks: 4096,
            file_blocks: None,
            eviction: EvictionKind::Lru,
            request_idle: Duration::from_secs(600),
        }
    }
}

impl SchedulerConfig {
    /// Check the settings; the error names the bad field.
    pub fn validate(&self) -> Result<(), OffloadError> {
        if self.block_tokens == 0 {
            return Err(OffloadError::config("block_tokens", "must be at least 1"));
        }
        if self.host_blocks == 0 {
            return Err(OffloadError::config("host_blocks", "must be at least 1"));
        }
        if self.file_blocks == Some(0) {
            return Err(OffloadError::config(
                "file_blocks",
                "Some(0) would turn the file tier off; use None for no file tier",
            ));
        }
        if self.request_idle.is_zero() {
            return Err(OffloadError::config("request_idle", "must be positive"));
        }
        Ok(())
    }

    /// Check the settings that both halves carry against the worker half's: call it when the
    /// two halves are built separately (the builder sets them once for both).
    pub fn check_worker(&self, worker: &WorkerConfig) -> Result<(), OffloadError> {
        if self.block_tokens != worker.block_tokens {
            return Err(OffloadError::config(
                "block_tokens",
                format!(
                    "the scheduler half has {} tokens per block, the worker half {}",
                    self.block_tokens, worker.block_tokens
                ),
            ));
        }
        Ok(())
    }
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
    /// A load from a remote producer (nothing in the tier index to update).
    Remote,
}

/// A lookup that found blocks, waiting for the engine to allocate for them.
struct PendingLookup {
    keys: Vec<BlockKey>,
    tiers: Vec<Tier>,
    at: Instant,
}

/// An admitted request: one with a load or a store.
struct Req {
    /// Jobs whose engine-memory part is not reported yet.
    active: u32,
    finished: bool,
    last_seen: Instant,
}

impl Req {
    fn new(now: Instant) -> Req {
        Req {
            active: 0,
            finished: false,
            last_seen: now,
        }
    }
}

/// How often idle request state is looked for, at most (a quarter of the idle time if shorter).
const IDLE_SWEEP: Duration = Duration::from_secs(1);

/// The scheduler half.
pub struct SchedulerSide {
    mgr: OffloadManager,
    block_tokens: u32,
    next_job: u64,
    reqs: FxHashMap<RequestId, Req>,
    lookups: FxHashMap<RequestId, PendingLookup>,
    request_idle: Duration,
    last_sweep: Instant,
    jobs: FxHashMap<JobId, (RequestId, JobInfo)>,
    meta: StepMeta,
    probe: Option<std::sync::Arc<dyn FileTierProbe>>,
    /// The newest listing of the shared file tier taken into account.
    listing_pass: u64,
    /// Write-back: blocks that left the host tier, to write in this step's write-back job.
    write_back_pending: Vec<(BlockKey, SystemTime)>,
    /// Write-back jobs in flight: their keys, each with its last use.
    write_backs: FxHashMap<JobId, Vec<(BlockKey, SystemTime)>>,
    /// Workers behind this half (see [`SchedulerSide::set_world`]).
    world: u32,
    /// Job parts some ranks reported and others not yet.
    partials: ranks::Partials,
    /// Blocks no tier had room for.
    skips: StoreSkips,
    /// Blocks no tier had room for since [`SchedulerSide::take_stats`].
    stats: TransferStats,
}

/// Most keys one lookup asks a shared file tier about.
const MAX_PROBES_PER_LOOKUP: usize = 1024;

impl SchedulerSide {
    /// A scheduler half with empty tiers; an invalid `cfg` is refused.
    pub fn new(cfg: SchedulerConfig) -> Result<SchedulerSide, OffloadError> {
        cfg.validate()?;
        Ok(SchedulerSide {
            mgr: OffloadManager::new(cfg.host_blocks, cfg.file_blocks, cfg.eviction),
            block_tokens: cfg.block_tokens,
            next_job: 1,
            reqs: FxHashMap::default(),
            lookups: FxHashMap::default(),
            request_idle: cfg.request_idle,
            last_sweep: Instant::now(),
            jobs: FxHashMap::default(),
            meta: StepMeta::default(),
            probe: None,
            listing_pass: 0,
            write_back_pending: Vec::new(),
            write_backs: FxHashMap::default(),
            world: 1,
            partials: ranks::Partials::default(),
            skips: StoreSkips::default(),
            stats: TransferStats::default(),
        })
    }

    /// The tier index.
    pub fn manager(&self) -> &OffloadManager {
        &self.mgr
    }

    /// Blocks [`SchedulerSide::save_blocks`] put in no tier, by reason (`no_room`; the workers
    /// count the blocks whose stores failed).
    pub fn store_skips(&self) -> &StoreSkips {
        &self.skips
    }

    /// Blocks no tier had room for since the last call (the workers count what they moved:
    /// [`crate::WorkerSide::take_stats`]).
    pub fn take_stats(&mut self) -> TransferStats {
        self.stats.take()
    }

    /// Adopt blocks already in the file tier (its startup scan), up to its capacity; returns
    /// how many were taken.
    pub fn adopt_file_blocks(&mut self, keys: impl IntoIterator<Item = BlockKey>) -> usize {
        self.mgr.adopt_file_blocks(keys)
    }

    /// Consult `probe` when a lookup misses the file tier's index (a file tier shared with other
    /// nodes): blocks it finds are loaded from the file tier, and a probe in flight makes the
    /// lookup answer "ask again later".
    pub fn set_file_probe(&mut self, probe: std::sync::Arc<dyn FileTierProbe>) {
        self.probe = Some(probe);
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// An admitted request's state, created when it gets its first job.
    fn admit(&mut self, req: RequestId) -> &mut Req {
        let now = Instant::now();
        let r = self.reqs.entry(req).or_insert_with(|| Req::new(now));
        r.last_seen = now;
        r
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
        self.lookups.remove(&req);
        match self.lookup_with_probes(rest) {
            Lookup::Retry => None,
            Lookup::Hit(tiers) => {
                let n = tiers.len();
                if n > 0 {
                    let lookup = PendingLookup {
                        keys: rest[..n].to_vec(),
                        tiers,
                        at: Instant::now(),
                    };
                    self.lookups.insert(req, lookup);
                }
                Some(n as u64 * self.block_tokens as u64)
            }
        }
    }

    /// The tiers of the longest prefix of `keys` the tiers hold (probing a shared file tier,
    /// as a request's lookup does), without a request: a storage backend's "exists".
    pub fn lookup(&mut self, keys: &[BlockKey]) -> Lookup {
        self.lookup_with_probes(keys)
    }

    /// The tier of each block the last [`SchedulerSide::get_num_new_matched_tokens`] of `req`
    /// matched, in order (empty when it matched nothing or the match was loaded since): what
    /// that lookup found, without looking again.
    pub fn matched_tiers(&self, req: RequestId) -> &[Tier] {
        self.lookups.get(&req).map_or(&[], |l| l.tiers.as_slice())
    }

    /// The engine allocated `engine_blocks` for the tokens matched by the last
    /// `get_num_new_matched_tokens`: the load is queued for this step. `Ok(None)`: nothing was
    /// matched and no blocks were given. A refused call changes nothing: the lookup stays
    /// pending and a corrected call loads it.
    pub fn update_state_after_alloc(
        &mut self,
        req: RequestId,
        engine_blocks: &[EngineBlockId],
    ) -> Result<Option<JobId>, OffloadError> {
        let Some(lookup) = self.lookups.get(&req) else {
            return match (engine_blocks.is_empty(), self.reqs.contains_key(&req)) {
                (true, _) => Ok(None),
                (false, true) => Err(OffloadError::NoPendingLookup(req)),
                (false, false) => Err(OffloadError::UnknownRequest(req)),
            };
        };
        if engine_blocks.len() != lookup.keys.len() {
            return Err(OffloadError::BlockCountMismatch {
                request: req,
                keys: lookup.keys.len(),
                blocks: engine_blocks.len(),
            });
        }
        let Some(PendingLookup { keys, tiers, .. }) = self.lookups.remove(&req) else {
            return Err(OffloadError::UnknownRequest(req));
        };
        let (promote, evicted) = self.mgr.prepare_load(&keys, &tiers);
        self.meta.evict_host.extend(evicted);
        self.queue_write_back();
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
        self.admit(req).active += 1;
        Ok(Some(job))
    }

    /// Save computed blocks of `req` (full blocks, keyed). Blocks already offloaded are
    /// skipped; each tier takes the new blocks it has room for (the file tier whether or not
    /// the host tier took them), and blocks no tier has room for are counted in
    /// [`SchedulerSide::store_skips`].
    pub fn save_blocks(
        &mut self,
        req: RequestId,
        blocks: &[(BlockKey, EngineBlockId)],
    ) -> Option<JobId> {
        let keys: Vec<BlockKey> = blocks.iter().map(|b| b.0).collect();
        self.mgr.touch(&keys);
        let d = self.mgr.prepare_store(&keys);
        if !d.no_room.is_empty() {
            debug!(request = %req, blocks = d.no_room.len(), "no tier had room: blocks not stored");
        }
        self.skips.record(StoreSkips::NO_ROOM, d.no_room.len());
        self.stats
            .skipped(StoreSkips::NO_ROOM, d.no_room.len() as u64);
        self.meta.evict_host.extend(d.evicted_host);
        self.meta.evict_file.extend(d.evicted_file);
        self.queue_write_back();
        if d.host.is_empty() && d.file.is_empty() {
            return None;
        }
        let job = self.job_id();
        let host: FxHashSet<BlockKey> = d.host.iter().copied().collect();
        let mut chosen_keys: FxHashSet<BlockKey> = host.iter().chain(&d.file).copied().collect();
        let chosen: Vec<(BlockKey, EngineBlockId)> = blocks
            .iter()
            .copied()
            .filter(|(k, _)| chosen_keys.remove(k))
            .collect();
        let file_only = d
            .file
            .iter()
            .copied()
            .filter(|k| !host.contains(k))
            .collect();
        let file_pending = !d.file.is_empty();
        self.meta.stores.push(StoreJob {
            job,
            request: req,
            blocks: chosen,
            write_file: d.file,
            file_only,
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
        self.admit(req).active += 1;
        Some(job)
    }

    /// The engine preempted `req`: its pending (not yet allocated) load is dropped.
    pub fn request_preempted(&mut self, req: RequestId) {
        self.lookups.remove(&req);
        if let Some(r) = self.reqs.get_mut(&req) {
            r.last_seen = Instant::now();
        }
        self.meta.preempted.push(req);
    }

    /// The engine is done with `req`; true when freeing its blocks must wait until the worker
    /// reports it in `finished_sending`.
    pub fn request_finished(&mut self, req: RequestId) -> bool {
        self.meta.finished.push(req);
        self.lookups.remove(&req);
        let Some(r) = self.reqs.get_mut(&req) else {
            return false;
        };
        r.finished = true;
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
        self.drop_idle(Instant::now());
        self.forget_unlisted();
        self.start_write_back();
        let (host, file) = self.mgr.take_dropped();
        self.meta.evict_host.extend(host);
        self.meta.evict_file.extend(file);
        let mut m = std::mem::take(&mut self.meta);
        m.submit_stores_now = self.reqs.values().all(|r| r.finished);
        m
    }

    /// Take in what the worker reported (with several workers: what rank 0 reported, see
    /// [`SchedulerSide::update_from_rank`]).
    pub fn update_from_worker(&mut self, out: &WorkerOutput) {
        self.update_from_rank(0, out);
    }

    /// Apply job results (a single worker's, or the ranks' merged ones).
    fn apply_results(&mut self, results: &[JobResult]) {
        for r in results {
            if let Some(used) = self.write_backs.remove(&r.job) {
                self.write_back_done(r, &used);
                continue;
            }
            let Some((req, info)) = self.jobs.get_mut(&r.job) else {
                continue; // a job from before a reset
            };
            let req = *req;
            let failed: Vec<BlockKey> = r.failed.iter().map(|f| f.0).collect();
            let mut engine_part_done = false;
            let mut job_done = false;
            match (info, r.part) {
                (
                    JobInfo::Load {
                        keys,
                        tiers,
                        promote,
                    },
                    JobPart::Load,
                ) => {
                    let invalid: Vec<BlockKey> = r
                        .failed
                        .iter()
                        .filter(|(_, e)| matches!(e, BlockError::Corrupt(_) | BlockError::NotFound))
                        .map(|f| f.0)
                        .collect();
                    let removed =
                        self.mgr
                            .complete_load(keys, tiers, promote, &invalid, &r.promoted);
                    // A corrupt file is removed; a missing one is only forgotten: on a shared
                    // mount another node may have stored the block again under that name.
                    let (gone, corrupt): (Vec<BlockKey>, Vec<BlockKey>) =
                        removed.into_iter().partition(|k| {
                            r.failed
                                .iter()
                                .any(|(f, e)| f == k && matches!(e, BlockError::NotFound))
                        });
                    self.meta.evict_file.extend(gone);
                    self.meta.remove_file.extend(corrupt);
                    engine_part_done = true;
                    job_done = true;
                }
                (
                    JobInfo::Store {
                        host_pending,
                        file_pending,
                    },
                    JobPart::StoreHost,
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
                    JobPart::StoreFile,
                ) => {
                    self.mgr.complete_store(Tier::File, &r.ok, true);
                    self.mgr.complete_store(Tier::File, &failed, false);
                    *file_pending = false;
                    job_done = !*host_pending;
                }
                (JobInfo::Remote, JobPart::Load) => {
                    engine_part_done = true;
                    job_done = true;
                }
                _ => {}
            }
            if job_done {
                self.jobs.remove(&r.job);
            }
            if engine_part_done && let Some(q) = self.reqs.get_mut(&req) {
                q.last_seen = Instant::now();
                q.active = q.active.saturating_sub(1);
                if q.finished && q.active == 0 {
                    self.reqs.remove(&req);
                }
            }
        }
    }

    /// Forget every block the tiers hold (the engine reset its prefix cache, e.g. because the
    /// model's weights changed): no lookup offers one again, the next [`StepMeta`] drops them
    /// from the host tier and removes their files (on a shared mount: forgets them), and blocks
    /// a load or store in flight still touches follow once it ended. Requests and their jobs
    /// go on; a store planned before the reset stores nothing that is ever offered.
    pub fn reset_cache(&mut self) {
        let (host, file) = self.mgr.forget_all();
        self.meta.evict_host.extend(host);
        self.meta.evict_file.extend(file);
        self.lookups.clear();
        self.write_back_pending.clear();
    }

    /// Forget every job in flight (their late results will be ignored); keep stored blocks.
    pub fn reset(&mut self) {
        self.mgr.reset_in_flight();
        self.write_backs.clear();
        self.write_back_pending.clear();
        self.partials.clear();
        self.jobs.clear();
        self.reqs.clear();
        self.lookups.clear();
        self.meta = StepMeta::default();
        // The worker drops every host buffer the index no longer holds.
        self.meta.retain_host = Some(self.mgr.stored_keys(Tier::Host));
    }

    /// Drop the state of requests nothing named for `request_idle`: lookups never allocated,
    /// and admitted requests with no job left that never finished.
    fn drop_idle(&mut self, now: Instant) {
        if now.duration_since(self.last_sweep) < IDLE_SWEEP.min(self.request_idle / 4) {
            return;
        }
        self.last_sweep = now;
        let idle = self.request_idle;
        self.lookups.retain(|req, l| {
            let keep = now.duration_since(l.at) < idle;
            if !keep {
                warn!(request = %req, ?idle, "dropping a lookup that was never allocated");
            }
            keep
        });
        self.reqs.retain(|req, r| {
            let keep = r.active > 0 || now.duration_since(r.last_seen) < idle;
            if !keep {
                warn!(request = %req, ?idle, "dropping the state of a request that never finished");
            }
            keep
        });
    }

    /// Requests with state here: admitted ones, and lookups waiting for an allocation.
    pub fn request_count(&self) -> usize {
        self.reqs.len() + self.lookups.len()
    }

    /// Jobs not yet fully reported.
    pub fn job_count(&self) -> usize {
        self.jobs.len() + self.write_backs.len()
    }
}

mod ranks;
mod remote;
mod shared;
#[cfg(test)]
mod tests;
