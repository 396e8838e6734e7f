//! Scheduler-half tests: config checks, lookups and allocations, request state.

use super::*;
use crate::worker::DEFAULT_PREEMPT_WAIT;

fn sched(idle: Duration) -> SchedulerSide {
    SchedulerSide::new(SchedulerConfig {
        host_blocks: 8,
        request_idle: idle,
        ..SchedulerConfig::default()
    })
    .unwrap()
}

/// A scheduler whose host tier holds `keys` (a store of request 1000, reported done).
fn with_stored(keys: &[BlockKey]) -> SchedulerSide {
    let mut s = sched(Duration::from_secs(600));
    let pairs: Vec<_> = keys.iter().map(|k| (*k, EngineBlockId(0))).collect();
    let job = s.save_blocks(RequestId(1000), &pairs).unwrap();
    s.request_finished(RequestId(1000));
    s.update_from_worker(&host_store_done(job, RequestId(1000), keys));
    s.build_meta();
    assert_eq!(s.request_count(), 0, "the store's request is gone");
    s
}

/// The worker's report that host store `job` of `request` stored every one of `keys`.
fn host_store_done(job: crate::meta::JobId, request: RequestId, keys: &[BlockKey]) -> WorkerOutput {
    WorkerOutput {
        jobs: vec![crate::meta::JobResult {
            job,
            request,
            part: JobPart::StoreHost,
            ok: keys.to_vec(),
            failed: vec![],
            promoted: vec![],
        }],
        ..Default::default()
    }
}

fn k(i: u128) -> BlockKey {
    BlockKey(i)
}

#[test]
fn zero_file_blocks_and_zero_host_blocks_name_the_field() {
    for (cfg, field) in [
        (
            SchedulerConfig {
                file_blocks: Some(0),
                ..SchedulerConfig::default()
            },
            "file_blocks",
        ),
        (
            SchedulerConfig {
                host_blocks: 0,
                ..SchedulerConfig::default()
            },
            "host_blocks",
        ),
        (
            SchedulerConfig {
                block_tokens: 0,
                ..SchedulerConfig::default()
            },
            "block_tokens",
        ),
    ] {
        match SchedulerSide::new(cfg) {
            Err(OffloadError::Config { field: f, .. }) => assert_eq!(f, field),
            Err(e) => panic!("{field}: wrong error {e}"),
            Ok(_) => panic!("{field}: accepted"),
        }
    }
}

#[test]
fn block_tokens_of_the_halves_are_cross_checked() {
    let s = SchedulerConfig::default();
    let mut w = WorkerConfig {
        block_tokens: s.block_tokens,
        block_bytes: 4096,
        timeouts: Default::default(),
        policy: Default::default(),
        preempt_wait: DEFAULT_PREEMPT_WAIT,
    };
    assert_eq!(s.check_worker(&w), Ok(()));
    w.block_tokens = 32;
    let e = s.check_worker(&w).unwrap_err();
    assert!(
        matches!(&e, OffloadError::Config { field, .. } if field == "block_tokens"),
        "{e}"
    );
    assert!(
        e.to_string().contains("16") && e.to_string().contains("32"),
        "{e}"
    );
}

#[test]
fn a_refused_alloc_leaves_the_lookup_usable() {
    let mut s = with_stored(&[k(1), k(2)]);
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(1), &[k(1), k(2)], 0),
        Some(32)
    );
    let e = s
        .update_state_after_alloc(RequestId(1), &[EngineBlockId(5)])
        .unwrap_err();
    assert!(matches!(
        e,
        OffloadError::BlockCountMismatch {
            keys: 2,
            blocks: 1,
            ..
        }
    ));
    let job = s
        .update_state_after_alloc(RequestId(1), &[EngineBlockId(5), EngineBlockId(6)])
        .unwrap();
    assert!(job.is_some(), "the corrected retry queues the load");
    let meta = s.build_meta();
    assert_eq!(meta.loads.len(), 1);
    assert_eq!(
        meta.loads[0]
            .blocks
            .iter()
            .map(|b| b.engine)
            .collect::<Vec<_>>(),
        vec![EngineBlockId(5), EngineBlockId(6)]
    );
    // Allocating again for the same lookup is an error, not a silent "nothing matched".
    assert_eq!(
        s.update_state_after_alloc(RequestId(1), &[EngineBlockId(7)]),
        Err(OffloadError::NoPendingLookup(RequestId(1)))
    );
}

#[test]
fn unknown_requests_are_named() {
    let mut s = with_stored(&[k(1)]);
    assert_eq!(
        s.update_state_after_alloc(RequestId(9), &[EngineBlockId(1)]),
        Err(OffloadError::UnknownRequest(RequestId(9)))
    );
    assert_eq!(s.update_state_after_alloc(RequestId(9), &[]), Ok(None));
}

#[test]
fn request_state_only_for_admitted_requests() {
    let mut s = with_stored(&[k(1)]);
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(1), &[k(7)], 0),
        Some(0)
    );
    assert_eq!(
        s.request_count(),
        0,
        "a lookup that found nothing leaves no state"
    );
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(2), &[k(1)], 0),
        Some(16)
    );
    assert_eq!(s.request_count(), 1, "a hit waits for its allocation");
    assert!(!s.request_finished(RequestId(2)));
    assert_eq!(s.request_count(), 0, "finish drops it");
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(3), &[k(1)], 0),
        Some(16)
    );
    s.reset();
    assert_eq!(s.request_count(), 0, "reset drops it");
}

#[test]
fn idle_request_state_is_dropped() {
    let idle = Duration::from_millis(40);
    let mut s = sched(idle);
    let pairs = [(k(1), EngineBlockId(0))];
    let job = s.save_blocks(RequestId(1), &pairs).unwrap();
    s.update_from_worker(&host_store_done(job, RequestId(1), &[k(1)]));
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(2), &[k(1)], 0),
        Some(16)
    );
    s.build_meta();
    assert_eq!(
        s.request_count(),
        2,
        "request 1 never finished, request 2 never allocated"
    );
    std::thread::sleep(idle + idle / 2);
    s.build_meta();
    assert_eq!(
        s.request_count(),
        0,
        "both dropped after {idle:?} of silence"
    );
}

#[test]
fn output_with_only_a_decision_is_not_empty() {
    let out = WorkerOutput {
        decisions: vec![(
            RequestId(1),
            kvx_policy::LoadDecision::Fail {
                failed: vec![EngineBlockId(3)],
            },
        )],
        ..Default::default()
    };
    assert!(!out.is_empty());
    assert!(WorkerOutput::default().is_empty());
}

#[test]
fn a_missing_file_is_forgotten_and_a_corrupt_one_removed() {
    let mut s = SchedulerSide::new(SchedulerConfig {
        host_blocks: 8,
        file_blocks: Some(8),
        ..SchedulerConfig::default()
    })
    .unwrap();
    let ks = [k(1), k(2), k(3)];
    assert_eq!(s.adopt_file_blocks(ks), 3);
    assert_eq!(s.get_num_new_matched_tokens(RequestId(1), &ks, 0), Some(48));
    let blocks = [EngineBlockId(0), EngineBlockId(1), EngineBlockId(2)];
    let job = s
        .update_state_after_alloc(RequestId(1), &blocks)
        .unwrap()
        .unwrap();
    assert_eq!(s.build_meta().loads.len(), 1);
    s.update_from_worker(&WorkerOutput {
        jobs: vec![crate::meta::JobResult {
            job,
            request: RequestId(1),
            part: JobPart::Load,
            ok: vec![k(1)],
            failed: vec![
                (k(2), BlockError::NotFound),
                (k(3), BlockError::Corrupt("checksum".into())),
            ],
            promoted: vec![k(1)],
        }],
        ..Default::default()
    });
    let meta = s.build_meta();
    // On a shared mount another node may have stored k(2) again meanwhile: never unlink it.
    assert_eq!(meta.evict_file, vec![k(2)]);
    assert_eq!(meta.remove_file, vec![k(3)]);
    assert!(!s.manager().is_stored(Tier::File, k(2)));
    assert!(!s.manager().is_stored(Tier::File, k(3)));
    assert!(s.manager().is_stored(Tier::File, k(1)));
}

/// The worker's report that load `job` of `request` loaded every one of `keys`.
fn load_done(job: crate::meta::JobId, request: RequestId, keys: &[BlockKey]) -> WorkerOutput {
    WorkerOutput {
        finished_recving: vec![request],
        jobs: vec![crate::meta::JobResult {
            job,
            request,
            part: JobPart::Load,
            ok: keys.to_vec(),
            failed: vec![],
            promoted: vec![],
        }],
        ..Default::default()
    }
}

#[test]
fn reset_cache_offers_nothing_held_before_and_drops_it() {
    let keys = [k(1), k(2)];
    let mut s = with_stored(&keys);
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(1), &keys, 0),
        Some(32)
    );
    s.reset_cache();
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(2), &keys, 0),
        Some(0)
    );
    let mut dropped = s.build_meta().evict_host;
    dropped.sort();
    assert_eq!(dropped, keys, "the worker drops the host tier's buffers");
    assert_eq!(s.manager().blocks(Tier::Host), 0);
    // The tier works as before for what is stored after the reset.
    let job = s
        .save_blocks(RequestId(3), &[(k(1), EngineBlockId(4))])
        .unwrap();
    s.request_finished(RequestId(3));
    s.update_from_worker(&host_store_done(job, RequestId(3), &[k(1)]));
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(4), &keys, 0),
        Some(16)
    );
}

#[test]
fn reset_cache_forgets_a_store_in_flight_and_drops_it_when_it_lands() {
    let mut s = sched(Duration::from_secs(600));
    let job = s
        .save_blocks(RequestId(1), &[(k(7), EngineBlockId(0))])
        .unwrap();
    let meta = s.build_meta();
    assert_eq!(meta.stores.len(), 1);
    s.reset_cache();
    assert!(
        s.build_meta().evict_host.is_empty(),
        "nothing to drop before it lands"
    );
    // A new store of the same key while the old one runs is skipped (its room is taken).
    assert_eq!(
        s.save_blocks(RequestId(2), &[(k(7), EngineBlockId(1))]),
        None
    );
    s.update_from_worker(&host_store_done(job, RequestId(1), &[k(7)]));
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(3), &[k(7)], 0),
        Some(0)
    );
    assert_eq!(
        s.build_meta().evict_host,
        vec![k(7)],
        "dropped once it landed"
    );
    assert!(s.manager().is_quiet());
    // The request's lifecycle went on: it finishes without a delayed free.
    assert!(!s.request_finished(RequestId(1)));
}

#[test]
fn reset_cache_keeps_a_block_a_load_reads_until_the_load_ends() {
    let keys = [k(5)];
    let mut s = with_stored(&keys);
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(1), &keys, 0),
        Some(16)
    );
    let job = s
        .update_state_after_alloc(RequestId(1), &[EngineBlockId(3)])
        .unwrap()
        .unwrap();
    assert_eq!(s.build_meta().loads.len(), 1);
    s.reset_cache();
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(2), &keys, 0),
        Some(0)
    );
    assert!(
        s.build_meta().evict_host.is_empty(),
        "the load still reads it"
    );
    s.update_from_worker(&load_done(job, RequestId(1), &keys));
    assert_eq!(
        s.build_meta().evict_host,
        keys,
        "dropped once the load ended"
    );
    assert!(s.manager().is_quiet());
    assert_eq!(s.manager().blocks(Tier::Host), 0);
}

/// A shared file tier's probe that finds every key in `present`.
struct Finds(Vec<BlockKey>);

impl FileTierProbe for Finds {
    fn probe(&self, key: BlockKey) -> kvx_posix::ProbeAnswer {
        if self.0.contains(&key) {
            kvx_posix::ProbeAnswer::Present
        } else {
            kvx_posix::ProbeAnswer::Absent
        }
    }
}

/// The tiers of a match are those of the lookup that made it: a block the index lacks but the
/// shared tier's probe found counts as a file block (a second lookup of the index alone, as the
/// Python binding once made to count tiers, saw one host block for a two-block match).
#[test]
fn a_match_names_the_tier_of_each_block_it_found() {
    let mut s = SchedulerSide::new(SchedulerConfig {
        host_blocks: 8,
        file_blocks: Some(16),
        ..SchedulerConfig::default()
    })
    .unwrap();
    let job = s
        .save_blocks(RequestId(1000), &[(k(1), EngineBlockId(0))])
        .unwrap();
    s.request_finished(RequestId(1000));
    s.update_from_worker(&host_store_done(job, RequestId(1000), &[k(1)]));
    s.set_file_probe(std::sync::Arc::new(Finds(vec![k(2)])));
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(1), &[k(1), k(2), k(3)], 0),
        Some(32)
    );
    assert_eq!(s.matched_tiers(RequestId(1)), &[Tier::Host, Tier::File]);
    assert_eq!(
        s.manager().lookup(&[k(1), k(2), k(3)]),
        Lookup::Hit(vec![Tier::Host, Tier::File]),
        "the probe's find is in the index now"
    );
    s.update_state_after_alloc(RequestId(1), &[EngineBlockId(4), EngineBlockId(5)])
        .unwrap();
    assert!(
        s.matched_tiers(RequestId(1)).is_empty(),
        "loaded: no match pending"
    );
    assert!(s.matched_tiers(RequestId(9)).is_empty());
}
