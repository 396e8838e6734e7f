//! The host tier's data: one shared pool buffer per stored block, keyed by content.

use std::sync::Arc;

use kvx_core::{BlockKey, PoolBuf};
use rustc_hash::{FxHashMap, FxHashSet};

/// The buffers of the blocks the host tier holds (the scheduler half keeps the index).
#[derive(Default)]
pub(crate) struct HostTier {
    data: FxHashMap<BlockKey, Arc<PoolBuf>>,
}

impl HostTier {
    /// The buffer of `key`, shared with an op that reads it.
    pub(crate) fn get(&self, key: &BlockKey) -> Option<Arc<PoolBuf>> {
        self.data.get(key).cloned()
    }

    /// `key` is stored (or promoted from a file) in `buf`.
    pub(crate) fn insert(&mut self, key: BlockKey, buf: Arc<PoolBuf>) {
        self.data.insert(key, buf);
    }

    /// Drop evicted blocks; their buffers go back to the pool once no op reads them.
    pub(crate) fn evict(&mut self, keys: &[BlockKey]) {
        for k in keys {
            self.data.remove(k);
        }
    }

    /// Keep only `keep` (after a reset, the blocks the scheduler's index still holds).
    pub(crate) fn retain(&mut self, keep: Vec<BlockKey>) {
        let keep: FxHashSet<BlockKey> = keep.into_iter().collect();
        self.data.retain(|k, _| keep.contains(k));
    }

    /// Blocks held.
    pub(crate) fn len(&self) -> usize {
        self.data.len()
    }

    /// Keys held.
    pub(crate) fn keys(&self) -> Vec<BlockKey> {
        self.data.keys().copied().collect()
    }
}
