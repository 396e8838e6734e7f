//! The tracker scenarios end to end: real CPU backend (memcpy on worker threads), real driver
//! thread, real clock.

use std::time::{Duration, Instant};

use kvx_core::*;

const BLOCK: usize = 3 * 1024;

struct Rig {
    arena: CpuArena,
    pool: BufferPool,
    driver: Option<Driver>,
    host: BackendId,
}

fn rig(delay: Duration) -> Rig {
    let mut arena = CpuArena::per_layer(3, 1024, 16).unwrap();
    for b in 0..16u32 {
        arena.write_block(EngineBlockId(b), &pattern(b, 0)).unwrap();
    }
    let mut builder = DriverBuilder::new(DriverConfig::default());
    // SAFETY: the arena outlives the driver (Rig drops the driver first) and tests read blocks
    // only after their tasks reported or a fence held.
    let host = builder.backend(Box::new(unsafe {
        CpuBackend::new(
            arena.layout().clone(),
            CpuBackendConfig { threads: 2, delay },
        )
        .unwrap()
    }));
    Rig {
        arena,
        pool: BufferPool::new(32, BLOCK, DEFAULT_ALIGN).unwrap(),
        driver: Some(builder.spawn().unwrap()),
        host,
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.driver.take();
    }
}

fn pattern(block: u32, salt: u8) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| {
            (i as u32)
                .wrapping_mul(31)
                .wrapping_add(block * 7 + salt as u32) as u8
        })
        .collect()
}

fn soon(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

impl Rig {
    fn d(&self) -> &Driver {
        self.driver.as_ref().unwrap()
    }

    fn spec(&self, req: u64, dir: Direction, blocks: &[u32], deadline: Instant) -> TaskSpec {
        TaskSpec {
            request: RequestId(req),
            dir,
            route: vec![self.host],
            blocks: blocks
                .iter()
                .map(|b| OpBlock {
                    key: BlockKey(*b as u128),
                    engine: Some(EngineBlockId(*b)),
                    buf: Buf::Owned(self.pool.take().unwrap()),
                })
                .collect(),
            deadline,
            deferred: false,
        }
    }

    /// Poll `get_finished` until `req` is released; false after 2 s.
    fn released(&self, req: u64) -> bool {
        let end = soon(2000);
        while Instant::now() < end {
            if self.d().get_finished().released.contains(&RequestId(req)) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    fn drained(&self) -> bool {
        let end = soon(2000);
        while Instant::now() < end {
            let (_, empty) = self.d().stats().unwrap();
            if empty && self.pool.is_whole() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }
}

#[test]
fn store_then_load_round_trip_is_byte_exact() {
    let mut r = rig(Duration::ZERO);
    let store = r
        .d()
        .submit(r.spec(1, Direction::Store, &[1, 2, 3], soon(2000)))
        .unwrap();
    let rep = r.d().wait_report(store, soon(2000)).unwrap();
    assert_eq!(rep.state, TaskState::Done);
    let saved: Vec<Buf> = rep.blocks.into_iter().map(|b| b.buf.unwrap()).collect();
    assert_eq!(saved[1].as_slice(), &pattern(2, 0)[..]);
    // Load the saved blocks into blocks 10, 11, 12.
    let spec = TaskSpec {
        request: RequestId(1),
        dir: Direction::Load,
        route: vec![r.host],
        blocks: saved
            .into_iter()
            .enumerate()
            .map(|(i, buf)| OpBlock {
                key: BlockKey(i as u128),
                engine: Some(EngineBlockId(10 + i as u32)),
                buf,
            })
            .collect(),
        deadline: soon(2000),
        deferred: false,
    };
    let load = r.d().submit(spec).unwrap();
    assert!(r.d().wait_report(load, soon(2000)).unwrap().is_ok());
    r.d().finish(RequestId(1)).unwrap();
    assert!(r.released(1), "a finished request is always released");
    assert!(r.drained());
    r.driver.take();
    for i in 0..3u32 {
        assert_eq!(
            r.arena.read_block(EngineBlockId(10 + i)).unwrap(),
            pattern(1 + i, 0)
        );
    }
}

#[test]
fn deadline_fires_while_the_backend_is_slow() {
    let r = rig(Duration::from_millis(400));
    let before = r.arena.read_block(EngineBlockId(5)).unwrap();
    let mut spec = r.spec(1, Direction::Load, &[5], soon(60));
    if let Buf::Owned(b) = &mut spec.blocks[0].buf {
        b.as_mut_slice().fill(0xEE);
    }
    let deadline = spec.deadline;
    let t0 = Instant::now();
    let task = r.d().submit(spec).unwrap();
    let rep = r.d().wait_report(task, soon(2000)).unwrap();
    // The driver's verdict time (the test thread may be scheduled later on a loaded machine).
    let ended = rep.finished_at;
    assert_eq!(rep.state, TaskState::TimedOut);
    assert!(ended >= deadline, "ended before its deadline");
    println!(
        "deadline_fires_while_the_backend_is_slow: verdict {:?} after the deadline (bound {:?})",
        ended - deadline,
        TICK + Duration::from_millis(50)
    );
    assert!(
        ended <= deadline + TICK + Duration::from_millis(50),
        "ended {:?} after submit for a 60 ms deadline",
        ended - t0
    );
    let (st, _) = r.d().stats().unwrap();
    assert_eq!(st.zombie_ops, 1, "the slow op is quarantined");
    assert_eq!(r.pool.lent(), 1, "its buffer is not back in the pool");
    r.d().finish(RequestId(1)).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        !r.d().get_finished().released.contains(&RequestId(1)),
        "the zombie copy (400 ms) still holds block 5"
    );
    assert!(r.released(1));
    assert_eq!(
        r.d().stats().unwrap().0.zombie_ops,
        0,
        "released only once the zombie returned"
    );
    // The late op was cancelled before it copied: engine block 5 was never written.
    assert!(r.drained(), "late completion must return the buffer");
    assert_eq!(r.arena.read_block(EngineBlockId(5)).unwrap(), before);
    assert_eq!(r.d().stats().unwrap().0.late_completions, 1);
}

#[test]
fn preempt_flushes_deferred_stores_and_the_fence_holds_after() {
    let r = rig(Duration::from_millis(30));
    let mut spec = r.spec(7, Direction::Store, &[4], soon(3000));
    spec.deferred = true;
    let store = r.d().submit(spec).unwrap();
    let fence = r.d().preempt(RequestId(7)).unwrap();
    assert!(!fence.is_ready(), "the store is running");
    assert!(fence.wait(soon(2000)));
    let rep = r
        .d()
        .wait_report(store, soon(100))
        .expect("store reported before the fence");
    assert_eq!(rep.state, TaskState::Done);
    assert_eq!(
        rep.blocks[0].buf.as_ref().unwrap().as_slice(),
        &pattern(4, 0)[..]
    );
    drop(rep);
    r.d().finish(RequestId(7)).unwrap();
    assert!(r.released(7));
    assert!(r.drained());
}

#[test]
fn finish_delays_until_stores_end_then_releases() {
    let r = rig(Duration::from_millis(50));
    let store = r
        .d()
        .submit(r.spec(3, Direction::Store, &[0, 1], soon(3000)))
        .unwrap();
    r.d().finish(RequestId(3)).unwrap();
    let end = soon(2000);
    let mut released = false;
    let mut reported = false;
    while Instant::now() < end && !(released && reported) {
        let f = r.d().get_finished();
        let now_reported = f.reports.iter().any(|x| x.task == store && x.is_ok());
        let now_released = f.released.contains(&RequestId(3));
        assert!(
            !now_released || reported || now_reported,
            "released before its store reported"
        );
        released |= now_released;
        reported |= now_reported;
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(released && reported);
    assert!(r.drained());
}

#[test]
fn block_reuse_waits_for_the_store_through_the_driver() {
    let r = rig(Duration::from_millis(40));
    let store = r
        .d()
        .submit(r.spec(1, Direction::Store, &[9], soon(3000)))
        .unwrap();
    // Block 9 is handed to request 2 as a load target while the store still reads it.
    let mut load = r.spec(2, Direction::Load, &[9], soon(3000));
    if let Buf::Owned(b) = &mut load.blocks[0].buf {
        b.as_mut_slice().copy_from_slice(&pattern(9, 99));
    }
    let load = r.d().submit(load).unwrap();
    let s = r.d().wait_report(store, soon(2000)).unwrap();
    assert_eq!(
        s.blocks[0].buf.as_ref().unwrap().as_slice(),
        &pattern(9, 0)[..],
        "the store saw the old bytes, not the new load's"
    );
    let l = r.d().wait_report(load, soon(2000)).unwrap();
    assert!(l.finished_at >= s.finished_at);
    assert!(l.is_ok());
}

#[test]
fn reset_through_the_driver_drops_late_results() {
    let r = rig(Duration::from_millis(60));
    let t = r
        .d()
        .submit(r.spec(1, Direction::Store, &[2], soon(3000)))
        .unwrap();
    let fence = r.d().reset().unwrap();
    assert!(
        fence.wait(soon(2000)),
        "the reset fence holds once the copy returned"
    );
    assert_eq!(r.d().stats().unwrap().0.zombie_ops, 0);
    assert!(
        r.d().wait_report(t, soon(50)).is_none(),
        "no report after reset"
    );
    assert!(r.drained());
}

#[cfg(feature = "tokio")]
#[test]
fn task_future_resolves_with_the_report() {
    let r = rig(Duration::ZERO);
    let fut = r
        .d()
        .submit_async(r.spec(1, Direction::Store, &[6], soon(2000)))
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let rep = rt.block_on(fut).unwrap();
    assert_eq!(rep.state, TaskState::Done);
    assert_eq!(
        rep.blocks[0].buf.as_ref().unwrap().as_slice(),
        &pattern(6, 0)[..]
    );
}

#[test]
fn driver_stopped_is_an_error_not_a_hang() {
    let mut r = rig(Duration::ZERO);
    let h = r.d().handle();
    r.driver.take();
    let stopped = CoreError::DriverStopped {
        reason: "stopped".into(),
    };
    assert_eq!(h.finish(RequestId(1)), Err(stopped.clone()));
    assert_eq!(h.stats().err(), Some(stopped));
    assert_eq!(h.stopped().map(|s| s.reason), Some("stopped".into()));
    assert!(
        h.submit(r.spec(1, Direction::Store, &[0], soon(100)))
            .is_err()
    );
}

#[test]
fn stats_never_says_empty_while_a_command_is_queued() {
    let r = rig(Duration::from_millis(30));
    assert!(r.drained(), "a fresh driver is empty");
    let t = r
        .d()
        .submit(r.spec(1, Direction::Store, &[3], soon(3000)))
        .unwrap();
    let (_, empty) = r.d().stats().unwrap();
    assert!(!empty, "the submit is queued or its copy is running");
    assert!(r.d().wait_report(t, soon(2000)).unwrap().is_ok());
    r.d().finish(RequestId(1)).unwrap();
    assert!(r.released(1));
    assert!(r.drained());
}

#[cfg(feature = "tokio")]
#[test]
fn a_future_of_a_task_dropped_by_reset_resolves_with_an_error() {
    let r = rig(Duration::from_millis(60));
    let fut = r
        .d()
        .submit_async(r.spec(1, Direction::Store, &[6], soon(3000)))
        .unwrap();
    let id = fut.id();
    let fence = r.d().reset().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert_eq!(rt.block_on(fut).unwrap_err(), CoreError::DroppedByReset(id));
    assert!(fence.wait(soon(2000)));
    assert!(r.drained());
}

/// An op of 20 MiB is copied by both copy threads at once (it is at least 4 MiB): every block
/// lands byte-exact in its own engine block, and each block's verdict stays its own, also for a
/// block of the second thread's half that fails.
#[test]
fn a_large_op_spread_over_the_copy_threads_keeps_every_block_its_own() {
    const SEG: usize = 64 * 1024;
    const N: u32 = 80; // 80 blocks of 4 x 64 KiB = 20 MiB per op
    let mut arena = CpuArena::per_layer(4, SEG, 2 * N).unwrap();
    let block = |b: u32| -> Vec<u8> {
        (0..4 * SEG)
            .map(|i| (i as u32 / 4096).wrapping_add(b * 13) as u8)
            .collect()
    };
    for b in 0..N {
        arena.write_block(EngineBlockId(b), &block(b)).unwrap();
    }
    let mut builder = DriverBuilder::new(DriverConfig::default());
    // SAFETY: the arena outlives the driver (dropped first, below) and the test reads blocks
    // only after their tasks reported.
    let host = builder.backend(Box::new(unsafe {
        CpuBackend::new(
            arena.layout().clone(),
            CpuBackendConfig {
                threads: 2,
                delay: Duration::ZERO,
            },
        )
        .unwrap()
    }));
    let pool = BufferPool::new(N as usize + 1, 4 * SEG, DEFAULT_ALIGN).unwrap();
    let driver = builder.spawn().unwrap();
    let shared = Buf::Owned(pool.take().unwrap()).into_shared();
    let bad = 60; // in the second half: a store cannot copy into a shared buffer
    let spec = |dir, blocks: Vec<OpBlock>| TaskSpec {
        request: RequestId(1),
        dir,
        route: vec![host],
        blocks,
        deadline: soon(5000),
        deferred: false,
    };
    let stores = (0..N)
        .map(|b| OpBlock {
            key: BlockKey(b as u128),
            engine: Some(EngineBlockId(b)),
            buf: if b == bad {
                Buf::Shared(shared.clone())
            } else {
                Buf::Owned(pool.take().unwrap())
            },
        })
        .collect();
    let task = driver.submit(spec(Direction::Store, stores)).unwrap();
    let rep = driver.wait_report(task, soon(5000)).unwrap();
    assert_eq!(rep.blocks.len(), N as usize);
    for (b, r) in rep.blocks.iter().enumerate() {
        assert_eq!(r.engine, Some(EngineBlockId(b as u32)));
        assert_eq!(
            r.result.is_err(),
            b as u32 == bad,
            "block {b}: {:?}",
            r.result
        );
    }
    // Load the stored blocks into the arena's other half.
    let loads = rep
        .blocks
        .into_iter()
        .filter(|r| r.result.is_ok())
        .map(|r| OpBlock {
            key: r.key,
            engine: r.engine.map(|e| EngineBlockId(e.0 + N)),
            buf: r.buf.unwrap(),
        })
        .collect();
    let task = driver.submit(spec(Direction::Load, loads)).unwrap();
    assert!(driver.wait_report(task, soon(5000)).unwrap().is_ok());
    drop(driver);
    for b in (0..N).filter(|b| *b != bad) {
        assert_eq!(
            arena.read_block(EngineBlockId(b + N)).unwrap(),
            block(b),
            "block {b}"
        );
    }
}
