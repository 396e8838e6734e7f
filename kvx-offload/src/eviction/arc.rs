//! Adaptive replacement cache order (Megiddo & Modha): T1 holds blocks seen once recently, T2
//! blocks seen at least twice; ghost lists B1/B2 remember recent victims and steer the target
//! size `p` of T1.

use hashlink::LinkedHashMap;
use kvx_core::BlockKey;

use super::EvictionOrder;

/// ARC order over a tier of `capacity` blocks.
pub(crate) struct ArcOrder {
    capacity: usize,
    p: usize,
    t1: LinkedHashMap<BlockKey, ()>,
    t2: LinkedHashMap<BlockKey, ()>,
    b1: LinkedHashMap<BlockKey, ()>,
    b2: LinkedHashMap<BlockKey, ()>,
}

impl ArcOrder {
    /// An empty order for a tier of `capacity` blocks.
    pub(crate) fn new(capacity: usize) -> ArcOrder {
        ArcOrder {
            capacity: capacity.max(1),
            p: 0,
            t1: LinkedHashMap::new(),
            t2: LinkedHashMap::new(),
            b1: LinkedHashMap::new(),
            b2: LinkedHashMap::new(),
        }
    }

    /// Target size of T1 (for tests and metrics).
    #[cfg(test)]
    pub(crate) fn target_recent(&self) -> usize {
        self.p
    }

    fn trim_ghosts(&mut self) {
        while self.b1.len() + self.b2.len() > self.capacity {
            if self.b1.len() >= self.b2.len() {
                self.b1.pop_front();
            } else {
                self.b2.pop_front();
            }
        }
    }
}

impl EvictionOrder for ArcOrder {
    fn insert(&mut self, key: BlockKey) {
        if self.t1.contains_key(&key) || self.t2.contains_key(&key) {
            self.touch(key);
        } else if self.b1.remove(&key).is_some() {
            // A recent victim came back: recency deserves more room.
            let delta = (self.b2.len() / self.b1.len().max(1)).max(1);
            self.p = (self.p + delta).min(self.capacity);
            self.t2.insert(key, ());
        } else if self.b2.remove(&key).is_some() {
            let delta = (self.b1.len() / self.b2.len().max(1)).max(1);
            self.p = self.p.saturating_sub(delta);
            self.t2.insert(key, ());
        } else {
            self.t1.insert(key, ());
        }
    }

    fn touch(&mut self, key: BlockKey) {
        if self.t1.remove(&key).is_some() {
            self.t2.insert(key, ());
        } else {
            self.t2.to_back(&key);
        }
    }

    fn remove(&mut self, key: BlockKey) {
        // Leaving the tier: remember it as a ghost of the list it was in.
        if self.t1.remove(&key).is_some() {
            self.b1.insert(key, ());
        } else if self.t2.remove(&key).is_some() {
            self.b2.insert(key, ());
        }
        self.trim_ghosts();
    }

    fn victims(&self, n: usize, eligible: &dyn Fn(BlockKey) -> bool) -> Vec<BlockKey> {
        // REPLACE: take from T1 while it is above its target, otherwise from T2; fall back to
        // the other list when the preferred one has no eligible block left.
        let t1_first = self.t1.len() > self.p || self.t2.is_empty();
        let (first, second) = if t1_first {
            (&self.t1, &self.t2)
        } else {
            (&self.t2, &self.t1)
        };
        first
            .keys()
            .chain(second.keys())
            .copied()
            .filter(|k| eligible(*k))
            .take(n)
            .collect()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.t1.len() + self.t2.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frequent_blocks_outlive_a_scan() {
        let mut o = ArcOrder::new(4);
        o.insert(BlockKey(1));
        o.insert(BlockKey(2));
        o.touch(BlockKey(1)); // 1 is frequent now
        for k in 10..13 {
            o.insert(BlockKey(k)); // a scan of one-time blocks
        }
        let v = o.victims(3, &|_| true);
        assert!(
            !v.contains(&BlockKey(1)),
            "the frequent block is not among {v:?}"
        );
        assert_eq!(v[0], BlockKey(2), "oldest one-time block first");
    }

    #[test]
    fn ghost_hit_grows_the_recent_target() {
        let mut o = ArcOrder::new(2);
        o.insert(BlockKey(1));
        o.remove(BlockKey(1));
        assert_eq!(o.target_recent(), 0);
        o.insert(BlockKey(1));
        assert_eq!(o.target_recent(), 1);
        assert_eq!(o.len(), 1);
    }

    #[test]
    fn ghosts_stay_bounded() {
        let mut o = ArcOrder::new(3);
        for k in 0..100 {
            o.insert(BlockKey(k));
            o.remove(BlockKey(k));
        }
        assert!(o.b1.len() + o.b2.len() <= 3);
        assert_eq!(o.len(), 0);
    }
}
