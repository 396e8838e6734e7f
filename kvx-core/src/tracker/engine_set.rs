//! The engine blocks of a task or op: sorted, without duplicates, and kept inline up to
//! [`INLINE`] blocks, so the common short task costs no allocation for them.

use std::ops::Deref;

use crate::ids::EngineBlockId;
use crate::op::OpBlock;

/// Blocks kept without an allocation.
pub(super) const INLINE: usize = 6;

/// A sorted set of engine blocks; see the module comment.
#[derive(Debug, Clone)]
pub(super) enum EngineSet {
    Inline {
        len: u8,
        ids: [EngineBlockId; INLINE],
    },
    Heap(Vec<EngineBlockId>),
}

impl Default for EngineSet {
    fn default() -> Self {
        EngineSet::Inline {
            len: 0,
            ids: [EngineBlockId(0); INLINE],
        }
    }
}

impl EngineSet {
    /// The engine blocks that `blocks` name.
    #[inline]
    pub(super) fn of(blocks: &[OpBlock]) -> EngineSet {
        let mut ids = [EngineBlockId(0); INLINE];
        if let [b] = blocks {
            // The common one-block task.
            ids[0] = b.engine.unwrap_or(EngineBlockId(0));
            return EngineSet::Inline {
                len: u8::from(b.engine.is_some()),
                ids,
            };
        }
        let mut len = 0;
        for e in blocks.iter().filter_map(|b| b.engine) {
            let Err(at) = ids[..len].binary_search(&e) else {
                continue;
            };
            if len == INLINE {
                let mut v: Vec<EngineBlockId> = blocks.iter().filter_map(|b| b.engine).collect();
                v.sort_unstable();
                v.dedup();
                return EngineSet::Heap(v);
            }
            ids.copy_within(at..len, at + 1);
            ids[at] = e;
            len += 1;
        }
        EngineSet::Inline {
            len: len as u8,
            ids,
        }
    }
}

impl Deref for EngineSet {
    type Target = [EngineBlockId];

    fn deref(&self) -> &[EngineBlockId] {
        match self {
            EngineSet::Inline { len, ids } => &ids[..*len as usize],
            EngineSet::Heap(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::{Buf, BufferPool};
    use crate::ids::BlockKey;

    fn blocks(pool: &BufferPool, engines: &[Option<u32>]) -> Vec<OpBlock> {
        engines
            .iter()
            .map(|e| OpBlock {
                key: BlockKey(1),
                engine: e.map(EngineBlockId),
                buf: Buf::Owned(pool.take().unwrap()),
            })
            .collect()
    }

    fn ids(s: &EngineSet) -> Vec<u32> {
        s.iter().map(|b| b.0).collect()
    }

    #[test]
    fn sorted_deduplicated_inline_then_on_the_heap() {
        let pool = BufferPool::new(16, 8, 8).unwrap();
        let s = EngineSet::of(&blocks(&pool, &[Some(9), None, Some(2), Some(9), Some(5)]));
        assert!(matches!(s, EngineSet::Inline { .. }));
        assert_eq!(ids(&s), vec![2, 5, 9]);
        assert!(EngineSet::of(&blocks(&pool, &[None, None])).is_empty());
        let many: Vec<Option<u32>> = (0..=INLINE as u32).rev().map(Some).collect();
        let s = EngineSet::of(&blocks(&pool, &many));
        assert!(matches!(s, EngineSet::Heap(_)));
        assert_eq!(ids(&s), (0..=INLINE as u32).collect::<Vec<_>>());
        let dup: Vec<Option<u32>> = (0..2 * INLINE as u32).map(|i| Some(i % 3)).collect();
        let s = EngineSet::of(&blocks(&pool, &dup));
        assert!(
            matches!(s, EngineSet::Inline { .. }),
            "duplicates take no room"
        );
        assert_eq!(ids(&s), vec![0, 1, 2]);
    }
}
