//! Task deadlines in slots of one [`crate::TICK`] (1 ms) in an ordered map (a timer wheel
//! without wrap-around): expiring N tasks costs O(N) plus one map step per slot, whatever the
//! number of tasks in flight; finding the next deadline looks at the first slot only. Emptied
//! slot vectors are kept for new slots, so a steady load allocates nothing here.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::ids::TaskId;

/// A deadline: when, whose, and the task's slot in the tracker.
pub(crate) type Entry = (Instant, TaskId, u32);

/// Emptied slot vectors kept for reuse, at most.
const SPARES: usize = 64;

/// Deadlines of live tasks. Entries of tasks that ended are dropped lazily: when their slot
/// comes up, when stale entries dominate, or all at once when no task is live any more (so an
/// idle tracker holds no timer).
#[derive(Default, Debug)]
pub(crate) struct Deadlines {
    /// Slot 0 starts here: the `now` of the first push since the last clear (deadlines are
    /// never before the `now` they were submitted at).
    origin: Option<Instant>,
    slots: BTreeMap<u64, Vec<Entry>>,
    len: usize,
    /// Emptied slot vectors, for new slots.
    spares: Vec<Vec<Entry>>,
}

impl Deadlines {
    /// The slot of `at`: ticks since the origin.
    fn slot(&self, at: Instant) -> u64 {
        self.origin.map_or(0, |o| {
            (at.saturating_duration_since(o).as_nanos() / crate::TICK.as_nanos()) as u64
        })
    }

    pub(crate) fn push(&mut self, now: Instant, e: Entry) {
        self.origin.get_or_insert(now);
        let s = self.slot(e.0);
        let spares = &mut self.spares;
        self.slots
            .entry(s)
            .or_insert_with(|| spares.pop().unwrap_or_default())
            .push(e);
        self.len += 1;
    }

    /// Keep an emptied slot vector for a later slot.
    fn recycle(&mut self, mut v: Vec<Entry>) {
        if self.spares.len() < SPARES {
            v.clear();
            self.spares.push(v);
        }
    }

    /// Earliest live entry, after dropping those for which `is_live` says the task ended.
    pub(crate) fn peek(&mut self, mut is_live: impl FnMut(&Entry) -> bool) -> Option<Instant> {
        while let Some(mut first) = self.slots.first_entry() {
            let v = first.get_mut();
            let before = v.len();
            v.retain(&mut is_live);
            self.len -= before - v.len();
            if let Some(min) = v.iter().map(|e| e.0).min() {
                return Some(min);
            }
            let v = first.remove();
            self.recycle(v);
        }
        None
    }

    /// Move every entry due at or before `now` into `out`.
    pub(crate) fn drain_due(&mut self, now: Instant, out: &mut Vec<Entry>) {
        let now_slot = self.slot(now);
        while let Some(mut first) = self.slots.first_entry() {
            if *first.key() > now_slot {
                break;
            }
            if *first.key() < now_slot {
                let mut v = first.remove();
                self.len -= v.len();
                out.append(&mut v);
                self.recycle(v);
                continue;
            }
            // The current millisecond: only what is really due.
            let v = first.get_mut();
            let before = v.len();
            let mut i = 0;
            while i < v.len() {
                if v[i].0 <= now {
                    out.push(v.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            self.len -= before - v.len();
            if v.is_empty() {
                let v = first.remove();
                self.recycle(v);
            }
            break;
        }
    }

    /// Drop every entry whose task ended, if stale entries dominate.
    pub(crate) fn compact(&mut self, live: usize, mut is_live: impl FnMut(&Entry) -> bool) {
        if live == 0 {
            self.clear();
        } else if self.len > 2 * live + 1024 {
            for v in self.slots.values_mut() {
                v.retain(&mut is_live);
            }
            self.slots.retain(|_, v| !v.is_empty());
            self.len = self.slots.values().map(Vec::len).sum();
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Drop every entry. (Slot by slot: the map keeps its root node and the vectors are kept
    /// for reuse, so a tracker that keeps going from one task to none allocates nothing.)
    pub(crate) fn clear(&mut self) {
        while let Some((_, v)) = self.slots.pop_first() {
            self.recycle(v);
        }
        self.len = 0;
        self.origin = None;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
}
