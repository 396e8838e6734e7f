//! Deterministic tests of the tracker: fake time, ops completed by hand.

use std::time::{Duration, Instant};

use super::*;
use crate::backend::SubmitError;
use crate::buffer::{Buf, BufferPool};
use crate::ids::{BlockKey, EngineBlockId};
use crate::op::{BlockError, Op, OpCompletion};
use crate::task::{FailReason, TaskReport, TaskSpec, TaskState};

const MS: Duration = Duration::from_millis(1);

impl Tracker {
    /// State of a live task (`None` once it ended).
    fn task_state(&self, task: TaskId) -> Option<TaskState> {
        let slot = self.task_slots.get(task)?;
        self.tasks.get(slot).map(|t| match t.phase {
            Phase::InFlight(_) => TaskState::InFlight,
            _ => TaskState::Queued,
        })
    }
}

struct World {
    t: Tracker,
    pool: BufferPool,
    engine: BackendId,
    file: BackendId,
    now: Instant,
}

fn world() -> World {
    world_with(TrackerConfig::default())
}

fn world_with(cfg: TrackerConfig) -> World {
    let mut t = Tracker::new(cfg);
    let engine = t.add_backend(true);
    let file = t.add_backend(false);
    World {
        t,
        pool: BufferPool::new(64, 4096, 4096).unwrap(),
        engine,
        file,
        now: Instant::now(),
    }
}

impl World {
    fn spec(&self, req: u64, dir: Direction, blocks: &[u32], route: Vec<BackendId>) -> TaskSpec {
        TaskSpec {
            request: RequestId(req),
            dir,
            route,
            blocks: blocks
                .iter()
                .map(|b| OpBlock {
                    key: BlockKey(*b as u128 + 1000),
                    engine: Some(EngineBlockId(*b)),
                    buf: Buf::Owned(self.pool.take().unwrap()),
                })
                .collect(),
            deadline: self.now + 100 * MS,
            deferred: false,
        }
    }

    fn submit(&mut self, req: u64, dir: Direction, blocks: &[u32]) -> TaskId {
        let s = self.spec(req, dir, blocks, vec![self.engine]);
        self.t.submit(s, self.now)
    }

    /// Ops handed to backends so far (cancels dropped).
    fn take_ops(&mut self) -> Vec<(BackendId, Op)> {
        let mut out = Vec::new();
        while let Some(x) = self.t.poll_backend_command() {
            if let BackendCommand::Submit { backend, op } = x {
                out.push((backend, op));
            }
        }
        out
    }

    fn complete(&mut self, op: Op) {
        self.t
            .handle_completion(OpCompletion::all(op, Ok(())), self.now);
    }

    fn reports(&mut self) -> Vec<TaskReport> {
        let mut out = Vec::new();
        while let Some(e) = self.t.poll_event() {
            if let Event::TaskFinished(r) = e {
                out.push(r);
            }
        }
        out
    }

    fn events(&mut self) -> Vec<Event> {
        std::iter::from_fn(|| self.t.poll_event()).collect()
    }
}

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
    drop(r);
    assert_eq!(w.pool.lent(), 2, "the zombie op holds two buffers");
    w.complete(second);
    assert!(w.pool.is_whole());
    assert_eq!(w.t.stats().late_completions, 1);
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
