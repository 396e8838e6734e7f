//! A request's life: preempted (loads cancelled, stores flushed, a fence), finished (reported
//! released once nothing of it is out), or dropped by a reset (a fence over every engine copy
//! still out).

use std::time::Instant;

use tracing::{debug, info};

use super::{Event, Fence, Tracker};
use crate::ids::{Direction, EngineBlockId, RequestId, TaskId};
use crate::task::TaskState;

impl Tracker {
    /// The engine is done with a request. Its loads are cancelled, its queued stores flushed.
    /// The request always comes back once as [`Event::RequestReleased`]: at once when nothing
    /// of it is out, else once its stores ended and its engine copies returned. Returns true
    /// when something of it was still out (the release comes later).
    pub fn finish(&mut self, req: RequestId, now: Instant) -> bool {
        let Some(r) = self.requests.get(&req) else {
            self.events.push_back(Event::RequestReleased(req));
            return false;
        };
        let loads: Vec<TaskId> = r
            .tasks
            .iter()
            .copied()
            .filter(|t| self.tasks.get(t).is_some_and(|t| t.dir == Direction::Load))
            .collect();
        for t in loads {
            self.cancel(t, now);
        }
        let Some(r) = self.requests.get_mut(&req) else {
            return false;
        };
        r.finished = true;
        r.report_release = true;
        let delay = !r.tasks.is_empty() || !r.zombies.is_empty();
        let stores = r.tasks.clone();
        for t in stores {
            self.flush_ahead(t);
        }
        self.maybe_release(req);
        delay
    }

    /// Preempt a request: its loads are cancelled, its deferred stores are submitted now. The
    /// returned fence holds once no op of the request touches its engine blocks any more (its
    /// stores ended, its loads' engine copies returned).
    pub fn preempt(&mut self, req: RequestId, now: Instant) -> Fence {
        let Some(r) = self.requests.get(&req) else {
            return Fence {
                blocks: Vec::new(),
                seq: self.holders.seq(),
            };
        };
        let tasks = r.tasks.clone();
        let zombies = r.zombies.clone();
        let mut blocks: Vec<EngineBlockId> = Vec::new();
        for z in &zombies {
            if let Some(o) = self.ops.get(z) {
                blocks.extend_from_slice(&o.engine_blocks);
            }
        }
        let seq = self.holders.seq();
        for id in tasks {
            let Some(t) = self.tasks.get(&id) else {
                continue;
            };
            blocks.extend_from_slice(&t.engine_blocks);
            match t.dir {
                Direction::Load => self.cancel(id, now),
                Direction::Store => self.flush_ahead(id),
            }
        }
        blocks.sort_unstable();
        blocks.dedup();
        info!(request = %req, blocks = blocks.len(), "preempt: fence created");
        Fence { blocks, seq }
    }

    /// Forget every live task without reporting it; their ops become zombies whose late
    /// completions are dropped. Engine-memory zombies still hold their blocks until they return.
    ///
    /// The returned fence holds once every engine-memory op that is out now (zombies included)
    /// has returned. Requests the engine had finished are not forgotten: each still comes back
    /// once as [`Event::RequestReleased`], when its own engine-memory ops have returned (at once
    /// when it has none).
    pub fn reset(&mut self, now: Instant) -> Fence {
        let ids: Vec<TaskId> = self.tasks.keys().copied().collect();
        for id in ids {
            self.terminate(id, TaskState::Cancelled, now);
        }
        // Queued submits stay: their ops are zombies now and must still reach their backend so
        // that they complete and give their buffers back.
        self.events
            .retain(|e| matches!(e, Event::RequestReleased(_)));
        self.requests.retain(|_, r| {
            r.finished = true;
            !r.zombies.is_empty()
        });
        self.deferred.clear();
        self.blocked.clear();
        self.deadlines.clear();
        Fence {
            blocks: self.holders.blocks(),
            seq: self.holders.seq(),
        }
    }

    /// Drop a finished request's entry once nothing of it is outstanding.
    pub(super) fn maybe_release(&mut self, req: RequestId) {
        let Some(r) = self.requests.get(&req) else {
            return;
        };
        if r.finished && r.tasks.is_empty() && r.zombies.is_empty() {
            let report = r.report_release;
            self.requests.remove(&req);
            if report {
                debug!(request = %req, "request released");
                self.events.push_back(Event::RequestReleased(req));
            }
        }
    }
}
