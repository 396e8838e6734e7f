//! End of a request: finish, abort and reset release engine blocks at the right time.

use super::*;

#[test]
fn finish_with_stores_in_flight_delays_and_releases_later() {
    let mut w = world();
    w.submit(1, Direction::Store, &[0]);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    assert!(w.t.finish(RequestId(1), w.now));
    assert!(w.events().is_empty());
    w.complete(op);
    let ev = w.events();
    assert!(matches!(ev[0], Event::TaskFinished(_)));
    assert!(matches!(ev[1], Event::RequestReleased(RequestId(1))));
    assert!(w.t.is_empty());
}

#[test]
fn finish_with_a_failed_store_still_releases() {
    let mut w = world();
    w.submit(1, Direction::Store, &[0]);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    assert!(w.t.finish(RequestId(1), w.now));
    w.t.handle_completion(
        OpCompletion::all(op, Err(BlockError::Io("ENOSPC".into()))),
        w.now,
    );
    let ev = w.events();
    assert!(
        matches!(&ev[0], Event::TaskFinished(r) if r.state == TaskState::Failed(FailReason::Blocks))
    );
    assert!(matches!(ev[1], Event::RequestReleased(RequestId(1))));
}

#[test]
fn finish_without_work_frees_at_once() {
    let mut w = world();
    let t = w.submit(1, Direction::Store, &[0]);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    w.complete(op);
    assert_eq!(w.reports()[0].task, t);
    assert!(!w.t.finish(RequestId(1), w.now));
    assert!(matches!(
        w.events()[..],
        [Event::RequestReleased(RequestId(1))]
    ));
    assert!(!w.t.finish(RequestId(99), w.now), "unknown request");
    assert!(
        matches!(w.events()[..], [Event::RequestReleased(RequestId(99))]),
        "an unknown request is released too"
    );
    assert!(w.t.is_empty());
}

#[test]
fn abort_during_engine_copy_keeps_blocks_until_it_returns() {
    let mut w = world();
    w.submit(1, Direction::Load, &[4]);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    assert!(
        w.t.finish(RequestId(1), w.now),
        "the copy into block 4 is still running"
    );
    assert_eq!(w.reports()[0].state, TaskState::Cancelled);
    w.complete(op);
    assert!(matches!(
        w.events()[..],
        [Event::RequestReleased(RequestId(1))]
    ));
    assert!(w.take_ops().is_empty(), "only the cancel hint was queued");
    assert!(w.t.is_empty(), "{:?}", w.t.stats());
}

#[test]
fn finished_request_refuses_new_tasks() {
    let mut w = world();
    w.submit(1, Direction::Store, &[0]);
    let (_, _op) = w.take_ops().into_iter().next().unwrap();
    assert!(w.t.finish(RequestId(1), w.now));
    w.submit(1, Direction::Store, &[1]);
    let r = w.reports().pop().unwrap();
    assert_eq!(r.state, TaskState::Failed(FailReason::RequestFinished));
}

#[test]
fn reset_drops_late_completions() {
    let mut w = world();
    w.submit(1, Direction::Store, &[0]);
    w.submit(2, Direction::Load, &[1]);
    let ops = w.take_ops();
    let fence = w.t.reset(w.now);
    assert_eq!(fence.blocks(), [EngineBlockId(0), EngineBlockId(1)]);
    assert!(!w.t.fence_holds(&fence), "both engine copies are out");
    assert!(w.events().is_empty(), "reset reports nothing");
    assert_eq!(w.t.stats().zombie_ops, 2);
    // The old engine ops still hold their blocks: a new load on block 1 waits.
    let mut s = w.spec(3, Direction::Load, &[1], vec![w.engine]);
    s.deadline = w.now + 100 * MS;
    w.t.submit(s, w.now);
    assert!(w.take_ops().is_empty());
    for (_, op) in ops {
        w.complete(op);
    }
    assert!(w.t.fence_holds(&fence));
    assert!(w.reports().is_empty(), "late completions change nothing");
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    w.complete(op);
    assert_eq!(w.reports().len(), 1);
    assert!(!w.t.finish(RequestId(3), w.now));
    assert!(matches!(
        w.events()[..],
        [Event::RequestReleased(RequestId(3))]
    ));
    assert!(w.t.is_empty(), "{:?}", w.t.stats());
    assert!(w.pool.is_whole());
}

#[test]
fn reset_still_releases_finished_requests_once_their_copies_return() {
    let mut w = world();
    w.submit(1, Direction::Store, &[0]);
    w.submit(2, Direction::Store, &[1]);
    let mut ops = w.take_ops();
    assert!(w.t.finish(RequestId(1), w.now), "its store is out");
    let fence = w.t.reset(w.now);
    assert!(w.events().is_empty(), "request 1's copy is still out");
    let (_, op2) = ops.pop().unwrap();
    let (_, op1) = ops.pop().unwrap();
    w.complete(op2);
    assert!(
        w.events().is_empty(),
        "request 2 was never finished: not reported"
    );
    assert!(!w.t.fence_holds(&fence));
    w.complete(op1);
    assert!(matches!(
        w.events()[..],
        [Event::RequestReleased(RequestId(1))]
    ));
    assert!(w.t.fence_holds(&fence));
    assert!(w.take_ops().is_empty(), "only cancel hints were queued");
    assert!(w.t.is_empty(), "{:?}", w.t.stats());
}

#[test]
fn reset_keeps_a_release_already_queued() {
    let mut w = world();
    assert!(!w.t.finish(RequestId(5), w.now));
    let fence = w.t.reset(w.now);
    assert!(w.t.fence_holds(&fence), "nothing was out");
    assert!(matches!(
        w.events()[..],
        [Event::RequestReleased(RequestId(5))]
    ));
}
