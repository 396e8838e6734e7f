//! The driver: a thread that owns the clock, the backends and the [`Tracker`], and the
//! engine-facing handle to it.
//!
//! Every engine-facing call is non-blocking except [`DriverHandle::finish`] (a round trip to the
//! driver thread, which itself never blocks on a device) and the explicit waits
//! ([`FenceHandle::wait`], [`DriverHandle::wait_report`]). Results are collected with
//! [`DriverHandle::get_finished`], the way an engine step loop polls.

#[cfg(feature = "tokio")]
mod future;
mod sync;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use crate::backend::{Backend, Notifier};
use crate::error::CoreError;
use crate::ids::{BackendId, EngineBlockId, RequestId, TaskId};
use crate::task::{TaskReport, TaskSpec};
use crate::tracker::{Event, Fence, Tracker, TrackerConfig, TrackerStats, Transmit};
#[cfg(feature = "tokio")]
pub use future::TaskFuture;
pub use sync::FenceHandle;
use sync::FenceSlot;

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
    /// Finished requests whose delayed freeing may happen now.
    pub released: Vec<RequestId>,
}

impl Finished {
    /// True when nothing finished.
    pub fn is_empty(&self) -> bool {
        self.reports.is_empty() && self.released.is_empty()
    }
}

type Watcher = Box<dyn FnOnce(TaskReport) + Send>;

enum Cmd {
    Submit(TaskId, TaskSpec, Option<Watcher>),
    StartStep,
    Cancel(TaskId),
    Preempt(RequestId, Arc<FenceSlot>),
    FenceBlocks(Vec<EngineBlockId>, Arc<FenceSlot>),
    Finish(RequestId, mpsc::Sender<bool>),
    Reset,
    Stats(mpsc::Sender<(TrackerStats, bool)>),
}

struct Inner {
    cmds: Mutex<Vec<Cmd>>,
    thread: Thread,
    next_task: AtomicU64,
    out: Mutex<Finished>,
    out_cv: Condvar,
    stop: AtomicBool,
}

impl Inner {
    fn send(&self, cmd: Cmd) -> Result<(), CoreError> {
        let mut cmds = self.cmds.lock().unwrap_or_else(|e| e.into_inner());
        if self.stop.load(Ordering::Acquire) {
            return Err(CoreError::DriverStopped);
        }
        cmds.push(cmd);
        drop(cmds);
        self.thread.unpark();
        Ok(())
    }
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
        let (tx, rx) = mpsc::channel::<Arc<Inner>>();
        let DriverBuilder { cfg, backends } = self;
        let thread = std::thread::Builder::new()
            .name("kvx-driver".into())
            .spawn(move || {
                if let Ok(inner) = rx.recv() {
                    run(inner, cfg, backends)
                }
            })
            .map_err(|e| CoreError::BadLayout(format!("cannot spawn the driver thread: {e}")))?;
        let inner = Arc::new(Inner {
            cmds: Mutex::new(Vec::new()),
            thread: thread.thread().clone(),
            next_task: AtomicU64::new(1),
            out: Mutex::new(Finished::default()),
            out_cv: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        tx.send(inner.clone())
            .map_err(|_| CoreError::DriverStopped)?;
        Ok(Driver {
            handle: DriverHandle { inner },
            thread: Some(thread),
        })
    }
}

/// The running driver. Dropping it stops the thread (zombie ops are abandoned to their backends).
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
        self.handle.inner.stop.store(true, Ordering::Release);
        self.handle.inner.thread.unpark();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The engine-facing handle of a driver.
#[derive(Clone)]
pub struct DriverHandle {
    inner: Arc<Inner>,
}

impl DriverHandle {
    /// Submit a task; returns at once with its id. Its verdict comes through `get_finished`.
    pub fn submit(&self, spec: TaskSpec) -> Result<TaskId, CoreError> {
        let id = TaskId(self.inner.next_task.fetch_add(1, Ordering::Relaxed));
        self.inner.send(Cmd::Submit(id, spec, None))?;
        Ok(id)
    }

    /// Submit deferred tasks now (call at the start of each engine step).
    pub fn start_step(&self) -> Result<(), CoreError> {
        self.inner.send(Cmd::StartStep)
    }

    /// Cancel a task (best effort: a task that already ended is unaffected).
    pub fn cancel(&self, task: TaskId) -> Result<(), CoreError> {
        self.inner.send(Cmd::Cancel(task))
    }

    /// Preempt a request: cancel its loads, flush its stores. Wait for the fence before reusing
    /// its blocks.
    pub fn preempt(&self, req: RequestId) -> Result<FenceHandle, CoreError> {
        let slot = Arc::new(FenceSlot::default());
        self.inner.send(Cmd::Preempt(req, slot.clone()))?;
        Ok(FenceHandle::new(slot))
    }

    /// A fence over engine blocks about to be handed to someone else (flushes queued stores).
    pub fn fence_blocks(&self, blocks: &[EngineBlockId]) -> Result<FenceHandle, CoreError> {
        let slot = Arc::new(FenceSlot::default());
        self.inner
            .send(Cmd::FenceBlocks(blocks.to_vec(), slot.clone()))?;
        Ok(FenceHandle::new(slot))
    }

    /// The engine is done with a request; true when freeing its blocks must wait for
    /// [`Finished::released`].
    pub fn finish(&self, req: RequestId) -> Result<bool, CoreError> {
        let (tx, rx) = mpsc::channel();
        self.inner.send(Cmd::Finish(req, tx))?;
        rx.recv().map_err(|_| CoreError::DriverStopped)
    }

    /// Forget all live tasks; late completions of their ops are dropped.
    pub fn reset(&self) -> Result<(), CoreError> {
        self.inner.send(Cmd::Reset)
    }

    /// Everything that finished since the last call. Never blocks.
    pub fn get_finished(&self) -> Finished {
        std::mem::take(&mut *self.inner.out.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Block until `task`'s report arrives or `until` passes; the report is taken out of the
    /// finished set. (Convenience for tests and simple callers.)
    pub fn wait_report(&self, task: TaskId, until: Instant) -> Option<TaskReport> {
        let mut out = self.inner.out.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(i) = out.reports.iter().position(|r| r.task == task) {
                return Some(out.reports.remove(i));
            }
            let now = Instant::now();
            if now >= until {
                return None;
            }
            out = self
                .inner
                .out_cv
                .wait_timeout(out, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Tracker counters, and whether the tracker is completely empty.
    pub fn stats(&self) -> Result<(TrackerStats, bool), CoreError> {
        let (tx, rx) = mpsc::channel();
        self.inner.send(Cmd::Stats(tx))?;
        rx.recv().map_err(|_| CoreError::DriverStopped)
    }

    /// Submit a task and get a future of its report (feature `tokio`).
    #[cfg(feature = "tokio")]
    pub fn submit_async(&self, spec: TaskSpec) -> Result<TaskFuture, CoreError> {
        let id = TaskId(self.inner.next_task.fetch_add(1, Ordering::Relaxed));
        let (fut, watcher) = TaskFuture::new(id);
        self.inner.send(Cmd::Submit(id, spec, Some(watcher)))?;
        Ok(fut)
    }
}

struct Loop {
    inner: Arc<Inner>,
    tracker: Tracker,
    backends: Vec<Box<dyn Backend>>,
    fences: Vec<(Fence, Arc<FenceSlot>)>,
    watchers: FxHashMap<TaskId, Watcher>,
    completions: Vec<crate::op::OpCompletion>,
}

fn run(inner: Arc<Inner>, cfg: DriverConfig, mut backends: Vec<Box<dyn Backend>>) {
    let mut tracker = Tracker::new(cfg.tracker.clone());
    let me = std::thread::current();
    for b in backends.iter_mut() {
        let t = me.clone();
        b.set_notifier(Notifier::new(move || t.unpark()));
        tracker.add_backend(b.touches_engine_memory());
    }
    let mut l = Loop {
        inner,
        tracker,
        backends,
        fences: Vec::new(),
        watchers: FxHashMap::default(),
        completions: Vec::new(),
    };
    while !l.inner.stop.load(Ordering::Acquire) {
        let busy = l.turn();
        if !busy {
            let park = match l.tracker.poll_timeout() {
                Some(at) => at
                    .saturating_duration_since(Instant::now())
                    .min(cfg.max_park),
                None => cfg.max_park,
            };
            if !park.is_zero() {
                std::thread::park_timeout(park);
            }
        }
    }
    // Commands that raced with the stop are dropped, so their callers see `DriverStopped`.
    l.inner
        .cmds
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clear();
}

impl Loop {
    /// One pass: commands, completions, timers, transmits, events. True if anything happened.
    fn turn(&mut self) -> bool {
        let mut busy = false;
        let cmds = std::mem::take(&mut *self.inner.cmds.lock().unwrap_or_else(|e| e.into_inner()));
        let now = Instant::now();
        for cmd in cmds {
            busy = true;
            self.apply(cmd, now);
        }
        for b in self.backends.iter_mut() {
            b.poll(&mut self.completions);
        }
        let now = Instant::now();
        for c in self.completions.drain(..) {
            busy = true;
            self.tracker.handle_completion(c, now);
        }
        self.tracker.handle_timeout(Instant::now());
        while let Some(t) = self.tracker.poll_transmit() {
            busy = true;
            match t {
                Transmit::Submit { backend, op } => {
                    if let Err(e) = self.backends[backend.0 as usize].submit(op) {
                        self.tracker.handle_submit_error(e, Instant::now());
                    }
                }
                Transmit::Cancel { backend, op } => self.backends[backend.0 as usize].cancel(op),
            }
        }
        let mut delivered = false;
        while let Some(ev) = self.tracker.poll_event() {
            busy = true;
            let mut out = self.inner.out.lock().unwrap_or_else(|e| e.into_inner());
            match ev {
                Event::TaskFinished(r) => match self.watchers.remove(&r.task) {
                    Some(w) => {
                        drop(out);
                        w(r)
                    }
                    None => {
                        out.reports.push(r);
                        delivered = true;
                    }
                },
                Event::RequestReleased(req) => {
                    out.released.push(req);
                    delivered = true;
                }
            }
        }
        if delivered {
            self.inner.out_cv.notify_all();
        }
        let tracker = &self.tracker;
        self.fences.retain(|(f, slot)| {
            if tracker.fence_holds(f) {
                slot.set();
                false
            } else {
                true
            }
        });
        busy
    }

    fn apply(&mut self, cmd: Cmd, now: Instant) {
        match cmd {
            Cmd::Submit(id, spec, watcher) => {
                if let Some(w) = watcher {
                    self.watchers.insert(id, w);
                }
                if let Err(e) = self.tracker.submit_as(id, spec, now) {
                    tracing::error!(%id, error = %e, "driver: task id reused");
                    self.watchers.remove(&id);
                }
            }
            Cmd::StartStep => self.tracker.start_step(),
            Cmd::Cancel(t) => self.tracker.cancel(t, now),
            Cmd::Preempt(req, slot) => {
                let f = self.tracker.preempt(req, now);
                self.fences.push((f, slot));
            }
            Cmd::FenceBlocks(blocks, slot) => {
                let f = self.tracker.fence_blocks(&blocks);
                self.fences.push((f, slot));
            }
            Cmd::Finish(req, reply) => {
                let _ = reply.send(self.tracker.finish(req, now));
            }
            Cmd::Reset => {
                self.tracker.reset(now);
                self.watchers.clear();
            }
            Cmd::Stats(reply) => {
                let _ = reply.send((self.tracker.stats(), self.tracker.is_empty()));
            }
        }
    }
}
