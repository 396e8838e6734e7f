//! Task deadlines in a min-heap: expiring N tasks costs O(N log n), never a scan.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use crate::ids::TaskId;

/// Deadlines of live tasks. Entries of tasks that ended are dropped lazily: when they reach the
/// top, or all at once when no task is live any more (so an idle tracker holds no timer).
#[derive(Default, Debug)]
pub(crate) struct Deadlines {
    heap: BinaryHeap<Reverse<(Instant, TaskId)>>,
}

impl Deadlines {
    pub(crate) fn push(&mut self, at: Instant, task: TaskId) {
        self.heap.push(Reverse((at, task)));
    }

    /// Earliest entry, after dropping those for which `is_live` says the task ended.
    pub(crate) fn peek(
        &mut self,
        mut is_live: impl FnMut(TaskId, Instant) -> bool,
    ) -> Option<Instant> {
        while let Some(Reverse((at, t))) = self.heap.peek().copied() {
            if is_live(t, at) {
                return Some(at);
            }
            self.heap.pop();
        }
        None
    }

    /// Pop the next entry due at or before `now`.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(Instant, TaskId)> {
        match self.heap.peek() {
            Some(Reverse((at, _))) if *at <= now => self.heap.pop().map(|Reverse(e)| e),
            _ => None,
        }
    }

    /// Drop every entry whose task ended, if stale entries dominate.
    pub(crate) fn compact(
        &mut self,
        live: usize,
        mut is_live: impl FnMut(TaskId, Instant) -> bool,
    ) {
        if live == 0 {
            self.heap.clear();
        } else if self.heap.len() > 2 * live + 1024 {
            self.heap.retain(|Reverse((at, t))| is_live(*t, *at));
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }

    pub(crate) fn clear(&mut self) {
        self.heap.clear();
    }
}
