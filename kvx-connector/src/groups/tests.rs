//! Hybrid groups: the hit planner against a brute-force model, store selection, allocation
//! checks, and [`Hybrid`] over kvx-offload's real scheduler side.

use std::collections::BTreeSet;

use kvx_offload::{SchedulerConfig, WorkerOutput};
use proptest::prelude::*;

use super::*;
use crate::Namespace;
use crate::test_support::stored_on_host;

#[test]
fn skipped_tokens_are_vllms_for_a_sliding_window() {
    // vLLM's example: window 4, 7 tokens computed: tokens 0-3 are outside the next window.
    assert_eq!(Group::sliding(4, 0).skipped(7), 4);
    assert_eq!(Group::sliding(4, 0).skipped(3), 0);
    assert_eq!(Group::sliding(4, 2).skipped(7), 2);
    assert_eq!(Group::FULL.skipped(1000), 0);
}

#[test]
fn a_group_list_kvx_cannot_serve_is_refused() {
    assert_eq!(Groups::new(vec![], 16), Err(GroupsError::NoGroups));
    assert_eq!(
        Groups::new(vec![Group::FULL], 0),
        Err(GroupsError::ZeroBlockTokens)
    );
    assert_eq!(
        Groups::new(vec![Group::FULL, Group::sliding(0, 0)], 16),
        Err(GroupsError::ZeroWindow { group: 1 })
    );
}

/// Leading blocks of `blocks` that `held` holds.
fn leading(held: &BTreeSet<u64>, blocks: Range<u64>) -> u64 {
    blocks.take_while(|b| held.contains(b)).count() as u64
}

/// True when every group holds every block it reads for a hit `[first, end)`.
fn servable(groups: &Groups, held: &[BTreeSet<u64>], first: u64, end: u64) -> bool {
    (0..groups.len()).all(|g| groups.wanted(g, first, end).all(|b| held[g].contains(&b)))
}

fn group() -> impl Strategy<Value = Group> {
    prop_oneof![
        Just(Group::FULL),
        (1u64..40, 0u64..6).prop_map(|(w, e)| Group::sliding(w, e)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The plan is the longest hit every group can serve: found by brute force over every end.
    #[test]
    fn the_plan_is_the_longest_servable_hit(
        groups in prop::collection::vec(group(), 1..4),
        block_tokens in 1u64..9,
        held in prop::collection::vec(prop::collection::btree_set(0u64..24, 0..24), 3),
        first in 0u64..12,
        extra in 0u64..14,
    ) {
        let groups = Groups::new(groups, block_tokens).unwrap();
        let held = &held[..groups.len()];
        let end = first + extra;
        let mut calls = 0;
        let plan = groups
            .plan(first, end, |g, blocks| {
                calls += 1;
                Some(leading(&held[g], blocks))
            })
            .unwrap();
        let longest = (first + 1..=end)
            .rev()
            .find(|&e| servable(&groups, held, first, e))
            .unwrap_or(first);
        prop_assert_eq!(plan.end, longest);
        prop_assert_eq!(plan.first, first);
        for g in 0..groups.len() {
            prop_assert_eq!(&plan.wanted[g], &groups.wanted(g, first, plan.end));
        }
        // A pass over the groups ends in a shrink of at least one block or in the answer.
        prop_assert!(calls <= groups.len() as u64 * (extra + 1));
    }

    /// A lookup that must be asked again later makes the whole plan "later".
    #[test]
    fn a_later_answer_makes_the_plan_later(
        groups in prop::collection::vec(group(), 1..4),
        first in 0u64..6,
        extra in 1u64..10,
        later_at in 0usize..4,
    ) {
        let groups = Groups::new(groups, 4).unwrap();
        let mut calls = 0;
        let mut answered_later = false;
        let plan = groups.plan(first, first + extra, |_, blocks| {
            calls += 1;
            if calls > later_at {
                answered_later = true;
                return None;
            }
            Some(blocks.end - blocks.start)
        });
        prop_assert_eq!(plan.is_none(), answered_later);
    }
}

#[test]
fn a_sliding_group_is_asked_only_for_its_window() {
    // 4-token blocks, an 8-token window: a 6-block prefix keeps blocks 3.. (skipped(24) = 17).
    let groups = Groups::new(vec![Group::FULL, Group::sliding(8, 0)], 4).unwrap();
    let mut asked = Vec::new();
    let plan = groups
        .plan(0, 6, |g, blocks| {
            asked.push((g, blocks.clone()));
            Some(blocks.end - blocks.start)
        })
        .unwrap();
    assert_eq!(asked, vec![(0, 0..6), (1, 4..6)]);
    assert_eq!(plan.wanted, vec![0..6, 4..6]);
}

#[test]
fn an_allocation_must_match_the_plan_block_for_block() {
    let groups = Groups::new(vec![Group::FULL, Group::sliding(8, 0)], 4).unwrap();
    let plan = Plan {
        first: 1,
        end: 3,
        wanted: vec![1..3, 2..3],
    };
    let tables = vec![vec![9, 10, 11], vec![0, 0, 21]];
    assert_eq!(
        groups.engine_blocks(&plan, &tables),
        Ok(vec![
            EngineBlockId(10),
            EngineBlockId(11),
            EngineBlockId(21)
        ])
    );
    let err = groups
        .engine_blocks(&plan, &[vec![9, 10, 11], vec![0, 20, 21]])
        .unwrap_err();
    assert_eq!(
        err,
        AllocMismatch {
            group: 1,
            index: 1,
            engine_block: 20,
            planned_load: false
        }
    );
    assert_eq!(
        err.to_string(),
        "group 1: block 1 is engine block 20, kvx planned none"
    );
    let short = groups.engine_blocks(&plan, &[vec![9, 10]]).unwrap_err();
    assert_eq!((short.group, short.index, short.engine_block), (0, 2, 0));
}

#[test]
fn a_step_stores_the_window_and_never_a_null_block() {
    let groups = Groups::new(vec![Group::FULL, Group::sliding(8, 0)], 4).unwrap();
    // Blocks 0..4 complete, 16 tokens computed: the window keeps blocks from 9 / 4 = 2 on.
    let stores = groups.stores(0, 4, 16, &[vec![1, 2, 3, 4], vec![0, 0, 13, 14]]);
    let b = EngineBlockId;
    assert_eq!(
        stores,
        vec![
            (0, 0, b(1)),
            (0, 1, b(2)),
            (0, 2, b(3)),
            (0, 3, b(4)),
            (1, 2, b(13)),
            (1, 3, b(14))
        ]
    );
    assert!(groups.stores(2, 2, 16, &[vec![1, 2, 3]]).is_empty());
}

fn side() -> SchedulerSide {
    SchedulerSide::new(SchedulerConfig {
        block_tokens: 4,
        host_blocks: 64,
        ..SchedulerConfig::default()
    })
    .unwrap()
}

/// Reports every store job of `meta` done on the host tier.
fn stores_done(side: &mut SchedulerSide) {
    let meta = side.build_meta();
    let jobs = meta.stores.iter().map(stored_on_host).collect();
    side.update_from_worker(&WorkerOutput {
        jobs,
        ..Default::default()
    });
}

fn hybrid() -> (Hybrid, Keyring) {
    let groups = Groups::new(vec![Group::FULL, Group::sliding(8, 0)], 4).unwrap();
    let ns = vec![Namespace::new(b"m|group0"), Namespace::new(b"m|group1")];
    (Hybrid::new(groups), Keyring::new(ns, 1).unwrap())
}

fn hashes(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("hash{i}").into_bytes()).collect()
}

#[test]
fn a_request_stored_by_one_request_is_a_hit_for_the_next_over_both_groups() {
    let mut side = side();
    let (mut h, mut keys) = hybrid();
    let hs = hashes(6);
    let (a, b) = (RequestId(1), RequestId(2));
    keys.extend(a, hs.iter().map(Vec::as_slice));
    let tables = vec![vec![1, 2, 3, 4, 5, 6], vec![0, 0, 0, 0, 15, 16]];
    assert!(h.save(&mut side, &keys, a, 0, 6, 24, &tables));
    stores_done(&mut side);
    // Blocks 4 and 5 of the sliding group were store sources: handed out again, they are
    // fenced once.
    assert_eq!(
        h.fence([EngineBlockId(16), EngineBlockId(3)]),
        vec![EngineBlockId(16)]
    );
    assert_eq!(h.fence([EngineBlockId(16)]), vec![]);
    assert_eq!(h.fenced_blocks(), 1);
    side.request_finished(a);
    h.forget(a);

    keys.extend(b, hs.iter().map(Vec::as_slice));
    let hit = h.lookup(&mut side, &keys, b, 0, 6).unwrap();
    assert_eq!(
        hit,
        Hit {
            tokens: 24,
            host_blocks: 8,
            file_blocks: 0
        }
    );
    let loaded = h
        .allocated(
            &mut side,
            b,
            &[vec![31, 32, 33, 34, 35, 36], vec![0, 0, 0, 0, 45, 46]],
        )
        .unwrap()
        .unwrap();
    assert_eq!(loaded.len(), 8);
    assert_eq!(side.build_meta().loads.len(), 1);
    h.forget(b);
    assert_eq!(h.request_count(), 0);
}

#[test]
fn a_block_the_sliding_group_lacks_ends_the_hit_before_it() {
    let mut side = side();
    let (mut h, mut keys) = hybrid();
    let hs = hashes(6);
    keys.extend(RequestId(1), hs.iter().map(Vec::as_slice));
    // The sliding group's block 5 was never stored: the hit ends before it, and then the
    // window of a 5-block prefix (blocks 3 and 4) is needed.
    let tables = vec![vec![1, 2, 3, 4, 5, 6], vec![0, 0, 0, 14, 15, 0]];
    assert!(h.save(&mut side, &keys, RequestId(1), 0, 6, 20, &tables));
    stores_done(&mut side);
    keys.extend(RequestId(2), hs.iter().map(Vec::as_slice));
    let hit = h.lookup(&mut side, &keys, RequestId(2), 0, 6).unwrap();
    assert_eq!(hit.tokens, 20);
    // An allocation that gives the sliding group a block kvx does not load is refused, and
    // the hit stays unqueued.
    let err = h
        .allocated(
            &mut side,
            RequestId(2),
            &[vec![1, 2, 3, 4, 5], vec![0, 0, 9, 14, 15]],
        )
        .unwrap_err();
    assert!(err.contains("group 1: block 2"), "{err}");
    assert!(side.build_meta().loads.is_empty());
}

#[test]
fn a_miss_leaves_no_pending_lookup() {
    let mut side = side();
    let mut h = Hybrid::new(Groups::new(vec![Group::FULL], 4).unwrap());
    let mut keys = Keyring::new(vec![Namespace::new(b"m")], 1).unwrap();
    keys.extend(RequestId(1), hashes(2).iter().map(Vec::as_slice));
    assert_eq!(
        h.lookup(&mut side, &keys, RequestId(1), 0, 2),
        Some(Hit::default())
    );
    assert_eq!(h.allocated(&mut side, RequestId(1), &[vec![]]), Ok(None));
    assert!(side.matched_tiers(RequestId(1)).is_empty());
    assert_eq!(h.request_count(), 0);
}
