//! The psync engine: a pool of threads running each job's syscalls one after another.
//!
//! The pool's target size is the queue depth. A thread whose load or store became overdue
//! (cancelled, or past its deadline) while it is still inside a syscall is *written off* and a
//! replacement starts, so the pool keeps its target of live threads; when a written-off thread
//! comes back it rejoins the pool if the pool is below target, and exits otherwise. Threads
//! never exceed `queue_depth + max_stuck` for loads and stores (past that no replacement
//! starts, and the store refuses new ops with `Busy` from `max_stuck` written off on), plus
//! [`MAINTENANCE_DEPTH`] threads for removes, which are never written off. The job queue is
//! bounded: a full queue refuses at submit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use rustc_hash::FxHashMap;

#[cfg(any(test, feature = "faults"))]
use super::fault::Faults;
use super::{Engine, EngineCounters, MAINTENANCE_DEPTH, MAINTENANCE_QUEUE, Outbox, Refused};
use crate::error::PosixError;
use crate::job::{BlockJob, Next};
use kvx_core::sync::lock;

/// What a worker is doing right now.
struct Running {
    deadline: Instant,
    cancel: Arc<AtomicBool>,
    written_off: bool,
}

/// The workers and what each is running, with the live and written-off counts.
#[derive(Default)]
struct Roster {
    /// Worker id -> its current job, if any.
    workers: FxHashMap<u64, Option<Running>>,
    next_id: u64,
    /// Threads not written off.
    live: usize,
    /// Threads written off, still in a syscall.
    stuck: usize,
}

/// The worker threads' common state: their roster, the two job queues, the outbox and counters.
struct WorkerPool {
    roster: Mutex<Roster>,
    rx: Receiver<Box<BlockJob>>,
    maintenance_rx: Receiver<Box<BlockJob>>,
    outbox: Arc<Outbox>,
    counters: EngineCounters,
    target: usize,
    /// Most threads for loads and stores, live and written off together.
    bound: usize,
    stop: AtomicBool,
    #[cfg(any(test, feature = "faults"))]
    faults: Option<Arc<Faults>>,
}

impl WorkerPool {
    fn set_live(&self, p: &Roster) {
        self.counters.workers.store(p.live, Ordering::Release);
        self.counters
            .threads
            .store(p.live + p.stuck, Ordering::Release);
    }

    fn run(&self, job: &mut BlockJob) {
        let mut next = job.start();
        while let Next::Call(call) = next {
            // SAFETY: the job is boxed and owned by this thread for the whole syscall; the
            // pointers in `call` point into it (buffers, iovecs, paths) and nobody else can
            // reach it until it is pushed to the outbox.
            let res = unsafe { crate::job::sys::run(&call) };
            #[cfg(any(test, feature = "faults"))]
            if let Some(f) = &self.faults {
                f.gate(job.pending_late());
            }
            next = job.advance(res);
        }
    }
}

/// The thread-pool engine.
pub(crate) struct PsyncEngine {
    tx: Sender<Box<BlockJob>>,
    maintenance_tx: Sender<Box<BlockJob>>,
    pool: Arc<WorkerPool>,
    capacity: usize,
}

impl PsyncEngine {
    /// Start `threads` workers (the target); at most `max_stuck` more may be written off at
    /// once; at most `max_queued` jobs wait for a worker.
    pub(crate) fn new(
        threads: usize,
        max_stuck: usize,
        max_queued: usize,
        outbox: Arc<Outbox>,
        #[cfg(any(test, feature = "faults"))] faults: Option<Arc<Faults>>,
    ) -> Result<PsyncEngine, PosixError> {
        let target = threads.max(1);
        let capacity = max_queued.max(1);
        let (tx, rx) = crossbeam_channel::bounded(capacity);
        let (maintenance_tx, maintenance_rx) = crossbeam_channel::bounded(MAINTENANCE_QUEUE);
        let pool = Arc::new(WorkerPool {
            roster: Mutex::new(Roster::default()),
            rx,
            maintenance_rx,
            outbox,
            counters: EngineCounters::default(),
            target,
            bound: target + max_stuck,
            stop: AtomicBool::new(false),
            #[cfg(any(test, feature = "faults"))]
            faults,
        });
        let err = |e: std::io::Error| PosixError::Engine {
            engine: "psync",
            msg: format!("cannot start a worker thread: {e}"),
        };
        for _ in 0..target {
            spawn_worker(&pool).map_err(err)?;
        }
        for i in 0..MAINTENANCE_DEPTH {
            let s = pool.clone();
            std::thread::Builder::new()
                .name(format!("kvx-psync-rm-{i}"))
                .spawn(move || maintenance_worker(s))
                .map_err(err)?;
        }
        Ok(PsyncEngine {
            tx,
            maintenance_tx,
            pool,
            capacity,
        })
    }
}

fn spawn_worker(pool: &Arc<WorkerPool>) -> std::io::Result<()> {
    let id = reserve_worker(pool, &mut lock(&pool.roster));
    start_worker(pool, id)
}

/// Count a worker about to start as live, under the pool's lock: a written-off worker that
/// comes back meanwhile then sees the pool at target and exits, instead of rejoining it next
/// to its replacement (which left the pool above target for good).
fn reserve_worker(pool: &WorkerPool, p: &mut Roster) -> u64 {
    let id = p.next_id;
    p.next_id += 1;
    p.workers.insert(id, None);
    p.live += 1;
    pool.set_live(p);
    id
}

/// Start the thread of reserved worker `id`; if it cannot start, its reservation is undone.
fn start_worker(pool: &Arc<WorkerPool>, id: u64) -> std::io::Result<()> {
    let s = pool.clone();
    let r = std::thread::Builder::new()
        .name(format!("kvx-psync-{id}"))
        .spawn(move || worker(s, id));
    if r.is_err() {
        remove_worker(pool, id);
    }
    r.map(drop)
}

/// Worker `id` is gone (or never started): it no longer counts as live.
fn remove_worker(pool: &WorkerPool, id: u64) {
    let mut p = lock(&pool.roster);
    if p.workers.remove(&id).is_some() {
        p.live = p.live.saturating_sub(1);
        pool.set_live(&p);
    }
}

fn worker(pool: Arc<WorkerPool>, id: u64) {
    loop {
        let mut job = match pool.rx.recv_timeout(Duration::from_millis(200)) {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
                if pool.stop.load(Ordering::Acquire) {
                    break;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        if let Some(slot) = lock(&pool.roster).workers.get_mut(&id) {
            *slot = Some(Running {
                deadline: job.deadline(),
                cancel: job.cancel_flag(),
                written_off: false,
            });
        }
        pool.run(&mut job);
        let leave = {
            let mut p = lock(&pool.roster);
            let r = p.workers.get_mut(&id).and_then(Option::take);
            let mut leave = false;
            if r.is_some_and(|r| r.written_off) {
                p.stuck -= 1;
                pool.counters.written_off.fetch_sub(1, Ordering::AcqRel);
                if p.live < pool.target {
                    // Back from the kernel while the pool is short: rejoin it.
                    p.live += 1;
                    pool.set_live(&p);
                } else {
                    p.workers.remove(&id);
                    pool.set_live(&p);
                    leave = true;
                }
            }
            leave
        };
        pool.counters.in_flight.fetch_sub(1, Ordering::AcqRel);
        pool.outbox.push([job]);
        if leave {
            return;
        }
    }
    remove_worker(&pool, id);
}

fn maintenance_worker(pool: Arc<WorkerPool>) {
    loop {
        let mut job = match pool.maintenance_rx.recv_timeout(Duration::from_millis(200)) {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
                if pool.stop.load(Ordering::Acquire) {
                    return;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return,
        };
        pool.run(&mut job);
        // Into the outbox first: once the count reads zero, every remove can be absorbed.
        pool.outbox.push([job]);
        pool.counters.maintenance.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Engine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn submit(&self, job: Box<BlockJob>) -> Result<(), Refused> {
        let c = &self.pool.counters;
        if job.is_maintenance() {
            c.maintenance.fetch_add(1, Ordering::AcqRel);
            return self.maintenance_tx.try_send(job).map_err(|e| {
                c.maintenance.fetch_sub(1, Ordering::AcqRel);
                refused(e, "psync maintenance queue")
            });
        }
        // Notice threads whose job went overdue, so a stuck pool grows replacements.
        self.write_off_overdue();
        c.in_flight.fetch_add(1, Ordering::AcqRel);
        self.tx.try_send(job).map_err(|e| {
            c.in_flight.fetch_sub(1, Ordering::AcqRel);
            refused(e, "psync job queue")
        })
    }

    fn room(&self) -> usize {
        self.capacity.saturating_sub(self.tx.len())
    }

    fn write_off_overdue(&self) {
        let now = Instant::now();
        let (newly, replacements) = {
            let mut p = lock(&self.pool.roster);
            let mut newly = 0;
            for r in p.workers.values_mut().flatten() {
                if !r.written_off && (r.cancel.load(Ordering::Acquire) || now >= r.deadline) {
                    r.written_off = true;
                    newly += 1;
                }
            }
            p.live -= newly;
            p.stuck += newly;
            self.pool.set_live(&p);
            self.pool
                .counters
                .written_off
                .fetch_add(newly, Ordering::AcqRel);
            let room = self.pool.bound.saturating_sub(p.live + p.stuck);
            let short = self.pool.target.saturating_sub(p.live);
            let replacements: Vec<u64> = (0..short.min(room))
                .map(|_| reserve_worker(&self.pool, &mut p))
                .collect();
            (newly, replacements)
        };
        let spawn = replacements.len();
        #[cfg(any(test, feature = "faults"))]
        if spawn > 0
            && let Some(f) = &self.pool.faults
        {
            f.replacements_may_start();
        }
        let mut ids = replacements.into_iter();
        for id in ids.by_ref() {
            if let Err(e) = start_worker(&self.pool, id) {
                tracing::error!(error = %e, "psync: cannot replace a stuck worker");
                break;
            }
        }
        for id in ids {
            remove_worker(&self.pool, id);
        }
        if newly > 0 {
            tracing::warn!(
                stuck = self.pool.counters.written_off.load(Ordering::Acquire),
                "psync: wrote off {newly} worker(s) stuck in the kernel; started {spawn}"
            );
        }
    }

    fn counters(&self) -> &EngineCounters {
        &self.pool.counters
    }

    fn target(&self) -> usize {
        self.pool.target
    }

    fn queued(&self) -> usize {
        self.tx.len()
    }
}

fn refused(e: TrySendError<Box<BlockJob>>, what: &str) -> Refused {
    match e {
        TrySendError::Full(job) => Refused {
            job,
            reason: format!("busy: {what} is full"),
        },
        TrySendError::Disconnected(job) => Refused {
            job,
            reason: "psync workers stopped".into(),
        },
    }
}

impl Drop for PsyncEngine {
    fn drop(&mut self) {
        // Workers finish what is queued (the channels close when the senders drop) and exit;
        // a worker stuck in the kernel exits once its syscall returns. Nothing here waits.
        self.pool.stop.store(true, Ordering::Release);
    }
}
