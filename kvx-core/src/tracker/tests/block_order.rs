//! Per-block ordering: reuse waits for older ops and zombies; preempt fences.

use super::*;

#[test]
fn block_reuse_waits_for_the_older_op() {
    let mut w = world();
    w.submit(1, Direction::Store, &[5]);
    let (_, store) = w.take_ops().into_iter().next().unwrap();
    let load = w.submit(2, Direction::Load, &[5, 6]);
    assert!(
        w.take_ops().is_empty(),
        "load must not start while the store reads block 5"
    );
    assert_eq!(w.t.task_state(load), Some(TaskState::Queued));
    w.complete(store);
    let ops = w.take_ops();
    assert_eq!(ops.len(), 1);
    assert_eq!(ops[0].1.task, load);
}

#[test]
fn block_reuse_flushes_a_deferred_store() {
    let mut w = world();
    let mut s = w.spec(1, Direction::Store, &[5], vec![w.engine]);
    s.deferred = true;
    let store = w.t.submit(s, w.now);
    assert!(w.take_ops().is_empty());
    w.submit(2, Direction::Load, &[5]);
    let ops = w.take_ops();
    assert_eq!(ops.len(), 1, "the deferred store is submitted now");
    assert_eq!(ops[0].1.task, store);
}

#[test]
fn reuse_behind_a_zombie_waits_for_its_late_completion() {
    let mut w = world();
    w.submit(1, Direction::Load, &[7]);
    let (_, old) = w.take_ops().into_iter().next().unwrap();
    w.now += 100 * MS;
    w.t.handle_timeout(w.now);
    let mut s = w.spec(2, Direction::Load, &[7], vec![w.engine]);
    s.deadline = w.now + 100 * MS;
    w.t.submit(s, w.now);
    assert!(w.take_ops().is_empty(), "the zombie still writes block 7");
    w.complete(old);
    assert_eq!(w.take_ops().len(), 1);
}

#[test]
fn a_many_block_zombie_holds_every_block_until_it_returns() {
    let mut w = world();
    let blocks: Vec<u32> = (0..10).rev().collect(); // more than fit inline, unsorted
    w.submit(1, Direction::Load, &blocks);
    let (_, old) = w.take_ops().into_iter().next().unwrap();
    w.now += 100 * MS;
    w.t.handle_timeout(w.now);
    let all: Vec<EngineBlockId> = (0..10).map(EngineBlockId).collect();
    assert_eq!(
        w.t.engine_blocks_out(),
        all,
        "the zombie may still write all ten"
    );
    let fence = w.t.fence_blocks(&[EngineBlockId(9)]);
    let mut s = w.spec(2, Direction::Load, &[9, 4], vec![w.engine]);
    s.deadline = w.now + 100 * MS;
    w.t.submit(s, w.now);
    assert!(
        w.take_ops().is_empty(),
        "the zombie still writes blocks 9 and 4"
    );
    assert!(!w.t.fence_holds(&fence));
    w.complete(old);
    assert!(w.t.fence_holds(&fence));
    let ops = w.take_ops();
    assert_eq!(ops.len(), 1, "the new load starts once the zombie returned");
    assert_eq!(
        w.t.engine_blocks_out(),
        [EngineBlockId(4), EngineBlockId(9)]
    );
}

#[test]
fn preempt_cancels_loads_flushes_stores_and_fences() {
    let mut w = world();
    let mut s = w.spec(1, Direction::Store, &[0], vec![w.engine]);
    s.deferred = true;
    let store = w.t.submit(s, w.now);
    let load = w.submit(1, Direction::Load, &[1]);
    let (_, load_op) = w.take_ops().into_iter().next().unwrap();
    let fence = w.t.preempt(RequestId(1), w.now);
    assert_eq!(fence.blocks(), &[EngineBlockId(0), EngineBlockId(1)]);
    let r = w.reports();
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].task, &r[0].state), (load, &TaskState::Cancelled));
    let ops = w.take_ops();
    assert_eq!(ops.len(), 1, "the deferred store was flushed");
    assert_eq!(ops[0].1.task, store);
    assert!(!w.t.fence_holds(&fence));
    let (_, store_op) = ops.into_iter().next().unwrap();
    w.complete(store_op);
    assert!(
        !w.t.fence_holds(&fence),
        "the cancelled load's copy is still running"
    );
    w.complete(load_op);
    assert!(w.t.fence_holds(&fence));
}

#[test]
fn preempt_during_file_stage_fences_at_once() {
    let mut w = world();
    let s = w.spec(1, Direction::Load, &[2], vec![w.file, w.engine]);
    w.t.submit(s, w.now);
    let (_, file_op) = w.take_ops().into_iter().next().unwrap();
    let fence = w.t.preempt(RequestId(1), w.now);
    assert!(
        w.t.fence_holds(&fence),
        "a file read never touches engine memory"
    );
    w.complete(file_op);
    assert!(w.take_ops().is_empty(), "the engine stage never starts");
    assert_eq!(w.t.stats().zombie_ops, 0);
}

#[test]
fn new_work_after_a_fence_does_not_block_it() {
    let mut w = world();
    w.submit(1, Direction::Store, &[0]);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    let fence = w.t.fence_blocks(&[EngineBlockId(0)]);
    w.submit(2, Direction::Load, &[0]);
    w.complete(op);
    assert!(w.t.fence_holds(&fence));
    assert_eq!(w.take_ops().len(), 1, "the new load starts after the store");
}
