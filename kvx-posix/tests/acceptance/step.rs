//! The engine-facing calls (Backend::submit / poll, and the driver handle's submit and
//! get_finished) return promptly while the mount is frozen. A watchdog fails the test (and
//! aborts the FUSE connection so the process can exit) instead of letting it hang, and each
//! call is held to one tick plus the stated allowance.

use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_fusefs::{Backing, StallFs};
use kvx_posix::{IoEngine, PosixConfig, PosixStore};

use crate::rig::*;

/// Longest a single engine-facing call may take: one tick plus the stated allowance.
const HUNG: Duration = TICK.saturating_add(ALLOWANCE);

/// Times each engine-facing call. A call still running past [`HUNG`] stalls the test: the
/// watchdog aborts the FUSE connection (so the process can exit) and exits with a failure;
/// the longest call is also asserted at the end.
struct Watchdog {
    /// Microseconds since `t0` at which the current call started; 0 when no call runs.
    started: Arc<AtomicU64>,
    longest: Arc<AtomicU64>,
    done: Arc<AtomicBool>,
    t0: Instant,
}

impl Watchdog {
    /// Watch the caller; `conn` is the FUSE connection id to abort if it hangs.
    fn start(conn: u64, what: &'static str) -> Watchdog {
        let started = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let t0 = Instant::now();
        let (b, d) = (started.clone(), done.clone());
        std::thread::spawn(move || {
            while !d.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
                let at = b.load(Ordering::Acquire);
                // Far past the bound (ten times): the call is stuck, not merely slow.
                if at != 0 && t0.elapsed().saturating_sub(Duration::from_micros(at)) > HUNG * 10 {
                    eprintln!(
                        "watchdog: {what} blocked for more than {:?} on a frozen mount",
                        HUNG * 10
                    );
                    let _ = std::fs::write(format!("/sys/fs/fuse/connections/{conn}/abort"), "1");
                    std::process::exit(101);
                }
            }
        });
        Watchdog {
            started,
            longest: Arc::new(AtomicU64::new(0)),
            done,
            t0,
        }
    }

    /// Run one engine-facing call under the watchdog.
    fn call<T>(&self, f: impl FnOnce() -> T) -> T {
        let at = self.t0.elapsed().as_micros().max(1) as u64;
        self.started.store(at, Ordering::Release);
        let c = Instant::now();
        let out = f();
        self.longest
            .fetch_max(c.elapsed().as_micros() as u64, Ordering::AcqRel);
        self.started.store(0, Ordering::Release);
        out
    }

    /// Assert that no call took longer than [`HUNG`].
    fn check(&self, what: &str) {
        let longest = Duration::from_micros(self.longest.load(Ordering::Acquire));
        println!("{what}: the longest engine-facing call took {longest:?} (bound {HUNG:?})");
        assert!(
            longest <= HUNG,
            "an engine-facing call took {longest:?} (bound {HUNG:?})"
        );
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
    }
}

fn conn_of(path: &std::path::Path) -> u64 {
    let dev = std::fs::metadata(path).expect("stat mount").dev();
    (u64::from(libc::major(dev)) << 20) | u64::from(libc::minor(dev))
}

pub fn engine_step_never_blocks(engine: IoEngine) {
    backend_calls(engine);
    driver_calls(engine);
}

/// Backend::submit and poll called directly, as a driver would, on a frozen mount.
fn backend_calls(engine: IoEngine) {
    let dir = tempfile::tempdir().unwrap();
    let mount = StallFs::mount(dir.path(), Backing::Memory).unwrap();
    let mut cfg = PosixConfig::new(mount.path().join("kv"));
    cfg.io_engine = engine;
    cfg.queue_depth = 8;
    cfg.max_stuck = 24;
    // Keep the breaker out of the way: this test is about the stuck-I/O bound.
    cfg.breaker.failure_threshold = 1_000_000;
    let mut store = PosixStore::open(cfg).unwrap();
    let files = store.handle();
    let pool = BufferPool::new(256, 16 << 10, DEFAULT_ALIGN).unwrap();
    let conn = conn_of(mount.path());
    mount.freeze();
    let dog = Watchdog::start(conn, "Backend::submit/poll");
    let mut accepted = 0usize;
    let mut busy = 0usize;
    let mut done = Vec::new();
    let end = Instant::now() + Duration::from_millis(1500);
    let mut n = 0u64;
    while Instant::now() < end {
        n += 1;
        let dir = if n % 2 == 0 {
            Direction::Load
        } else {
            Direction::Store
        };
        let Some(buf) = pool.take() else { break };
        let op = Op {
            id: OpId(n),
            task: TaskId(n),
            request: RequestId(1),
            dir,
            deadline: Instant::now() + Duration::from_millis(100),
            blocks: vec![OpBlock {
                key: key(5000 + n),
                engine: None,
                buf: Buf::Owned(buf),
            }],
        };
        match dog.call(|| store.submit(op)) {
            Ok(()) => accepted += 1,
            Err(e) => {
                assert!(matches!(e.kind, SubmitErrorKind::Busy(_)), "{:?}", e.kind);
                assert_eq!(e.op.blocks.len(), 1, "a refused op comes back whole");
                busy += 1;
            }
        }
        dog.call(|| store.poll(&mut done));
        if n % 10 == 0 {
            // Cancel what is overdue, as the tracker does at each deadline.
            for id in n.saturating_sub(20)..n {
                dog.call(|| store.cancel(OpId(id)));
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    dog.check(&format!("backend calls {engine}"));
    drop(dog);
    assert!(accepted > 0);
    assert!(mount.blocked_requests() > 0, "the mount really was stuck");
    assert!(busy > 0, "past max_stuck the store refuses with Busy");
    assert!(files.stats().written_off > 0);
    mount.thaw();
    // Every accepted op completes exactly once, however late.
    assert!(wait_until(SOON, || {
        store.poll(&mut done);
        done.len() >= accepted
    }));
    std::thread::sleep(Duration::from_millis(50));
    store.poll(&mut done);
    assert_eq!(done.len(), accepted);
    let mut ids: Vec<u64> = done.iter().map(|c| c.op.id.0).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), accepted, "each op completes once");
    drop(done);
    assert!(wait_until(SOON, || files.stats().in_flight == 0));
    assert!(pool.is_whole());
    drop(store);
    drop(mount);
}

/// The driver handle's submit / start_step / get_finished on a frozen mount: each returns at
/// once, and every task still ends by its deadline (timed out, or refused once the breaker
/// opened).
fn driver_calls(engine: IoEngine) {
    let r = Rig::new(engine, Place::Fuse, |_| {});
    let conn = conn_of(r.mount().path());
    r.mount().freeze();
    let dog = Watchdog::start(conn, "driver submit/get_finished");
    let mut pending = std::collections::HashMap::new();
    let mut reports = Vec::new();
    let end = Instant::now() + Duration::from_millis(1500);
    let mut i = 0u64;
    while Instant::now() < end {
        i += 1;
        if let Some(buf) = r.pool.take() {
            let deadline = Instant::now() + DEADLINE;
            let blocks = vec![OpBlock {
                key: key(6000 + i),
                engine: None,
                buf: Buf::Owned(buf),
            }];
            let t = dog.call(|| r.submit_route(Direction::Load, vec![r.posix], blocks, deadline));
            pending.insert(t, deadline);
        }
        dog.call(|| r.driver.start_step().unwrap());
        reports.extend(dog.call(|| r.driver.get_finished()).reports);
        std::thread::sleep(Duration::from_millis(5));
    }
    dog.check(&format!("driver calls {engine}"));
    drop(dog);
    assert!(wait_until(SOON, || {
        reports.extend(r.driver.get_finished().reports);
        reports.len() == pending.len()
    }));
    let late = reports
        .iter()
        .map(|rep| {
            rep.finished_at
                .saturating_duration_since(pending[&rep.task])
        })
        .max()
        .unwrap_or_default();
    println!(
        "driver calls {engine}: {} tasks ended at most {late:?} after their deadline (bound {MARGIN:?})",
        reports.len()
    );
    for rep in &reports {
        let deadline = pending[&rep.task];
        assert!(rep.finished_at <= deadline + MARGIN, "{:?}", rep.state);
        assert!(
            matches!(rep.state, TaskState::TimedOut | TaskState::Failed(_)),
            "{:?}",
            rep.state
        );
    }
    drop(reports);
    r.mount().thaw();
    assert!(r.drained());
}
