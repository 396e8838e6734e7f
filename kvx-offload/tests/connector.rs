//! Connector acceptance tests: real CPU backend, real kvx-posix file tier, both halves.

mod common;

use std::time::{Duration, Instant};

use common::scenarios::{self, corrupt_third_block, seq};
use common::*;
use kvx_core::*;
use kvx_offload::*;
use kvx_policy::{LoadDecision, LoadFailurePolicy};

const T: Duration = Duration::from_secs(10);

#[test]
fn preempt_flush_then_reload() {
    scenarios::preempt_flush_then_reload(rig);
}

#[test]
fn same_prefix_concurrent() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(7, 6, 0, 0);
    {
        // A first engine put the prefix on disk.
        let mut r = rig(dir.path(), Opts::default());
        assert!(r.offload(1, &ks, &seq(6, 0), T));
        assert_eq!(r.files.lookup(&ks), 6);
    }
    // A new engine: the prefix is only in the file tier.
    let mut r = rig(dir.path(), Opts::default());
    assert_eq!(r.load(1, &ks, &seq(6, 0)), Some(6 * BT as u64));
    r.step(); // request 1's load is in flight
    assert_eq!(
        r.sched.get_num_new_matched_tokens(RequestId(2), &ks, 0),
        None,
        "request 2 is told to ask again while the shared blocks are loading"
    );
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(1))));
    let reads = r.files.stats().loaded;
    assert_eq!(reads, 6, "the shared blocks were read from disk once");
    assert_eq!(r.load(2, &ks, &seq(6, 10)), Some(6 * BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(2))));
    assert_eq!(
        r.files.stats().loaded,
        reads,
        "request 2 was served from host memory"
    );
    assert!(r.holds(&ks, &seq(6, 0)) && r.holds(&ks, &seq(6, 10)));
    r.finish(1);
    r.finish(2);
    assert!(r.settle(T));
}

#[test]
fn abort_during_load() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = rig(
        dir.path(),
        Opts {
            host_delay: Duration::from_millis(80),
            ..Opts::default()
        },
    );
    let ks = keys(2, 0, 2, 3);
    assert!(r.offload(1, &ks, &seq(3, 0), T));
    r.out = WorkerOutput::default();
    assert!(r.load(2, &ks, &seq(3, 30)).is_some());
    r.step(); // the load (a slow engine copy) is in flight
    assert!(r.finish(2), "freeing must wait for the load");
    r.step();
    assert!(
        !r.out.finished_sending.contains(&RequestId(2)),
        "blocks kept while the copy runs"
    );
    assert!(r.step_until(T, |r| r.out.finished_sending.contains(&RequestId(2))));
    assert!(r.settle(T));
    assert!(r.pool_whole(), "nothing leaked");
}

#[test]
fn reuse_fence() {
    scenarios::reuse_fence(rig);
}

#[test]
fn complete_store_per_job() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = rig(dir.path(), Opts::default());
    let ks = keys(5, 0, 5, 4);
    r.compute(&ks, &seq(4, 0));
    let j1 = r.save(1, &ks[..2], &[0, 1]).unwrap();
    let j2 = r.save(1, &ks[2..], &[2, 3]).unwrap();
    // Run both stores for real, but hold their results back from the scheduler.
    let meta = r.sched.build_meta();
    assert!(r.w().start_step(meta).unwrap().fence().is_none());
    let mut outs = r.w().drain(T).unwrap();
    assert_eq!(
        outs.jobs
            .iter()
            .filter(|j| j.part == JobPart::StoreHost)
            .count(),
        2
    );
    // Deliver job 2's results first: only its keys become loadable.
    let (first, rest): (Vec<_>, Vec<_>) = outs.jobs.drain(..).partition(|j| j.job == j2);
    let host_part = |v: &[JobResult], keys: &[BlockKey]| {
        v.iter()
            .any(|j| j.part == JobPart::StoreHost && j.ok.as_slice() == keys)
    };
    assert!(
        host_part(&first, &ks[2..]),
        "job 2 stored its keys: {first:?}"
    );
    assert!(
        rest.iter().all(|j| j.job == j1) && host_part(&rest, &ks[..2]),
        "the other results are job 1's, with its keys: {rest:?}"
    );
    r.sched.update_from_worker(&WorkerOutput {
        jobs: first,
        ..Default::default()
    });
    let m = r.sched.manager();
    assert!(m.is_stored(Tier::Host, ks[2]) && m.is_stored(Tier::Host, ks[3]));
    assert!(m.is_storing(Tier::Host, ks[0]) && m.is_storing(Tier::Host, ks[1]));
    assert_eq!(
        m.lookup(&ks),
        Lookup::Retry,
        "job 1's keys are still in flight"
    );
    r.sched.update_from_worker(&WorkerOutput {
        jobs: rest,
        ..Default::default()
    });
    assert_eq!(r.sched.manager().lookup(&ks).blocks(), 4);
    r.finish(1);
    assert!(r.settle(T));
}

#[test]
fn load_failure_recompute() {
    scenarios::load_failure_recompute(rig);
}

#[test]
fn load_failure_fail() {
    let (mut r, _d, _ks) = corrupt_third_block(rig, LoadFailurePolicy::Fail);
    assert_eq!(
        r.out.decisions,
        vec![(
            RequestId(9),
            LoadDecision::Fail {
                failed: vec![EngineBlockId(13)]
            }
        )]
    );
    r.finish(9);
    assert!(r.settle(T));
}

#[test]
fn load_failure_auto() {
    // 5 blocks (80 tokens) to redo: under a 100-token limit it recomputes, over a 64 one it fails.
    let (mut r, _d, _ks) = corrupt_third_block(
        rig,
        LoadFailurePolicy::Auto {
            max_recompute_tokens: 100,
        },
    );
    assert!(matches!(
        r.out.decisions[0].1,
        LoadDecision::Recompute {
            first_invalid_index: 3,
            ..
        }
    ));
    r.finish(9);
    assert!(r.settle(T));
    drop(r);
    let (mut r, _d, _ks) = corrupt_third_block(
        rig,
        LoadFailurePolicy::Auto {
            max_recompute_tokens: 64,
        },
    );
    assert!(matches!(r.out.decisions[0].1, LoadDecision::Fail { .. }));
    r.finish(9);
    assert!(r.settle(T));
}

#[test]
fn reset_drops_stale() {
    scenarios::reset_drops_stale(rig);
}

#[test]
fn idle_flush_submits_queued_stores_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = rig(dir.path(), Opts::default());
    let ks = keys(12, 0, 12, 2);
    r.compute(&ks, &[0, 1]);
    r.save(1, &ks, &[0, 1]);
    assert!(r.finish(1), "the store is still queued");
    // No request remains: this single step submits the queued store without waiting for
    // another step.
    let meta = r.sched.build_meta();
    assert!(meta.submit_stores_now);
    assert!(r.w().start_step(meta).unwrap().fence().is_none());
    // Only poll from now on (no further step).
    let end = Instant::now() + T;
    let mut out = WorkerOutput::default();
    while Instant::now() < end && !out.finished_sending.contains(&RequestId(1)) {
        out.merge(r.w().get_finished().unwrap());
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        out.jobs
            .iter()
            .any(|j| j.part == JobPart::StoreHost && j.ok.len() == 2)
    );
    assert!(out.finished_sending.contains(&RequestId(1)));
}

#[test]
fn preempted_load_is_not_reported_to_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = rig(
        dir.path(),
        Opts {
            host_delay: Duration::from_millis(60),
            ..Opts::default()
        },
    );
    let ks = keys(13, 0, 13, 2);
    assert!(r.offload(1, &ks, &[0, 1], T));
    r.out = WorkerOutput::default();
    assert!(r.load(2, &ks, &[20, 21]).is_some());
    r.step(); // the (slow) load is in flight
    r.sched.request_preempted(RequestId(2));
    r.step(); // cancels it and waits for the fence
    assert!(
        r.step_until(T, |r| r.sched.job_count() == 0),
        "the scheduler still gets the job result"
    );
    assert!(
        !r.out.finished_recving.contains(&RequestId(2)),
        "a cancelled load is not a finished one: {:?}",
        r.out
    );
    assert!(
        r.out.invalid_blocks.is_empty(),
        "its blocks may belong to someone else now"
    );
    assert!(r.out.decisions.is_empty());
    r.finish(2);
    assert!(r.settle(T));
}

/// Load every block of `ks` (all offloaded) for `req` into `blocks`: byte-exact.
fn load_back(r: &mut Rig, req: u64, ks: &[BlockKey], blocks: &[u32]) {
    r.scribble(blocks);
    let tokens = ks.len() as u64 * BT as u64;
    assert_eq!(
        r.load(req, ks, blocks),
        Some(tokens),
        "request {req}: every block a hit"
    );
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(req))));
    assert!(
        r.out.invalid_blocks.is_empty(),
        "{:?}",
        r.out.invalid_blocks
    );
    assert!(r.holds(ks, blocks), "request {req}: loaded byte-exact");
    r.finish(req);
}

/// A host tier with no room (all of it being stored) and a store job larger than the host
/// tier: every block still reaches the file tier, through staging buffers that go back to the
/// pool, and every block is a hit next, loaded back byte-exact.
#[test]
fn stores_reach_the_file_tier_when_the_host_tier_has_no_room() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = rig(
        dir.path(),
        Opts {
            host_blocks: 4,
            ..Opts::default()
        },
    );
    let (k1, k2, k3) = (keys(1, 0, 1, 4), keys(2, 0, 2, 4), keys(3, 0, 3, 10));
    let (b1, b2, b3) = (seq(4, 0), seq(4, 4), seq(10, 8));
    for (ks, bs) in [(&k1, &b1), (&k2, &b2), (&k3, &b3)] {
        r.compute(ks, bs);
    }
    // Planned in one step: request 1 takes the whole host tier; 2 and 3 find no room there.
    assert!(r.save(1, &k1, &b1).is_some());
    assert!(r.save(2, &k2, &b2).is_some(), "request 2 is stored");
    assert!(r.save(3, &k3, &b3).is_some(), "request 3 is stored");
    for req in 1..=3 {
        r.finish(req);
    }
    assert!(r.settle(T));
    assert_eq!(r.sched.store_skips().get(StoreSkips::NO_ROOM), 0);
    assert_eq!(r.w().store_skips(), &StoreSkips::default());
    for ks in [&k1, &k2, &k3] {
        assert_eq!(r.files.lookup(ks), ks.len(), "every block is in a file");
    }
    assert_eq!(r.w().host_blocks(), 4);
    assert!(r.pool_whole(), "the staging buffers went back to the pool");
    // The engine's stats: every block stored in files, the host tier's four in memory.
    let st = r.w().take_stats();
    assert_eq!(st.stored_blocks.get("file"), Some(&18), "{st:?}");
    assert_eq!(st.stored_blocks.get("host"), Some(&4), "{st:?}");
    assert_eq!(st.stored_bytes.get("file"), Some(&(18 * BLOCK as u64)));
    assert!(st.store_failed_blocks.is_empty() && st.store_skipped_blocks.is_empty());
    assert!(st.loaded_blocks.is_empty() && st.load_seconds.is_empty());
    load_back(&mut r, 11, &k1, &seq(4, 30));
    load_back(&mut r, 12, &k2, &seq(4, 30));
    load_back(&mut r, 13, &k3, &seq(10, 40));
    assert!(r.settle(T));
    let st = r.w().take_stats();
    let loaded: u64 = st.loaded_blocks.values().sum();
    assert_eq!(loaded, 18, "{st:?}");
    assert_eq!(st.loaded_bytes.values().sum::<u64>(), 18 * BLOCK as u64);
    assert_eq!(st.load_seconds.len(), 3, "one latency per load");
    assert!(st.load_failed_blocks.is_empty(), "{st:?}");
    assert!(
        r.w().take_stats().is_empty(),
        "taken: the next stats start from zero"
    );
}

/// Blocks no tier has room for (host and file tiers all being stored) are stored nowhere and
/// counted, and the blocks that were stored are unaffected.
#[test]
fn blocks_no_tier_has_room_for_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = rig(
        dir.path(),
        Opts {
            host_blocks: 4,
            file_blocks: 4,
            ..Opts::default()
        },
    );
    let (k1, k2) = (keys(1, 0, 1, 4), keys(2, 0, 2, 4));
    r.compute(&k1, &seq(4, 0));
    r.compute(&k2, &seq(4, 4));
    assert!(r.save(1, &k1, &seq(4, 0)).is_some());
    assert_eq!(r.save(2, &k2, &seq(4, 4)), None, "no tier has room");
    assert_eq!(r.sched.store_skips().get(StoreSkips::NO_ROOM), 4);
    let st = r.sched.take_stats();
    assert_eq!(st.store_skipped_blocks.get(StoreSkips::NO_ROOM), Some(&4));
    assert!(r.sched.take_stats().is_empty());
    r.finish(1);
    r.finish(2);
    assert!(r.settle(T));
    assert_eq!(r.files.lookup(&k1), 4);
    assert_eq!(
        r.sched.get_num_new_matched_tokens(RequestId(3), &k2, 0),
        Some(0)
    );
    load_back(&mut r, 4, &k1, &seq(4, 30));
}

/// A store whose copy out of engine memory never returns (the engine backend holds it): at
/// its deadline its blocks, those for the host tier and those staged for the file tier only,
/// are counted as stored nowhere, by the kind of failure (`timed_out`).
#[test]
fn a_store_that_ends_in_no_tier_is_counted_by_its_failure() {
    let dir = tempfile::tempdir().unwrap();
    let (mut r, gate) = common::faults::gated_rig(
        dir.path(),
        Opts {
            host_blocks: 4,
            store_ms: 200,
            ..Opts::default()
        },
    );
    let ks = keys(5, 0, 5, 6);
    r.compute(&ks, &seq(6, 0));
    gate.close();
    assert!(r.save(1, &ks, &seq(6, 0)).is_some());
    r.finish(1);
    let timed_out = |r: &Rig| r.worker.as_ref().unwrap().store_skips().get("timed_out");
    assert!(r.step_until(T, |r| timed_out(r) == 6));
    gate.open();
    assert!(r.settle(T));
    assert_eq!(
        r.w().store_skips().iter().count(),
        1,
        "{:?}",
        r.w().store_skips()
    );
    assert_eq!(r.files.lookup(&ks), 0);
    assert_eq!(
        r.sched.get_num_new_matched_tokens(RequestId(2), &ks, 0),
        Some(0)
    );
    let st = r.w().take_stats();
    assert_eq!(st.store_skipped_blocks.get("timed_out"), Some(&6), "{st:?}");
    let failed: u64 = st.store_failed_blocks.values().sum();
    assert!(
        failed >= 6,
        "each tier's part counts its timed-out blocks: {st:?}"
    );
    assert!(
        st.store_failed_blocks
            .keys()
            .all(|(_, reason)| *reason == "timed_out"),
        "{st:?}"
    );
    assert!(st.stored_blocks.is_empty(), "{st:?}");
}
