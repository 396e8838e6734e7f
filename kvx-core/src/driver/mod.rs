//! The driver: a thread that owns the clock, the backends and the [`Tracker`](crate::Tracker),
//! and the engine-facing [`DriverHandle`].

mod fence;
#[cfg(feature = "tokio")]
mod future;
mod mailbox;
mod run;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::CoreError;
use crate::ids::{BackendId, EngineBlockId, RequestId, TaskId};
use crate::sync::{lock, wait_timeout};
use crate::task::{TaskReport, TaskSpec};
use crate::tracker::{Bond, TrackerConfig, TrackerStats};
use fence::FenceSlot;
pub use fence::{FenceHandle, FenceWait};
#[cfg(feature = "tokio")]
pub use future::TaskFuture;
use mailbox::{Cmd, Mailbox};

/// The driver's timer granularity (1 ms).
///
/// The tracker keeps deadlines in slots of one tick and the driver thread sleeps until the
/// earliest deadline, so a task gets its `TimedOut` verdict no later than one tick after its
/// deadline (plus the OS's scheduling delay on a loaded machine). It is also the bound of every
/// [`DriverHandle`] call.
pub const TICK: Duration = Duration::from_millis(1);

/// Settings of the driver.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// Tracker limits.
    pub tracker: TrackerConfig,
    /// Longest the driver thread sleeps without a wake-up (a safety net; default 50 ms).
    pub max_park: Duration,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            tracker: TrackerConfig::default(),
            max_park: Duration::from_millis(50),
        }
    }
}

/// What finished since the last [`DriverHandle::get_finished`].
#[derive(Debug, Default)]
pub struct Finished {
    /// Verdicts of tasks that ended (loads and stores).
    pub reports: Vec<TaskReport>,
    /// Requests passed to [`DriverHandle::finish`] of which no op is out any more: their
    /// blocks may be freed now. A finished request comes here once (a second `finish` while
    /// it is still out adds nothing), also when nothing of it was out, and also when a reset
    /// dropped its tasks (once its engine copies returned).
    pub released: Vec<RequestId>,
}

impl Finished {
    /// True when nothing finished.
    pub fn is_empty(&self) -> bool {
        self.reports.is_empty() && self.released.is_empty()
    }
}

/// Why the driver stopped, and what may still be touched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stopped {
    /// `stopped` after a shutdown; the panic message after a panic.
    pub reason: String,
    /// Engine blocks that an op which was out when the driver stopped may still read or write:
    /// never reuse them. `None` when the driver could not tell (its thread died mid-pass):
    /// then every block that had an op out is at risk, so treat the whole pool as such.
    pub blocks_at_risk: Option<Vec<EngineBlockId>>,
}

/// Collects backends, then starts the driver thread.
pub struct DriverBuilder {
    cfg: DriverConfig,
    backends: Vec<Box<dyn Backend>>,
}

impl DriverBuilder {
    /// A builder with `cfg`.
    pub fn new(cfg: DriverConfig) -> DriverBuilder {
        DriverBuilder {
            cfg,
            backends: Vec::new(),
        }
    }

    /// Add a backend; the id is what task routes name.
    pub fn backend(&mut self, b: Box<dyn Backend>) -> BackendId {
        self.backends.push(b);
        BackendId((self.backends.len() - 1) as u16)
    }

    /// Start the driver thread.
    pub fn spawn(self) -> Result<Driver, CoreError> {
        let (tx, rx) = mpsc::channel::<Arc<Mailbox>>();
        let DriverBuilder { cfg, backends } = self;
        crate::metrics::register_counters();
        let thread = std::thread::Builder::new()
            .name("kvx-driver".into())
            .spawn(move || {
                if let Ok(mailbox) = rx.recv() {
                    run::run(mailbox, cfg, backends)
                }
            })
            .map_err(|e| CoreError::DriverStopped {
                reason: format!("cannot spawn the driver thread: {e}"),
            })?;
        let mailbox = Arc::new(Mailbox::new(thread.thread().clone()));
        tx.send(mailbox.clone())
            .map_err(|_| CoreError::DriverStopped {
                reason: "the driver thread exited at start".into(),
            })?;
        Ok(Driver {
            handle: DriverHandle { mailbox },
            thread: Some(thread),
        })
    }
}

/// The running driver. Dropping it stops the driver and waits for its thread to finish its
/// current pass and drop the backends (zombie ops are abandoned to them).
#[must_use = "dropping the driver stops it"]
pub struct Driver {
    handle: DriverHandle,
    thread: Option<JoinHandle<()>>,
}

impl Driver {
    /// A cloneable handle for the engine's threads.
    pub fn handle(&self) -> DriverHandle {
        self.handle.clone()
    }
}

impl std::ops::Deref for Driver {
    type Target = DriverHandle;
    fn deref(&self) -> &DriverHandle {
        &self.handle
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let mailbox = &self.handle.mailbox;
        mailbox.stop_requested.store(true, Ordering::Release);
        mailbox.thread.unpark();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The engine-facing handle of a driver.
///
/// # The bound every call honours
///
/// No [`DriverHandle`] method waits for the driver thread or a backend. A call queues a
/// command and returns, or reads state the driver thread publishes after every pass: each
/// takes at most two short locks that the driver thread only holds to swap a queue or copy a
/// snapshot, never while it runs a backend. A call therefore returns within one [`TICK`]
/// (tens of microseconds in practice) whenever the OS runs the calling thread, whatever a
/// backend does: hangs, never completes, or panics. The only
/// calls that wait are the explicit waits, [`DriverHandle::wait_report`] and
/// [`FenceHandle::wait`]: they return by the `until` the caller passes, and at once once the
/// driver stopped. Answers that need the driver thread come back later: verdicts and released
/// requests through [`DriverHandle::get_finished`], fences through [`FenceHandle`].
///
/// # When the driver stops
///
/// Every pass of the driver thread, and so every backend call, runs under `catch_unwind`. A
/// panic stops the driver: it records the panic message, wakes every waiter (fence waits
/// return false, `wait_report` returns `None`, futures resolve with an error), and every later
/// call returns [`CoreError::DriverStopped`] with that message. [`DriverHandle::stopped`] says
/// why and which engine blocks an op that was out may still touch; the engine must not reuse
/// those. Dropping the [`Driver`] stops it the same way, with the reason `stopped`.
///
/// The process's panic hook runs first, on the driver thread, before the unwind reaches the
/// driver: the stop is recorded when the hook returns. Calls stay non-blocking meanwhile (they
/// are queued and dropped with the stop), but an engine that wants the stop seen within
/// milliseconds keeps its hook short (the default hook with `RUST_BACKTRACE=1` symbolizes a
/// backtrace, which can take hundreds of milliseconds).
#[derive(Clone)]
#[must_use]
pub struct DriverHandle {
    mailbox: Arc<Mailbox>,
}

impl DriverHandle {
    /// Submit a task; returns at once with its id. Its verdict comes through `get_finished`.
    pub fn submit(&self, spec: TaskSpec) -> Result<TaskId, CoreError> {
        let id = TaskId(self.mailbox.next_task.fetch_add(1, Ordering::Relaxed));
        self.mailbox
            .send(Cmd::Submit(id, spec, Bond::Request, None))?;
        Ok(id)
    }

    /// Submit a detached task (see [`Tracker::submit_detached`](crate::Tracker::submit_detached)):
    /// it runs on behalf of `spec.request` but outside its life, and names no engine block.
    /// Returns at once with its id; its verdict comes through `get_finished`.
    pub fn submit_detached(&self, spec: TaskSpec) -> Result<TaskId, CoreError> {
        let id = TaskId(self.mailbox.next_task.fetch_add(1, Ordering::Relaxed));
        self.mailbox
            .send(Cmd::Submit(id, spec, Bond::Detached, None))?;
        Ok(id)
    }

    /// Submit deferred tasks now (call at the start of each engine step).
    pub fn start_step(&self) -> Result<(), CoreError> {
        self.mailbox.send(Cmd::StartStep)
    }

    /// Cancel a task (best effort: a task that already ended is unaffected).
    pub fn cancel(&self, task: TaskId) -> Result<(), CoreError> {
        self.mailbox.send(Cmd::Cancel(task))
    }

    /// Preempt a request: cancel its loads, flush its stores. Wait for the fence before reusing
    /// its blocks.
    pub fn preempt(&self, req: RequestId) -> Result<FenceHandle, CoreError> {
        let slot = Arc::new(FenceSlot::default());
        self.mailbox.send(Cmd::Preempt(req, slot.clone()))?;
        Ok(FenceHandle::new(slot, self.mailbox.clone()))
    }

    /// A fence over engine blocks about to be handed to someone else (flushes queued stores).
    pub fn fence_blocks(&self, blocks: &[EngineBlockId]) -> Result<FenceHandle, CoreError> {
        let slot = Arc::new(FenceSlot::default());
        self.mailbox
            .send(Cmd::FenceBlocks(blocks.to_vec(), slot.clone()))?;
        Ok(FenceHandle::new(slot, self.mailbox.clone()))
    }

    /// The engine is done with a request: its loads are cancelled, its queued stores flushed.
    /// Returns at once. The request is reported once in [`Finished::released`] as soon as no
    /// op of it is out (in the next pass when nothing was out); free its blocks then.
    pub fn finish(&self, req: RequestId) -> Result<(), CoreError> {
        self.mailbox.send(Cmd::Finish(req))
    }

    /// Forget every live task without reporting it; late completions of their ops are dropped
    /// and their futures resolve with [`CoreError::DroppedByReset`]. Returns at once with a
    /// fence that holds once every engine-memory op that was out at the reset (zombies
    /// included) has returned: reuse no engine block before it holds. Requests already passed
    /// to [`DriverHandle::finish`] are not forgotten: each is still reported in
    /// [`Finished::released`] once its own engine-memory ops have returned.
    pub fn reset(&self) -> Result<FenceHandle, CoreError> {
        let slot = Arc::new(FenceSlot::default());
        self.mailbox.send(Cmd::Reset(slot.clone()))?;
        Ok(FenceHandle::new(slot, self.mailbox.clone()))
    }

    /// Everything that finished since the last call. Never blocks.
    pub fn get_finished(&self) -> Finished {
        std::mem::take(&mut lock(&self.mailbox.out).finished)
    }

    /// Block until `task`'s report arrives (taken out of the finished set), `until` passes or
    /// the driver stops (`None`). For tests and simple callers.
    pub fn wait_report(&self, task: TaskId, until: Instant) -> Option<TaskReport> {
        let mut out = lock(&self.mailbox.out);
        loop {
            if let Some(i) = out.finished.reports.iter().position(|r| r.task == task) {
                return Some(out.finished.reports.remove(i));
            }
            let now = Instant::now();
            if now >= until || self.mailbox.stopped.get().is_some() {
                return None;
            }
            out = wait_timeout(&self.mailbox.cv, out, until - now);
        }
    }

    /// Wait, at most until `until`, for something [`DriverHandle::get_finished`] would hand
    /// out (a report or a released request); true when there is. Returns at once when there
    /// already is, or the driver stopped; returns early (false) when the driver woke its
    /// waiters for another reason (a fence held). Takes nothing: for callers that poll
    /// `get_finished` until a result of theirs came.
    pub fn wait_finished(&self, until: Instant) -> bool {
        let mut out = lock(&self.mailbox.out);
        let now = Instant::now();
        if out.finished.is_empty() && now < until && self.mailbox.stopped.get().is_none() {
            out = wait_timeout(&self.mailbox.cv, out, until - now);
        }
        !out.finished.is_empty()
    }

    /// Tracker counters as of the driver's last pass, and whether the tracker is completely
    /// empty with no command of this driver still queued. Never blocks.
    pub fn stats(&self) -> Result<(TrackerStats, bool), CoreError> {
        self.mailbox.check()?;
        let out = lock(&self.mailbox.out);
        let current = out.applied == self.mailbox.sent.load(Ordering::Acquire);
        Ok((out.stats.clone(), out.empty && current))
    }

    /// Why the driver stopped and which engine blocks may still be touched; `None` while it
    /// runs. Never blocks.
    pub fn stopped(&self) -> Option<Stopped> {
        self.mailbox.stopped.get().cloned()
    }

    /// Submit a task and get a future of its report (feature `tokio`).
    #[cfg(feature = "tokio")]
    pub fn submit_async(&self, spec: TaskSpec) -> Result<TaskFuture, CoreError> {
        let id = TaskId(self.mailbox.next_task.fetch_add(1, Ordering::Relaxed));
        let (fut, watcher) = TaskFuture::new(id, self.mailbox.clone());
        self.mailbox
            .send(Cmd::Submit(id, spec, Bond::Request, Some(watcher)))?;
        Ok(fut)
    }
}
