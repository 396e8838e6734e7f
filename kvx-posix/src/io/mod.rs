//! I/O engines: `uring` and `psync`, side by side behind [`IoEngine`].
//!
//! An engine takes boxed [`BlockJob`]s (which own their buffers), runs each job's syscalls and
//! hands the finished job back through the [`Sink`]. A job whose op was cancelled or passed its
//! deadline while a syscall of it is still in the kernel is *written off*: it no longer counts
//! against the engine's queue depth, but it keeps its buffers until that syscall returns.
//! [`IoEngine::written_off`] is what the store checks against `max_stuck`.

pub mod psync;
pub mod sys;
#[cfg(target_os = "linux")]
pub mod uring;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use kvx_core::Notifier;

use crate::job::BlockJob;

/// Where engines put finished jobs; the store drains it in `poll`.
pub struct Sink {
    done: Mutex<Vec<Box<BlockJob>>>,
    cv: Condvar,
    notifier: Mutex<Notifier>,
}

impl Default for Sink {
    fn default() -> Self {
        Sink {
            done: Mutex::new(Vec::new()),
            cv: Condvar::new(),
            notifier: Mutex::new(Notifier::noop()),
        }
    }
}

impl Sink {
    fn lock(&self) -> MutexGuard<'_, Vec<Box<BlockJob>>> {
        self.done.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queue finished jobs and wake the store's owner.
    pub fn push(&self, jobs: impl IntoIterator<Item = Box<BlockJob>>) {
        let mut d = self.lock();
        let before = d.len();
        d.extend(jobs);
        let any = d.len() > before;
        drop(d);
        if any {
            self.cv.notify_all();
            self.notifier
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .notify();
        }
    }

    /// Take every finished job.
    pub fn take(&self) -> Vec<Box<BlockJob>> {
        std::mem::take(&mut *self.lock())
    }

    /// Take every finished job, waiting up to `timeout` for one when there is none.
    pub fn take_or_wait(&self, timeout: Duration) -> Vec<Box<BlockJob>> {
        let mut d = self.lock();
        if d.is_empty() {
            d = self
                .cv
                .wait_timeout(d, timeout)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        std::mem::take(&mut *d)
    }

    /// Install the notifier.
    pub fn set_notifier(&self, n: Notifier) {
        *self.notifier.lock().unwrap_or_else(|e| e.into_inner()) = n;
    }
}

/// Counters an engine keeps for the store and its handle.
#[derive(Debug, Default)]
pub struct EngineCounters {
    /// Jobs accepted and not yet finished.
    pub in_flight: AtomicUsize,
    /// Of those, jobs written off as stuck.
    pub written_off: AtomicUsize,
}

impl EngineCounters {
    /// Jobs written off right now.
    pub fn written_off(&self) -> usize {
        self.written_off.load(Ordering::Acquire)
    }

    /// Jobs accepted and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }
}

/// Why an engine refused a job.
#[derive(Debug)]
pub struct Refused {
    /// The job, untouched.
    pub job: Box<BlockJob>,
    /// Why.
    pub reason: String,
}

/// A way to run block jobs. Every method returns promptly, whatever the filesystem does.
pub trait IoEngine: Send + Sync {
    /// `uring` or `psync`.
    fn name(&self) -> &'static str;
    /// Start a job; it comes back through the sink, however late.
    fn submit(&self, job: Box<BlockJob>) -> Result<(), Refused>;
    /// Look for jobs that just became overdue (after a cancel) and write them off.
    fn kick(&self);
    /// The engine's counters.
    fn counters(&self) -> &EngineCounters;
}
