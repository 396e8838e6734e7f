//! Block ordering: a task may touch its engine blocks only when it is first in line on all of
//! them (see `holders`); whatever is ahead of a task someone waits for is flushed rather than
//! left waiting for a step; fences hold once every holder registered before them is gone.

use super::holders::Holder;
use super::{Fence, Phase, Tracker};
use crate::ids::{EngineBlockId, TaskId};

impl Tracker {
    /// Stop deferring `id` and, if it is blocked, everything ahead of it.
    pub(super) fn flush_ahead(&mut self, id: TaskId) {
        let mut work = vec![id];
        while let Some(t) = work.pop() {
            let Some(e) = self.tasks.get_mut(&t) else {
                continue;
            };
            e.deferred = false;
            match e.phase {
                Phase::Deferred => {
                    self.deferred.retain(|x| *x != t);
                    self.start_stage(t);
                }
                Phase::Blocked => {
                    let blocks = e.engine_blocks.clone();
                    for h in self.holders.ahead_of(&blocks, Holder::Task(t)) {
                        if let Holder::Task(a) = h {
                            work.push(a);
                        }
                    }
                }
                Phase::InFlight(_) | Phase::Finishing => {}
            }
        }
    }

    /// Start blocked tasks that are now first in line.
    pub(super) fn recheck_blocked(&mut self) {
        if self.blocked.is_empty() {
            return;
        }
        let blocked = std::mem::take(&mut self.blocked);
        for id in blocked {
            let Some(t) = self.tasks.get_mut(&id) else {
                continue;
            };
            if !self.holders.is_first(&t.engine_blocks, Holder::Task(id)) {
                self.blocked.push(id);
                continue;
            }
            if t.deferred {
                t.phase = Phase::Deferred;
                self.deferred.push(id);
            } else {
                self.start_stage(id);
            }
        }
    }

    /// A fence over `blocks`: holds once every op queued on them before now has ended. Queued
    /// stores on them are flushed. (The engine calls this before handing blocks to someone else.)
    pub fn fence_blocks(&mut self, blocks: &[EngineBlockId]) -> Fence {
        let mut blocks = blocks.to_vec();
        blocks.sort_unstable();
        blocks.dedup();
        let seq = self.holders.seq();
        let live: Vec<TaskId> = self
            .tasks
            .iter()
            .filter(|(_, t)| {
                t.engine_blocks
                    .iter()
                    .any(|b| blocks.binary_search(b).is_ok())
            })
            .map(|(id, _)| *id)
            .collect();
        for id in live {
            self.flush_ahead(id);
        }
        Fence { blocks, seq }
    }

    /// True once the fence holds.
    pub fn fence_holds(&self, fence: &Fence) -> bool {
        self.holders.clear_up_to(&fence.blocks, fence.seq)
    }
}
