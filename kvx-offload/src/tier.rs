//! The index of one tier: which blocks it holds, which are being stored, which are pinned by a
//! load, and the eviction order over the rest.

use std::time::{Instant, SystemTime};

use kvx_core::BlockKey;
use rustc_hash::{FxHashMap, FxHashSet};
use serde::{Deserialize, Serialize};

use crate::error::OffloadError;
use crate::eviction::{EvictionKind, EvictionOrder, new_order};

/// A tier below engine memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Tier {
    /// kvx-owned host memory.
    Host,
    /// Files (kvx-posix).
    File,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    stored: bool,
    /// Forgotten by [`TierIndex::forget_all`]: never offered again, gone once no load pins it
    /// and its store (if any) ended.
    doomed: bool,
    pins: u32,
    /// When the block became stored here (or when its store began, while `!stored`).
    since: Instant,
    /// When the block was last stored, loaded or looked up here, by the wall clock: what a
    /// write-back gives its file as modification time (read at the use, never converted from
    /// the monotonic clock later, which a wall-clock adjustment in between would shift).
    used: SystemTime,
}

impl Entry {
    fn storing() -> Entry {
        let now = Instant::now();
        Entry {
            stored: false,
            doomed: false,
            pins: 0,
            since: now,
            used: SystemTime::now(),
        }
    }
}

/// What `prepare_store` decided.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct StorePlan {
    /// Keys to store now (they were absent; now marked "being stored").
    pub(crate) new: Vec<BlockKey>,
    /// Keys evicted to make room (already gone from the index).
    pub(crate) evicted: Vec<BlockKey>,
}

/// Index of one tier.
pub(crate) struct TierIndex {
    tier: Tier,
    capacity: usize,
    entries: FxHashMap<BlockKey, Entry>,
    order: Box<dyn EvictionOrder>,
    /// With [`TierIndex::record_evictions`]: blocks evicted since the last
    /// [`TierIndex::take_evicted`], with their last use.
    evicted_log: Option<Vec<(BlockKey, SystemTime)>>,
    /// Doomed blocks whose data exists and that just left the index (their last pin ended, or
    /// their store completed): the tier must drop them ([`TierIndex::take_dropped`]).
    dropped: Vec<BlockKey>,
}

impl TierIndex {
    /// An empty tier of `capacity` blocks.
    pub(crate) fn new(tier: Tier, capacity: usize, kind: EvictionKind) -> TierIndex {
        TierIndex {
            tier,
            capacity,
            entries: FxHashMap::default(),
            order: new_order(kind, capacity),
            evicted_log: None,
            dropped: Vec::new(),
        }
    }

    /// Capacity in blocks.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks held or being stored.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when `key` is fully stored here (and not forgotten).
    pub(crate) fn is_stored(&self, key: BlockKey) -> bool {
        self.entries
            .get(&key)
            .is_some_and(|e| e.stored && !e.doomed)
    }

    /// True when a store of `key` into this tier is in flight (and not forgotten).
    pub(crate) fn is_storing(&self, key: BlockKey) -> bool {
        self.entries
            .get(&key)
            .is_some_and(|e| !e.stored && !e.doomed)
    }

    /// Total pins (0 when no load is in flight).
    pub(crate) fn total_pins(&self) -> u64 {
        self.entries.values().map(|e| e.pins as u64).sum()
    }

    /// Blocks being stored.
    pub(crate) fn storing(&self) -> usize {
        self.entries.values().filter(|e| !e.stored).count()
    }

    /// Mark absent keys as being stored, evicting unpinned stored blocks if needed. Atomic:
    /// if there is not enough room, nothing changes and an error says how much was missing.
    pub(crate) fn prepare_store(&mut self, keys: &[BlockKey]) -> Result<StorePlan, OffloadError> {
        let new = self.absent(keys);
        let need = (self.entries.len() + new.len()).saturating_sub(self.capacity);
        let evicted = self.victims(need, &new);
        if evicted.len() < need {
            return Err(OffloadError::NoRoom {
                tier: self.tier,
                needed: need,
                evictable: evicted.len(),
            });
        }
        Ok(self.admit(new, evicted))
    }

    /// Like [`TierIndex::prepare_store`], but when there is not room for every absent key, the
    /// leading ones that fit are marked (possibly none); the others stay absent.
    pub(crate) fn prepare_store_some(&mut self, keys: &[BlockKey]) -> StorePlan {
        let mut new = self.absent(keys);
        let free = self.capacity.saturating_sub(self.entries.len());
        let evicted = self.victims(new.len().saturating_sub(free), &new);
        new.truncate(free + evicted.len());
        self.admit(new, evicted)
    }

    /// The keys of `keys` absent from the index, each once, in order.
    pub(crate) fn absent(&self, keys: &[BlockKey]) -> Vec<BlockKey> {
        let mut seen = FxHashSet::default();
        keys.iter()
            .copied()
            .filter(|k| !self.entries.contains_key(k) && seen.insert(*k))
            .collect()
    }

    /// Up to `need` evictable blocks (stored, not forgotten, unpinned, not in `protected`).
    fn victims(&self, need: usize, protected: &[BlockKey]) -> Vec<BlockKey> {
        if need == 0 {
            return Vec::new();
        }
        let entries = &self.entries;
        let protected: FxHashSet<BlockKey> = protected.iter().copied().collect();
        self.order.victims(need, &|k| {
            !protected.contains(&k)
                && entries
                    .get(&k)
                    .is_some_and(|e| e.stored && !e.doomed && e.pins == 0)
        })
    }

    /// Evict `evicted` and mark `new` as being stored.
    fn admit(&mut self, new: Vec<BlockKey>, evicted: Vec<BlockKey>) -> StorePlan {
        for k in &evicted {
            if let (Some(e), Some(log)) = (self.entries.remove(k), self.evicted_log.as_mut()) {
                log.push((*k, e.used));
            }
            self.order.remove(*k);
        }
        for k in &new {
            self.entries.insert(*k, Entry::storing());
        }
        StorePlan { new, evicted }
    }

    /// A store of `keys` ended: they become visible on success, vanish on failure. Keys that
    /// are not being stored (e.g. after a reset) are ignored; a forgotten key's store leaves
    /// the index either way (and, if it succeeded, is to be dropped).
    pub(crate) fn complete_store(&mut self, keys: &[BlockKey], success: bool) {
        for k in keys {
            if let Some(e) = self.entries.get_mut(k)
                && !e.stored
            {
                if e.doomed {
                    self.entries.remove(k);
                    if success {
                        self.dropped.push(*k);
                    }
                } else if success {
                    e.stored = true;
                    e.since = Instant::now();
                    e.used = SystemTime::now();
                    self.order.insert(*k);
                } else {
                    // A block that never became visible: any pin on it came from a stale plan.
                    self.entries.remove(k);
                }
            }
        }
    }

    /// Pin stored keys against eviction (a load reads them).
    pub(crate) fn pin(&mut self, keys: &[BlockKey]) {
        for k in keys {
            if let Some(e) = self.entries.get_mut(k) {
                e.pins += 1;
                e.used = SystemTime::now();
                if !e.doomed {
                    self.order.touch(*k);
                }
            }
        }
    }

    /// Release pins taken by `pin`. A forgotten stored block whose last pin ends leaves the
    /// index (to be dropped).
    pub(crate) fn unpin(&mut self, keys: &[BlockKey]) {
        for k in keys {
            if let Some(e) = self.entries.get_mut(k) {
                e.pins = e.pins.saturating_sub(1);
                if e.doomed && e.stored && e.pins == 0 {
                    self.entries.remove(k);
                    self.dropped.push(*k);
                }
            }
        }
    }

    /// Forget every block (a cache reset): none is offered again. Stored blocks no load pins
    /// leave the index now and are returned (drop them); pinned ones leave when their last pin
    /// ends, and blocks being stored when their store ends ([`TierIndex::take_dropped`]).
    /// Until then they keep their room, and a new store of the same key is skipped.
    pub(crate) fn forget_all(&mut self) -> Vec<BlockKey> {
        let mut gone = std::mem::take(&mut self.dropped);
        for (k, e) in self.entries.iter_mut() {
            if e.stored && !e.doomed {
                self.order.remove(*k);
            }
            e.doomed = true;
        }
        self.entries.retain(|k, e| {
            let keep = !e.stored || e.pins > 0;
            if !keep {
                gone.push(*k);
            }
            keep
        });
        gone
    }

    /// Forgotten blocks that left the index since the last call (see
    /// [`TierIndex::forget_all`]): drop them.
    pub(crate) fn take_dropped(&mut self) -> Vec<BlockKey> {
        std::mem::take(&mut self.dropped)
    }

    /// Mark keys recently used.
    pub(crate) fn touch(&mut self, keys: &[BlockKey]) {
        let now = SystemTime::now();
        for k in keys {
            if let Some(e) = self.entries.get_mut(k)
                && e.stored
                && !e.doomed
            {
                e.used = now;
                self.order.touch(*k);
            }
        }
    }

    /// Keep a log of the blocks evicted to make room, for [`TierIndex::take_evicted`].
    pub(crate) fn record_evictions(&mut self) {
        self.evicted_log.get_or_insert_with(Vec::new);
    }

    /// Blocks evicted to make room since the last call, each with its last use (always empty
    /// without [`TierIndex::record_evictions`]).
    pub(crate) fn take_evicted(&mut self) -> Vec<(BlockKey, SystemTime)> {
        self.evicted_log
            .as_mut()
            .map_or_else(Vec::new, std::mem::take)
    }

    /// Drop a stored, unpinned `key` (e.g. it failed verification on load); true if removed.
    /// Blocks being stored or still pinned by another load stay.
    pub(crate) fn remove(&mut self, key: BlockKey) -> bool {
        match self.entries.get(&key) {
            Some(e) if e.stored && !e.doomed && e.pins == 0 => {
                self.entries.remove(&key);
                self.order.remove(key);
                true
            }
            _ => false,
        }
    }

    /// Insert already-stored keys (a startup scan of a file tier), up to capacity; returns how
    /// many were taken.
    pub(crate) fn adopt(&mut self, keys: impl IntoIterator<Item = BlockKey>) -> usize {
        let mut n = 0;
        for k in keys {
            if self.entries.len() >= self.capacity {
                break;
            }
            let entry = Entry {
                stored: true,
                ..Entry::storing()
            };
            if self.entries.insert(k, entry).is_none() {
                self.order.insert(k);
                n += 1;
            }
        }
        n
    }

    /// Drop the stored, unpinned blocks that became stored before `listed_at` and are not in
    /// `present` (a complete listing of the tier taken from then on): they are gone. Returns
    /// them. A block stored later, being stored, or pinned by a load stays.
    pub(crate) fn forget_absent(
        &mut self,
        present: &FxHashSet<BlockKey>,
        listed_at: Instant,
    ) -> Vec<BlockKey> {
        let gone: Vec<BlockKey> = self
            .entries
            .iter()
            .filter(|(k, e)| {
                e.stored && !e.doomed && e.pins == 0 && e.since < listed_at && !present.contains(*k)
            })
            .map(|(k, _)| *k)
            .collect();
        for k in &gone {
            self.entries.remove(k);
            self.order.remove(*k);
        }
        gone
    }

    /// Every stored key (not forgotten).
    pub(crate) fn stored_keys(&self) -> Vec<BlockKey> {
        self.entries
            .iter()
            .filter(|(_, e)| e.stored && !e.doomed)
            .map(|(k, _)| *k)
            .collect()
    }

    /// Forget in-flight stores and pins (after a reset); stored blocks stay, but forgotten
    /// ones leave (to be dropped).
    pub(crate) fn reset_in_flight(&mut self) {
        let dropped = &mut self.dropped;
        self.entries.retain(|k, e| {
            if e.stored && e.doomed {
                dropped.push(*k);
            }
            e.stored && !e.doomed
        });
        for e in self.entries.values_mut() {
            e.pins = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(r: std::ops::Range<u128>) -> Vec<BlockKey> {
        r.map(BlockKey).collect()
    }

    #[test]
    fn store_skips_present_and_evicts_lru() {
        let mut t = TierIndex::new(Tier::Host, 3, EvictionKind::Lru);
        let p = t.prepare_store(&keys(0..3)).unwrap();
        assert_eq!(p.new.len(), 3);
        assert!(t.is_storing(BlockKey(0)));
        t.complete_store(&keys(0..3), true);
        t.touch(&[BlockKey(0)]);
        let p = t.prepare_store(&keys(2..4)).unwrap();
        assert_eq!(p.new, vec![BlockKey(3)]);
        assert_eq!(p.evicted, vec![BlockKey(1)]);
        assert!(!t.is_stored(BlockKey(1)));
    }

    #[test]
    fn prepare_store_is_atomic_when_no_room() {
        let mut t = TierIndex::new(Tier::File, 2, EvictionKind::Lru);
        t.prepare_store(&keys(0..2)).unwrap();
        t.complete_store(&keys(0..2), true);
        t.pin(&[BlockKey(0)]);
        let err = t.prepare_store(&keys(5..7)).unwrap_err();
        assert!(matches!(
            err,
            OffloadError::NoRoom {
                needed: 2,
                evictable: 1,
                ..
            }
        ));
        assert!(
            t.is_stored(BlockKey(0)) && t.is_stored(BlockKey(1)),
            "nothing changed"
        );
        assert!(!t.is_storing(BlockKey(5)));
        t.unpin(&[BlockKey(0)]);
        assert_eq!(t.prepare_store(&keys(5..7)).unwrap().evicted.len(), 2);
    }

    #[test]
    fn only_old_unpinned_entries_missing_from_a_listing_are_forgotten() {
        let mut t = TierIndex::new(Tier::File, 8, EvictionKind::Lru);
        t.adopt(keys(0..3));
        t.pin(&[BlockKey(1)]);
        let listed_at = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        t.prepare_store(&keys(3..5)).unwrap();
        t.complete_store(&[BlockKey(3)], true); // stored after the walk began
        let present: FxHashSet<BlockKey> = [BlockKey(2)].into_iter().collect();
        let gone = t.forget_absent(&present, listed_at);
        assert_eq!(
            gone,
            vec![BlockKey(0)],
            "absent, unpinned and older than the walk"
        );
        assert!(!t.is_stored(BlockKey(0)));
        assert!(
            t.is_stored(BlockKey(1)),
            "pinned by a load: its load will tell"
        );
        assert!(t.is_stored(BlockKey(2)), "listed");
        assert!(t.is_stored(BlockKey(3)), "stored after the walk began");
        assert!(t.is_storing(BlockKey(4)), "being stored");
        // The eviction order forgot it too: the least recently used block left is the victim.
        let p = t.prepare_store(&keys(10..15)).unwrap();
        assert_eq!(p.evicted, vec![BlockKey(2)]);
    }

    #[test]
    fn evictions_are_logged_with_their_last_use() {
        let mut t = TierIndex::new(Tier::Host, 2, EvictionKind::Lru);
        t.prepare_store(&keys(0..2)).unwrap();
        t.complete_store(&keys(0..2), true);
        t.prepare_store(&keys(2..3)).unwrap();
        assert!(t.take_evicted().is_empty(), "not recorded unless asked");
        t.complete_store(&keys(2..3), true);
        t.record_evictions();
        let before = SystemTime::now();
        t.touch(&[BlockKey(1)]);
        let after = SystemTime::now();
        t.prepare_store(&keys(3..5)).unwrap();
        let log = t.take_evicted();
        let evicted: Vec<BlockKey> = log.iter().map(|e| e.0).collect();
        assert_eq!(evicted, vec![BlockKey(2), BlockKey(1)]);
        assert!(
            log[1].1 >= before && log[1].1 <= after,
            "key 1's last use is its touch"
        );
        assert!(log[0].1 <= before, "key 2 was last used when it was stored");
        assert!(t.take_evicted().is_empty(), "taken once");
    }

    #[test]
    fn keys_being_stored_are_not_evicted_and_failures_vanish() {
        let mut t = TierIndex::new(Tier::Host, 2, EvictionKind::Arc);
        t.prepare_store(&keys(0..2)).unwrap();
        assert!(
            t.prepare_store(&keys(2..3)).is_err(),
            "both are being stored"
        );
        t.complete_store(&[BlockKey(0)], false);
        assert_eq!(t.len(), 1);
        t.complete_store(&[BlockKey(1)], true);
        assert!(t.is_stored(BlockKey(1)));
        t.complete_store(&[BlockKey(1)], false);
        assert!(
            t.is_stored(BlockKey(1)),
            "a late failure does not undo a stored block"
        );
    }
}
