//! One health breaker per root (kvx-policy's [`Breaker`]), shared with the store's handle.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvx_core::metrics::{self, BreakerGauge};
use kvx_policy::{Admission, Breaker, BreakerConfig, BreakerState};

use crate::error::PosixError;
use kvx_core::sync::lock;

/// The breakers of all roots.
#[derive(Debug)]
pub(crate) struct Health {
    breakers: Mutex<Vec<Breaker>>,
    /// The roots' paths: the `target` label of the breaker metrics.
    names: Vec<String>,
}

impl Health {
    /// A closed breaker per root, named by the root's path.
    pub(crate) fn new(
        roots: &[std::path::PathBuf],
        cfg: BreakerConfig,
    ) -> Result<Health, PosixError> {
        let b = Breaker::new(cfg).map_err(|e| PosixError::BadConfig(e.to_string()))?;
        let names: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
        for n in &names {
            metrics::record_breaker(n, BreakerGauge::Closed);
        }
        Ok(Health {
            breakers: Mutex::new(vec![b; roots.len()]),
            names,
        })
    }

    /// Publish `root`'s breaker state when an op changed it.
    fn publish(&self, root: usize, before: BreakerState, after: BreakerState) {
        if std::mem::discriminant(&before) == std::mem::discriminant(&after) {
            return;
        }
        let gauge = match after {
            BreakerState::Closed => BreakerGauge::Closed,
            BreakerState::Open { .. } => BreakerGauge::Open,
            BreakerState::HalfOpen { .. } => BreakerGauge::HalfOpen,
        };
        if let Some(name) = self.names.get(root) {
            metrics::record_breaker(name, gauge);
        }
    }

    /// May an op start on `root` now?
    pub(crate) fn admit(&self, root: usize, now: Instant) -> Admission {
        let mut breakers = lock(&self.breakers);
        let Some(b) = breakers.get_mut(root) else {
            return Admission::Rejected;
        };
        let before = b.state();
        let admission = b.admit(now);
        let after = b.state();
        drop(breakers);
        self.publish(root, before, after);
        admission
    }

    /// An op on `root` succeeded after `latency`.
    pub(crate) fn success(&self, root: usize, now: Instant, latency: Duration) {
        let mut breakers = lock(&self.breakers);
        if let Some(b) = breakers.get_mut(root) {
            let before = b.state();
            b.record_success(now, latency);
            let after = b.state();
            drop(breakers);
            self.publish(root, before, after);
        }
    }

    /// An op on `root` failed or timed out.
    pub(crate) fn failure(&self, root: usize, now: Instant) {
        let mut breakers = lock(&self.breakers);
        if let Some(b) = breakers.get_mut(root) {
            let before = b.state();
            b.record_failure(now);
            let after = b.state();
            drop(breakers);
            if !matches!(before, BreakerState::Open { .. })
                && matches!(after, BreakerState::Open { .. })
            {
                tracing::warn!(root, "posix: breaker opened; ops on this root fail at once");
            }
            self.publish(root, before, after);
        }
    }

    /// State of `root`'s breaker.
    pub(crate) fn state(&self, root: usize) -> Option<BreakerState> {
        lock(&self.breakers).get(root).map(Breaker::state)
    }
}
