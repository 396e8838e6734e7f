//! One health breaker per root (kvx-policy's [`Breaker`]), shared with the store's handle.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvx_policy::{Admission, Breaker, BreakerConfig, BreakerState};

use crate::error::PosixError;

/// The breakers of all roots.
#[derive(Debug)]
pub(crate) struct Health {
    breakers: Mutex<Vec<Breaker>>,
}

impl Health {
    /// A closed breaker per root.
    pub(crate) fn new(roots: usize, cfg: BreakerConfig) -> Result<Health, PosixError> {
        let b = Breaker::new(cfg).map_err(|e| PosixError::BadConfig(e.to_string()))?;
        Ok(Health {
            breakers: Mutex::new(vec![b; roots]),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Breaker>> {
        self.breakers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// May an op start on `root` now?
    pub(crate) fn admit(&self, root: usize, now: Instant) -> Admission {
        self.lock()
            .get_mut(root)
            .map_or(Admission::Rejected, |b| b.admit(now))
    }

    /// An op on `root` succeeded after `latency`.
    pub(crate) fn success(&self, root: usize, now: Instant, latency: Duration) {
        if let Some(b) = self.lock().get_mut(root) {
            b.record_success(now, latency);
        }
    }

    /// An op on `root` failed or timed out.
    pub(crate) fn failure(&self, root: usize, now: Instant) {
        if let Some(b) = self.lock().get_mut(root) {
            let was_open = b.is_open();
            b.record_failure(now);
            if !was_open && b.is_open() {
                tracing::warn!(root, "posix: breaker opened; ops on this root fail at once");
            }
        }
    }

    /// State of `root`'s breaker.
    pub(crate) fn state(&self, root: usize) -> Option<BreakerState> {
        self.lock().get(root).map(Breaker::state)
    }
}
