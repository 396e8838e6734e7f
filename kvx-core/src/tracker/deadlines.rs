//! Task deadlines in slots of one [`crate::TICK`] (1 ms) in an ordered map (a timer wheel
//! without wrap-around): expiring N tasks costs O(N) plus one map step per slot, whatever the
//! number of tasks in flight; finding the next deadline looks at the first slot only.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::ids::TaskId;

/// Deadlines of live tasks. Entries of tasks that ended are dropped lazily: when their slot
/// comes up, when stale entries dominate, or all at once when no task is live any more (so an
/// idle tracker holds no timer).
#[derive(Default, Debug)]
pub(crate) struct Deadlines {
    /// Slot 0 starts here: the `now` of the first push since the last clear (deadlines are
    /// never before the `now` they were submitted at).
    origin: Option<Instant>,
    slots: BTreeMap<u64, Vec<(Instant, TaskId)>>,
    len: usize,
    /// An emptied slot vector kept for the next new slot (no allocation per idle/busy cycle).
    spare: Vec<(Instant, TaskId)>,
}

impl Deadlines {
    /// The slot of `at`: ticks since the origin.
    fn slot(&self, at: Instant) -> u64 {
        self.origin.map_or(0, |o| {
            (at.saturating_duration_since(o).as_nanos() / crate::TICK.as_nanos()) as u64
        })
    }

    pub(crate) fn push(&mut self, now: Instant, at: Instant, task: TaskId) {
        self.origin.get_or_insert(now);
        let s = self.slot(at);
        let spare = &mut self.spare;
        self.slots
            .entry(s)
            .or_insert_with(|| std::mem::take(spare))
            .push((at, task));
        self.len += 1;
    }

    /// Earliest live entry, after dropping those for which `is_live` says the task ended.
    pub(crate) fn peek(
        &mut self,
        mut is_live: impl FnMut(TaskId, Instant) -> bool,
    ) -> Option<Instant> {
        while let Some(mut first) = self.slots.first_entry() {
            let v = first.get_mut();
            let before = v.len();
            v.retain(|(at, t)| is_live(*t, *at));
            self.len -= before - v.len();
            if let Some(min) = v.iter().map(|(at, _)| *at).min() {
                return Some(min);
            }
            first.remove();
        }
        None
    }

    /// Move every entry due at or before `now` into `out`.
    pub(crate) fn drain_due(&mut self, now: Instant, out: &mut Vec<(Instant, TaskId)>) {
        let now_slot = self.slot(now);
        while let Some(mut first) = self.slots.first_entry() {
            if *first.key() > now_slot {
                break;
            }
            if *first.key() < now_slot {
                let v = first.remove();
                self.len -= v.len();
                out.extend(v);
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
                first.remove();
            }
            break;
        }
    }

    /// Drop every entry whose task ended, if stale entries dominate.
    pub(crate) fn compact(
        &mut self,
        live: usize,
        mut is_live: impl FnMut(TaskId, Instant) -> bool,
    ) {
        if live == 0 {
            self.clear();
        } else if self.len > 2 * live + 1024 {
            for v in self.slots.values_mut() {
                v.retain(|(at, t)| is_live(*t, *at));
            }
            self.slots.retain(|_, v| !v.is_empty());
            self.len = self.slots.values().map(Vec::len).sum();
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn clear(&mut self) {
        if let Some((_, mut v)) = self.slots.pop_first() {
            v.clear();
            if v.capacity() > self.spare.capacity() {
                self.spare = v;
            }
        }
        self.slots.clear();
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
        d.push(t0, t0 + us(5_500), TaskId(3));
        d.push(t0, t0 + us(100), TaskId(1));
        d.push(t0, t0 + us(5_200), TaskId(2));
        d.push(t0, t0 + us(9_000), TaskId(4));
        assert_eq!(d.peek(|_, _| true), Some(t0 + us(100)));
        let mut out = Vec::new();
        d.drain_due(t0 + us(5_300), &mut out);
        let got: Vec<u64> = out.iter().map(|e| e.1.0).collect();
        assert_eq!(got, vec![1, 2], "5.5 ms is in the current slot but not due");
        assert_eq!(d.len(), 2);
        assert_eq!(
            d.peek(|t, _| t != TaskId(3)),
            Some(t0 + us(9_000)),
            "dead entry dropped"
        );
        assert_eq!(d.len(), 1);
        d.compact(0, |_, _| true);
        assert_eq!(d.len(), 0);
        assert_eq!(d.peek(|_, _| true), None);
    }
}
