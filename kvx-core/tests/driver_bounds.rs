//! The bounds of the engine-facing driver calls when a backend misbehaves: it panics, it never
//! completes, or its copies cannot be cancelled. Real driver thread, real clock; every time
//! margin is one `TICK` plus a stated allowance of at most 50 ms.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::*;

/// Allowance on top of one tick for a real-time margin on a loaded 2-core machine.
const ALLOWANCE: Duration = Duration::from_millis(50);
/// The longest an engine-facing call may take while a backend is stuck.
const CALL_BOUND: Duration = Duration::from_millis(10);

fn soon(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

fn load(
    pool: &BufferPool,
    backend: BackendId,
    req: u64,
    block: u32,
    deadline: Instant,
) -> TaskSpec {
    TaskSpec {
        request: RequestId(req),
        dir: Direction::Load,
        route: vec![backend],
        blocks: vec![OpBlock {
            key: BlockKey(block as u128),
            engine: Some(EngineBlockId(block)),
            buf: Buf::Owned(pool.take().expect("pool has a buffer")),
        }],
        deadline,
        deferred: false,
    }
}

/// Worst call time seen, and how many calls took longer than `CALL_BOUND` only because the OS
/// did not run the calling thread or kvx's threads (the machine is shared; that is not the call
/// waiting).
#[derive(Default, Debug)]
struct Timing {
    worst: Duration,
    excused: usize,
}

/// Time one call. Fail if its time less the time the OS did not run the calling thread (its
/// run-queue wait, steal) or kvx's threads (their run-queue wait) is over `CALL_BOUND`: a call
/// that waited on the driver thread or a backend slept, which is not excused.
fn timed<R>(what: &str, timing: &mut Timing, f: impl FnOnce() -> R) -> R {
    let clock = kvx_thread_clock::ThreadClock::also_excusing("kvx-");
    let (r, took) = clock.time(f);
    assert!(
        took.unexcused() <= CALL_BOUND,
        "{what} took {took} ({}): it waited",
        clock.source()
    );
    if took.wall > CALL_BOUND {
        timing.excused += 1;
    }
    timing.worst = timing.worst.max(took.wall);
    r
}

// ---------------------------------------------------------------------------------------------
// A backend that panics.

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PanicIn {
    /// The Nth `submit` panics.
    Submit,
    /// `poll` panics once N ops were submitted.
    Poll,
}

/// Holds every op it is given (never completes one) and panics on its Nth op.
struct Exploding {
    nth: usize,
    at: PanicIn,
    held: Vec<Op>,
}

impl Backend for Exploding {
    fn name(&self) -> &str {
        "exploding"
    }
    fn touches_engine_memory(&self) -> bool {
        true
    }
    fn set_notifier(&mut self, _: Notifier) {}
    fn submit(&mut self, op: Op) -> Result<(), SubmitError> {
        self.held.push(op);
        if self.at == PanicIn::Submit && self.held.len() == self.nth {
            panic!("exploding backend: op {} in submit", self.nth);
        }
        Ok(())
    }
    fn poll(&mut self, _: &mut Vec<OpCompletion>) {
        if self.at == PanicIn::Poll && self.held.len() >= self.nth {
            panic!("exploding backend: op {} in poll", self.nth);
        }
    }
    fn cancel(&mut self, _: OpId) {}
    fn wait(&mut self, _: &[OpId], _: Instant) -> WaitOutcome {
        WaitOutcome::TimedOut
    }
}

/// The process's panic hook runs on the panicking thread before the driver can catch the
/// unwind; the default hook with `RUST_BACKTRACE=1` symbolizes a backtrace, which takes far
/// longer than the bound under test in a debug build. An engine chooses its own hook, so the
/// test installs a short one for the driver thread (every other thread keeps the default).
fn quiet_driver_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some("kvx-driver") {
                eprintln!("kvx-driver panicked: {info}");
            } else {
                default(info)
            }
        }));
    });
}

fn panic_stops_the_driver_and_every_call_errs(at: PanicIn) {
    quiet_driver_panics();
    // The future (feature `tokio`) takes one op more before the one that explodes.
    let nth = if cfg!(feature = "tokio") { 4 } else { 3 };
    let mut b = DriverBuilder::new(DriverConfig::default());
    let be = b.backend(Box::new(Exploding {
        nth,
        at,
        held: Vec::new(),
    }));
    let driver = b.spawn().unwrap();
    let h = driver.handle();
    let pool = BufferPool::new(8, 4096, DEFAULT_ALIGN).unwrap();

    // Two loads out with the backend, a fence on the first, waiters on both.
    let _t1 = h.submit(load(&pool, be, 1, 0, soon(10_000))).unwrap();
    let t2 = h.submit(load(&pool, be, 2, 1, soon(10_000))).unwrap();
    let fence = h.preempt(RequestId(1)).unwrap();
    // Each waiter notes when it returned: the test thread checks that later, after calls of
    // its own that a preempted machine may stretch, and must not count them.
    let waiter_report = {
        let h = h.clone();
        std::thread::spawn(move || (h.wait_report(t2, soon(10_000)), Instant::now()))
    };
    let waiter_fence = {
        let f = fence.clone();
        std::thread::spawn(move || (f.wait(soon(10_000)), Instant::now()))
    };
    #[cfg(feature = "tokio")]
    let fut = h.submit_async(load(&pool, be, 4, 4, soon(10_000))).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(h.stopped().is_none(), "two ops out: nothing exploded yet");
    assert!(!fence.is_ready(), "the load's copy is still out");

    // The last op explodes.
    let t0 = Instant::now();
    h.submit(load(&pool, be, 3, 2, soon(10_000))).unwrap();
    let stopped = loop {
        if let Some(s) = h.stopped() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_millis(100),
            "no stop within 100 ms"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    let place = if at == PanicIn::Submit {
        "submit"
    } else {
        "poll"
    };
    let expected = format!("exploding backend: op {nth} in {place}");
    assert!(
        stopped.reason.contains(&expected),
        "reason: {}",
        stopped.reason
    );
    let at_risk = stopped.blocks_at_risk.expect("the driver could tell");
    for b in [0, 1, 2, 4].into_iter().take(nth) {
        assert!(
            at_risk.contains(&EngineBlockId(b)),
            "block {b} had an op out: {at_risk:?}"
        );
    }

    // Every later call errs at once, with the message.
    let mut timing = Timing::default();
    let is_stopped = |e: CoreError| matches!(e, CoreError::DriverStopped { reason } if reason.contains(&expected));
    assert!(is_stopped(
        timed("submit", &mut timing, || h.submit(load(
            &pool,
            be,
            5,
            5,
            soon(1000)
        )))
        .unwrap_err()
    ));
    assert!(is_stopped(
        timed("finish", &mut timing, || h.finish(RequestId(1))).unwrap_err()
    ));
    assert!(is_stopped(
        timed("stats", &mut timing, || h.stats()).unwrap_err()
    ));
    assert!(is_stopped(
        timed("start_step", &mut timing, || h.start_step()).unwrap_err()
    ));
    assert!(is_stopped(
        timed("cancel", &mut timing, || h.cancel(t2)).unwrap_err()
    ));
    assert!(is_stopped(
        timed("preempt", &mut timing, || h.preempt(RequestId(2))).unwrap_err()
    ));
    assert!(is_stopped(
        timed("fence_blocks", &mut timing, || h
            .fence_blocks(&[EngineBlockId(7)]))
        .unwrap_err()
    ));
    assert!(is_stopped(
        timed("reset", &mut timing, || h.reset()).unwrap_err()
    ));
    let f = timed("get_finished", &mut timing, || h.get_finished());
    assert!(
        f.reports
            .iter()
            .all(|r| r.request == RequestId(1) && r.state == TaskState::Cancelled),
        "only the preempted load reported"
    );
    // The fence never claims the blocks are safe.
    assert!(!fence.is_ready());
    assert!(is_stopped(fence.poll().unwrap_err()));
    assert!(!timed("fence wait", &mut timing, || fence.wait(soon(5_000))));
    assert!(!timed("wait_finished", &mut timing, || h
        .wait_finished(soon(5_000))));
    assert!(
        timed("wait_report", &mut timing, || h
            .wait_report(t2, soon(5_000)))
        .is_none()
    );

    // The waiters that were blocked before the panic returned too, within 100 ms of it (their
    // own deadlines are 10 s away).
    let (report, report_at) = waiter_report.join().unwrap();
    let (held, fence_at) = waiter_fence.join().unwrap();
    let returned = report_at.max(fence_at) - t0;
    println!(
        "panic in {at:?}: the blocked waiters returned {returned:?} after the exploding submit (bound 100ms)"
    );
    assert!(
        returned < Duration::from_millis(100),
        "a waiter still blocked {returned:?} after the panic"
    );
    assert!(report.is_none());
    assert!(!held);
    #[cfg(feature = "tokio")]
    {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let r = rt.block_on(fut);
        assert!(
            matches!(r, Err(CoreError::DriverStopped { reason }) if reason.contains(&expected))
        );
    }
    let t_drop = Instant::now();
    drop(driver);
    assert!(
        t_drop.elapsed() < Duration::from_millis(100),
        "the driver thread had already exited"
    );
}

#[test]
fn a_backend_panic_in_submit_stops_the_driver_and_every_call_errs() {
    panic_stops_the_driver_and_every_call_errs(PanicIn::Submit);
}

#[test]
fn a_backend_panic_in_poll_stops_the_driver_and_every_call_errs() {
    panic_stops_the_driver_and_every_call_errs(PanicIn::Poll);
}

// ---------------------------------------------------------------------------------------------
// A backend whose ops never complete and whose cancel does nothing.

#[derive(Default)]
struct StuckState {
    held: Mutex<Vec<Op>>,
    thawed: AtomicBool,
    notifier: Mutex<Option<Notifier>>,
}

/// Holds every op until the test thaws it; `cancel` does nothing.
struct Stuck(Arc<StuckState>);

impl Stuck {
    fn thaw(state: &StuckState) {
        state.thawed.store(true, Ordering::Release);
        if let Some(n) = lock(&state.notifier).as_ref() {
            n.notify();
        }
    }
}

impl Backend for Stuck {
    fn name(&self) -> &str {
        "stuck"
    }
    fn touches_engine_memory(&self) -> bool {
        true
    }
    fn set_notifier(&mut self, n: Notifier) {
        *lock(&self.0.notifier) = Some(n);
    }
    fn submit(&mut self, op: Op) -> Result<(), SubmitError> {
        lock(&self.0.held).push(op);
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<OpCompletion>) {
        if self.0.thawed.load(Ordering::Acquire) {
            out.extend(
                lock(&self.0.held)
                    .drain(..)
                    .map(|op| OpCompletion::all(op, Ok(()))),
            );
        }
    }
    fn cancel(&mut self, _: OpId) {}
    fn wait(&mut self, _: &[OpId], _: Instant) -> WaitOutcome {
        WaitOutcome::TimedOut
    }
}

#[test]
fn a_stuck_backend_never_slows_a_call_and_loads_still_time_out() {
    let state = Arc::new(StuckState::default());
    let mut b = DriverBuilder::new(DriverConfig::default());
    let be = b.backend(Box::new(Stuck(state.clone())));
    let driver = b.spawn().unwrap();
    let h = driver.handle();
    let pool = BufferPool::new(1100, 512, DEFAULT_ALIGN).unwrap();

    // 1,000 engine steps: submit a load (20 ms deadline), poll, finish an old request, read
    // stats. Loads on the same 64 blocks queue behind the stuck copies and time out too.
    const LAG: u64 = 100;
    let mut seen = Seen::new();
    let mut timing: [Timing; 4] = Default::default();
    for i in 0..1000u64 {
        let deadline = soon(20);
        let spec = load(&pool, be, i, (i % 64) as u32, deadline);
        let task = timed("submit", &mut timing[0], || h.submit(spec)).unwrap();
        seen.deadlines.insert(task, deadline);
        let f = timed("get_finished", &mut timing[1], || h.get_finished());
        seen.take(f);
        // The request of 100 steps ago (its load timed out long since; finishing a request
        // cancels its loads, so a fresh one would be cancelled instead).
        if let Some(old) = i.checked_sub(LAG) {
            timed("finish", &mut timing[2], || h.finish(RequestId(old))).unwrap();
        }
        let (st, empty) = timed("stats", &mut timing[3], || h.stats()).unwrap();
        assert!(!empty, "copies are stuck: the tracker cannot be empty");
        assert!(
            st.zombie_ops <= 64,
            "one stuck copy per block at most: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // The last loads reach their deadlines.
    // (Collecting them may lag on a loaded machine; their verdict times are what is checked.)
    let end = soon(1000);
    while seen.timed_out < 1000 && Instant::now() < end {
        seen.take(h.get_finished());
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(seen.timed_out, 1000, "every load got its verdict");
    println!(
        "stuck backend: latest of 1000 verdicts {:?} after its deadline (bound {:?})",
        seen.latest,
        TICK + ALLOWANCE
    );
    for old in 1000 - LAG..1000 {
        h.finish(RequestId(old)).unwrap();
    }
    let end = soon(1000);
    while seen.released.len() < 1000 - 64 && Instant::now() < end {
        seen.take(h.get_finished());
        std::thread::sleep(Duration::from_millis(1));
    }
    let zombies = h.stats().unwrap().0.zombie_ops;
    assert_eq!(zombies, 64, "each block has its stuck copy");
    assert_eq!(
        seen.released.len(),
        1000 - 64,
        "requests with a stuck copy are not released"
    );
    eprintln!(
        "calls (worst, past the bound only while not scheduled): submit {:?}, get_finished {:?}, finish {:?}, stats {:?}",
        timing[0], timing[1], timing[2], timing[3]
    );

    // wait_finished: with nothing to take it waits until its `until`, not past it; a load's
    // timeout verdict wakes it by that deadline.
    let start = Instant::now();
    assert!(!h.wait_finished(start + Duration::from_millis(30)));
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(30)
            && waited < Duration::from_millis(30) + TICK + ALLOWANCE,
        "wait_finished with nothing to take returned after {waited:?} (until: 30 ms)"
    );
    let deadline = soon(20);
    let t = h.submit(load(&pool, be, 6000, 101, deadline)).unwrap();
    assert!(
        h.wait_finished(soon(2000)),
        "the timed-out load is there to take"
    );
    let late = Instant::now().saturating_duration_since(deadline);
    assert!(
        late < TICK + ALLOWANCE,
        "woken {late:?} after the load's deadline"
    );
    let f = h.get_finished();
    assert!(
        f.reports
            .iter()
            .any(|r| r.task == t && r.state == TaskState::TimedOut)
    );
    h.finish(RequestId(6000)).unwrap();

    // A preemption fence over a stuck copy holds only once the backend returns it.
    let t = h.submit(load(&pool, be, 5000, 100, soon(10_000))).unwrap();
    let fence = h.preempt(RequestId(5000)).unwrap();
    let rep = h
        .wait_report(t, soon(1000))
        .expect("the preempted load is reported");
    assert_eq!(rep.state, TaskState::Cancelled);
    assert!(
        !fence.wait(soon(50)),
        "the copy into block 100 is still out"
    );
    assert_eq!(fence.poll(), Ok(false));
    let thawed = Instant::now();
    Stuck::thaw(&state);
    assert!(
        fence.wait(thawed + Duration::from_secs(2)),
        "the fence holds once the copies returned"
    );
    h.finish(RequestId(5000)).unwrap();
    let end = soon(1000);
    while seen.released.len() < 1002 && Instant::now() < end {
        seen.take(h.get_finished());
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        seen.released.len(),
        1002,
        "every finished request is released once"
    );
    let (st, empty) = h.stats().unwrap();
    assert!(empty, "the tracker drained: {st:?}");
    assert!(pool.is_whole());
}

/// What the stuck-backend test saw come out of the driver.
struct Seen {
    /// The driver thread's unscheduled time (run-queue wait, steal), sampled at each batch: a
    /// verdict late because the OS did not run the driver thread is excused that much.
    driver: kvx_thread_clock::UnscheduledLog,
    deadlines: std::collections::HashMap<TaskId, Instant>,
    timed_out: usize,
    /// The latest verdict past its deadline, for the log.
    latest: Duration,
    released: std::collections::HashSet<RequestId>,
}

impl Seen {
    fn new() -> Self {
        let mut driver = kvx_thread_clock::UnscheduledLog::new("kvx-driver");
        driver.sample();
        Seen {
            driver,
            deadlines: Default::default(),
            timed_out: 0,
            latest: Duration::ZERO,
            released: Default::default(),
        }
    }

    /// Check a batch: every load timed out (the driver's verdict time) no earlier than its
    /// deadline and no later than one tick plus the allowance after it, plus the driver
    /// thread's run-queue wait meanwhile; no request is released twice.
    fn take(&mut self, f: Finished) {
        self.driver.sample();
        for r in f.reports {
            assert_eq!(r.state, TaskState::TimedOut, "{} got {:?}", r.task, r.state);
            let deadline = self.deadlines[&r.task];
            assert!(
                r.finished_at >= deadline,
                "{} ended before its deadline",
                r.task
            );
            let unscheduled = self.driver.between(deadline, r.finished_at);
            assert!(
                r.finished_at <= deadline + TICK + ALLOWANCE + unscheduled,
                "{} timed out {:?} after its deadline ({unscheduled:?} of it the driver thread \
                 was not scheduled)",
                r.task,
                r.finished_at - deadline
            );
            self.latest = self.latest.max(r.finished_at - deadline);
            self.timed_out += 1;
        }
        for req in f.released {
            assert!(self.released.insert(req), "{req} released twice");
        }
    }
}

#[test]
fn a_fence_waits_for_its_copies_until_their_deadline_and_no_longer() {
    let state = Arc::new(StuckState::default());
    // A driver thread that sleeps up to a second when nothing wakes it: a fence's copies
    // becoming overdue must wake it, not its safety-net park.
    let mut b = DriverBuilder::new(DriverConfig {
        max_park: Duration::from_secs(1),
        ..DriverConfig::default()
    });
    let be = b.backend(Box::new(Stuck(state.clone())));
    let driver = b.spawn().unwrap();
    let h = driver.handle();
    let pool = BufferPool::new(8, 512, DEFAULT_ALIGN).unwrap();
    let grace = Duration::from_millis(1);
    let clock = kvx_thread_clock::ThreadClock::also_excusing("kvx-");

    // Nothing out on a block: the fence holds within a tick.
    let (waited, took) = clock.time(|| {
        h.fence_blocks(&[EngineBlockId(7)])
            .unwrap()
            .wait_for_copies(grace)
    });
    assert_eq!(waited, FenceWait::Held);
    assert!(took.unexcused() <= TICK + ALLOWANCE, "{took}");

    // A copy that is stuck past its deadline: the wait outlasts the grace up to the deadline,
    // then ends with the copy overdue (one tick later, when the driver sees it still out).
    let deadline_ms = 150;
    let start = Instant::now();
    let deadline = start + Duration::from_millis(deadline_ms);
    let _t = h.submit(load(&pool, be, 1, 1, deadline)).unwrap();
    let fence = h.preempt(RequestId(1)).unwrap();
    let mut driver_thread = kvx_thread_clock::UnscheduledLog::new("kvx-driver");
    driver_thread.sample();
    let (waited, took) = clock.time(|| fence.wait_for_copies(grace));
    driver_thread.sample();
    let FenceWait::Overdue { late } = waited else {
        panic!("a stuck copy's fence held: {waited:?}");
    };
    let unscheduled = driver_thread.between(deadline, Instant::now());
    assert!(
        late <= TICK + ALLOWANCE + unscheduled,
        "the driver saw the copy overdue only {late:?} after its deadline ({unscheduled:?} of \
         it unscheduled)"
    );
    assert!(
        Instant::now() >= deadline + TICK,
        "ended before the copy was due: {took}"
    );
    assert!(late >= TICK, "{late:?}");
    assert!(
        took.unexcused() <= Duration::from_millis(deadline_ms) + TICK + ALLOWANCE,
        "{took} for a copy due in {deadline_ms} ms"
    );
    assert!(!fence.is_ready());

    // A copy that returns before its deadline: the wait outlasts the grace until it returns.
    let _t = h.submit(load(&pool, be, 2, 2, soon(10_000))).unwrap();
    let fence = h.preempt(RequestId(2)).unwrap();
    let thaw = {
        let state = state.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(60));
            Stuck::thaw(&state);
        })
    };
    let t0 = Instant::now();
    assert_eq!(fence.wait_for_copies(grace), FenceWait::Held);
    assert!(
        t0.elapsed() >= Duration::from_millis(60),
        "held before the copy returned"
    );
    assert!(fence.is_ready());
    thaw.join().unwrap();

    // A stopped driver: the fence never holds, and the wait says so at once.
    let state = Arc::new(StuckState::default());
    let mut b = DriverBuilder::new(DriverConfig::default());
    let be = b.backend(Box::new(Stuck(state.clone())));
    let driver = b.spawn().unwrap();
    let h = driver.handle();
    let _t = h.submit(load(&pool, be, 3, 3, soon(10_000))).unwrap();
    let fence = h.preempt(RequestId(3)).unwrap();
    drop(driver);
    let (waited, took) = clock.time(|| fence.wait_for_copies(grace));
    assert_eq!(waited, FenceWait::Stopped);
    assert!(took.unexcused() <= TICK + ALLOWANCE, "{took}");
}

// ---------------------------------------------------------------------------------------------
// Reset during a load copy with the real CPU backend.

/// The real CPU backend with a cancel that arrives too late: every copy it accepted runs.
struct NoCancel(CpuBackend);

impl Backend for NoCancel {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn touches_engine_memory(&self) -> bool {
        self.0.touches_engine_memory()
    }
    fn set_notifier(&mut self, n: Notifier) {
        self.0.set_notifier(n)
    }
    fn submit(&mut self, op: Op) -> Result<(), SubmitError> {
        self.0.submit(op)
    }
    fn poll(&mut self, out: &mut Vec<OpCompletion>) {
        self.0.poll(out)
    }
    fn cancel(&mut self, _: OpId) {}
    fn wait(&mut self, ops: &[OpId], until: Instant) -> WaitOutcome {
        self.0.wait(ops, until)
    }
}

#[test]
fn no_engine_block_is_written_after_the_reset_fence_holds() {
    const BLOCK: usize = 2048;
    const COPY: Duration = Duration::from_millis(60);
    let mut arena = CpuArena::contiguous(BLOCK, 16).unwrap();
    for b in 0..16 {
        arena.write_block(EngineBlockId(b), &[0x11; BLOCK]).unwrap();
    }
    let pool = BufferPool::new(8, BLOCK, DEFAULT_ALIGN).unwrap();
    let mut b = DriverBuilder::new(DriverConfig::default());
    // SAFETY: the arena outlives the driver (dropped first, below); the test touches a block
    // only after the fence over it held.
    let host = unsafe {
        CpuBackend::new(
            arena.layout().clone(),
            CpuBackendConfig {
                threads: 1,
                delay: COPY,
            },
        )
    }
    .unwrap();
    let be = b.backend(Box::new(NoCancel(host)));
    let driver = b.spawn().unwrap();
    let h = driver.handle();

    // Two loads (blocks 5 and 6, one worker: copies land at ~60 and ~120 ms) and a store of
    // request 9 that the engine already finished.
    for (req, block) in [(1, 5), (2, 6)] {
        let mut spec = load(&pool, be, req, block, soon(5_000));
        if let Buf::Owned(buf) = &mut spec.blocks[0].buf {
            buf.as_mut_slice().fill(0xAB);
        }
        h.submit(spec).unwrap();
    }
    let mut store = load(&pool, be, 9, 7, soon(5_000));
    store.dir = Direction::Store;
    h.submit(store).unwrap();
    h.finish(RequestId(9)).unwrap();

    let t0 = Instant::now();
    let fence = h.reset().unwrap();
    std::thread::sleep(Duration::from_millis(5));
    assert!(!fence.is_ready(), "the copies are still running");
    assert!(
        !h.get_finished().released.contains(&RequestId(9)),
        "request 9's store still reads block 7"
    );
    assert!(
        fence.wait(t0 + Duration::from_secs(2)),
        "the fence holds once the three copies returned"
    );
    // The copies really ran after the reset: the fence was needed.
    assert_eq!(
        arena.read_block(EngineBlockId(5)).unwrap(),
        vec![0xAB; BLOCK]
    );
    assert_eq!(
        arena.read_block(EngineBlockId(6)).unwrap(),
        vec![0xAB; BLOCK]
    );
    // The engine reuses the blocks: canaries.
    for b in [5, 6, 7] {
        arena.write_block(EngineBlockId(b), &[0xC5; BLOCK]).unwrap();
    }
    let mut released = h.get_finished().released;
    let end = soon(1000);
    while released.is_empty() && Instant::now() < end {
        released = h.get_finished().released;
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        released,
        [RequestId(9)],
        "the finished request is still reported"
    );
    std::thread::sleep(2 * COPY);
    drop(driver);
    for b in [5, 6, 7] {
        assert_eq!(
            arena.read_block(EngineBlockId(b)).unwrap(),
            vec![0xC5; BLOCK],
            "block {b} written after the fence"
        );
    }
    assert!(pool.is_whole());
}
