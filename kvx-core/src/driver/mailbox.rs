//! What the engine's threads and the driver thread share: the command queue, the outbox of
//! results and stats, the condvar every waiter sleeps on, and the stop record.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::Thread;

use crate::error::CoreError;
use crate::ids::{EngineBlockId, RequestId, TaskId};
use crate::sync::lock;
use crate::task::{TaskReport, TaskSpec};
use crate::tracker::{Bond, TrackerStats};

use super::fence::FenceSlot;
use super::{Finished, Stopped};

/// Called with a task's report instead of putting it in the outbox (futures).
pub(super) type Watcher = Box<dyn FnOnce(TaskReport) + Send>;

/// A handle call, queued for the driver thread. None of them has a reply channel: answers come
/// back through the outbox or a fence slot.
pub(super) enum Cmd {
    Submit(TaskId, TaskSpec, Bond, Option<Watcher>),
    StartStep,
    Cancel(TaskId),
    Preempt(RequestId, Arc<FenceSlot>),
    FenceBlocks(Vec<EngineBlockId>, Arc<FenceSlot>),
    Finish(RequestId),
    Reset(Arc<FenceSlot>),
}

/// What the driver thread publishes at the end of every pass.
#[derive(Default)]
pub(super) struct Outbox {
    /// Results not yet taken by `get_finished` / `wait_report`.
    pub(super) finished: Finished,
    /// Tracker counters after the pass.
    pub(super) stats: TrackerStats,
    /// The tracker was empty after the pass.
    pub(super) empty: bool,
    /// Commands applied so far (compared with `Mailbox::sent`).
    pub(super) applied: u64,
}

/// The meeting point of the engine's threads and the driver thread: the commands they queue,
/// the outbox the driver publishes, the condvar waiters sleep on, and the stop record.
pub(super) struct Mailbox {
    pub(super) cmds: Mutex<Vec<Cmd>>,
    /// Commands queued so far (counted under the `cmds` lock).
    pub(super) sent: AtomicU64,
    pub(super) thread: Thread,
    pub(super) next_task: AtomicU64,
    pub(super) out: Mutex<Outbox>,
    /// Notified when reports are delivered, a fence holds, or the driver stops.
    pub(super) cv: Condvar,
    /// `Driver` was dropped: the thread leaves its loop after the current pass.
    pub(super) stop_requested: AtomicBool,
    pub(super) stopped: OnceLock<Stopped>,
}

impl Mailbox {
    pub(super) fn new(thread: Thread) -> Mailbox {
        Mailbox {
            cmds: Mutex::new(Vec::new()),
            sent: AtomicU64::new(0),
            thread,
            next_task: AtomicU64::new(1),
            out: Mutex::new(Outbox::default()),
            cv: Condvar::new(),
            stop_requested: AtomicBool::new(false),
            stopped: OnceLock::new(),
        }
    }

    /// `DriverStopped` if the driver stopped or is stopping.
    pub(super) fn check(&self) -> Result<(), CoreError> {
        if let Some(s) = self.stopped.get() {
            return Err(CoreError::DriverStopped {
                reason: s.reason.clone(),
            });
        }
        if self.stop_requested.load(Ordering::Acquire) {
            return Err(CoreError::DriverStopped {
                reason: "stopped".into(),
            });
        }
        Ok(())
    }

    /// Queue a command and wake the driver thread. Never waits for the thread to act on it.
    pub(super) fn send(&self, cmd: Cmd) -> Result<(), CoreError> {
        let mut cmds = lock(&self.cmds);
        // Checked under the lock: `stop` sets the record before it empties the queue, so a
        // command is either refused here or dropped by `stop` (its caller then sees the stop).
        self.check()?;
        cmds.push(cmd);
        self.sent.fetch_add(1, Ordering::Release);
        drop(cmds);
        self.thread.unpark();
        Ok(())
    }

    /// Wake every thread sleeping on `cv`. Taking the lock first orders the wake-up after any
    /// flag the caller set, so a waiter that checked its flag under the lock cannot miss it.
    pub(super) fn wake_waiters(&self) {
        drop(lock(&self.out));
        self.cv.notify_all();
    }

    /// Record the stop (the first record wins), drop queued commands, wake every waiter.
    pub(super) fn stop(&self, stopped: Stopped) {
        let _ = self.stopped.set(stopped);
        let dropped = std::mem::take(&mut *lock(&self.cmds));
        drop(dropped);
        self.wake_waiters();
    }
}
