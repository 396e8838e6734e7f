//! Fence handles: a flag the driver thread sets once a fence holds, and ways to poll or wait
//! for it that return at once when the driver stopped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::CoreError;
use crate::sync::{lock, wait_timeout};

use super::TICK;
use super::mailbox::Mailbox;

/// The state of one fence: set (never cleared) by the driver thread once the fence holds, and
/// until then when the copies it waits for are due.
#[derive(Default)]
pub(super) struct FenceSlot {
    ready: AtomicBool,
    due: Mutex<Option<Due>>,
}

/// When the copies a fence waits for are due, as the driver saw it in its latest pass.
#[derive(Clone, Copy, Debug)]
struct Due {
    by: Instant,
    seen: Instant,
}

impl FenceSlot {
    /// Mark the fence as held. The driver wakes the waiters afterwards.
    pub(super) fn set(&self) {
        self.ready.store(true, Ordering::Release);
    }

    /// The driver's pass at `seen` found the fence waiting for copies due `by`.
    pub(super) fn note_due(&self, by: Instant, seen: Instant) {
        *lock(&self.due) = Some(Due { by, seen });
    }
}

/// How [`FenceHandle::wait_for_copies`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceWait {
    /// The fence holds: nothing kvx started touches its blocks any more.
    Held,
    /// A copy it waits for is still out past its deadline and the driver's tick after it (a
    /// stuck device): it may still touch the blocks, and no deadline bounds it. `late`: how far
    /// past its deadline the driver last saw it.
    Overdue {
        /// How far past the copies' deadline the driver last saw them out.
        late: Duration,
    },
    /// The driver stopped before the fence held: it never will.
    Stopped,
}

/// A fence from [`super::DriverHandle::preempt`], [`super::DriverHandle::fence_blocks`] or
/// [`super::DriverHandle::reset`].
///
/// It holds once no op that was out on its blocks when it was made can touch them any more.
/// A fence on a driver that stopped before it held never holds: the ops it waited for may
/// still be running (see [`super::DriverHandle::stopped`]), so [`FenceHandle::is_ready`] stays
/// false, [`FenceHandle::wait`] returns false at once and [`FenceHandle::poll`] returns
/// [`CoreError::DriverStopped`].
#[derive(Clone)]
#[must_use = "reuse no fenced engine block before the fence holds"]
pub struct FenceHandle {
    slot: Arc<FenceSlot>,
    mailbox: Arc<Mailbox>,
}

impl FenceHandle {
    pub(super) fn new(slot: Arc<FenceSlot>, mailbox: Arc<Mailbox>) -> FenceHandle {
        FenceHandle { slot, mailbox }
    }

    /// True once the fence holds. Never blocks.
    pub fn is_ready(&self) -> bool {
        self.slot.ready.load(Ordering::Acquire)
    }

    /// `Ok(true)` once the fence holds, `Ok(false)` while it may still hold, and
    /// `DriverStopped` when it never will. Never blocks.
    pub fn poll(&self) -> Result<bool, CoreError> {
        if self.is_ready() {
            return Ok(true);
        }
        self.mailbox.check().map(|()| false)
    }

    /// Wait `grace` for the fence, and beyond it for as long as the copies it waits for are
    /// within their deadlines: the wait ends when the fence holds, when the driver has seen a
    /// copy still out one tick past its deadline (and `grace` has passed), or when the driver
    /// stops. So it takes at most `grace`, or the latest deadline of the copies out on the
    /// fence's blocks plus one tick (and however late the OS runs the driver thread then).
    pub fn wait_for_copies(&self, grace: Duration) -> FenceWait {
        let start = Instant::now();
        loop {
            let now = Instant::now();
            let due = *lock(&self.slot.due);
            let overdue = due.filter(|d| d.seen >= d.by + TICK);
            if let Some(d) = overdue.filter(|_| now >= start + grace) {
                if !self.is_ready() {
                    return FenceWait::Overdue {
                        late: d.seen - d.by,
                    };
                }
            }
            // Until the driver's next pass, or the end of the grace.
            let until = if now < start + grace {
                (start + grace).min(now + TICK)
            } else {
                now + TICK
            };
            if self.wait(until) {
                return FenceWait::Held;
            }
            if self.mailbox.stopped.get().is_some() {
                return FenceWait::Stopped;
            }
        }
    }

    /// Block until the fence holds (true), `until` passes or the driver stops (false).
    pub fn wait(&self, until: Instant) -> bool {
        let mut out = lock(&self.mailbox.out);
        loop {
            if self.is_ready() {
                return true;
            }
            if self.mailbox.stopped.get().is_some() {
                return false;
            }
            let now = Instant::now();
            if now >= until {
                return false;
            }
            out = wait_timeout(&self.mailbox.cv, out, until - now);
        }
    }
}

impl std::fmt::Debug for FenceHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceHandle")
            .field("ready", &self.is_ready())
            .finish()
    }
}
