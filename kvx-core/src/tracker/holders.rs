//! Who touches each engine block, in arrival order.
//!
//! Every task that names an engine block registers as a holder of it, and keeps that place until
//! it ends. When a task ends while its engine-memory op is still running, the op (a zombie)
//! takes the task's place until the backend returns it. A task may start only when it is first
//! in line on all its blocks: this is what makes block reuse and preemption fences safe.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::ids::{EngineBlockId, OpId, TaskId};

/// A task, or a zombie op that outlived its task.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Holder {
    Task(TaskId),
    Op(OpId),
}

#[derive(Default, Debug)]
pub(crate) struct Holders {
    lines: FxHashMap<EngineBlockId, VecDeque<(u64, Holder)>>,
    seq: u64,
}

impl Holders {
    /// Queue `h` on `blocks`; true when it is first in line on all of them.
    pub(crate) fn register(&mut self, blocks: &[EngineBlockId], h: Holder) -> bool {
        self.seq += 1;
        let seq = self.seq;
        let mut first = true;
        for b in blocks {
            let line = self.lines.entry(*b).or_default();
            first &= line.is_empty();
            line.push_back((seq, h));
        }
        first
    }

    /// True when `h` is first in line on every one of `blocks`.
    pub(crate) fn is_first(&self, blocks: &[EngineBlockId], h: Holder) -> bool {
        blocks.iter().all(|b| {
            self.lines
                .get(b)
                .and_then(|l| l.front())
                .is_none_or(|(_, x)| *x == h)
        })
    }

    /// Holders ahead of `h` on `blocks`.
    pub(crate) fn ahead_of(&self, blocks: &[EngineBlockId], h: Holder) -> Vec<Holder> {
        let mut out = Vec::new();
        for b in blocks {
            if let Some(line) = self.lines.get(b) {
                for (_, x) in line {
                    if *x == h {
                        break;
                    }
                    if !out.contains(x) {
                        out.push(*x);
                    }
                }
            }
        }
        out
    }

    /// Replace `old` by `new` in place (a task's zombie op inherits its place).
    pub(crate) fn replace(&mut self, blocks: &[EngineBlockId], old: Holder, new: Holder) {
        for b in blocks {
            if let Some(line) = self.lines.get_mut(b) {
                for e in line.iter_mut() {
                    if e.1 == old {
                        e.1 = new;
                    }
                }
            }
        }
    }

    /// Remove `h` from `blocks`.
    pub(crate) fn remove(&mut self, blocks: &[EngineBlockId], h: Holder) {
        for b in blocks {
            if let Some(line) = self.lines.get_mut(b) {
                line.retain(|(_, x)| *x != h);
                if line.is_empty() {
                    self.lines.remove(b);
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
        blocks.iter().all(|b| {
            self.lines
                .get(b)
                .and_then(|l| l.front())
                .is_none_or(|(s, _)| *s > seq)
        })
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
