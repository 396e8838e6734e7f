//! The psync engine: a pool of threads running each job's syscalls one after another.
//!
//! A thread whose job became overdue (cancelled, or past its deadline) while the thread is still
//! inside a syscall is *written off*: a replacement thread is started so the pool keeps its
//! size, and the stuck thread exits once its syscall returns and its job is handed back. At most
//! `max_stuck` threads are written off at once; past that no replacement is started (and the
//! store refuses new ops with `Busy`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use rustc_hash::FxHashMap;

use super::{EngineCounters, IoEngine, Refused, Sink};
use crate::error::PosixError;
use crate::job::{BlockJob, Next};

/// What a worker is doing right now.
struct Running {
    deadline: Instant,
    cancel: Arc<AtomicBool>,
    written_off: bool,
}

#[derive(Default)]
struct Pool {
    /// Worker id -> its current job, if any.
    workers: FxHashMap<u64, Option<Running>>,
    next_id: u64,
    stuck: usize,
}

struct Shared {
    pool: Mutex<Pool>,
    rx: Receiver<Box<BlockJob>>,
    sink: Arc<Sink>,
    counters: EngineCounters,
    max_stuck: usize,
    stop: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The thread-pool engine.
pub struct PsyncEngine {
    tx: Sender<Box<BlockJob>>,
    shared: Arc<Shared>,
}

impl PsyncEngine {
    /// Start `threads` workers; at most `max_stuck` may be written off at once.
    pub fn new(
        threads: usize,
        max_stuck: usize,
        sink: Arc<Sink>,
    ) -> Result<PsyncEngine, PosixError> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(Shared {
            pool: Mutex::new(Pool::default()),
            rx,
            sink,
            counters: EngineCounters::default(),
            max_stuck,
            stop: AtomicBool::new(false),
        });
        for _ in 0..threads.max(1) {
            spawn_worker(&shared).map_err(|e| PosixError::Engine {
                engine: "psync",
                msg: format!("cannot start a worker thread: {e}"),
            })?;
        }
        Ok(PsyncEngine { tx, shared })
    }
}

fn spawn_worker(shared: &Arc<Shared>) -> std::io::Result<()> {
    let id = {
        let mut p = shared.lock();
        let id = p.next_id;
        p.next_id += 1;
        p.workers.insert(id, None);
        id
    };
    let s = shared.clone();
    let r = std::thread::Builder::new()
        .name(format!("kvx-psync-{id}"))
        .spawn(move || worker(s, id));
    if r.is_err() {
        shared.lock().workers.remove(&id);
    }
    r.map(drop)
}

fn worker(shared: Arc<Shared>, id: u64) {
    loop {
        let mut job = match shared.rx.recv_timeout(Duration::from_millis(200)) {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
                if shared.stop.load(Ordering::Acquire) {
                    break;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        if let Some(slot) = shared.lock().workers.get_mut(&id) {
            *slot = Some(Running {
                deadline: job.deadline(),
                cancel: job_cancel(&job),
                written_off: false,
            });
        }
        let mut next = job.start();
        while let Next::Call(call) = next {
            // SAFETY: the job is boxed and owned by this thread for the whole syscall; the
            // pointers in `call` point into it (buffers, iovecs, paths) and nobody else can
            // reach it until it is pushed to the sink below.
            let res = unsafe { super::sys::run(&call) };
            next = job.advance(res);
        }
        let written_off = {
            let mut p = shared.lock();
            let r = p.workers.get_mut(&id).and_then(Option::take);
            let w = r.is_some_and(|r| r.written_off);
            if w {
                p.stuck -= 1;
                p.workers.remove(&id);
                shared.counters.written_off.fetch_sub(1, Ordering::AcqRel);
            }
            w
        };
        shared.counters.in_flight.fetch_sub(1, Ordering::AcqRel);
        shared.sink.push([job]);
        if written_off {
            // A replacement took this thread's place when it was written off.
            return;
        }
    }
    shared.lock().workers.remove(&id);
}

fn job_cancel(job: &BlockJob) -> Arc<AtomicBool> {
    job.cancel_flag()
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn submit(&self, job: Box<BlockJob>) -> Result<(), Refused> {
        // Notice threads whose job went overdue, so a stuck pool grows replacements.
        self.kick();
        self.shared
            .counters
            .in_flight
            .fetch_add(1, Ordering::AcqRel);
        self.tx.send(job).map_err(|e| {
            self.shared
                .counters
                .in_flight
                .fetch_sub(1, Ordering::AcqRel);
            Refused {
                job: e.0,
                reason: "psync workers stopped".into(),
            }
        })
    }

    fn kick(&self) {
        let now = Instant::now();
        let mut replace = 0;
        {
            let mut p = self.shared.lock();
            let mut newly = 0;
            for r in p.workers.values_mut().flatten() {
                if !r.written_off && (r.cancel.load(Ordering::Acquire) || now >= r.deadline) {
                    r.written_off = true;
                    newly += 1;
                }
            }
            for _ in 0..newly {
                p.stuck += 1;
                self.shared
                    .counters
                    .written_off
                    .fetch_add(1, Ordering::AcqRel);
                if p.stuck <= self.shared.max_stuck {
                    replace += 1;
                }
            }
        }
        for _ in 0..replace {
            if let Err(e) = spawn_worker(&self.shared) {
                tracing::error!(error = %e, "psync: cannot replace a stuck worker");
            }
        }
        if replace > 0 {
            tracing::warn!(
                stuck = self.shared.counters.written_off(),
                "psync: wrote off {replace} worker(s) stuck in the kernel"
            );
        }
    }

    fn counters(&self) -> &EngineCounters {
        &self.shared.counters
    }
}

impl Drop for PsyncEngine {
    fn drop(&mut self) {
        // Workers finish what is queued (the channel closes when `tx` drops) and exit; a worker
        // stuck in the kernel exits once its syscall returns. Nothing here waits for them.
        self.shared.stop.store(true, Ordering::Release);
    }
}
