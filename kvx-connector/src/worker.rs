//! [`WorkerRequests`]: a worker's view of the engine's requests. Each [`StepMsg`] names the
//! requests whose load starts and whose freeing waits for their stores; kvx reports them by
//! number, the engine wants its own ids back, each once. The table keeps an engine id exactly
//! as long as a report of its request may still come, and starts each step once, whichever
//! of the engine's per-step calls hands it over first.

use std::collections::{HashMap, HashSet};

use kvx_core::RequestId;
use kvx_offload::ReleasedLoads;

use crate::step::StepMsg;

/// What to tell the engine, by its ids.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reported {
    /// Requests whose delayed freeing may happen now.
    pub finished_sending: Vec<String>,
    /// Requests whose asynchronous load ended (loaded, failed, or abandoned and ended).
    pub finished_recving: Vec<String>,
    /// Of those, the ones whose load failed in at least one block.
    pub failed_recving: Vec<String>,
}

/// The table (see the module docs).
#[derive(Debug, Default)]
pub struct WorkerRequests {
    /// The last step started.
    step: u64,
    names: HashMap<RequestId, String>,
    loading: HashSet<RequestId>,
    sending: HashSet<RequestId>,
    abandoned: HashSet<RequestId>,
}

impl WorkerRequests {
    /// Nothing tracked.
    pub fn new() -> WorkerRequests {
        WorkerRequests::default()
    }

    /// Take in step `msg`: false (and nothing changes) if it was started already.
    pub fn start(&mut self, msg: &StepMsg) -> bool {
        if msg.step == self.step {
            return false;
        }
        self.step = msg.step;
        for (r, name) in &msg.names {
            self.names.insert(*r, name.clone());
        }
        self.loading.extend(msg.loads.iter().copied());
        self.sending.extend(msg.delayed.iter().copied());
        let loading = &self.loading;
        self.abandoned
            .extend(msg.abandoned.iter().filter(|r| loading.contains(r)));
        true
    }

    /// What kvx reported (`finished_sending`, and the loads the hold-back let go), by the
    /// engine's ids: each request once, and only those a step named.
    pub fn reported(&mut self, sending: &[RequestId], loads: &ReleasedLoads) -> Reported {
        let mut out = Reported::default();
        // A load whose request finished meanwhile is reported once it ended, so that the
        // engine frees its blocks (kvx-offload hands it to the scheduler side only).
        let ended: Vec<RequestId> = loads
            .ended
            .iter()
            .copied()
            .filter(|r| self.abandoned.contains(r))
            .collect();
        for r in loads.finished_recving.iter().chain(&ended) {
            if !self.loading.remove(r) {
                continue;
            }
            self.abandoned.remove(r);
            if let Some(name) = self.name_of(*r) {
                if loads.failed_recving.contains(r) {
                    out.failed_recving.push(name.clone());
                }
                out.finished_recving.push(name);
            }
        }
        for r in sending {
            if self.sending.remove(r)
                && let Some(name) = self.name_of(*r)
            {
                out.finished_sending.push(name);
            }
        }
        out
    }

    /// The engine's id of `r`, forgotten once nothing of `r` is to be reported any more.
    fn name_of(&mut self, r: RequestId) -> Option<String> {
        if self.loading.contains(&r) || self.sending.contains(&r) {
            self.names.get(&r).cloned()
        } else {
            self.names.remove(&r)
        }
    }

    /// `(names, loading, sending, abandoned)`: all zero when nothing is to be reported.
    pub fn counts(&self) -> [usize; 4] {
        [
            self.names.len(),
            self.loading.len(),
            self.sending.len(),
            self.abandoned.len(),
        ]
    }
}

#[cfg(test)]
mod tests;
