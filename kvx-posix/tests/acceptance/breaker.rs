//! The health breaker of a root: timeouts open it, new loads fail at once without being
//! submitted, and after thaw a probe closes it.

use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_policy::{BreakerConfig, BreakerState};
use kvx_posix::IoEngine;

use crate::rig::*;

pub fn breaker(engine: IoEngine) {
    let r = Rig::new(engine, Place::Fuse, |c| {
        c.breaker = BreakerConfig {
            failure_threshold: 3,
            window_ms: 10_000,
            cool_down_ms: 400,
            probe_deadline_ms: 2_000,
        };
    });
    let k = key(4000);
    r.store_ok(&[k]);
    let root = r.files.root_of(k);
    assert_eq!(r.files.breaker_state(root), Some(BreakerState::Closed));
    r.mount().freeze();
    let deadline = Instant::now() + DEADLINE;
    let tasks: Vec<TaskId> = (0..3)
        .map(|_| r.submit_route(Direction::Load, vec![r.posix], r.empty(&[k]), deadline))
        .collect();
    let mut late = Duration::ZERO;
    for t in tasks {
        late = late.max(assert_timed_out_on_time(
            &r.report_by(t, deadline + SOON),
            deadline,
        ));
    }
    println!(
        "breaker {engine}: 3 loads timed out at most {late:?} after their deadline (bound {MARGIN:?})"
    );
    assert!(
        matches!(r.files.breaker_state(root), Some(BreakerState::Open { .. })),
        "three timeouts open the breaker: {:?}",
        r.files.breaker_state(root)
    );
    // A new load fails at once, long before its deadline, without reaching the engine.
    let before = r.files.stats();
    let started = Instant::now();
    let t = r.submit_route(
        Direction::Load,
        vec![r.posix],
        r.empty(&[k]),
        started + Duration::from_secs(30),
    );
    let rep = r.report_by(t, started + SOON);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "rejected at once, not after a deadline"
    );
    assert!(matches!(rep.state, TaskState::Failed(_)), "{:?}", rep.state);
    assert!(
        matches!(rep.blocks[0].result, Err(BlockError::Unavailable(_))),
        "{:?}",
        rep.blocks[0].result
    );
    let after = r.files.stats();
    assert_eq!(after.rejected, before.rejected + 1);
    assert_eq!(after.in_flight, before.in_flight, "never submitted");
    drop(rep);
    r.mount().thaw();
    assert!(r.drained());
    // After the cool-down the next load is the probe; it succeeds and closes the breaker.
    std::thread::sleep(Duration::from_millis(500));
    let rep = r.load(&[k]);
    assert!(rep.is_ok(), "probe: {:?}", first_error(&rep));
    assert_eq!(r.files.breaker_state(root), Some(BreakerState::Closed));
    assert!(r.load(&[k]).is_ok());
}
