//! Detached tasks: run on behalf of a request, outside its life.

use super::*;

/// A spec that writes kvx-held buffers (no engine block) to the file backend for `req`.
fn detached_spec(w: &World, req: u64, keys: &[u128]) -> TaskSpec {
    let mut s = w.spec(req, Direction::Store, &[], vec![w.file]);
    s.blocks = keys
        .iter()
        .map(|k| OpBlock {
            key: BlockKey(*k),
            engine: None,
            buf: Buf::Owned(w.pool.take().unwrap()),
        })
        .collect();
    s
}

#[test]
fn a_detached_task_outlives_its_request_and_holds_up_nothing() {
    let mut w = world();
    // The request's own store: engine blocks out to a kvx buffer.
    w.submit(1, Direction::Store, &[0]);
    let (_, store) = w.take_ops().into_iter().next().unwrap();
    w.complete(store);
    // Its buffers written on to the file, detached, one accepted before and one after the
    // request finished.
    let before = w.t.submit_detached(detached_spec(&w, 1, &[7]), w.now);
    assert!(
        !w.t.finish(RequestId(1), w.now),
        "nothing of the request is out"
    );
    let after = w.t.submit_detached(detached_spec(&w, 1, &[8, 9]), w.now);
    let ev = w.events();
    assert!(
        matches!(ev[0], Event::TaskFinished(_)),
        "the request's store"
    );
    assert!(
        matches!(ev[1..], [Event::RequestReleased(RequestId(1))]),
        "released at once, the detached writes still out: {ev:?}"
    );
    assert_eq!(
        w.t.stats().requests,
        0,
        "a detached task keeps no request entry"
    );
    assert!(w.t.preempt(RequestId(1), w.now).blocks().is_empty());
    let ops = w.take_ops();
    assert_eq!(ops.len(), 2, "a preemption of its request cancels neither");
    assert!(ops.iter().all(|(b, _)| *b == w.file));
    w.now += 10 * MS;
    for (_, op) in ops {
        w.complete(op);
    }
    let r = w.reports();
    assert_eq!(
        r.iter().map(|r| (r.task, r.request)).collect::<Vec<_>>(),
        vec![(before, RequestId(1)), (after, RequestId(1))],
        "each report names the request it ran for"
    );
    assert!(r.iter().all(|r| r.state == TaskState::Done));
    assert_eq!(r[1].blocks.len(), 2);
    assert!(w.events().is_empty(), "no second release");
    drop((r, ev));
    assert!(w.pool.is_whole());
    assert!(w.t.is_empty(), "{:?}", w.t.stats());
}

#[test]
fn a_detached_task_naming_an_engine_block_is_refused() {
    let mut w = world();
    let s = w.spec(1, Direction::Store, &[0], vec![w.file]);
    let task = w.t.submit_detached(s, w.now);
    let r = w.reports().pop().unwrap();
    assert_eq!(r.task, task);
    assert!(
        matches!(&r.state, TaskState::Failed(FailReason::Invalid(m)) if m.contains("engine block")),
        "{:?}",
        r.state
    );
    assert!(r.blocks[0].buf.is_some(), "its buffer comes back");
    assert!(w.take_ops().is_empty());
    assert!(w.t.is_empty());
}

#[test]
fn a_detached_task_times_out_and_a_reset_drops_it() {
    let mut w = world();
    w.t.submit_detached(detached_spec(&w, 1, &[7]), w.now);
    let mut s = detached_spec(&w, 2, &[8]);
    s.deadline += 100 * MS;
    let late = w.t.submit_detached(s, w.now);
    let ops = w.take_ops();
    assert_eq!(ops.len(), 2);
    w.now += 100 * MS;
    w.t.handle_timeout(w.now);
    let r = w.reports();
    assert_eq!(r.len(), 1, "the first deadline passed");
    assert_eq!(r[0].state, TaskState::TimedOut);
    assert_eq!(w.t.stats().zombie_ops, 1, "its write is quarantined");
    let fence = w.t.reset(w.now);
    assert!(w.t.fence_holds(&fence), "no engine block is involved");
    assert!(w.reports().is_empty(), "a reset reports nothing");
    assert!(w.t.task_state(late).is_none());
    assert!(w.take_ops().is_empty(), "only cancels are asked for");
    for (_, op) in ops {
        w.complete(op);
    }
    assert_eq!(w.t.stats().late_completions, 2);
    assert!(w.t.is_empty(), "{:?}", w.t.stats());
}
