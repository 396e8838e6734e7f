//! Task deadlines in slots of one [`crate::TICK`] (1 ms) in an ordered map (a timer wheel
//! without wrap-around): expiring N tasks costs O(N) plus one map step per slot, whatever the
//! number of tasks in flight; finding the next deadline looks at the first slot only.
//!
//! Deadlines mostly arrive in order (the same timeout after a later `now`), so the latest slot
//! is kept out of the map: most pushes land in it without a map step, and the map gains one
//! node per millisecond, not one per task. Emptied slot vectors are kept for new slots, so a
//! steady load allocates nothing here.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::ids::TaskId;

/// A deadline: when, whose, and the task's slot in the tracker.
pub(crate) type Entry = (Instant, TaskId, u32);

/// Emptied slot vectors kept for reuse, at most.
const SPARES: usize = 64;

/// One tick in nanoseconds.
const TICK_NS: u64 = crate::TICK.as_nanos() as u64;

/// Deadlines of live tasks. Entries of tasks that ended are dropped lazily: when their slot
/// comes up, when stale entries dominate, or all at once when no task is live any more (so an
/// idle tracker holds no timer).
#[derive(Default, Debug)]
pub(crate) struct Deadlines {
    /// Slot 0 starts here: the `now` of the first push (deadlines are never before the `now`
    /// they were submitted at; one that is lands in slot 0). Kept through `clear`.
    origin: Option<Instant>,
    /// The slot found last and the instants it covers, `[start, end)`: deadlines mostly come
    /// in runs within one tick, and this spares them the division.
    hot: Option<(Instant, Instant, u64)>,
    /// Every slot but the latest.
    slots: BTreeMap<u64, Vec<Entry>>,
    /// The latest slot: later than every slot in `slots`, and `None` only when `slots` is
    /// empty too (left in place, emptied, by `clear`).
    latest: Option<(u64, Vec<Entry>)>,
    len: usize,
    /// Emptied slot vectors, for new slots.
    spares: Vec<Vec<Entry>>,
}

impl Deadlines {
    /// The slot of `at`: ticks since the origin.
    #[inline]
    fn slot(&mut self, at: Instant) -> u64 {
        match self.hot {
            Some((start, end, s)) if start <= at && at < end => s,
            _ => self.slot_by_division(at),
        }
    }

    /// [`Deadlines::slot`] outside the hot slot; makes the slot of `at` the hot one.
    #[inline(never)]
    fn slot_by_division(&mut self, at: Instant) -> u64 {
        let Some(o) = self.origin else {
            return 0;
        };
        let ns = at.saturating_duration_since(o).as_nanos();
        let s = u64::try_from(ns).unwrap_or(u64::MAX) / TICK_NS;
        // Only a deadline at or after the origin is known to be in the slot's own tick.
        if at >= o {
            let start = s
                .checked_mul(TICK_NS)
                .and_then(|ns| o.checked_add(Duration::from_nanos(ns)));
            if let Some((start, end)) = start.and_then(|a| Some((a, a.checked_add(crate::TICK)?))) {
                self.hot = Some((start, end, s));
            }
        }
        s
    }

    #[inline]
    pub(crate) fn push(&mut self, now: Instant, e: Entry) {
        // The common case: into the latest slot, which is the hot one.
        if let (Some((start, end, s)), Some((latest, v))) = (self.hot, &mut self.latest) {
            if s == *latest && start <= e.0 && e.0 < end {
                v.push(e);
                self.len += 1;
                return;
            }
        }
        self.push_elsewhere(now, e);
    }

    /// [`Deadlines::push`] when the deadline is not in the latest slot, or that slot is not
    /// the hot one.
    #[inline(never)]
    fn push_elsewhere(&mut self, now: Instant, e: Entry) {
        self.origin.get_or_insert(now);
        let s = self.slot(e.0);
        self.len += 1;
        match &mut self.latest {
            Some((latest, v)) if *latest == s => v.push(e),
            Some((latest, _)) if *latest > s => {
                let spares = &mut self.spares;
                self.slots
                    .entry(s)
                    .or_insert_with(|| spares.pop().unwrap_or_default())
                    .push(e);
            }
            _ => {
                let mut v = self.spares.pop().unwrap_or_default();
                v.push(e);
                match self.latest.replace((s, v)) {
                    // Emptied by `clear`: nothing to keep but the vector.
                    Some((_, w)) if w.is_empty() => self.recycle(w),
                    Some((older, w)) => {
                        self.slots.insert(older, w);
                    }
                    None => {}
                }
            }
        }
    }

    /// Keep an emptied slot vector for a later slot.
    fn recycle(&mut self, mut v: Vec<Entry>) {
        if self.spares.len() < SPARES {
            v.clear();
            self.spares.push(v);
        }
    }

    /// The earliest slot and its entries.
    fn first_mut(&mut self) -> Option<(u64, &mut Vec<Entry>)> {
        match self.slots.first_entry() {
            Some(e) => Some((*e.key(), e.into_mut())),
            None => self.latest.as_mut().map(|(s, v)| (*s, v)),
        }
    }

    /// Remove the earliest slot (its entries are no longer counted) and keep its vector.
    fn drop_first(&mut self) {
        let v = match self.slots.pop_first() {
            Some((_, v)) => v,
            None => match self.latest.take() {
                Some((_, v)) => v,
                None => return,
            },
        };
        self.len -= v.len();
        self.recycle(v);
    }

    /// Earliest live entry, after dropping those for which `is_live` says the task ended.
    pub(crate) fn peek(&mut self, mut is_live: impl FnMut(&Entry) -> bool) -> Option<Instant> {
        loop {
            let (_, v) = self.first_mut()?;
            let before = v.len();
            v.retain(&mut is_live);
            let (removed, min) = (before - v.len(), v.iter().map(|e| e.0).min());
            self.len -= removed;
            if min.is_some() {
                return min;
            }
            self.drop_first();
        }
    }

    /// Move every entry due at or before `now` into `out`.
    pub(crate) fn drain_due(&mut self, now: Instant, out: &mut Vec<Entry>) {
        let now_slot = self.slot(now);
        while let Some((s, v)) = self.first_mut() {
            if s > now_slot {
                break;
            }
            if s < now_slot {
                let n = v.len();
                out.append(v);
                self.len -= n;
                self.drop_first();
                continue;
            }
            // The current millisecond: only what is really due, in push order (mostly the
            // deadline order already, which keeps the caller's sort cheap).
            let before = v.len();
            v.retain(|e| {
                let due = e.0 <= now;
                if due {
                    out.push(*e);
                }
                !due
            });
            let (removed, empty) = (before - v.len(), v.is_empty());
            self.len -= removed;
            if empty {
                self.drop_first();
            }
            break;
        }
    }

    /// Drop every entry whose task ended, if stale entries dominate.
    #[inline]
    pub(crate) fn compact(&mut self, live: usize, is_live: impl FnMut(&Entry) -> bool) {
        if live == 0 {
            self.clear();
        } else if self.len > 2 * live + 1024 {
            self.compact_now(is_live);
        }
    }

    /// The work of [`Deadlines::compact`] when stale entries dominate.
    #[inline(never)]
    fn compact_now(&mut self, mut is_live: impl FnMut(&Entry) -> bool) {
        for v in self.slots.values_mut() {
            v.retain(&mut is_live);
        }
        self.slots.retain(|_, v| !v.is_empty());
        if let Some((_, v)) = &mut self.latest {
            v.retain(&mut is_live);
        }
        self.len = self.slots.values().map(Vec::len).sum::<usize>()
            + self.latest.as_ref().map_or(0, |(_, v)| v.len());
        if self.latest.as_ref().is_some_and(|(_, v)| v.is_empty()) {
            let empty = std::mem::replace(&mut self.latest, self.slots.pop_last());
            if let Some((_, v)) = empty {
                self.recycle(v);
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Drop every entry (the origin stays). (Slot by slot: the map keeps its root node and the vectors are kept
    /// for reuse, so a tracker that keeps going from one task to none allocates nothing.)
    #[inline]
    pub(crate) fn clear(&mut self) {
        if !self.slots.is_empty() {
            while let Some((_, v)) = self.slots.pop_first() {
                self.recycle(v);
            }
        }
        // The latest slot stays, emptied: the next push most likely lands in it again.
        if let Some((_, v)) = &mut self.latest {
            v.clear();
        }
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drains_in_slot_order_and_only_what_is_due() {
        let t0 = Instant::now();
        let mut d = Deadlines::default();
        let us = Duration::from_micros;
        d.push(t0, (t0 + us(5_500), TaskId(3), 0));
        d.push(t0, (t0 + us(100), TaskId(1), 0));
        d.push(t0, (t0 + us(5_200), TaskId(2), 0));
        d.push(t0, (t0 + us(9_000), TaskId(4), 0));
        assert_eq!(d.peek(|_| true), Some(t0 + us(100)));
        let mut out = Vec::new();
        d.drain_due(t0 + us(5_300), &mut out);
        let got: Vec<u64> = out.iter().map(|e| e.1.0).collect();
        assert_eq!(got, vec![1, 2], "5.5 ms is in the current slot but not due");
        assert_eq!(d.len(), 2);
        assert_eq!(
            d.peek(|e| e.1 != TaskId(3)),
            Some(t0 + us(9_000)),
            "dead entry dropped"
        );
        assert_eq!(d.len(), 1);
        d.compact(0, |_| true);
        assert_eq!(d.len(), 0);
        assert_eq!(d.peek(|_| true), None);
        assert!(!d.spares.is_empty(), "emptied slot vectors are kept");
    }

    #[test]
    fn out_of_order_pushes_drain_in_order_through_the_latest_slot() {
        let t0 = Instant::now();
        let mut d = Deadlines::default();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        // In order, out of order, into the latest slot, then a new latest slot.
        for (i, at) in [3, 7, 5, 7, 1, 9, 5].into_iter().enumerate() {
            d.push(t0, (ms(at), TaskId(i as u64), 0));
        }
        assert_eq!(d.len(), 7);
        assert_eq!(d.peek(|_| true), Some(ms(1)));
        let mut out = Vec::new();
        d.drain_due(ms(7), &mut out);
        let mut got: Vec<u64> = out.iter().map(|e| e.1.0).collect();
        got.sort_unstable();
        assert_eq!(got, vec![0, 1, 2, 3, 4, 6], "everything up to 7 ms");
        assert_eq!(d.len(), 1);
        assert_eq!(d.peek(|_| true), Some(ms(9)));
        // Stale entries dominate: compaction drops them, the latest slot included.
        for i in 0..2000 {
            d.push(t0, (ms(20 + i % 3), TaskId(100 + i), 0));
        }
        d.compact(1, |e| e.1 == TaskId(5));
        assert_eq!(d.len(), 1);
        assert_eq!(d.peek(|_| true), Some(ms(9)));
        out.clear();
        d.drain_due(ms(100), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(d.len(), 0);
        assert_eq!(d.peek(|_| true), None);
    }
}
