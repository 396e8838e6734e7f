//! Preemption: the preempted requests' queued stores are flushed and their loads cancelled;
//! the engine gets a fence to poll before it reuses their blocks.

use std::time::{Duration, Instant};

use kvx_core::{CoreError, FenceHandle, FenceWait, RequestId};

use super::WorkerSide;
use crate::error::OffloadError;

/// Holds once no op can touch the engine blocks of the preempted requests any more: every
/// store of theirs has really returned (flushed) and every load copy has been cancelled or
/// has returned. Reuse none of their blocks before it holds.
#[derive(Debug, Clone)]
#[must_use = "reuse no preempted request's block before the fence holds"]
pub struct PreemptionFence {
    requests: Vec<RequestId>,
    fences: Vec<FenceHandle>,
}

impl PreemptionFence {
    /// The preempted requests it covers.
    pub fn requests(&self) -> &[RequestId] {
        &self.requests
    }

    /// True once the fence holds. Never blocks.
    pub fn is_ready(&self) -> bool {
        self.fences.iter().all(|f| f.is_ready())
    }

    /// `Ok(true)` once the fence holds, `Ok(false)` while it may still hold, an error when it
    /// never will (the driver stopped: see [`WorkerSide::stopped`] for the blocks at risk).
    /// Never blocks.
    pub fn poll(&self) -> Result<bool, OffloadError> {
        for f in &self.fences {
            if !f.poll()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Wait until the fence holds (true) or `until` passes or the driver stops (false).
    pub fn wait(&self, until: Instant) -> bool {
        self.fences.iter().all(|f| f.wait(until))
    }

    /// Wait `grace`, and beyond it while the copies the fence waits for are within their
    /// deadlines (see [`FenceHandle::wait_for_copies`]): `Held`, or why it does not hold.
    pub fn wait_for_copies(&self, grace: Duration) -> FenceWait {
        let start = Instant::now();
        for f in &self.fences {
            match f.wait_for_copies(grace.saturating_sub(start.elapsed())) {
                FenceWait::Held => {}
                other => return other,
            }
        }
        FenceWait::Held
    }
}

impl WorkerSide {
    /// Before the engine may overwrite anything: flush the preempted requests' stores and
    /// cancel their loads. Waits at most `budget` for the fence, then hands it back whether it
    /// holds or not: poll it before reusing those requests' blocks.
    pub fn handle_preemptions(
        &mut self,
        preempted: &[RequestId],
        budget: Duration,
    ) -> Result<PreemptionFence, OffloadError> {
        self.abandon_loads(preempted);
        let fences = preempted
            .iter()
            .map(|r| self.driver.preempt(*r))
            .collect::<Result<Vec<FenceHandle>, CoreError>>()?;
        let fence = PreemptionFence {
            requests: preempted.to_vec(),
            fences,
        };
        if !budget.is_zero() {
            fence.wait(Instant::now() + budget);
        }
        Ok(fence)
    }
}
