//! Fence handles: a flag the driver sets once a fence holds, and a way to wait for it.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// Shared state of one fence.
#[derive(Default)]
pub(crate) struct FenceSlot {
    ready: Mutex<bool>,
    cv: Condvar,
}

impl FenceSlot {
    pub(crate) fn set(&self) {
        *self.ready.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.cv.notify_all();
    }
}

/// A fence from [`super::DriverHandle::preempt`] or [`super::DriverHandle::fence_blocks`].
#[derive(Clone)]
pub struct FenceHandle {
    slot: Arc<FenceSlot>,
}

impl FenceHandle {
    pub(crate) fn new(slot: Arc<FenceSlot>) -> FenceHandle {
        FenceHandle { slot }
    }

    /// True once no op touches the fenced blocks any more. Never blocks.
    pub fn is_ready(&self) -> bool {
        *self.slot.ready.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Block until the fence holds (true) or `until` passes (false).
    pub fn wait(&self, until: Instant) -> bool {
        let mut ready = self.slot.ready.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if *ready {
                return true;
            }
            let now = Instant::now();
            if now >= until {
                return false;
            }
            ready = self
                .slot
                .cv
                .wait_timeout(ready, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
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
