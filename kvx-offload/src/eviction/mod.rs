//! Eviction orders: which stored, unpinned block goes first when a tier needs room.

mod arc;
mod lru;

use arc::ArcOrder;
use lru::LruOrder;

use kvx_core::BlockKey;
use serde::{Deserialize, Serialize};

/// Which eviction order a tier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionKind {
    /// Least recently used first.
    #[default]
    Lru,
    /// Adaptive replacement cache (recency and frequency, self-tuning).
    Arc,
}

/// An eviction order over the stored blocks of one tier.
pub(crate) trait EvictionOrder: Send {
    /// A block became stored.
    fn insert(&mut self, key: BlockKey);
    /// A block was used (looked up, loaded, stored again).
    fn touch(&mut self, key: BlockKey);
    /// A block left the tier (evicted or removed).
    fn remove(&mut self, key: BlockKey);
    /// Up to `n` victims, first to go first, among blocks for which `eligible` is true.
    /// Nothing changes until the caller removes them.
    fn victims(&self, n: usize, eligible: &dyn Fn(BlockKey) -> bool) -> Vec<BlockKey>;
    /// Blocks tracked.
    #[cfg(test)]
    fn len(&self) -> usize;
}

/// A boxed order of the given kind for a tier of `capacity` blocks.
pub(crate) fn new_order(kind: EvictionKind, capacity: usize) -> Box<dyn EvictionOrder> {
    match kind {
        EvictionKind::Lru => Box::new(LruOrder::default()),
        EvictionKind::Arc => Box::new(ArcOrder::new(capacity)),
    }
}
