//! Least-recently-used order on an insertion-ordered hash map.

use hashlink::LinkedHashMap;
use kvx_core::BlockKey;

use super::EvictionOrder;

/// LRU: the front of the map is the least recently used block.
#[derive(Default)]
pub(crate) struct LruOrder {
    map: LinkedHashMap<BlockKey, ()>,
}

impl EvictionOrder for LruOrder {
    fn insert(&mut self, key: BlockKey) {
        self.map.replace(key, ());
    }

    fn touch(&mut self, key: BlockKey) {
        self.map.to_back(&key);
    }

    fn remove(&mut self, key: BlockKey) {
        self.map.remove(&key);
    }

    fn victims(&self, n: usize, eligible: &dyn Fn(BlockKey) -> bool) -> Vec<BlockKey> {
        self.map
            .keys()
            .copied()
            .filter(|k| eligible(*k))
            .take(n)
            .collect()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recent_goes_first_and_touch_refreshes() {
        let mut o = LruOrder::default();
        for i in 0..4 {
            o.insert(BlockKey(i));
        }
        o.touch(BlockKey(0));
        assert_eq!(o.victims(2, &|_| true), vec![BlockKey(1), BlockKey(2)]);
        assert_eq!(
            o.victims(2, &|k| k != BlockKey(1)),
            vec![BlockKey(2), BlockKey(3)]
        );
        o.remove(BlockKey(2));
        assert_eq!(o.len(), 3);
        assert_eq!(
            o.victims(9, &|_| true),
            vec![BlockKey(1), BlockKey(3), BlockKey(0)]
        );
    }
}
