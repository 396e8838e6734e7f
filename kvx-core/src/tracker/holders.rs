//! Who touches each engine block, in arrival order.
//!
//! Every task that names an engine block registers as a holder of it, and keeps that place until
//! it ends. When a task ends while its engine-memory op is still running, the op (a zombie)
//! takes the task's place until the backend returns it. A task may start only when it is first
//! in line on all its blocks: this is what makes block reuse and preemption fences safe.
//!
//! A line's first holder is kept inline: a block with one holder (the common case) costs no
//! allocation.

use std::collections::VecDeque;
use std::collections::hash_map::Entry;

use rustc_hash::FxHashMap;

use crate::ids::EngineBlockId;

/// A task, or a zombie op that outlived its task (by slot in the tracker's slabs; a holder
/// leaves every line before its slot is freed).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Holder {
    Task(u32),
    Op(u32),
}

/// The holders of one block: the first, then those queued behind it.
#[derive(Debug)]
struct Line {
    first: (u64, Holder),
    rest: VecDeque<(u64, Holder)>,
}

impl Line {
    fn iter(&self) -> impl Iterator<Item = &(u64, Holder)> {
        std::iter::once(&self.first).chain(self.rest.iter())
    }
}

#[derive(Default, Debug)]
pub(crate) struct Holders {
    lines: FxHashMap<EngineBlockId, Line>,
    seq: u64,
}

impl Holders {
    /// Queue `h` on `blocks`; true when it is first in line on all of them.
    #[inline]
    pub(crate) fn register(&mut self, blocks: &[EngineBlockId], h: Holder) -> bool {
        self.seq += 1;
        let seq = self.seq;
        let mut first = true;
        for b in blocks {
            match self.lines.entry(*b) {
                Entry::Occupied(mut line) => {
                    first = false;
                    line.get_mut().rest.push_back((seq, h));
                }
                Entry::Vacant(v) => {
                    v.insert(Line {
                        first: (seq, h),
                        rest: VecDeque::new(),
                    });
                }
            }
        }
        first
    }

    /// True when `h` is first in line on every one of `blocks`.
    pub(crate) fn is_first(&self, blocks: &[EngineBlockId], h: Holder) -> bool {
        blocks
            .iter()
            .all(|b| self.lines.get(b).is_none_or(|l| l.first.1 == h))
    }

    /// Add the holders ahead of `h` on `blocks` to `out` (each once).
    pub(crate) fn ahead_of(&self, blocks: &[EngineBlockId], h: Holder, out: &mut Vec<Holder>) {
        for b in blocks {
            if let Some(line) = self.lines.get(b) {
                for (_, x) in line.iter() {
                    if *x == h {
                        break;
                    }
                    if !out.contains(x) {
                        out.push(*x);
                    }
                }
            }
        }
    }

    /// Replace `old` by `new` in place (a task's zombie op inherits its place).
    pub(crate) fn replace(&mut self, blocks: &[EngineBlockId], old: Holder, new: Holder) {
        for b in blocks {
            if let Some(line) = self.lines.get_mut(b) {
                if line.first.1 == old {
                    line.first.1 = new;
                }
                for e in line.rest.iter_mut() {
                    if e.1 == old {
                        e.1 = new;
                    }
                }
            }
        }
    }

    /// Remove `h` from `blocks`.
    #[inline]
    pub(crate) fn remove(&mut self, blocks: &[EngineBlockId], h: Holder) {
        for b in blocks {
            let Entry::Occupied(mut entry) = self.lines.entry(*b) else {
                continue;
            };
            let line = entry.get_mut();
            if !line.rest.is_empty() {
                line.rest.retain(|(_, x)| *x != h);
            }
            if line.first.1 == h {
                match line.rest.pop_front() {
                    Some(next) => line.first = next,
                    None => {
                        entry.remove();
                    }
                }
            }
        }
    }

    /// Sequence number of the latest registration (fences remember it).
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// True when no holder registered at or before `seq` remains on `blocks`.
    pub(crate) fn clear_up_to(&self, blocks: &[EngineBlockId], seq: u64) -> bool {
        blocks
            .iter()
            .all(|b| self.lines.get(b).is_none_or(|l| l.first.0 > seq))
    }

    /// Add the holders registered at or before `seq` on `blocks` to `out` (each once).
    pub(crate) fn up_to(&self, blocks: &[EngineBlockId], seq: u64, out: &mut Vec<Holder>) {
        for b in blocks {
            if let Some(line) = self.lines.get(b) {
                for (at, x) in line.iter() {
                    if *at > seq {
                        break;
                    }
                    if !out.contains(x) {
                        out.push(*x);
                    }
                }
            }
        }
    }

    /// Every block with a holder (sorted).
    pub(crate) fn blocks(&self) -> Vec<EngineBlockId> {
        let mut v: Vec<EngineBlockId> = self.lines.keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.lines.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_keep_arrival_order_and_drop_when_empty() {
        let mut h = Holders::default();
        let (a, b) = (EngineBlockId(1), EngineBlockId(2));
        assert!(h.register(&[a, b], Holder::Task(0)));
        assert!(!h.register(&[b], Holder::Task(1)));
        assert!(!h.register(&[a, b], Holder::Task(2)));
        let fence = h.seq();
        assert!(h.is_first(&[b], Holder::Task(0)));
        assert!(!h.is_first(&[b], Holder::Task(1)));
        let mut ahead = Vec::new();
        h.ahead_of(&[a, b], Holder::Task(2), &mut ahead);
        assert_eq!(ahead, vec![Holder::Task(0), Holder::Task(1)]);
        h.replace(&[a, b], Holder::Task(0), Holder::Op(7));
        assert!(h.is_first(&[a, b], Holder::Op(7)));
        h.remove(&[a, b], Holder::Op(7));
        assert!(h.is_first(&[b], Holder::Task(1)));
        assert!(h.is_first(&[a], Holder::Task(2)));
        assert!(!h.clear_up_to(&[a], fence));
        let mut up_to = Vec::new();
        h.up_to(&[a, b], fence, &mut up_to);
        assert!(!up_to.is_empty() && up_to.len() <= 2, "{up_to:?}");
        h.remove(&[b], Holder::Task(1));
        h.remove(&[a, b], Holder::Task(2));
        assert!(h.clear_up_to(&[a, b], fence));
        assert!(h.is_empty());
        assert!(
            h.register(&[a], Holder::Task(3)),
            "first on an emptied line"
        );
        assert_eq!(h.len(), 1);
        assert_eq!(h.blocks(), vec![a]);
    }
}
