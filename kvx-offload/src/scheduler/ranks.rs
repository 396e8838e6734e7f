//! Several workers (tensor- and pipeline-parallel ranks) behind one scheduler half.
//!
//! Every rank receives the same [`StepMeta`](crate::StepMeta) and runs each job on its own shard
//! of the KV cache (its heads, its layers), with its own host tier and its own file-tier
//! directory. The index here stays one index of logical blocks, so a job's outcome counts only
//! once every rank reported it: a block is stored (or loaded, or promoted) when every rank says
//! so, and failed when any rank failed it. The ranks' results of one job can arrive in different
//! steps (each rank's copy threads finish when they finish), so they are collected here, per job
//! and part, until all `world` ranks reported; only then is the merged result applied, exactly
//! as a single worker's would be.
//!
//! What a minority of ranks did beyond the merged outcome is undone through the next step's
//! metadata, so the ranks' tiers stay identical to the index: a block some ranks stored into
//! their host tier (or promoted there) while another failed it is evicted from every host tier;
//! a block some ranks wrote to their file-tier shard while another failed is evicted from every
//! shard.

use kvx_core::{BlockError, BlockKey, RequestId};
use rustc_hash::{FxHashMap, FxHashSet};
use tracing::warn;

use super::{JobInfo, SchedulerSide};
use crate::meta::{JobId, JobPart, JobResult, WorkerOutput};

/// One job part's results from the ranks that reported so far.
pub(super) struct Partial {
    request: RequestId,
    /// Ranks that reported.
    ranks: FxHashSet<u32>,
    /// Keys some rank reported ok, in first-report order, with how many ranks did.
    ok: Vec<(BlockKey, u32)>,
    /// Keys some rank failed, in first-report order, with the first rank's error.
    failed: Vec<(BlockKey, BlockError)>,
    /// Keys some rank promoted into its host tier, with how many ranks did.
    promoted: Vec<(BlockKey, u32)>,
}

impl Partial {
    fn new(request: RequestId) -> Partial {
        Partial {
            request,
            ranks: FxHashSet::default(),
            ok: Vec::new(),
            failed: Vec::new(),
            promoted: Vec::new(),
        }
    }

    fn add(&mut self, r: &JobResult) {
        count(&mut self.ok, &r.ok);
        count(&mut self.promoted, &r.promoted);
        for (k, e) in &r.failed {
            if !self.failed.iter().any(|(f, _)| f == k) {
                self.failed.push((*k, e.clone()));
            }
        }
    }

    /// The merged result, and the keys some ranks (not all) hold beyond it: stored (ok on a
    /// store part) or promoted on some rank, yet not in the merged `ok` or `promoted`. A load
    /// that was ok on some ranks changed no tier there (its block was in the host tier before
    /// and stays): only its promotions can be held beyond the merged result.
    fn merge(self, job: JobId, part: JobPart, world: u32) -> (JobResult, Vec<BlockKey>) {
        let failed_keys: FxHashSet<BlockKey> = self.failed.iter().map(|f| f.0).collect();
        let everywhere = |v: &[(BlockKey, u32)]| -> Vec<BlockKey> {
            v.iter()
                .filter(|(k, n)| *n == world && !failed_keys.contains(k))
                .map(|(k, _)| *k)
                .collect()
        };
        let ok = everywhere(&self.ok);
        let promoted = everywhere(&self.promoted);
        let ok_set: FxHashSet<BlockKey> = ok.iter().copied().collect();
        let promoted_set: FxHashSet<BlockKey> = promoted.iter().copied().collect();
        let mut stray: Vec<BlockKey> = Vec::new();
        if part != JobPart::Load {
            for (k, _) in &self.ok {
                if !ok_set.contains(k) {
                    stray.push(*k);
                }
            }
        }
        for (k, _) in &self.promoted {
            if !promoted_set.contains(k) && !stray.contains(k) {
                stray.push(*k);
            }
        }
        // A key some rank reported ok and another neither ok nor failed (none expected) fails
        // too, so that the index never waits for it.
        let mut failed = self.failed;
        for (k, _) in &self.ok {
            if !ok_set.contains(k) && !failed_keys.contains(k) {
                failed.push((*k, BlockError::Invalid("not reported by every rank".into())));
            }
        }
        let merged = JobResult {
            job,
            request: self.request,
            part,
            ok,
            failed,
            promoted,
        };
        (merged, stray)
    }
}

fn count(acc: &mut Vec<(BlockKey, u32)>, keys: &[BlockKey]) {
    for k in keys {
        match acc.iter_mut().find(|(a, _)| a == k) {
            Some((_, n)) => *n += 1,
            None => acc.push((*k, 1)),
        }
    }
}

impl SchedulerSide {
    /// The number of workers behind this scheduler half (tensor-parallel size × pipeline-parallel
    /// size; default 1). With more than one, job results count only once every rank reported
    /// them (see [`SchedulerSide::update_from_rank`]). Refused (`false`, nothing changes) while
    /// a job is in flight, or for 0.
    pub fn set_world(&mut self, world: u32) -> bool {
        if world == 0 || !self.jobs.is_empty() || !self.write_backs.is_empty() {
            return false;
        }
        self.world = world;
        true
    }

    /// The number of workers behind this scheduler half.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// Take in what worker `rank` (of [`SchedulerSide::world`]) reported. A job part's results
    /// are applied once every rank reported it, merged: a block is ok when every rank stored,
    /// loaded or promoted it, failed when any rank failed it. Returns the merged results
    /// applied by this call. A rank reporting a job part twice, or a rank outside the world,
    /// is ignored with a warning. With a world of 1 each result is applied as it comes.
    pub fn update_from_rank(&mut self, rank: u32, out: &WorkerOutput) -> Vec<JobResult> {
        if self.world <= 1 {
            self.apply_results(&out.jobs);
            return out.jobs.clone();
        }
        if rank >= self.world {
            warn!(
                rank,
                world = self.world,
                "job results of a rank outside the world ignored"
            );
            return Vec::new();
        }
        let mut ready = Vec::new();
        for r in &out.jobs {
            if !self.part_pending(r.job, r.part) {
                // A job from before a reset, or a part already merged (a rank's report replayed
                // late, as vLLM 0.33 may after a worker failure): nothing waits for it.
                continue;
            }
            let p = self
                .partials
                .entry((r.job, r.part))
                .or_insert_with(|| Partial::new(r.request));
            if !p.ranks.insert(rank) {
                warn!(rank, job = r.job.0, part = ?r.part, "a rank reported a job part twice; ignored");
                continue;
            }
            p.add(r);
            if p.ranks.len() == self.world as usize
                && let Some(p) = self.partials.remove(&(r.job, r.part))
            {
                let (merged, stray) = p.merge(r.job, r.part, self.world);
                match r.part {
                    JobPart::StoreFile => self.meta.evict_file.extend(stray),
                    JobPart::Load | JobPart::StoreHost => self.meta.evict_host.extend(stray),
                }
                ready.push(merged);
            }
        }
        self.apply_results(&ready);
        ready
    }

    /// True while `part` of `job` has not been applied yet.
    fn part_pending(&self, job: JobId, part: JobPart) -> bool {
        match self.jobs.get(&job) {
            Some((
                _,
                JobInfo::Store {
                    host_pending,
                    file_pending,
                },
            )) => match part {
                JobPart::StoreHost => *host_pending,
                JobPart::StoreFile => *file_pending,
                JobPart::Load => false,
            },
            Some((_, JobInfo::Load { .. } | JobInfo::Remote)) => part == JobPart::Load,
            None => self.write_backs.contains_key(&job) && part == JobPart::StoreFile,
        }
    }

    /// Job parts some ranks reported and others not yet.
    pub fn partial_count(&self) -> usize {
        self.partials.len()
    }
}

/// The key of [`SchedulerSide`]'s partial results.
pub(super) type PartialKey = (JobId, JobPart);

/// Partial results by job part.
pub(super) type Partials = FxHashMap<PartialKey, Partial>;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kvx_core::EngineBlockId;

    use super::*;
    use crate::manager::Lookup;
    use crate::scheduler::SchedulerConfig;
    use crate::tier::Tier;

    fn k(i: u128) -> BlockKey {
        BlockKey(i)
    }

    fn sched(world: u32, file: bool) -> SchedulerSide {
        let mut s = SchedulerSide::new(SchedulerConfig {
            host_blocks: 8,
            file_blocks: file.then_some(16),
            request_idle: Duration::from_secs(600),
            ..SchedulerConfig::default()
        })
        .unwrap();
        assert!(s.set_world(world));
        s
    }

    fn result(
        job: JobId,
        request: RequestId,
        part: JobPart,
        ok: &[BlockKey],
        failed: &[(BlockKey, BlockError)],
        promoted: &[BlockKey],
    ) -> WorkerOutput {
        WorkerOutput {
            jobs: vec![JobResult {
                job,
                request,
                part,
                ok: ok.to_vec(),
                failed: failed.to_vec(),
                promoted: promoted.to_vec(),
            }],
            ..WorkerOutput::default()
        }
    }

    fn store(s: &mut SchedulerSide, req: u64, keys: &[BlockKey]) -> JobId {
        let pairs: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (*k, EngineBlockId(i as u32)))
            .collect();
        s.save_blocks(RequestId(req), &pairs).unwrap()
    }

    #[test]
    fn a_store_counts_once_every_rank_reported_it_even_in_later_steps() {
        let mut s = sched(2, false);
        let (a, b) = (k(1), k(2));
        let job = store(&mut s, 1, &[a, b]);
        assert!(
            s.request_finished(RequestId(1)),
            "freeing waits for the store"
        );
        s.build_meta();
        let applied = s.update_from_rank(
            1,
            &result(job, RequestId(1), JobPart::StoreHost, &[a, b], &[], &[]),
        );
        assert!(applied.is_empty(), "one rank of two reported");
        assert_eq!(
            s.manager().lookup(&[a]),
            Lookup::Retry,
            "still being stored"
        );
        assert_eq!((s.partial_count(), s.request_count()), (1, 1));
        s.build_meta(); // the other rank's result comes a step later
        let applied = s.update_from_rank(
            0,
            &result(job, RequestId(1), JobPart::StoreHost, &[a, b], &[], &[]),
        );
        assert_eq!(applied.len(), 1);
        assert_eq!(applied[0].ok, vec![a, b]);
        assert_eq!(
            s.manager().lookup(&[a, b]),
            Lookup::Hit(vec![Tier::Host, Tier::Host])
        );
        assert_eq!(
            (s.partial_count(), s.request_count(), s.job_count()),
            (0, 0, 0)
        );
        assert!(s.build_meta().evict_host.is_empty());
    }

    #[test]
    fn a_part_reported_again_after_it_was_merged_leaves_nothing_behind() {
        let mut s = sched(2, true);
        let a = k(1);
        let job = store(&mut s, 1, &[a]);
        s.build_meta();
        let host = result(job, RequestId(1), JobPart::StoreHost, &[a], &[], &[]);
        assert!(s.update_from_rank(0, &host).is_empty());
        assert_eq!(s.update_from_rank(1, &host).len(), 1);
        // The file part is still out; rank 1's host report comes again (replayed late).
        assert!(s.update_from_rank(1, &host).is_empty());
        assert_eq!(
            s.partial_count(),
            0,
            "a replayed part opened a partial that never closes"
        );
        let file = result(job, RequestId(1), JobPart::StoreFile, &[a], &[], &[]);
        assert!(s.update_from_rank(0, &file).is_empty());
        assert_eq!(s.update_from_rank(1, &file).len(), 1);
        assert!(s.update_from_rank(0, &file).is_empty());
        assert_eq!((s.partial_count(), s.job_count()), (0, 0));
    }

    #[test]
    fn a_block_one_rank_failed_is_not_stored_and_leaves_every_host_tier() {
        let mut s = sched(4, false);
        let (a, b, c) = (k(1), k(2), k(3));
        let job = store(&mut s, 1, &[a, b, c]);
        s.build_meta();
        let full = result(job, RequestId(1), JobPart::StoreHost, &[a, b, c], &[], &[]);
        for rank in [0, 1, 3] {
            assert!(s.update_from_rank(rank, &full).is_empty());
        }
        let err = BlockError::Unavailable("host pool exhausted".into());
        let applied = s.update_from_rank(
            2,
            &result(
                job,
                RequestId(1),
                JobPart::StoreHost,
                &[a, c],
                &[(b, err.clone())],
                &[],
            ),
        );
        assert_eq!(applied[0].ok, vec![a, c]);
        assert_eq!(applied[0].failed, vec![(b, err)]);
        assert_eq!(s.manager().lookup(&[a]), Lookup::Hit(vec![Tier::Host]));
        assert_eq!(
            s.manager().lookup(&[b]),
            Lookup::Hit(vec![]),
            "b is not stored"
        );
        assert!(!s.manager().is_storing(Tier::Host, b));
        // Ranks 0, 1 and 3 hold b in their host tiers: every rank drops it.
        assert_eq!(s.build_meta().evict_host, vec![b]);
    }

    #[test]
    fn a_load_one_rank_failed_fails_the_block_and_drops_its_promotions() {
        let mut s = sched(2, true);
        let (a, b) = (k(1), k(2));
        assert_eq!(s.adopt_file_blocks([a, b]), 2);
        assert_eq!(
            s.get_num_new_matched_tokens(RequestId(7), &[a, b], 0),
            Some(32)
        );
        let job = s
            .update_state_after_alloc(RequestId(7), &[EngineBlockId(3), EngineBlockId(4)])
            .unwrap()
            .unwrap();
        let meta = s.build_meta();
        assert!(meta.loads[0].blocks.iter().all(|b| b.promote));
        s.update_from_rank(
            0,
            &result(job, RequestId(7), JobPart::Load, &[a, b], &[], &[a, b]),
        );
        assert_eq!(
            s.manager().lookup(&[a]),
            Lookup::Retry,
            "promotion in flight"
        );
        let corrupt = BlockError::Corrupt("payload checksum".into());
        let applied = s.update_from_rank(
            1,
            &result(
                job,
                RequestId(7),
                JobPart::Load,
                &[a],
                &[(b, corrupt.clone())],
                &[a],
            ),
        );
        assert_eq!(applied[0].failed, vec![(b, corrupt)]);
        assert_eq!(applied[0].promoted, vec![a]);
        // a is promoted on both ranks; b's shard is corrupt on rank 1: its files go (every
        // shard), and rank 0's promoted copy leaves the host tier.
        assert_eq!(s.manager().lookup(&[a, b]), Lookup::Hit(vec![Tier::Host]));
        let meta = s.build_meta();
        assert_eq!(meta.remove_file, vec![b]);
        assert_eq!(meta.evict_host, vec![b]);
        assert!(s.manager().is_quiet());
        assert_eq!((s.request_count(), s.job_count()), (1, 0));
    }

    #[test]
    fn a_host_load_one_rank_failed_fails_the_block_and_keeps_it_in_every_host_tier() {
        let mut s = sched(2, false);
        let a = k(1);
        let job = store(&mut s, 1, &[a]);
        s.build_meta();
        let stored = result(job, RequestId(1), JobPart::StoreHost, &[a], &[], &[]);
        s.update_from_rank(0, &stored);
        s.update_from_rank(1, &stored);
        assert_eq!(
            s.get_num_new_matched_tokens(RequestId(2), &[a], 0),
            Some(16)
        );
        let job = s
            .update_state_after_alloc(RequestId(2), &[EngineBlockId(5)])
            .unwrap()
            .unwrap();
        s.build_meta();
        s.update_from_rank(0, &result(job, RequestId(2), JobPart::Load, &[a], &[], &[]));
        let late = BlockError::TimedOut;
        let applied = s.update_from_rank(
            1,
            &result(
                job,
                RequestId(2),
                JobPart::Load,
                &[],
                &[(a, late.clone())],
                &[],
            ),
        );
        assert_eq!(applied[0].failed, vec![(a, late)]);
        // The copy out of rank 1's host tier timed out; the block is still in both host tiers
        // and in the index: nothing is evicted, the next request hits it again.
        assert!(s.build_meta().evict_host.is_empty());
        assert_eq!(s.manager().lookup(&[a]), Lookup::Hit(vec![Tier::Host]));
    }

    #[test]
    fn a_file_write_one_rank_failed_is_removed_from_every_shard() {
        let mut s = sched(2, true);
        let (a, b) = (k(1), k(2));
        let job = store(&mut s, 1, &[a, b]);
        assert_eq!(s.build_meta().stores[0].write_file, vec![a, b]);
        let host = result(job, RequestId(1), JobPart::StoreHost, &[a, b], &[], &[]);
        s.update_from_rank(0, &host);
        s.update_from_rank(1, &host);
        let io = BlockError::Io("ENOSPC".into());
        s.update_from_rank(
            0,
            &result(job, RequestId(1), JobPart::StoreFile, &[a, b], &[], &[]),
        );
        s.update_from_rank(
            1,
            &result(job, RequestId(1), JobPart::StoreFile, &[a], &[(b, io)], &[]),
        );
        assert!(s.manager().is_stored(Tier::File, a));
        assert!(!s.manager().is_stored(Tier::File, b) && !s.manager().is_storing(Tier::File, b));
        assert_eq!(
            s.build_meta().evict_file,
            vec![b],
            "rank 0's shard of b goes"
        );
        assert_eq!(s.job_count(), 0);
    }

    #[test]
    fn duplicates_strangers_and_stale_jobs_are_ignored() {
        let mut s = sched(2, false);
        let a = k(1);
        let job = store(&mut s, 1, &[a]);
        s.build_meta();
        let r = result(job, RequestId(1), JobPart::StoreHost, &[a], &[], &[]);
        assert!(s.update_from_rank(0, &r).is_empty());
        assert!(
            s.update_from_rank(0, &r).is_empty(),
            "rank 0 again: not rank 1"
        );
        assert!(
            s.update_from_rank(2, &r).is_empty(),
            "no rank 2 in a world of 2"
        );
        assert_eq!(s.manager().lookup(&[a]), Lookup::Retry);
        assert_eq!(s.update_from_rank(1, &r).len(), 1);
        assert_eq!(s.manager().lookup(&[a]), Lookup::Hit(vec![Tier::Host]));
        // After a reset, late results of forgotten jobs change nothing.
        let job2 = store(&mut s, 2, &[k(2)]);
        s.update_from_rank(
            0,
            &result(job2, RequestId(2), JobPart::StoreHost, &[k(2)], &[], &[]),
        );
        s.reset();
        assert_eq!(s.partial_count(), 0);
        assert!(
            s.update_from_rank(
                1,
                &result(job2, RequestId(2), JobPart::StoreHost, &[k(2)], &[], &[])
            )
            .is_empty()
        );
    }

    #[test]
    fn the_world_is_set_only_while_no_job_is_in_flight() {
        let mut s = sched(1, false);
        assert!(!s.set_world(0));
        let job = store(&mut s, 1, &[k(1)]);
        assert!(!s.set_world(2), "a job in flight");
        assert_eq!(s.world(), 1);
        // A world of one applies each result at once, as before.
        let applied = s.update_from_rank(
            0,
            &result(job, RequestId(1), JobPart::StoreHost, &[k(1)], &[], &[]),
        );
        assert_eq!(applied.len(), 1);
        assert!(s.set_world(2));
        assert_eq!(s.world(), 2);
    }
}
