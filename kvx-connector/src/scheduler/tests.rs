//! The scheduler core over kvx-offload's real scheduler side, driven as an engine adapter
//! drives it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvx_core::BlockError;
use kvx_offload::{FileTierProbe, JobPart, JobResult, ProbeAnswer, SchedulerConfig, WorkerOutput};

use super::*;
use crate::Namespace;
use crate::groups::Group;
use crate::test_support::stored_on_host;

const BT: u64 = 4;

fn core(host_loads_in_step: bool) -> Scheduler {
    let side = SchedulerSide::new(SchedulerConfig {
        block_tokens: BT as u32,
        host_blocks: 64,
        ..SchedulerConfig::default()
    })
    .unwrap();
    let keys = Keyring::new(vec![Namespace::new(b"m")], 1).unwrap();
    Scheduler::new(side, keys, None, host_loads_in_step).unwrap()
}

fn hashes(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("h{i}").into_bytes()).collect()
}

fn extend(s: &mut Scheduler, name: &str, hashes: &[Vec<u8>]) {
    let seen = s.hashes_seen(name);
    s.extend_keys(name, hashes[seen..].iter().map(Vec::as_slice));
}

/// Every job of this step reported: stores done on the host tier, loads as `load_failed`
/// says (the keys it names fail, the rest arrive).
fn run_step(s: &mut Scheduler, load_failed: &[BlockKey]) -> (Step, usize) {
    let step = s.build_step();
    let mut jobs: Vec<JobResult> = step.meta.stores.iter().map(stored_on_host).collect();
    for l in &step.meta.loads {
        let (failed, ok): (Vec<_>, Vec<_>) = l
            .blocks
            .iter()
            .map(|b| b.key)
            .partition(|k| load_failed.contains(k));
        jobs.push(JobResult {
            job: l.job,
            request: l.request,
            part: JobPart::Load,
            ok,
            failed: failed
                .into_iter()
                .map(|k| (k, BlockError::Corrupt("flipped".into())))
                .collect(),
            promoted: vec![],
        });
    }
    let failed = s.update_from_rank(
        0,
        &WorkerOutput {
            jobs,
            ..Default::default()
        },
    );
    (step, failed)
}

/// `s` holds the first `n` blocks of `hashes` in its host tier (stored by request "w").
fn stored(s: &mut Scheduler, hs: &[Vec<u8>], n: usize) {
    extend(s, "w", hs);
    let blocks: Vec<u32> = (0..n as u32).collect();
    assert!(s.save_blocks("w", 0, &blocks));
    run_step(s, &[]);
    assert!(!s.finished("w"));
}

/// A core whose host tier holds the first `stored` of `blocks` blocks, and a reader "r" of all
/// `blocks` keyed; the blocks' hashes.
fn with_reader(
    host_loads_in_step: bool,
    blocks: usize,
    stored_blocks: usize,
) -> (Scheduler, Vec<Vec<u8>>) {
    let mut s = core(host_loads_in_step);
    let hs = hashes(blocks);
    stored(&mut s, &hs, stored_blocks);
    extend(&mut s, "r", &hs);
    (s, hs)
}

#[test]
fn a_stored_prefix_is_offered_loaded_and_reported_and_then_nothing_is_left() {
    let (mut s, _) = with_reader(false, 4, 3);
    let offer = s.lookup("r", 0, 17).unwrap();
    assert_eq!(
        offer,
        Offer {
            tokens: 3 * BT,
            asynchronous: true
        }
    );
    assert_eq!(s.matched("r").host_blocks, 3);
    let loaded = s.allocated("r", &[vec![10, 11, 12, 13]], 3 * BT).unwrap();
    assert_eq!(loaded.map(|b| b.len()), Some(3));
    let (step, _) = run_step(&mut s, &[]);
    assert_eq!(step.loads, vec![(RequestId(2), "r".to_string())]);
    assert!(s.requests().is_loading("r"));
    s.reported(["r"], []);
    assert!(!s.finished("r"));
    assert_eq!(s.counts(), [0; 6]);
}

#[test]
fn a_host_hit_that_leaves_a_token_loads_in_the_step_and_a_whole_prompt_hit_does_not() {
    let (mut s, hs) = with_reader(true, 2, 2);
    // 9 tokens: the 8 of the hit leave one to compute.
    assert_eq!(s.lookup("r", 0, 9).map(|o| o.asynchronous), Some(false));
    assert!(
        s.allocated("r", &[vec![5, 6, 7]], 2 * BT)
            .unwrap()
            .is_some()
    );
    let step = s.build_step();
    assert_eq!((step.loads.len(), step.in_step), (0, vec![RequestId(2)]));
    assert!(
        !s.requests().is_loading("r"),
        "never reported in finished_recving"
    );
    // A hit of the whole prompt loads asynchronously.
    extend(&mut s, "q", &hs);
    assert_eq!(s.lookup("q", 0, 8).map(|o| o.asynchronous), Some(true));
}

#[test]
fn a_failed_block_is_never_offered_again() {
    let (mut s, _) = with_reader(false, 4, 4);
    assert_eq!(s.lookup("r", 0, 17).unwrap().tokens, 4 * BT);
    assert!(
        s.allocated("r", &[vec![1, 2, 3, 4]], 4 * BT)
            .unwrap()
            .is_some()
    );
    let third = s.keys("r")[2];
    let (_, failed) = run_step(&mut s, &[third]);
    assert_eq!(failed, 1);
    s.reported(["r"], []);
    // The engine restarts it from its local prefix: blocks from the failed one on are not
    // offered, those before it are.
    assert_eq!(s.lookup("r", 0, 17).unwrap().tokens, 2 * BT);
}

#[test]
fn a_request_finished_while_loading_is_abandoned_once_and_never_delayed() {
    let (mut s, _) = with_reader(false, 2, 2);
    s.lookup("r", 0, 9).unwrap();
    s.allocated("r", &[vec![1, 2]], 2 * BT).unwrap();
    let step = s.build_step();
    assert_eq!(step.loads.len(), 1);
    assert!(
        !s.finished("r"),
        "the engine keeps its blocks until the load is reported"
    );
    let step = s.build_step();
    assert_eq!(step.abandoned, vec![RequestId(2)]);
    assert!(step.delayed.is_empty());
    assert!(s.build_step().abandoned.is_empty(), "handed out once");
    assert_eq!(s.requests().name(RequestId(2)), Some("r"));
    s.reported(["r"], []);
    assert_eq!(s.counts()[..4], [0, 0, 0, 0]);
}

#[test]
fn an_allocation_that_does_not_fit_the_match_queues_nothing() {
    let (mut s, _) = with_reader(false, 2, 2);
    s.lookup("r", 0, 9).unwrap();
    let err = s.allocated("r", &[vec![1]], 2 * BT).unwrap_err();
    assert!(err.contains("no blocks 0..+2"), "{err}");
    assert!(s.build_step().loads.is_empty());
    assert!(!s.requests().is_loading("r"));
}

/// A shared file tier's probe that finds nothing and counts the keys it was asked about.
#[derive(Default)]
struct CountingProbe(AtomicUsize);

impl FileTierProbe for CountingProbe {
    fn probe(&self, _key: BlockKey) -> ProbeAnswer {
        self.0.fetch_add(1, Ordering::Relaxed);
        ProbeAnswer::Absent
    }
}

#[test]
fn a_lookup_asks_the_tiers_once() {
    // PyO3's get_num_new_matched_tokens once ran the lookup twice (a825c82): on a shared
    // mount, every lookup probed the mount twice.
    let mut side = SchedulerSide::new(SchedulerConfig {
        block_tokens: BT as u32,
        host_blocks: 64,
        file_blocks: Some(64),
        ..SchedulerConfig::default()
    })
    .unwrap();
    let probe = Arc::new(CountingProbe::default());
    side.set_file_probe(probe.clone());
    let keys = Keyring::new(vec![Namespace::new(b"m")], 1).unwrap();
    let mut s = Scheduler::new(side, keys, None, false).unwrap();
    extend(&mut s, "r", &hashes(3));
    assert_eq!(s.lookup("r", 0, 13).unwrap().tokens, 0);
    assert_eq!(
        probe.0.load(Ordering::Relaxed),
        1,
        "one probe: the first missing block"
    );
}

#[test]
fn several_groups_need_a_namespace_each_and_offer_what_every_group_holds() {
    let side = || {
        SchedulerSide::new(SchedulerConfig {
            block_tokens: BT as u32,
            host_blocks: 64,
            ..SchedulerConfig::default()
        })
        .unwrap()
    };
    let groups = Groups::new(vec![Group::FULL, Group::sliding(8, 0)], BT).unwrap();
    let one = Keyring::new(vec![Namespace::new(b"g0")], 1).unwrap();
    assert!(Scheduler::new(side(), one, Some(groups.clone()), false).is_err());
    let two = Keyring::new(vec![Namespace::new(b"g0"), Namespace::new(b"g1")], 1).unwrap();
    let mut s = Scheduler::new(side(), two, Some(groups), false).unwrap();
    let hs = hashes(4);
    extend(&mut s, "w", &hs);
    assert!(s.save_groups("w", 0, 4, 16, &[vec![1, 2, 3, 4], vec![0, 0, 13, 14]]));
    run_step(&mut s, &[]);
    s.finished("w");
    extend(&mut s, "r", &hs);
    // 17 tokens: the engine computes the last one, so 4 blocks at most.
    let offer = s.lookup("r", 0, 17).unwrap();
    assert_eq!(offer.tokens, 4 * BT);
    let tables = [vec![21, 22, 23, 24], vec![0, 0, 33, 34]];
    assert_eq!(
        s.allocated("r", &tables, 4 * BT).unwrap().map(|b| b.len()),
        Some(6)
    );
    // A sliding-window store source handed out again is fenced once.
    assert_eq!(s.fence([EngineBlockId(14)]), vec![EngineBlockId(14)]);
    assert!(s.fence([EngineBlockId(14)]).is_empty());
}
