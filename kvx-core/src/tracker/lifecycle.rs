//! A request's life: preempted (loads cancelled, stores flushed, a fence), finished (reported
//! released once nothing of it is out), or dropped by a reset (a fence over every engine copy
//! still out).

use std::time::Instant;

use tracing::{debug, info};

use super::{Event, Fence, Tracker};
use crate::ids::{Direction, EngineBlockId, RequestId};
use crate::task::TaskState;

impl Tracker {
    /// The engine is done with a request. Its loads are cancelled, its queued stores flushed.
    /// The request always comes back once as [`Event::RequestReleased`]: at once when nothing
    /// of it is out, else once its stores ended and its engine copies returned. Returns true
    /// when something of it was still out (the release comes later).
    pub fn finish(&mut self, req: RequestId, now: Instant) -> bool {
        let Some(&rs) = self.request_slots.get(&req) else {
            self.events.push_back(Event::RequestReleased(req));
            return false;
        };
        let mut list = std::mem::take(&mut self.scratch);
        list.clear();
        self.request_tasks(rs, &mut list);
        for &slot in &list {
            if self
                .tasks
                .get(slot)
                .is_some_and(|t| t.dir == Direction::Load)
            {
                self.terminate(slot, TaskState::Cancelled, now);
            }
        }
        list.clear();
        let delay = match self.requests.get_mut(rs) {
            Some(r) => {
                r.finished = true;
                r.report_release = true;
                r.tasks > 0 || !r.zombies.is_empty()
            }
            None => false,
        };
        // What is left are stores.
        self.request_tasks(rs, &mut list);
        for &slot in &list {
            self.flush_ahead(slot);
        }
        list.clear();
        self.scratch = list;
        self.maybe_release(rs);
        delay
    }

    /// Preempt a request: its loads are cancelled, its deferred stores are submitted now. The
    /// returned fence holds once no op of the request touches its engine blocks any more (its
    /// stores ended, its loads' engine copies returned).
    pub fn preempt(&mut self, req: RequestId, now: Instant) -> Fence {
        let seq = self.holders.seq();
        let Some(&rs) = self.request_slots.get(&req) else {
            return Fence {
                blocks: Vec::new(),
                seq,
            };
        };
        let mut blocks: Vec<EngineBlockId> = Vec::new();
        if let Some(r) = self.requests.get(rs) {
            for z in &r.zombies {
                if let Some(o) = self.ops.get(*z) {
                    blocks.extend_from_slice(&o.engine_blocks);
                }
            }
        }
        let mut list = std::mem::take(&mut self.scratch);
        list.clear();
        self.request_tasks(rs, &mut list);
        for &slot in &list {
            let Some(t) = self.tasks.get(slot) else {
                continue;
            };
            blocks.extend_from_slice(&t.engine_blocks);
            match t.dir {
                Direction::Load => self.terminate(slot, TaskState::Cancelled, now),
                Direction::Store => self.flush_ahead(slot),
            }
        }
        list.clear();
        self.scratch = list;
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
        let live: Vec<u32> = self.tasks.iter().map(|(slot, _)| slot).collect();
        for slot in live {
            self.terminate(slot, TaskState::Cancelled, now);
        }
        // Queued submits stay: their ops are zombies now and must still reach their backend so
        // that they complete and give their buffers back.
        self.events
            .retain(|e| matches!(e, Event::RequestReleased(_)));
        let requests: Vec<u32> = self.requests.iter().map(|(rs, _)| rs).collect();
        for rs in requests {
            if let Some(r) = self.requests.get_mut(rs) {
                r.finished = true;
                if r.zombies.is_empty() {
                    self.drop_request(rs);
                }
            }
        }
        self.deferred.clear();
        self.blocked.clear();
        self.deadlines.clear();
        Fence {
            blocks: self.holders.blocks(),
            seq: self.holders.seq(),
        }
    }

    /// Drop the entry of a finished request (by slot) once nothing of it is outstanding.
    #[inline]
    pub(super) fn maybe_release(&mut self, rs: u32) {
        let Some(r) = self.requests.get(rs) else {
            return;
        };
        if r.finished && r.tasks == 0 && r.zombies.is_empty() {
            let (req, report) = (r.id, r.report_release);
            self.drop_request(rs);
            if report {
                debug!(request = %req, "request released");
                self.events.push_back(Event::RequestReleased(req));
            }
        }
    }
}
