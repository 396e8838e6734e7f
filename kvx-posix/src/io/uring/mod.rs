//! The io_uring engine: one thread per ring owns the ring, takes new jobs from two bounded
//! channels (loads and stores; removes) and reaps completions. A read of an eventfd is always
//! posted on the ring, so a submitter wakes the thread by writing the eventfd.
//!
//! Every file syscall (open, statx, readv, writev, fdatasync, close, rename, unlink, mkdir) is a
//! ring op. On a root that can block (FUSE, NFS, any file system not known to be a local block
//! file system) each carries `IOSQE_ASYNC`: the kernel hands it to an io-wq worker at once
//! instead of trying it inline inside `io_uring_enter`, where an op on a stuck mount would block
//! the ring thread. On a local block file system (`PosixConfig::inline_io`) ops are issued
//! inline: the kernel tries them without blocking and hands any that would block to its
//! workers. No syscall that can touch a mount runs on the caller's thread or on the ring thread.
//! The ring is set up for its one owning thread (`COOP_TASKRUN`, `SINGLE_ISSUER`,
//! `DEFER_TASKRUN`): completions are posted when the thread waits for them.
//!
//! A load or store in flight whose op is cancelled or past its deadline is written off: it stops
//! counting against the ring's queue depth (so a healthy root sharing the ring keeps going), but
//! it keeps its slot, and so its buffers, until its CQE arrives. What can be in the kernel at
//! once is bounded: `queue_depth + max_stuck` loads and stores, [`MAINTENANCE_DEPTH`] removes,
//! `queue_depth` detached closes and the eventfd read; the submission and completion queues
//! are sized for all of it, and a full submission queue is handed to the kernel (reaping
//! completions when the kernel asks) rather than spun on.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use crossbeam_channel::{Sender, TrySendError};

#[cfg(any(test, feature = "faults"))]
use super::fault::Faults;
use super::{Engine, EngineCounters, MAINTENANCE_DEPTH, MAINTENANCE_QUEUE, Outbox, Refused};
use crate::error::PosixError;
use crate::job::BlockJob;

mod ring;
use ring::RingThread;

/// user_data of the eventfd read; jobs use their slot + 1.
const WAKE: u64 = 0;
/// user_data of a detached close (the last op of a load; its result is not needed).
const DETACHED: u64 = u64::MAX;
/// Longest the ring thread sleeps without looking for overdue ops.
const IDLE_WAIT: Duration = Duration::from_millis(50);

struct Ring {
    tx: Sender<Box<BlockJob>>,
    maintenance_tx: Sender<Box<BlockJob>>,
    efd: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
}

/// The io_uring engine.
pub(crate) struct UringEngine {
    rings: Vec<Ring>,
    next: AtomicUsize,
    counters: Arc<EngineCounters>,
    qd: usize,
    capacity: usize,
}

fn wake(efd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a local u64 to an eventfd we own; an eventfd write only
    // blocks when the counter would overflow, which 1 per submission cannot reach.
    let r = unsafe { libc::write(efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    if r < 0 {
        tracing::error!(error = %std::io::Error::last_os_error(), "uring: cannot wake the ring thread");
    }
}

/// Entries the queues need for `qd` loads and stores and `max_stuck` written-off ones.
pub(crate) fn ring_entries(qd: usize, max_stuck: usize) -> usize {
    // Loads and stores (live and written off), removes, detached closes, closing stores, the
    // eventfd read.
    qd + max_stuck + MAINTENANCE_DEPTH + qd + qd + 1
}

impl UringEngine {
    /// Start `rings` ring threads, each with `queue_depth` loads and stores in flight and
    /// `max_queued` waiting; `max_stuck` sizes the queues and the io-wq worker limit so
    /// written-off ops cannot starve new ones.
    pub(crate) fn new(
        rings: usize,
        queue_depth: usize,
        max_stuck: usize,
        max_queued: usize,
        outbox: Arc<Outbox>,
        #[cfg(any(test, feature = "faults"))] faults: Option<Arc<Faults>>,
    ) -> Result<UringEngine, PosixError> {
        let counters = Arc::new(EngineCounters::default());
        let err = |msg: String| PosixError::Engine {
            engine: "uring",
            msg,
        };
        let qd = queue_depth.max(1);
        let per_ring = max_queued.max(1).div_ceil(rings.max(1));
        let mut out = Vec::with_capacity(rings);
        for i in 0..rings.max(1) {
            // SAFETY: plain eventfd creation; the fd is owned by the OwnedFd below.
            let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            if raw < 0 {
                return Err(err(format!("eventfd: {}", std::io::Error::last_os_error())));
            }
            // SAFETY: `raw` is a fresh fd that nothing else owns.
            let efd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
            let (tx, rx) = crossbeam_channel::bounded(per_ring);
            let (maintenance_tx, maintenance_rx) = crossbeam_channel::bounded(MAINTENANCE_QUEUE);
            let stop = Arc::new(AtomicBool::new(false));
            let (ready_tx, ready_rx) = mpsc::channel();
            let ctx = RingThread {
                rx,
                maintenance_rx,
                efd: efd.clone(),
                stop: stop.clone(),
                outbox: outbox.clone(),
                counters: counters.clone(),
                qd,
                max_stuck,
                #[cfg(any(test, feature = "faults"))]
                faults: faults.clone(),
            };
            std::thread::Builder::new()
                .name(format!("kvx-uring-{i}"))
                .spawn(move || ctx.run(ready_tx))
                .map_err(|e| err(format!("cannot start the ring thread: {e}")))?;
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(err(e)),
                Err(_) => return Err(err("ring thread died while starting".into())),
            }
            out.push(Ring {
                tx,
                maintenance_tx,
                efd,
                stop,
            });
        }
        Ok(UringEngine {
            capacity: per_ring,
            rings: out,
            next: AtomicUsize::new(0),
            counters,
            qd,
        })
    }
}

impl Engine for UringEngine {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn submit(&self, job: Box<BlockJob>) -> Result<(), Refused> {
        let maintenance = job.is_maintenance();
        let counter = if maintenance {
            &self.counters.maintenance
        } else {
            &self.counters.in_flight
        };
        counter.fetch_add(1, Ordering::AcqRel);
        let n = self.rings.len();
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        let mut job = job;
        for k in 0..n {
            let ring = &self.rings[(first + k) % n];
            let tx = if maintenance {
                &ring.maintenance_tx
            } else {
                &ring.tx
            };
            match tx.try_send(job) {
                Ok(()) => {
                    wake(&ring.efd);
                    return Ok(());
                }
                Err(TrySendError::Full(j)) => job = j,
                Err(TrySendError::Disconnected(j)) => {
                    counter.fetch_sub(1, Ordering::AcqRel);
                    return Err(Refused {
                        job: j,
                        reason: "the ring thread stopped".into(),
                    });
                }
            }
        }
        counter.fetch_sub(1, Ordering::AcqRel);
        Err(Refused {
            job,
            reason: format!(
                "busy: uring {} queue is full",
                if maintenance { "maintenance" } else { "job" }
            ),
        })
    }

    fn room(&self) -> usize {
        self.rings
            .iter()
            .map(|r| self.capacity.saturating_sub(r.tx.len()))
            .sum()
    }

    fn write_off_overdue(&self) {
        for r in &self.rings {
            wake(&r.efd);
        }
    }

    fn counters(&self) -> &EngineCounters {
        &self.counters
    }

    fn target(&self) -> usize {
        self.qd * self.rings.len()
    }

    fn queued(&self) -> usize {
        self.rings.iter().map(|r| r.tx.len()).sum()
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // Each ring thread drains what it holds and exits once no op of it is in the kernel;
        // it owns the buffers until then. Nothing here waits for a stuck mount.
        for r in &self.rings {
            r.stop.store(true, Ordering::Release);
            wake(&r.efd);
        }
    }
}
