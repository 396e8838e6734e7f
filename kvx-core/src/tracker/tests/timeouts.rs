//! Deadlines: expiry order, quarantined buffers, zombie budget.

use super::*;

#[test]
fn timeout_in_a_later_stage_after_a_partial_failure_reports_each_block_in_place() {
    let mut w = world();
    let s = w.spec(1, Direction::Load, &[0, 1, 2, 3], vec![w.file, w.engine]);
    w.t.submit(s, w.now);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    let results = vec![
        Err(BlockError::NotFound),
        Ok(()),
        Err(BlockError::Corrupt("checksum".into())),
        Ok(()),
    ];
    w.t.handle_completion(OpCompletion { op, results }, w.now);
    let (_, second) = w.take_ops().into_iter().next().unwrap();
    assert_eq!(second.blocks.len(), 2, "blocks 1 and 3 go on");
    w.now += 100 * MS;
    w.t.handle_timeout(w.now);
    let r = w.reports().pop().unwrap();
    assert_eq!(r.state, TaskState::TimedOut);
    let got: Vec<(u32, Result<(), BlockError>, bool)> = r
        .blocks
        .iter()
        .map(|b| (b.engine.unwrap().0, b.result.clone(), b.buf.is_some()))
        .collect();
    assert_eq!(
        got,
        vec![
            (0, Err(BlockError::NotFound), true),
            (1, Err(BlockError::TimedOut), false),
            (2, Err(BlockError::Corrupt("checksum".into())), true),
            (3, Err(BlockError::TimedOut), false),
        ],
        "failed blocks keep their error and buffer; blocks in the zombie op time out"
    );
    assert!(
        r.engine_blocks_held,
        "the zombie is an engine copy: it may still write the blocks"
    );
    drop(r);
    assert_eq!(w.pool.lent(), 2, "the zombie op holds two buffers");
    w.complete(second);
    assert!(w.pool.is_whole());
    assert_eq!(w.t.stats().late_completions, 1);
}

#[test]
fn a_zombie_file_read_holds_no_engine_block() {
    let mut w = world();
    let s = w.spec(1, Direction::Load, &[0, 1], vec![w.file, w.engine]);
    w.t.submit(s, w.now);
    let (backend, read) = w.take_ops().into_iter().next().unwrap();
    assert_eq!(backend, w.file);
    w.now += 100 * MS;
    w.t.handle_timeout(w.now);
    let r = w.reports().pop().unwrap();
    assert_eq!(r.state, TaskState::TimedOut);
    assert!(
        r.blocks.iter().all(|b| b.buf.is_none()),
        "the read keeps the buffers"
    );
    assert!(
        !r.engine_blocks_held,
        "a stuck read fills kvx buffers only; no engine copy follows it"
    );
    let fence = w.t.fence_blocks(&[EngineBlockId(0), EngineBlockId(1)]);
    assert!(w.t.fence_holds(&fence), "nothing holds the engine blocks");
    w.complete(read);
    assert!(w.take_ops().is_empty(), "no copy starts after a late read");
    assert!(w.pool.is_whole());
}

#[test]
fn timeout_quarantines_buffers_until_the_late_completion() {
    let mut w = world();
    w.submit(1, Direction::Load, &[0, 1]);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    assert_eq!(w.t.poll_timeout(), Some(w.now + 100 * MS));
    w.now += 100 * MS;
    w.t.handle_timeout(w.now);
    let r = w.reports().pop().unwrap();
    assert_eq!(r.state, TaskState::TimedOut);
    assert!(
        r.blocks
            .iter()
            .all(|b| b.buf.is_none() && b.result == Err(BlockError::TimedOut))
    );
    assert_eq!(r.blocks[1].engine, Some(EngineBlockId(1)));
    assert!(r.engine_blocks_held, "an engine copy out keeps the blocks");
    let cancels: Vec<_> = std::iter::from_fn(|| w.t.poll_backend_command()).collect();
    assert!(matches!(cancels[0], BackendCommand::Cancel { op: o, .. } if o == op.id));
    let st = w.t.stats();
    assert_eq!((st.zombie_ops, st.zombie_bytes), (1, 8192));
    assert_eq!(w.pool.lent(), 2, "the zombie op still owns its buffers");
    w.now += 5 * MS;
    w.complete(op);
    assert!(w.reports().is_empty(), "late completion is dropped");
    assert_eq!(w.t.stats().late_completions, 1);
    assert_eq!(w.t.stats().zombie_ops, 0);
    assert!(w.pool.is_whole());
}

#[test]
fn completion_before_the_timer_fired_counts() {
    let mut w = world();
    w.submit(1, Direction::Load, &[0]);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    w.now += 150 * MS;
    w.complete(op); // handle_timeout was not called yet: the op did finish
    assert_eq!(w.reports()[0].state, TaskState::Done);
    w.t.handle_timeout(w.now);
    assert!(w.reports().is_empty(), "no second verdict");
    assert_eq!(w.t.stats().timed_out, 0);
}

#[test]
fn poll_timeout_is_the_earliest_live_deadline() {
    let mut w = world();
    let mut s = w.spec(1, Direction::Store, &[0], vec![w.engine]);
    s.deadline = w.now + 50 * MS;
    w.t.submit(s, w.now);
    let mut s = w.spec(1, Direction::Store, &[1], vec![w.engine]);
    s.deadline = w.now + 20 * MS;
    w.t.submit(s, w.now);
    assert_eq!(w.t.poll_timeout(), Some(w.now + 20 * MS));
    let ops = w.take_ops();
    let (_, second) = ops.into_iter().nth(1).unwrap();
    w.complete(second);
    assert_eq!(
        w.t.poll_timeout(),
        Some(w.now + 50 * MS),
        "stale timer skipped"
    );
}

#[test]
fn deferred_task_still_times_out() {
    let mut w = world();
    let mut s = w.spec(1, Direction::Store, &[0], vec![w.engine]);
    s.deferred = true;
    w.t.submit(s, w.now);
    w.now += 100 * MS;
    w.t.handle_timeout(w.now);
    let r = w.reports().pop().unwrap();
    assert_eq!(r.state, TaskState::TimedOut);
    assert!(
        r.blocks[0].buf.is_some(),
        "never submitted: buffer comes back"
    );
    w.t.start_step();
    assert!(w.take_ops().is_empty());
}

#[test]
fn zombie_budget_makes_new_tasks_fail_fast() {
    let mut w = world_with(TrackerConfig {
        zombie_budget_ops: 1,
        zombie_budget_bytes: u64::MAX,
    });
    w.submit(1, Direction::Load, &[0]);
    let (_, op) = w.take_ops().into_iter().next().unwrap();
    w.now += 100 * MS;
    w.t.handle_timeout(w.now);
    w.reports();
    w.submit(2, Direction::Load, &[1]);
    let r = w.reports().pop().unwrap();
    assert_eq!(
        r.state,
        TaskState::Failed(FailReason::ZombieBudget { backend: w.engine })
    );
    assert!(matches!(
        r.blocks[0].result,
        Err(BlockError::Unavailable(_))
    ));
    assert!(w.take_ops().iter().all(|(_, o)| o.request != RequestId(2)));
    // A different backend is not affected.
    let s = w.spec(3, Direction::Load, &[2], vec![w.file]);
    w.t.submit(s, w.now);
    assert_eq!(w.take_ops().len(), 1);
    w.complete(op);
    w.submit(4, Direction::Load, &[3]);
    assert!(
        w.reports().is_empty(),
        "budget freed by the late completion"
    );
}

#[test]
fn many_expiries_pop_in_deadline_order() {
    let mut w = world();
    for i in 0..50u64 {
        let mut s = w.spec(i, Direction::Store, &[], vec![w.engine]);
        s.blocks.push(OpBlock {
            key: BlockKey(i as u128),
            engine: None,
            buf: Buf::Owned(w.pool.take().unwrap()),
        });
        s.deadline = w.now + Duration::from_millis(100 - i);
        w.t.submit(s, w.now);
    }
    let _ops = w.take_ops();
    w.t.handle_timeout(w.now + 60 * MS);
    let r = w.reports();
    assert_eq!(r.len(), 10, "deadlines 51..=60 ms have passed");
    let reqs: Vec<u64> = r.iter().map(|r| r.request.0).collect();
    assert_eq!(reqs.first(), Some(&49), "earliest deadline first");
    assert_eq!(reqs.last(), Some(&40));
}
