//! Per-key order of removes against the loads and stores of the same key, so that what the
//! index says is on disk is on disk.
//!
//! A remove ([`crate::PosixHandle::remove`], an eviction or a cleanup) forgets its key in the
//! index at once and runs in the background, on the engine's maintenance lane: behind other
//! removes, or stuck in a frozen mount, it may land long after it was asked for. Whatever of
//! the key's file it then finds it unlinks, or recycles into the spare folder (see
//! `crate::spare`). Unordered, a store of the same key that landed in the meantime lost its
//! file to the late remove while the index (and the caller, told "stored") kept it; and a load
//! or store that came back after the remove had run put the key back in the index over a file
//! already gone. Loads of such keys then failed `NotFound` after a stall and thaw.
//!
//! So the store counts, per key, the unguarded removes in flight (from the submit of the
//! remove to its return through the store's poll, or to the engine's refusal) and the removes
//! started while a load or store of the key is in flight:
//!
//! - A store of a key with a remove in flight fails at once with
//!   [`kvx_core::BlockError::Unavailable`] ("a remove of this block is still in flight"): the
//!   caller is told the block is not stored, and retries once the remove is over. (Holding the
//!   store until the remove returns would keep a stuck mount's remove in the store's path, and
//!   the remove has no deadline.)
//! - A load or store that started before a remove of its key, and comes back after it, never
//!   puts the key in the index: a store is failed the same way and its own file (the one with
//!   its write nonce) removed by a guarded remove; a load keeps its verified bytes.
//! - A key goes into the index only under this table's lock, after that check, and a remove
//!   counts itself here before it forgets the key in the index: a remove that starts while a
//!   job's completion is being folded in either sees the key indexed (and forgets it) or makes
//!   the job see the remove.
//!
//! Guarded removes (the undo of a late rename, or of a store a remove overtook) are not
//! counted: they delete only the file their own write made, and put any other back (see
//! `crate::job::remove`), so they never take a newer store's file.

use std::sync::Mutex;

use kvx_core::BlockKey;
use kvx_core::sync::lock;
use rustc_hash::FxHashMap;

use crate::store::index::Index;

#[derive(Debug, Default)]
struct Flight {
    /// Unguarded removes in flight.
    removing: u32,
    /// Removes started while this entry lived (wrapping): a job compares it with what it saw.
    removals: u32,
    /// Loads and stores in flight.
    jobs: u32,
}

/// What a load or store job saw of its key's removes when it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket(u32);

/// The per-key table (see the module docs); an entry lives while something of its key is in
/// flight.
#[derive(Debug, Default)]
pub(crate) struct KeyOrder {
    keys: Mutex<FxHashMap<BlockKey, Flight>>,
}

impl KeyOrder {
    /// An unguarded remove of `key` is about to be handed to the engine.
    pub(crate) fn remove_started(&self, key: BlockKey) {
        let mut keys = lock(&self.keys);
        let f = keys.entry(key).or_default();
        f.removing += 1;
        f.removals = f.removals.wrapping_add(1);
    }

    /// An unguarded remove of `key` came back (or the engine refused it).
    pub(crate) fn remove_ended(&self, key: BlockKey) {
        let mut keys = lock(&self.keys);
        if let Some(f) = keys.get_mut(&key) {
            f.removing = f.removing.saturating_sub(1);
            if f.removing == 0 && f.jobs == 0 {
                keys.remove(&key);
            }
        }
    }

    /// A load of `key` is about to be handed to the engine.
    pub(crate) fn load_started(&self, key: BlockKey) -> Ticket {
        let mut keys = lock(&self.keys);
        let f = keys.entry(key).or_default();
        f.jobs += 1;
        Ticket(f.removals)
    }

    /// A store of `key` is about to be handed to the engine; `None` (nothing counted) while a
    /// remove of `key` is in flight.
    pub(crate) fn store_started(&self, key: BlockKey) -> Option<Ticket> {
        let mut keys = lock(&self.keys);
        let f = keys.entry(key).or_default();
        if f.removing > 0 {
            return None;
        }
        f.jobs += 1;
        Some(Ticket(f.removals))
    }

    /// The load or store of `key` that started with `ticket` came back (or never ran). With
    /// `index` (it succeeded), `key` goes into the index, unless a remove of `key` started
    /// since the job did: then nothing is recorded and this answers true (the file the job
    /// read or wrote may be gone).
    pub(crate) fn job_ended(&self, key: BlockKey, ticket: Ticket, index: Option<&Index>) -> bool {
        let mut keys = lock(&self.keys);
        let Some(f) = keys.get_mut(&key) else {
            // Unreachable by construction (the job's entry lives until it ends); indexing the
            // key could claim a file a remove took, so leave it out.
            return true;
        };
        let overtaken = f.removals != ticket.0;
        if !overtaken && let Some(index) = index {
            index.insert(key);
        }
        f.jobs = f.jobs.saturating_sub(1);
        if f.removing == 0 && f.jobs == 0 {
            keys.remove(&key);
        }
        overtaken
    }

    /// Keys with something in flight (for tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        lock(&self.keys).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::key;

    #[test]
    fn a_store_waits_out_a_remove_and_a_remove_overtakes_a_job() {
        let (order, index) = (KeyOrder::default(), Index::default());
        let k = key(1);
        order.remove_started(k);
        assert_eq!(order.store_started(k), None, "a remove is in flight");
        let load = order.load_started(k);
        order.remove_ended(k);
        assert!(
            !order.job_ended(k, load, Some(&index)),
            "the load started after the remove"
        );
        assert!(index.contains(k));
        let store = order.store_started(k).expect("no remove in flight");
        order.remove_started(k);
        order.remove_ended(k);
        index.remove(k);
        assert!(order.job_ended(k, store, Some(&index)), "overtaken");
        assert!(!index.contains(k), "an overtaken store is not indexed");
        assert_eq!(order.len(), 0, "nothing in flight, nothing kept");
    }
}
