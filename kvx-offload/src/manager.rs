//! The offload manager (scheduler side): what each tier holds, what may be loaded, what must be
//! stored, and what to evict. Pure bookkeeping: no I/O, no threads.
//!
//! Tiers: a host tier (kvx-owned host memory) and, optionally, a file tier. The file tier is
//! **written through**: a block stored into the host tier is also written to the file tier
//! (when new there), so host eviction never has to write anything and a stuck disk never
//! holds engine memory. Loads read the host tier, else the file tier; a block loaded from a
//! file is promoted into the host tier, which is how concurrent requests sharing a prefix read
//! it from disk only once.
//!
//! On a file tier shared with other nodes the manager may instead **write back**
//! ([`OffloadManager::set_write_back`]): a block enters the file tier when it leaves this node's
//! host tier (and only if the file tier lacks it), so the host tiers of the nodes and the shared
//! file tier hold different blocks and their capacities add up; another node sees a block once
//! its node's host tier let it go.

use std::time::SystemTime;

use kvx_core::BlockKey;
use rustc_hash::{FxHashMap, FxHashSet};

use crate::eviction::EvictionKind;
use crate::tier::{StorePlan, Tier, TierIndex};

/// Answer of [`OffloadManager::lookup`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The longest present prefix: the tier each of its blocks will be loaded from.
    Hit(Vec<Tier>),
    /// A block that would extend the prefix is being stored or promoted: ask again later.
    Retry,
}

impl Lookup {
    /// Number of leading blocks present (0 for `Retry`).
    pub fn blocks(&self) -> usize {
        match self {
            Lookup::Hit(t) => t.len(),
            Lookup::Retry => 0,
        }
    }
}

/// What a store must do in each tier.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StoreDecision {
    /// Keys to copy into the host tier.
    pub host: Vec<BlockKey>,
    /// Keys to write to the file tier: those of `host` new there and, when the host tier had no
    /// room for them, others copied into a staging buffer only for this write.
    pub file: Vec<BlockKey>,
    /// Keys new to every tier that no tier had room for (every block pinned by a load or being
    /// stored): stored nowhere.
    pub no_room: Vec<BlockKey>,
    /// Host-tier keys evicted to make room (drop their buffers).
    pub evicted_host: Vec<BlockKey>,
    /// File-tier keys evicted to make room (remove their files).
    pub evicted_file: Vec<BlockKey>,
}

/// Scheduler-side index of the tiers.
pub struct OffloadManager {
    host: TierIndex,
    file: Option<TierIndex>,
    /// File-tier keys being loaded (and promoted into the host tier), with a count.
    promoting: FxHashMap<BlockKey, u32>,
    /// Blocks leave the host tier into the file tier instead of being written through.
    write_back: bool,
}

/// Blocks to write from the host tier into the file tier as they leave it (write-back).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct WriteBack {
    /// Keys now being stored in the file tier, each with its last use in the host tier.
    pub keys: Vec<(BlockKey, SystemTime)>,
    /// File-tier keys evicted from the index to make room (forget them).
    pub evicted_file: Vec<BlockKey>,
}

impl OffloadManager {
    /// A manager with a host tier of `host_blocks` and an optional file tier of `file_blocks`.
    pub fn new(
        host_blocks: usize,
        file_blocks: Option<usize>,
        kind: EvictionKind,
    ) -> OffloadManager {
        OffloadManager {
            host: TierIndex::new(Tier::Host, host_blocks, kind),
            file: file_blocks.map(|n| TierIndex::new(Tier::File, n, kind)),
            promoting: FxHashMap::default(),
            write_back: false,
        }
    }

    /// Write blocks into the file tier when they leave the host tier, not when they are stored
    /// (see the module docs). Has no effect without a file tier.
    pub fn set_write_back(&mut self) {
        if self.file.is_some() {
            self.write_back = true;
            self.host.record_evictions();
        }
    }

    /// True when blocks are written back (see [`OffloadManager::set_write_back`]).
    pub fn writes_back(&self) -> bool {
        self.write_back
    }

    /// The host-tier blocks evicted since the last call that the file tier lacks: they are
    /// marked as being stored there (the caller writes them before the host tier drops their
    /// buffers). Empty unless writing back; a file tier that cannot make room takes none.
    pub fn take_write_back(&mut self) -> WriteBack {
        let evicted = self.host.take_evicted();
        let Some(f) = self.file.as_mut().filter(|_| !evicted.is_empty()) else {
            return WriteBack::default();
        };
        let candidates: Vec<BlockKey> = evicted
            .iter()
            .map(|e| e.0)
            .filter(|k| !f.is_stored(*k) && !f.is_storing(*k))
            .collect();
        let mut used: FxHashMap<BlockKey, SystemTime> = evicted.into_iter().collect();
        match f.prepare_store(&candidates) {
            Ok(plan) => WriteBack {
                keys: plan
                    .new
                    .into_iter()
                    .filter_map(|k| used.remove(&k).map(|t| (k, t)))
                    .collect(),
                evicted_file: plan.evicted,
            },
            Err(e) => {
                tracing::debug!(error = %e, "file tier full: evicted host blocks are dropped");
                WriteBack::default()
            }
        }
    }

    fn tier(&self, tier: Tier) -> Option<&TierIndex> {
        match tier {
            Tier::Host => Some(&self.host),
            Tier::File => self.file.as_ref(),
        }
    }

    /// True when `key` is fully stored in `tier`.
    pub fn is_stored(&self, tier: Tier, key: BlockKey) -> bool {
        self.tier(tier).is_some_and(|t| t.is_stored(key))
    }

    /// True when a store of `key` into `tier` is in flight.
    pub fn is_storing(&self, tier: Tier, key: BlockKey) -> bool {
        self.tier(tier).is_some_and(|t| t.is_storing(key))
    }

    /// Blocks `tier` holds or is storing (0 for an absent file tier).
    pub fn blocks(&self, tier: Tier) -> usize {
        self.tier(tier).map_or(0, |t| t.len())
    }

    /// Capacity of `tier` in blocks (`None` for an absent file tier).
    pub fn capacity(&self, tier: Tier) -> Option<usize> {
        self.tier(tier).map(|t| t.capacity())
    }

    /// Keys stored in `tier`.
    pub fn stored_keys(&self, tier: Tier) -> Vec<BlockKey> {
        self.tier(tier).map_or_else(Vec::new, |t| t.stored_keys())
    }

    /// Adopt blocks already in the file tier (from its startup scan).
    pub fn adopt_file_blocks(&mut self, keys: impl IntoIterator<Item = BlockKey>) -> usize {
        self.file.as_mut().map_or(0, |f| f.adopt(keys))
    }

    /// Record `key`, found in the file tier by a probe (another node stored it), as stored
    /// there, evicting this node's least recently used file-tier entries if needed (returned:
    /// forget them). `None` when there is no file tier or no room can be made.
    pub fn adopt_probed(&mut self, key: BlockKey) -> Option<Vec<BlockKey>> {
        let f = self.file.as_mut()?;
        if f.is_stored(key) {
            return Some(Vec::new());
        }
        let plan = f.prepare_store(&[key]).ok()?;
        f.complete_store(&[key], true);
        Some(plan.evicted)
    }

    /// Forget the file-tier blocks a complete listing of the tier, begun at `listed_at`, did not
    /// find (`present` is what it found) and that the index took before then; returns them.
    /// Blocks pinned by a load stay (the load reports them).
    pub fn forget_absent_file(
        &mut self,
        present: &rustc_hash::FxHashSet<BlockKey>,
        listed_at: std::time::Instant,
    ) -> Vec<BlockKey> {
        self.file
            .as_mut()
            .map_or_else(Vec::new, |f| f.forget_absent(present, listed_at))
    }

    /// Longest prefix of `keys` present in the tiers, or `Retry` when the next block is being
    /// stored or promoted.
    pub fn lookup(&self, keys: &[BlockKey]) -> Lookup {
        let mut tiers = Vec::new();
        for k in keys {
            if self.host.is_stored(*k) {
                tiers.push(Tier::Host);
            } else if self.promoting.contains_key(k) {
                return Lookup::Retry;
            } else if self.file.as_ref().is_some_and(|f| f.is_stored(*k)) {
                tiers.push(Tier::File);
            } else if self.host.is_storing(*k)
                || self.file.as_ref().is_some_and(|f| f.is_storing(*k))
            {
                return Lookup::Retry;
            } else {
                break;
            }
        }
        Lookup::Hit(tiers)
    }

    /// Pin `keys` (loaded from `tiers`, as `lookup` said) until `complete_load`. A block read
    /// from a file also reserves its place in the host tier (it is promoted there when the load
    /// succeeds); the returned flags say which blocks got a place, and the host keys evicted
    /// to make that room are returned too (drop their buffers).
    pub fn prepare_load(
        &mut self,
        keys: &[BlockKey],
        tiers: &[Tier],
    ) -> (Vec<bool>, Vec<BlockKey>) {
        // Pin every block of the load first, so that making room for the promotions below
        // can never evict a host block this same load is about to read.
        for (k, t) in keys.iter().zip(tiers) {
            match t {
                Tier::Host => self.host.pin(&[*k]),
                Tier::File => {
                    if let Some(f) = self.file.as_mut() {
                        f.pin(&[*k]);
                    }
                    *self.promoting.entry(*k).or_default() += 1;
                }
            }
        }
        let mut promote = Vec::with_capacity(keys.len());
        let mut evicted = Vec::new();
        for (k, t) in keys.iter().zip(tiers) {
            let reserved = *t == Tier::File
                && match self.host.prepare_store(&[*k]) {
                    Ok(plan) => {
                        evicted.extend(plan.evicted);
                        plan.new == [*k]
                    }
                    Err(_) => false,
                };
            promote.push(reserved);
        }
        (promote, evicted)
    }

    /// A load ended: unpin; blocks that failed verification leave the tier they were read
    /// from (returned: remove their files); reserved host places become stored for the blocks
    /// in `promoted` and are released for the others.
    pub fn complete_load(
        &mut self,
        keys: &[BlockKey],
        tiers: &[Tier],
        promote: &[bool],
        corrupt: &[BlockKey],
        promoted: &[BlockKey],
    ) -> Vec<BlockKey> {
        let mut removed = Vec::new();
        for ((k, t), p) in keys.iter().zip(tiers).zip(promote) {
            match t {
                Tier::Host => self.host.unpin(&[*k]),
                Tier::File => {
                    if let Some(f) = self.file.as_mut() {
                        f.unpin(&[*k]);
                        if corrupt.contains(k) && f.remove(*k) {
                            removed.push(*k);
                        }
                    }
                    if let Some(n) = self.promoting.get_mut(k) {
                        *n -= 1;
                        if *n == 0 {
                            self.promoting.remove(k);
                        }
                    }
                    if *p {
                        self.host.complete_store(&[*k], promoted.contains(k));
                    }
                }
            }
        }
        removed
    }

    /// Mark keys recently used in every tier that holds them.
    pub fn touch(&mut self, keys: &[BlockKey]) {
        self.host.touch(keys);
        if let Some(f) = self.file.as_mut() {
            f.touch(keys);
        }
    }

    /// Decide a store of `keys` new to the host tier: those the host tier has room for
    /// (evicting LRU/ARC victims), and the ones new to the file tier, written there whether or
    /// not the host tier took them (written through; writing back, only those it did not take).
    /// Each tier takes what fits; what fits in none is in [`StoreDecision::no_room`].
    pub fn prepare_store(&mut self, keys: &[BlockKey]) -> StoreDecision {
        let fresh = self.host.absent(keys);
        let StorePlan { new, evicted } = self.host.prepare_store_some(&fresh);
        let in_host: FxHashSet<BlockKey> = new.iter().copied().collect();
        let mut d = StoreDecision {
            host: new,
            evicted_host: evicted,
            ..Default::default()
        };
        let write_back = self.write_back;
        let Some(f) = self.file.as_mut() else {
            d.no_room = fresh.into_iter().filter(|k| !in_host.contains(k)).collect();
            return d;
        };
        let candidates: Vec<BlockKey> = fresh
            .iter()
            .copied()
            .filter(|k| !f.is_stored(*k) && !f.is_storing(*k))
            .filter(|k| !write_back || !in_host.contains(k))
            .collect();
        let plan = f.prepare_store_some(&candidates);
        d.file = plan.new;
        d.evicted_file = plan.evicted;
        d.no_room = fresh
            .into_iter()
            .filter(|k| !in_host.contains(k) && !f.is_stored(*k) && !f.is_storing(*k))
            .collect();
        d
    }

    /// A store into `tier` ended for `keys`.
    pub fn complete_store(&mut self, tier: Tier, keys: &[BlockKey], success: bool) {
        match tier {
            Tier::Host => self.host.complete_store(keys, success),
            Tier::File => {
                if let Some(f) = self.file.as_mut() {
                    f.complete_store(keys, success)
                }
            }
        }
    }

    /// Forget every block of every tier (a cache reset): none is offered again. Returns the
    /// host-tier and file-tier blocks to drop now; blocks a load still reads, or a store still
    /// writes, follow in [`OffloadManager::take_dropped`] once it ended.
    pub fn forget_all(&mut self) -> (Vec<BlockKey>, Vec<BlockKey>) {
        let host = self.host.forget_all();
        let file = self.file.as_mut().map_or_else(Vec::new, |f| f.forget_all());
        (host, file)
    }

    /// Blocks forgotten by [`OffloadManager::forget_all`] that left the index since the last
    /// call (host tier, file tier): drop them.
    pub fn take_dropped(&mut self) -> (Vec<BlockKey>, Vec<BlockKey>) {
        let host = self.host.take_dropped();
        let file = self
            .file
            .as_mut()
            .map_or_else(Vec::new, |f| f.take_dropped());
        (host, file)
    }

    /// Forget in-flight stores, pins and promotions (after a reset).
    pub fn reset_in_flight(&mut self) {
        self.host.reset_in_flight();
        if let Some(f) = self.file.as_mut() {
            f.reset_in_flight();
        }
        self.promoting.clear();
    }

    /// True when no load or store is in flight in the index.
    pub fn is_quiet(&self) -> bool {
        self.promoting.is_empty()
            && self.host.total_pins() == 0
            && self.host.storing() == 0
            && self
                .file
                .as_ref()
                .is_none_or(|f| f.total_pins() == 0 && f.storing() == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u128) -> BlockKey {
        BlockKey(i)
    }

    #[test]
    fn lookup_prefers_host_then_file_and_stops_at_a_gap() {
        let mut m = OffloadManager::new(4, Some(8), EvictionKind::Lru);
        let d = m.prepare_store(&[k(1), k(2)]);
        assert_eq!(d.file, vec![k(1), k(2)]);
        assert_eq!(m.lookup(&[k(1), k(2)]), Lookup::Retry, "stores in flight");
        m.complete_store(Tier::Host, &[k(1)], true);
        m.complete_store(Tier::File, &[k(1), k(2)], true);
        m.complete_store(Tier::Host, &[k(2)], false);
        assert_eq!(
            m.lookup(&[k(1), k(2), k(3)]),
            Lookup::Hit(vec![Tier::Host, Tier::File])
        );
    }

    #[test]
    fn promotion_in_flight_makes_others_wait_then_hit_host() {
        let mut m = OffloadManager::new(4, Some(8), EvictionKind::Lru);
        m.adopt_file_blocks([k(1), k(2)]);
        let Lookup::Hit(tiers) = m.lookup(&[k(1), k(2)]) else {
            panic!()
        };
        let (promote, evicted) = m.prepare_load(&[k(1), k(2)], &tiers);
        assert_eq!(promote, vec![true, true], "host places reserved");
        assert!(evicted.is_empty());
        assert_eq!(m.lookup(&[k(1)]), Lookup::Retry);
        m.complete_load(&[k(1), k(2)], &tiers, &promote, &[], &[k(1), k(2)]);
        assert_eq!(
            m.lookup(&[k(1), k(2)]),
            Lookup::Hit(vec![Tier::Host, Tier::Host])
        );
        assert!(m.is_quiet());
    }

    #[test]
    fn promotions_never_evict_host_blocks_of_the_same_load() {
        let mut m = OffloadManager::new(2, Some(8), EvictionKind::Lru);
        m.adopt_file_blocks([k(2)]);
        m.prepare_store(&[k(1), k(3)]);
        m.complete_store(Tier::Host, &[k(1), k(3)], true);
        let Lookup::Hit(tiers) = m.lookup(&[k(1), k(2), k(3)]) else {
            panic!()
        };
        assert_eq!(tiers, vec![Tier::Host, Tier::File, Tier::Host]);
        let (promote, evicted) = m.prepare_load(&[k(1), k(2), k(3)], &tiers);
        assert!(evicted.is_empty(), "evicted {evicted:?} of the load itself");
        assert_eq!(promote, vec![false, false, false], "no room: no promotion");
        assert!(m.is_stored(Tier::Host, k(1)) && m.is_stored(Tier::Host, k(3)));
    }

    #[test]
    fn write_back_moves_blocks_into_the_file_tier_as_they_leave_the_host_tier() {
        let mut m = OffloadManager::new(2, Some(8), EvictionKind::Lru);
        m.set_write_back();
        assert!(m.writes_back());
        m.adopt_file_blocks([k(9)]);
        let d = m.prepare_store(&[k(1), k(9)]);
        assert!(d.file.is_empty(), "nothing is written through");
        m.complete_store(Tier::Host, &[k(1), k(9)], true);
        assert!(!m.is_stored(Tier::File, k(1)) && !m.is_storing(Tier::File, k(1)));
        assert_eq!(
            m.take_write_back(),
            WriteBack::default(),
            "nothing left yet"
        );
        let t1 = SystemTime::now();
        m.touch(&[k(1)]);
        let d = m.prepare_store(&[k(3), k(4)]);
        assert_eq!(d.evicted_host.len(), 2);
        let wb = m.take_write_back();
        // k(9) is already in the file tier: only k(1) is written, with its last use.
        assert_eq!(wb.keys.len(), 1);
        assert_eq!(wb.keys[0].0, k(1));
        assert!(wb.keys[0].1 >= t1 && wb.keys[0].1 <= SystemTime::now());
        assert!(m.is_storing(Tier::File, k(1)));
        assert_eq!(m.lookup(&[k(1)]), Lookup::Retry, "being written back");
        m.complete_store(Tier::File, &[k(1)], true);
        assert_eq!(
            m.lookup(&[k(1), k(9)]),
            Lookup::Hit(vec![Tier::File, Tier::File])
        );
        // Without write-back the same eviction writes nothing.
        let mut plain = OffloadManager::new(2, Some(8), EvictionKind::Lru);
        plain.prepare_store(&[k(1), k(2)]);
        plain.complete_store(Tier::Host, &[k(1), k(2)], true);
        plain.prepare_store(&[k(3), k(4)]);
        assert_eq!(plain.take_write_back(), WriteBack::default());
    }

    #[test]
    fn blocks_the_host_tier_has_no_room_for_still_go_to_the_file_tier() {
        let mut m = OffloadManager::new(2, Some(8), EvictionKind::Lru);
        m.adopt_file_blocks([k(1), k(2)]);
        let tiers = vec![Tier::File, Tier::File];
        // A load pins its blocks and reserves both host places for their promotion.
        let (promote, _) = m.prepare_load(&[k(1), k(2)], &tiers);
        assert_eq!(promote, vec![true, true]);
        let d = m.prepare_store(&[k(3), k(4), k(5)]);
        assert!(d.host.is_empty(), "the host tier is all pinned: {d:?}");
        assert_eq!(
            d.file,
            vec![k(3), k(4), k(5)],
            "every new block is written to a file"
        );
        assert!(d.no_room.is_empty());
        m.complete_store(Tier::File, &d.file, true);
        m.complete_load(&[k(1), k(2)], &tiers, &promote, &[], &[k(1), k(2)]);
        assert_eq!(
            m.lookup(&[k(1), k(2), k(3), k(4), k(5)]).blocks(),
            5,
            "the file-only blocks are hits"
        );
    }

    #[test]
    fn each_tier_takes_what_fits_and_the_rest_is_no_room() {
        let mut m = OffloadManager::new(1, Some(2), EvictionKind::Lru);
        let d = m.prepare_store(&[k(1), k(2), k(3), k(4)]);
        assert_eq!(d.host, vec![k(1)], "the leading block that fits");
        assert_eq!(d.file, vec![k(1), k(2)], "written through, then file-only");
        assert_eq!(d.no_room, vec![k(3), k(4)]);
        assert!(m.is_storing(Tier::File, k(2)) && !m.is_storing(Tier::Host, k(2)));
        assert!(!m.is_storing(Tier::File, k(3)) && !m.is_storing(Tier::Host, k(3)));
        // Without a file tier the same store keeps what fits and counts the rest.
        let mut host_only = OffloadManager::new(1, None, EvictionKind::Lru);
        let d = host_only.prepare_store(&[k(1), k(2)]);
        assert_eq!(
            (d.host, d.file, d.no_room),
            (vec![k(1)], vec![], vec![k(2)])
        );
    }

    #[test]
    fn writing_back_a_block_the_host_tier_cannot_take_goes_straight_to_its_file() {
        let mut m = OffloadManager::new(1, Some(8), EvictionKind::Lru);
        m.set_write_back();
        let d = m.prepare_store(&[k(1), k(2)]);
        assert_eq!(d.host, vec![k(1)]);
        assert_eq!(
            d.file,
            vec![k(2)],
            "only the block the host tier did not take"
        );
    }

    #[test]
    fn corrupt_blocks_leave_the_index() {
        let mut m = OffloadManager::new(4, Some(8), EvictionKind::Lru);
        m.adopt_file_blocks([k(1), k(2)]);
        let tiers = vec![Tier::File, Tier::File];
        let (promote, _) = m.prepare_load(&[k(1), k(2)], &tiers);
        m.complete_load(&[k(1), k(2)], &tiers, &promote, &[k(2)], &[k(1)]);
        assert_eq!(m.lookup(&[k(1), k(2)]), Lookup::Hit(vec![Tier::Host]));
    }
}
