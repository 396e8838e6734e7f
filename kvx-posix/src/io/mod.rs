//! I/O engines: `uring` and `psync`, side by side behind [`Engine`].
//!
//! An engine takes boxed [`BlockJob`]s (which own their buffers), runs each job's syscalls and
//! hands the finished job back through its [`Outbox`] to the store's [`JobBoard`]. Two lanes: loads and stores (bounded by
//! the queue depth, their queue bounded by `max_queued`) and maintenance (removes: their own
//! small depth, never counted against loads and stores). A load or store whose op was
//! cancelled or passed its deadline while a syscall of it is still in the kernel is *written
//! off*: it no longer counts against the queue depth, but it keeps its buffers until that
//! syscall returns. [`EngineCounters::written_off`] is what the store checks against
//! `max_stuck`.

#[cfg(any(test, feature = "faults"))]
pub(crate) mod fault;
pub(crate) mod noop;
pub(crate) mod psync;
#[cfg(target_os = "linux")]
pub(crate) mod uring;
pub(crate) mod verify;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvx_core::CompletionBoard;

use crate::config::{IoEngine, PosixConfig};
use crate::error::PosixError;
use crate::job::BlockJob;

/// Removes in flight at once per engine (per ring for uring): maintenance never takes more.
pub(crate) const MAINTENANCE_DEPTH: usize = 4;
/// Removes queued at most; past that a remove is dropped with a warning (the file stays on
/// disk and the next startup scan finds it again).
pub(crate) const MAINTENANCE_QUEUE: usize = 1 << 20;

/// Finished jobs, for the store to drain in `poll` (kvx-core's completion board, posted to
/// job by job: the store makes an op's completion of its jobs).
pub(crate) type JobBoard = CompletionBoard<(), Box<BlockJob>>;

/// Where an engine hands finished jobs: to the store's [`JobBoard`], a load with an unchecked
/// payload through the verify lane first (uring).
pub(crate) struct Outbox {
    board: Arc<JobBoard>,
    verify: Option<verify::VerifyLane>,
}

impl Outbox {
    /// Hand finished jobs to the store; loads with an unchecked payload go through the verify
    /// lane first, when there is one.
    pub(crate) fn push(&self, jobs: impl IntoIterator<Item = Box<BlockJob>>) {
        match &self.verify {
            None => self.board.post(jobs),
            // A job the lane cannot take (it is gone) is posted as is: the store checks it.
            Some(lane) => self.board.post(jobs.into_iter().filter_map(|job| {
                if job.payload_unchecked() {
                    lane.send(job).err()
                } else {
                    Some(job)
                }
            })),
        }
    }
}

/// Counters an engine keeps for the store and its handle.
#[derive(Debug, Default)]
pub(crate) struct EngineCounters {
    /// Loads and stores accepted and not yet finished.
    pub(crate) in_flight: AtomicUsize,
    /// Of those, jobs written off as stuck.
    pub(crate) written_off: AtomicUsize,
    /// Removes (and probes) accepted and not yet handed back: zero means each finished one
    /// is on the job board for the store's next poll.
    pub(crate) maintenance: AtomicUsize,
    /// Loads and stores the engine can run at once right now (psync: live worker threads;
    /// uring: queue-depth slots free of stuck ops).
    pub(crate) workers: AtomicUsize,
    /// psync: load and store threads, live and written off (bounded by
    /// `queue_depth + max_stuck`); uring: 0.
    pub(crate) threads: AtomicUsize,
}

impl EngineCounters {
    fn get(a: &AtomicUsize) -> usize {
        a.load(Ordering::Acquire)
    }
}

/// A snapshot of an engine's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct EngineSnapshot {
    pub(crate) in_flight: usize,
    pub(crate) written_off: usize,
    pub(crate) maintenance: usize,
    pub(crate) workers: usize,
    pub(crate) target: usize,
    pub(crate) queued: usize,
    pub(crate) threads: usize,
}

/// Why an engine refused a job.
#[derive(Debug)]
pub(crate) struct Refused {
    /// The job, untouched.
    pub(crate) job: Box<BlockJob>,
    /// Why.
    pub(crate) reason: String,
}

/// What a store's tests change about the engine it starts.
#[derive(Default)]
pub(crate) struct EngineOverride {
    /// Faults injected around the engine.
    #[cfg(any(test, feature = "faults"))]
    pub(crate) faults: Option<Arc<fault::Faults>>,
    /// Run the [`noop`] engine instead of the one the config names.
    pub(crate) noop: bool,
}

#[cfg(any(test, feature = "faults"))]
impl EngineOverride {
    /// The configured engine with `faults` injected around it.
    pub(crate) fn with_faults(faults: Arc<fault::Faults>) -> EngineOverride {
        EngineOverride {
            faults: Some(faults),
            noop: false,
        }
    }
}

/// The job board and the engine `cfg` names (with its verify lane for uring), or what `over`
/// asks for instead (tests).
pub(crate) fn start(
    cfg: &PosixConfig,
    over: EngineOverride,
) -> Result<(Arc<JobBoard>, Box<dyn Engine>), PosixError> {
    let board = Arc::new(JobBoard::default());
    if over.noop {
        let outbox = Arc::new(Outbox {
            board: board.clone(),
            verify: None,
        });
        let engine = noop::NoopEngine::new(cfg.queue_depth, cfg.max_queued, outbox);
        return Ok((board, Box::new(engine)));
    }
    #[cfg(any(test, feature = "faults"))]
    let faults = over.faults;
    let verify = if cfg.io_engine == IoEngine::Uring {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
        let lane = verify::VerifyLane::start(threads, Arc::downgrade(&board)).map_err(|e| {
            PosixError::Engine {
                engine: "verify",
                msg: format!("cannot start the verify threads: {e}"),
            }
        })?;
        Some(lane)
    } else {
        None
    };
    let outbox = Arc::new(Outbox {
        board: board.clone(),
        verify,
    });
    let engine: Box<dyn Engine> = match cfg.io_engine {
        IoEngine::Psync => Box::new(psync::PsyncEngine::new(
            cfg.queue_depth,
            cfg.max_stuck,
            cfg.max_queued,
            outbox.clone(),
            #[cfg(any(test, feature = "faults"))]
            faults,
        )?),
        #[cfg(target_os = "linux")]
        IoEngine::Uring => Box::new(uring::UringEngine::new(
            cfg.rings,
            cfg.queue_depth,
            cfg.max_stuck,
            cfg.max_queued,
            outbox.clone(),
            #[cfg(any(test, feature = "faults"))]
            faults,
        )?),
        #[cfg(not(target_os = "linux"))]
        IoEngine::Uring => {
            return Err(PosixError::Engine {
                engine: "uring",
                msg: "io_uring needs Linux".into(),
            });
        }
    };
    Ok((board, engine))
}

/// A way to run block jobs. Every method returns promptly, whatever the filesystem does.
pub(crate) trait Engine: Send + Sync {
    /// `uring` or `psync`.
    fn name(&self) -> &'static str;
    /// Start a job (a remove goes to the maintenance lane); it comes back through the outbox,
    /// however late. A full queue refuses it.
    fn submit(&self, job: Box<BlockJob>) -> Result<(), Refused>;
    /// Loads and stores the queue takes right now.
    fn room(&self) -> usize;
    /// Write off the loads and stores that became overdue (after a cancel or a deadline) while
    /// a syscall of them is in the kernel, and keep the engine at its target size.
    fn write_off_overdue(&self);
    /// The engine's counters.
    fn counters(&self) -> &EngineCounters;
    /// Loads and stores the engine runs at once when nothing is stuck.
    fn target(&self) -> usize;
    /// Loads and stores queued, not yet started.
    fn queued(&self) -> usize;

    /// A snapshot of the counters.
    fn snapshot(&self) -> EngineSnapshot {
        let c = self.counters();
        EngineSnapshot {
            in_flight: EngineCounters::get(&c.in_flight),
            written_off: EngineCounters::get(&c.written_off),
            maintenance: EngineCounters::get(&c.maintenance),
            workers: EngineCounters::get(&c.workers),
            target: self.target(),
            queued: self.queued(),
            threads: EngineCounters::get(&c.threads),
        }
    }
}
