//! Fence handles: a flag the driver thread sets once a fence holds, and ways to poll or wait
//! for it that return at once when the driver stopped.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::error::CoreError;
use crate::sync::{lock, wait_timeout};

use super::mailbox::Mailbox;

/// The state of one fence: set (never cleared) by the driver thread once the fence holds.
#[derive(Default)]
pub(super) struct FenceSlot {
    ready: AtomicBool,
}

impl FenceSlot {
    /// Mark the fence as held. The driver wakes the waiters afterwards.
    pub(super) fn set(&self) {
        self.ready.store(true, Ordering::Release);
    }
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
