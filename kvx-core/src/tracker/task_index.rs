//! Task id → slot.
//!
//! Task ids come from a counter (the tracker's own, or the driver's), so the live ids are
//! mostly one recent run. That run sits in a window indexed by `id - base`: finding an id costs
//! no hashing, and the ids submitted lately are neighbours in memory, hot in cache, however
//! many tasks are in flight. An id away from the run (a late arrival, or a long-lived task the
//! window moved on from) goes to a hash map instead. The window holds at most about twice as
//! many places as live ids: when ended ids dominate, its oldest live ids move to the map.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use super::slab::NIL;
use crate::ids::TaskId;

/// Places the window may hold beyond twice its live ids.
const SLACK: usize = 64;
/// Live ids moved from the window to the map per call, at most (the rest on later calls).
const MOVES_PER_CALL: usize = 4;

/// Task id → slot; see the module comment.
#[derive(Debug, Default)]
pub(super) struct TaskIndex {
    /// The id of `window[0]`.
    base: u64,
    /// The slot of each id from `base` on (`NIL` where that id is not live).
    window: VecDeque<u32>,
    /// Live ids in the window.
    in_window: usize,
    /// Live ids not in the window. An id is in one place only; a `NIL` place in the window
    /// may have its id here.
    away: FxHashMap<TaskId, u32>,
}

impl TaskIndex {
    /// Where `id` sits in the window, if its range covers it.
    fn place(&self, id: TaskId) -> Option<usize> {
        let d = id.0.checked_sub(self.base)?;
        (d < self.window.len() as u64).then_some(d as usize)
    }

    /// The slot of live task `id`.
    pub(super) fn get(&self, id: TaskId) -> Option<u32> {
        match self.place(id).map(|i| self.window[i]) {
            Some(slot) if slot != NIL => Some(slot),
            _ if self.away.is_empty() => None,
            _ => self.away.get(&id).copied(),
        }
    }

    /// True when `id` is live.
    pub(super) fn contains(&self, id: TaskId) -> bool {
        self.get(id).is_some()
    }

    /// Record live task `id` in `slot` (`id` must not be live already).
    #[inline]
    pub(super) fn insert(&mut self, id: TaskId, slot: u32) {
        if self.window.is_empty() {
            self.base = id.0;
        }
        let end = self.base + self.window.len() as u64;
        if id.0 == end {
            // The common case: the next id.
            self.window.push_back(slot);
            self.in_window += 1;
        } else if let Some(i) = self.place(id) {
            self.window[i] = slot;
            self.in_window += 1;
        } else if id.0 >= end && id.0 - end <= (self.window.len() + SLACK) as u64 {
            // Ahead of the window by at most its length: grow it (places in between are free).
            let gap = (id.0 - end) as usize;
            self.window.extend(std::iter::repeat_n(NIL, gap));
            self.window.push_back(slot);
            self.in_window += 1;
        } else if id.0 >= end && self.in_window <= MOVES_PER_CALL {
            // Far ahead of a window with next to nothing live: start the window over there.
            let (base, away) = (self.base, &mut self.away);
            for (i, s) in self.window.drain(..).enumerate() {
                if s != NIL {
                    away.insert(TaskId(base + i as u64), s);
                }
            }
            self.base = id.0;
            self.window.push_back(slot);
            self.in_window = 1;
        } else {
            self.away.insert(id, slot);
        }
        self.tidy();
    }

    /// Forget `id`; returns its slot.
    #[inline]
    pub(super) fn remove(&mut self, id: TaskId) -> Option<u32> {
        if let Some(i) = self.place(id) {
            let slot = std::mem::replace(&mut self.window[i], NIL);
            if slot != NIL {
                self.in_window -= 1;
                if self.in_window == 0 {
                    // The common case: the only live id ended.
                    self.window.clear();
                } else {
                    self.tidy();
                }
                return Some(slot);
            }
        }
        self.away.remove(&id)
    }

    /// Drop free places at the front; move the oldest live ids away while free places
    /// dominate. (Free places at the back stay: the next ids land right after them.)
    #[inline]
    fn tidy(&mut self) {
        if self.window.front() != Some(&NIL) && self.window.len() <= 2 * self.in_window + SLACK {
            return;
        }
        self.tidy_now();
    }

    /// The work of [`TaskIndex::tidy`], when there is some.
    #[inline(never)]
    fn tidy_now(&mut self) {
        let mut moves = 0;
        loop {
            while self.window.front() == Some(&NIL) {
                self.window.pop_front();
                self.base += 1;
            }
            if self.window.len() <= 2 * self.in_window + SLACK || moves == MOVES_PER_CALL {
                break;
            }
            if let Some(slot) = self.window.pop_front() {
                self.away.insert(TaskId(self.base), slot);
                self.base += 1;
                self.in_window -= 1;
                moves += 1;
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.in_window + self.away.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_ids_stay_in_the_window() {
        let mut x = TaskIndex::default();
        for i in 0..1000u32 {
            x.insert(TaskId(500 + u64::from(i)), i);
        }
        assert_eq!((x.window.len(), x.away.len()), (1000, 0));
        assert_eq!(x.get(TaskId(742)), Some(242));
        assert_eq!(x.get(TaskId(499)), None);
        assert_eq!(x.get(TaskId(1500)), None);
        for i in 0..999u64 {
            assert_eq!(x.remove(TaskId(500 + i)), Some(i as u32));
        }
        assert_eq!(x.remove(TaskId(500)), None, "removed once");
        assert_eq!(
            (x.base, x.window.len()),
            (1499, 1),
            "ended ids dropped off the front"
        );
        assert_eq!(x.remove(TaskId(1499)), Some(999));
        assert_eq!((x.len(), x.window.len()), (0, 0));
    }

    #[test]
    fn bursts_behind_a_block_of_live_ids_stay_in_a_bounded_window() {
        let mut x = TaskIndex::default();
        for i in 0..100 {
            x.insert(TaskId(i), 0);
        }
        let mut next = 100;
        for _ in 0..200 {
            for k in 0..10 {
                x.insert(TaskId(next + k), 1);
                assert!(
                    x.place(TaskId(next + k)).is_some(),
                    "a new id is in the window"
                );
            }
            for k in 0..10 {
                assert_eq!(x.remove(TaskId(next + k)), Some(1));
            }
            next += 10;
            // At most twice the peak of live ids, plus slack, plus one burst.
            assert!(x.window.len() <= 2 * 110 + SLACK + 20, "{}", x.window.len());
        }
        assert!(x.window.len() <= 2 * x.in_window + SLACK);
        assert_eq!(x.len(), 100);
        assert_eq!(
            x.away.len(),
            100,
            "the old block moved out of the window's way"
        );
        assert_eq!(x.get(TaskId(42)), Some(0));
    }

    #[test]
    fn far_and_late_ids_go_to_the_map_and_the_window_stays_small() {
        let mut x = TaskIndex::default();
        x.insert(TaskId(1_000), 1);
        // A long-lived id at the front while 10 000 later ids come and go, 10 live at a time.
        for i in 1..10_000u64 {
            x.insert(TaskId(1_000 + i), 10);
            if i > 10 {
                assert_eq!(x.remove(TaskId(1_000 + i - 10)), Some(10));
            }
            assert!(x.window.len() <= 2 * x.in_window + SLACK + 1);
        }
        assert_eq!(x.in_window, 10, "the long-lived id moved to the map");
        assert_eq!(x.get(TaskId(1_000)), Some(1), "and is still found");
        x.insert(TaskId(7), 2); // late
        x.insert(TaskId(1_000_000), 3); // far ahead of a busy window
        assert_eq!(x.away.len(), 3);
        assert_eq!(x.get(TaskId(7)), Some(2));
        for i in 9_990..10_000u64 {
            assert_eq!(x.remove(TaskId(1_000 + i)), Some(10));
        }
        assert!(x.window.is_empty());
        // An id the window grew over while it sat in the map is still found there.
        for id in (998_000..1_001_000u64).filter(|id| *id != 1_000_000) {
            x.insert(TaskId(id), 20);
        }
        assert_eq!(x.place(TaskId(1_000_000)), Some(2000));
        assert_eq!(x.get(TaskId(1_000_000)), Some(3));
        assert_eq!(x.remove(TaskId(1_000_000)), Some(3));
        assert_eq!(x.get(TaskId(1_000_000)), None);
        assert_eq!(x.len(), 2 + 2999);
        // Far ahead of a window with next to nothing live: the window starts over there.
        for id in 998_000..1_001_000u64 {
            x.remove(TaskId(id));
        }
        x.insert(TaskId(5_000), 30);
        x.insert(TaskId(9_000_000), 31);
        assert_eq!((x.base, x.window.len()), (9_000_000, 1));
        assert_eq!(x.get(TaskId(5_000)), Some(30));
        assert_eq!(x.len(), 4);
    }
}
