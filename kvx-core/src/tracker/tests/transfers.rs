//! Transfers through their stages: completion, failures, refusals, cancels.

use super::*;

#[test]
fn submit_then_complete_is_done_with_buffers_back() {
    let mut w = world();
    let task = w.submit(1, Direction::Store, &[0, 1]);
    assert_eq!(w.t.task_state(task), Some(TaskState::InFlight));
    let ops = w.take_ops();
    assert_eq!(ops.len(), 1);
    assert_eq!(ops[0].1.blocks.len(), 2);
    let (_, op) = ops.into_iter().next().unwrap();
    w.complete(op);
    let r = w.reports();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].state, TaskState::Done);
    assert!(
        r[0].blocks
            .iter()
            .all(|b| b.buf.is_some() && b.result.is_ok())
    );
    assert_eq!(w.t.task_state(task), None);
    drop(r);
    assert!(w.pool.is_whole());
    assert!(!w.t.finish(RequestId(1), w.now));
    assert!(matches!(
        w.events()[..],
        [Event::RequestReleased(RequestId(1))]
    ));
    assert!(w.t.is_empty(), "{:?}", w.t.stats());
}

#[test]
fn two_stage_route_hands_buffers_from_stage_to_stage() {
    let mut w = world();
    let s = w.spec(1, Direction::Load, &[3], vec![w.file, w.engine]);
    w.t.submit(s, w.now);
    let ops = w.take_ops();
    assert_eq!(ops[0].0, w.file);
    let (_, op) = ops.into_iter().next().unwrap();
    w.complete(op);
    assert!(w.reports().is_empty(), "not done after the first stage");
    let ops = w.take_ops();
    assert_eq!(ops[0].0, w.engine);
    assert_eq!(ops[0].1.blocks[0].engine, Some(EngineBlockId(3)));
    let (_, op) = ops.into_iter().next().unwrap();
    w.complete(op);
    assert_eq!(w.reports()[0].state, TaskState::Done);
}

#[test]
fn failed_block_is_reported_and_skips_later_stages() {
    let mut w = world();
    let s = w.spec(1, Direction::Load, &[0, 1, 2], vec![w.file, w.engine]);
    w.t.submit(s, w.now);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    let results = vec![Ok(()), Err(BlockError::Corrupt("checksum".into())), Ok(())];
    w.t.handle_completion(OpCompletion { op, results }, w.now);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    assert_eq!(
        op.blocks
            .iter()
            .map(|b| b.engine.unwrap().0)
            .collect::<Vec<_>>(),
        vec![0, 2]
    );
    w.complete(op);
    let r = w.reports().pop().unwrap();
    assert_eq!(r.state, TaskState::Failed(FailReason::Blocks));
    assert_eq!(r.failed_engine_blocks(), vec![EngineBlockId(1)]);
    let order: Vec<u32> = r.blocks.iter().map(|b| b.engine.unwrap().0).collect();
    assert_eq!(order, vec![0, 1, 2], "reports keep the spec's order");
}

#[test]
fn deferred_task_waits_for_the_next_step() {
    let mut w = world();
    let mut s = w.spec(1, Direction::Store, &[0], vec![w.engine]);
    s.deferred = true;
    let task = w.t.submit(s, w.now);
    assert!(w.take_ops().is_empty());
    assert_eq!(w.t.task_state(task), Some(TaskState::Queued));
    w.t.start_step();
    assert_eq!(w.take_ops().len(), 1);
}

#[test]
fn refused_specs_end_at_once() {
    let mut w = world();
    let mut s = w.spec(1, Direction::Load, &[0], vec![w.engine]);
    s.deadline = w.now;
    w.t.submit(s, w.now);
    let s = w.spec(1, Direction::Load, &[0], vec![]);
    w.t.submit(s, w.now);
    let s = w.spec(1, Direction::Load, &[0], vec![BackendId(9)]);
    w.t.submit(s, w.now);
    let s = w.spec(1, Direction::Load, &[], vec![w.engine]);
    w.t.submit(s, w.now);
    let states: Vec<_> = w.reports().into_iter().map(|r| r.state).collect();
    assert_eq!(states[0], TaskState::TimedOut);
    assert!(
        states[1..]
            .iter()
            .all(|s| matches!(s, TaskState::Failed(FailReason::Invalid(_))))
    );
    assert!(w.take_ops().is_empty());
    assert!(w.pool.is_whole());
    assert!(w.t.is_empty());
}

#[test]
fn mismatched_results_and_refused_submits_fail_the_blocks() {
    let mut w = world();
    w.submit(1, Direction::Store, &[0, 1]);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    w.t.handle_completion(
        OpCompletion {
            op,
            results: vec![Ok(())],
        },
        w.now,
    );
    let r = w.reports().pop().unwrap();
    assert!(
        r.blocks
            .iter()
            .all(|b| matches!(b.result, Err(BlockError::Io(_))))
    );
    w.submit(1, Direction::Store, &[2]);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    w.t.handle_submit_error(
        SubmitError {
            op,
            kind: crate::backend::SubmitErrorKind::Unavailable("breaker open".into()),
        },
        w.now,
    );
    let r = w.reports().pop().unwrap();
    assert_eq!(
        r.blocks[0].result,
        Err(BlockError::Unavailable("breaker open".into()))
    );
    assert!(r.blocks[0].buf.is_some());
}

#[test]
fn explicit_cancel_and_unknown_completion() {
    let mut w = world();
    let t = w.submit(1, Direction::Store, &[0]);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    w.t.cancel(t, w.now);
    w.t.cancel(t, w.now); // twice is harmless
    let r = w.reports();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].state, TaskState::Cancelled);
    w.complete(op);
    w.complete(op_for_nobody(&w));
    assert_eq!(w.t.stats().late_completions, 2);
}

fn op_for_nobody(w: &World) -> Op {
    Op {
        id: OpId(424242),
        task: TaskId(1),
        request: RequestId(1),
        dir: Direction::Load,
        deadline: w.now,
        blocks: vec![],
    }
}

#[test]
fn engine_blocks_out_lists_engine_copies_only() {
    let mut w = world();
    w.submit(1, Direction::Load, &[3, 1]);
    let s = w.spec(2, Direction::Load, &[7], vec![w.file, w.engine]);
    w.t.submit(s, w.now);
    let _ops = w.take_ops();
    assert_eq!(
        w.t.engine_blocks_out(),
        [EngineBlockId(1), EngineBlockId(3)],
        "block 7 is with the file backend, which never touches engine memory"
    );
}
