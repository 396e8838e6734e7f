//! Every engine-facing call returns in bounded time, whatever the engine backend does: its ops
//! never complete (a gate in front of the real CPU backend), it panics, or the engine resets
//! while a copy is out (the real CPU backend, slowed).

mod common;

use std::time::{Duration, Instant};

use common::faults::{Fuse, gated_rig};
use common::*;
use kvx_core::*;
use kvx_offload::*;

const T: Duration = Duration::from_secs(10);
/// A verdict comes by its deadline plus one tick, the load-fence grace, and this allowance
/// (the most the project allows a loaded 2-core machine).
const ALLOWANCE: Duration = Duration::from_millis(50);
/// What one call may take: the longest the connector's calls wait by design (`start_step`
/// waits up to `preempt_wait_ms` for a preemption's fence), one tick, and the allowance. A
/// call that waited on a stuck device would take a deadline (100 ms here) or forever.
const CALL_BOUND: Duration = Duration::from_millis(
    DEFAULT_PREEMPT_WAIT.as_millis() as u64
        + TICK.as_millis() as u64
        + ALLOWANCE.as_millis() as u64,
);
const LOAD_MS: u64 = 100;

/// The tests of this file measure call times: they run one at a time, not beside each other.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    kvx_core::lock(&SERIAL)
}

/// One engine-facing call of the worker half, its result dropped.
type Call = Box<dyn Fn(&mut Rig) -> Result<(), OffloadError>>;

/// Time one call: fail if its time less the time the OS did not run the calling thread (its
/// run-queue wait, steal) or kvx's threads (their run-queue wait) is over `CALL_BOUND`. The
/// machine is shared: the OS taking the CPU away is not the call waiting.
fn timed<R>(what: &str, worst: &mut Duration, f: impl FnOnce() -> R) -> R {
    let clock = kvx_thread_clock::ThreadClock::also_excusing("kvx-");
    let (r, took) = clock.time(f);
    *worst = (*worst).max(took.wall);
    assert!(
        took.unexcused() <= CALL_BOUND,
        "{what} took {took} ({})",
        clock.source()
    );
    r
}

#[test]
fn ops_that_never_complete_leave_every_call_bounded() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (mut r, gate) = gated_rig(
        dir.path(),
        Opts {
            load_ms: LOAD_MS,
            store_ms: LOAD_MS,
            ..Opts::default()
        },
    );
    let prefix = keys(40, 0, 40, 2);
    assert!(
        r.offload(1, &prefix, &[0, 1], T),
        "stored while the gate was open"
    );
    gate.close();

    let mut worst = Duration::ZERO;
    let mut loads: Vec<(RequestId, Instant, Vec<EngineBlockId>)> = Vec::new();
    let mut verdicts = 0;
    let mut loading = std::collections::HashSet::new();
    let mut in_use = Vec::new();
    let mut fences = Vec::new();
    // When the previous get_finished was called: a verdict first seen in a poll was still
    // missing then. Loads are held to their bound at that poll, not at the one that saw the
    // verdict: the test's own work between polls (computing and saving a block, sleeping) is
    // not the connector's.
    let mut last_poll: Option<Instant> = None;
    // The driver thread's unscheduled time (run-queue wait, steal), sampled at each poll: a
    // verdict late because the OS did not run the driver thread is excused that much.
    let mut driver = kvx_thread_clock::UnscheduledLog::new("kvx-driver");
    driver.sample();
    let mut latest_missing = Duration::ZERO;
    let by = Duration::from_millis(LOAD_MS) + TICK + Duration::from_millis(5) + ALLOWANCE;
    let mut next_block = 2u32;
    let mut block = || {
        next_block = 2 + (next_block - 1) % (ENGINE_BLOCKS - 2);
        next_block
    };
    for step in 0..1000u64 {
        let req = RequestId(100 + step);
        // Every step computes and saves a block; its store never completes.
        let b = block();
        let k = keys(41, 0, 100 + step, 1);
        r.compute(&k, &[b]);
        r.save(req.0, &k, &[b]);
        // Every 25th step loads the stored prefix; every 10th preempts the last step's request.
        if step % 25 == 0 {
            let target = [block(), block()];
            if let Some(n) = r.sched.get_num_new_matched_tokens(req, &prefix, 0) {
                assert_eq!(n, 2 * BT as u64);
                let ids: Vec<EngineBlockId> = target.iter().map(|b| EngineBlockId(*b)).collect();
                r.sched.update_state_after_alloc(req, &ids).unwrap();
                loads.push((req, Instant::now(), ids));
                loading.insert(req);
            }
        }
        if step % 10 == 5 {
            r.sched.request_preempted(RequestId(100 + step - 1));
        }
        let meta = r.sched.build_meta();
        let started = timed("start_step", &mut worst, || r.w().start_step(meta));
        match started {
            Ok(StepStarted::Clear) => {}
            Ok(StepStarted::FenceOutstanding(f)) => fences.push(f),
            Err(e) => panic!("start_step: {e}"),
        }
        let polled = Instant::now();
        driver.sample();
        let out = timed("get_finished", &mut worst, || r.w().get_finished()).unwrap();
        let missing_at = last_poll.replace(polled);
        r.sched.update_from_worker(&out);
        for got in &out.finished_recving {
            let (_, t0, ids) = loads.iter().find(|l| l.0 == *got).expect("a load of ours");
            // Still missing at the previous poll (zero if that came before the load started).
            let missing = missing_at.map_or(Duration::ZERO, |at| at.saturating_duration_since(*t0));
            let unscheduled = missing_at.map_or(Duration::ZERO, |at| driver.between(*t0, at));
            latest_missing = latest_missing.max(missing);
            assert!(
                missing <= by + unscheduled,
                "{got}'s verdict was still missing {missing:?} after its load started (bound \
                 {by:?} plus the {unscheduled:?} the driver thread was not scheduled)"
            );
            assert!(
                ids.iter().all(|b| out.invalid_blocks.contains(b)),
                "{out:?}"
            );
            verdicts += 1;
            // The engine ends a request once its load's verdict is in.
            loading.remove(got);
            timed("request_finished", &mut worst, || {
                r.sched.request_finished(*got)
            });
        }
        in_use.extend(out.blocks_in_use.iter().copied());
        // Requests finish a few steps after they saved.
        if step >= 3 && !loading.contains(&RequestId(100 + step - 3)) {
            let done = RequestId(100 + step - 3);
            timed("request_finished", &mut worst, || {
                r.sched.request_finished(done)
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    println!(
        "latest a verdict was still missing: {latest_missing:?} after its load started (bound {by:?})"
    );
    // The loads that had time to reach their deadline by the last poll all got a verdict.
    let last_poll = last_poll.expect("1000 polls");
    let due = loads
        .iter()
        .filter(|l| last_poll - l.1 > Duration::from_millis(LOAD_MS) + TICK + ALLOWANCE)
        .count();
    assert!(due >= 30, "only {due} loads were due");
    assert!(verdicts >= due, "{verdicts} verdicts for {due} loads due");
    assert!(
        !in_use.is_empty(),
        "stuck load copies keep their blocks out of use"
    );
    assert!(
        fences.iter().any(|f| !f.is_ready()),
        "preemptions of requests with stores out hand back fences that do not hold"
    );
    println!("worst call: {worst:?} over 1000 steps");
    // The device answers at last: every op returns, every fence holds, all blocks come back.
    gate.open();
    for f in &fences {
        assert!(
            f.wait(Instant::now() + T),
            "a fence never held after the ops returned"
        );
    }
    for s in 1000..1003u64 {
        r.sched.request_finished(RequestId(100 + s - 3));
    }
    for req in loading {
        r.sched.request_finished(req);
    }
    assert!(
        r.settle(T),
        "the connector did not settle once the device answered"
    );
    let released: Vec<EngineBlockId> = r.out.blocks_released.clone();
    assert!(
        in_use.iter().all(|b| released.contains(b)),
        "every block held for a stuck copy is released"
    );
}

#[test]
fn a_preemption_fence_holds_only_once_the_ops_returned() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (mut r, gate) = gated_rig(
        dir.path(),
        Opts {
            store_ms: LOAD_MS,
            ..Opts::default()
        },
    );
    let ks = keys(50, 0, 50, 3);
    r.compute(&ks, &[0, 1, 2]);
    r.save(1, &ks, &[0, 1, 2]);
    r.step(); // the store is queued
    gate.close();
    r.sched.request_preempted(RequestId(1));
    let meta = r.sched.build_meta();
    let started = timed("start_step", &mut Duration::default(), || {
        r.w().start_step(meta)
    });
    let Ok(StepStarted::FenceOutstanding(fence)) = started else {
        panic!("the preemption fence cannot hold while the store is out: {started:?}");
    };
    assert_eq!(fence.requests(), &[RequestId(1)]);
    // Past the store's deadline the task is over, but its op is still out: no fence.
    std::thread::sleep(Duration::from_millis(2 * LOAD_MS));
    r.step();
    assert!(!fence.is_ready(), "the fence held while the op was out");
    assert_eq!(gate.returned(), 0);
    gate.open();
    assert!(fence.wait(Instant::now() + T));
    assert_eq!(
        gate.returned(),
        gate.submitted(),
        "the fence held before every op had returned"
    );
    r.finish(1);
    assert!(r.settle(T));
}

#[test]
fn reset_during_a_load_copy_fences_the_engine_blocks() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let delay = Duration::from_millis(150);
    let mut r = rig(
        dir.path(),
        Opts {
            host_delay: delay,
            ..Opts::default()
        },
    );
    let ks = keys(60, 0, 60, 2);
    assert!(r.offload(1, &ks, &[0, 1], T));
    // Request 2 loads into blocks 20 and 21; request 3 saves block 30 and finishes with its
    // store out, so its freeing is delayed.
    assert_eq!(r.load(2, &ks, &[20, 21]), Some(2 * BT as u64));
    let k3 = keys(61, 0, 61, 1);
    r.compute(&k3, &[30]);
    r.save(3, &k3, &[30]);
    assert!(r.finish(3));
    r.step(); // the load copies start (each sleeps `delay` first); the store is queued
    r.step(); // the store is submitted
    let reset = timed("reset", &mut Duration::default(), || r.w().reset()).unwrap();
    r.sched.reset();
    assert_eq!(
        reset.delayed_free,
        vec![RequestId(3)],
        "the delayed free is handed back"
    );
    assert!(!reset.fence.is_ready(), "the copies are still out");
    assert!(reset.fence.wait(Instant::now() + T));
    // The engine reuses the blocks at once: nothing kvx started may write them now.
    let canary = vec![0xC3; BLOCK];
    for b in [20, 21, 30] {
        r.arena.write_block(EngineBlockId(b), &canary).unwrap();
    }
    std::thread::sleep(2 * delay);
    r.step();
    for b in [20, 21, 30] {
        assert_eq!(
            r.arena.read_block(EngineBlockId(b)).unwrap(),
            canary,
            "engine block {b} was written after the reset's fence held"
        );
    }
    assert!(
        !r.out.finished_sending.contains(&RequestId(3)),
        "a request handed back by the reset is not reported again"
    );
    assert!(r.settle(T));
}

#[test]
fn a_backend_panic_turns_every_call_into_an_error() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut r = rig(
        dir.path(),
        Opts {
            wrap_engine: Some(Box::new(|inner| Box::new(Fuse::new(inner, 3)))),
            ..Opts::default()
        },
    );
    // Ops 1 and 2 run; op 3 blows up the driver thread.
    let mut stopped = None;
    for i in 0..3u64 {
        let k = keys(70, 0, 70 + i, 1);
        r.compute(&k, &[i as u32]);
        r.save(i, &k, &[i as u32]);
        r.finish(i);
        let end = Instant::now() + T;
        while stopped.is_none() && Instant::now() < end {
            let meta = r.sched.build_meta();
            match r.w().start_step(meta).and_then(|_| r.w().get_finished()) {
                Ok(out) => {
                    r.sched.update_from_worker(&out);
                    if r.sched.job_count() == 0 {
                        break;
                    }
                }
                Err(e) => stopped = Some(e),
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let e = stopped.expect("the fuse blew");
    assert!(
        e.to_string().contains("test fuse"),
        "the panic message is kept: {e}"
    );
    let calls: Vec<(&str, Call)> = vec![
        (
            "start_step",
            Box::new(|r| r.w().start_step(StepMeta::default()).map(drop)),
        ),
        ("get_finished", Box::new(|r| r.w().get_finished().map(drop))),
        (
            "handle_preemptions",
            Box::new(|r| {
                r.w()
                    .handle_preemptions(&[RequestId(1)], Duration::from_secs(5))
                    .map(drop)
            }),
        ),
        ("reset", Box::new(|r| r.w().reset().map(drop))),
        (
            "drain",
            Box::new(|r| r.w().drain(Duration::from_secs(5)).map(drop)),
        ),
    ];
    for (what, call) in calls {
        let res = timed(what, &mut Duration::default(), || call(&mut r));
        match res {
            Err(OffloadError::Core(CoreError::DriverStopped { reason })) => {
                assert!(reason.contains("test fuse"), "{what}: {reason}")
            }
            other => panic!("{what} after the panic: {other:?}"),
        }
    }
    let stop = r.w().stopped().expect("the worker says why");
    assert!(stop.reason.contains("test fuse"));
}
