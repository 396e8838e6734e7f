//! Block ordering: a task may touch its engine blocks only when it is first in line on all of
//! them (see `holders`); whatever is ahead of a task someone waits for is flushed rather than
//! left waiting for a step; fences hold once every holder registered before them is gone.

use super::holders::Holder;
use super::{Fence, Phase, Tracker};
use crate::ids::EngineBlockId;
use std::time::Instant;

impl Tracker {
    /// Stop deferring the task in `slot` and, if it is blocked, everything ahead of it.
    pub(super) fn flush_ahead(&mut self, slot: u32) {
        // Allocated only when a blocked task has others ahead of it.
        let (mut work, mut ahead) = (Vec::new(), Vec::new());
        let mut next = Some(slot);
        while let Some(t) = next.take().or_else(|| work.pop()) {
            let Some(e) = self.tasks.get_mut(t) else {
                continue;
            };
            e.deferred = false;
            match e.phase {
                Phase::Deferred => {
                    self.deferred.retain(|x| x.0 != t);
                    self.start_stage(t);
                }
                Phase::Blocked => {
                    ahead.clear();
                    self.holders
                        .ahead_of(&e.engine_blocks, Holder::Task(t), &mut ahead);
                    for h in &ahead {
                        if let Holder::Task(a) = h {
                            work.push(*a);
                        }
                    }
                }
                Phase::InFlight(_) | Phase::Finishing => {}
            }
        }
    }

    /// Start blocked tasks that are now first in line.
    #[inline]
    pub(super) fn recheck_blocked(&mut self) {
        if !self.blocked.is_empty() {
            self.recheck_blocked_now();
        }
    }

    /// The work of [`Tracker::recheck_blocked`] when some task is blocked.
    #[inline(never)]
    fn recheck_blocked_now(&mut self) {
        let mut list = std::mem::take(&mut self.blocked);
        let mut kept = 0;
        for i in 0..list.len() {
            let (slot, id) = list[i];
            let Some(t) = self.tasks.get_mut(slot).filter(|t| t.id == id) else {
                continue; // it ended
            };
            if !self.holders.is_first(&t.engine_blocks, Holder::Task(slot)) {
                list[kept] = (slot, id);
                kept += 1;
                continue;
            }
            if t.deferred {
                t.phase = Phase::Deferred;
                self.deferred.push((slot, id));
            } else {
                self.start_stage(slot);
            }
        }
        list.truncate(kept);
        list.append(&mut self.blocked);
        self.blocked = list;
    }

    /// A fence over `blocks`: holds once every op queued on them before now has ended. Queued
    /// stores on them are flushed. (The engine calls this before handing blocks to someone else.)
    pub fn fence_blocks(&mut self, blocks: &[EngineBlockId]) -> Fence {
        let mut blocks = blocks.to_vec();
        blocks.sort_unstable();
        blocks.dedup();
        let seq = self.holders.seq();
        let live: Vec<u32> = self
            .tasks
            .iter()
            .filter(|(_, t)| {
                t.engine_blocks
                    .iter()
                    .any(|b| blocks.binary_search(b).is_ok())
            })
            .map(|(slot, _)| slot)
            .collect();
        for slot in live {
            self.flush_ahead(slot);
        }
        Fence { blocks, seq }
    }

    /// True once the fence holds.
    pub fn fence_holds(&self, fence: &Fence) -> bool {
        self.holders.clear_up_to(&fence.blocks, fence.seq)
    }

    /// When the copies a fence waits for are due: the latest deadline of the tasks it waits
    /// for, a zombie op counting its task's (passed) deadline; `None` once the fence holds.
    /// A fence whose due time plus one tick has passed waits for a copy no deadline bounds
    /// any more (a stuck device).
    pub fn fence_due(&self, fence: &Fence) -> Option<Instant> {
        let mut holders = Vec::new();
        self.holders.up_to(&fence.blocks, fence.seq, &mut holders);
        holders
            .into_iter()
            .filter_map(|h| match h {
                Holder::Task(slot) => self.tasks.get(slot).map(|t| t.deadline),
                Holder::Op(slot) => self.ops.get(slot).map(|o| o.deadline),
            })
            .max()
    }
}
