//! What the scheduler half does for a file tier shared with other nodes: lookups that probe
//! the mount past this node's index, forgetting blocks a listing of the mount shows gone, and
//! writing blocks back into the mount as they leave the host tier.

use std::time::SystemTime;

use kvx_core::BlockKey;
use rustc_hash::FxHashSet;
use tracing::debug;

use super::{MAX_PROBES_PER_LOOKUP, SchedulerSide};
use crate::manager::Lookup;
use crate::meta::{JobResult, WriteBackJob};
use crate::tier::Tier;
use kvx_posix::ProbeAnswer;

impl SchedulerSide {
    /// Write blocks into the file tier as they leave the host tier, not when they are stored
    /// (a file tier shared with other nodes: see [`crate::OffloadManager::set_write_back`]).
    /// A block written back gets its last use in this node's host tier as its recency on the
    /// mount.
    pub fn set_write_back(&mut self) {
        self.mgr.set_write_back();
    }

    /// Take the blocks that just left the host tier into this step's write-back.
    pub(super) fn queue_write_back(&mut self) {
        let wb = self.mgr.take_write_back();
        self.meta.evict_file.extend(wb.evicted_file);
        self.write_back_pending.extend(wb.keys);
    }

    /// Put the blocks that left the host tier since the last step into one write-back job.
    pub(super) fn start_write_back(&mut self) {
        if self.write_back_pending.is_empty() {
            return;
        }
        let job = self.job_id();
        let used = std::mem::take(&mut self.write_back_pending);
        let keys = used.iter().map(|(k, _)| *k).collect();
        self.meta.write_back.push(WriteBackJob { job, keys });
        self.write_backs.insert(job, used);
    }

    /// The lookup of `keys`, extended by probes of the shared file tier past the index's hits.
    pub(super) fn lookup_with_probes(&mut self, keys: &[BlockKey]) -> Lookup {
        let first = self.mgr.lookup(keys);
        let (Lookup::Hit(tiers), Some(probe)) = (&first, &self.probe) else {
            return first;
        };
        if tiers.len() >= keys.len() || self.mgr.capacity(Tier::File).is_none() {
            return first;
        }
        let probe = probe.clone();
        let hits = tiers.len();
        // Adopting evicts this node's least recently used file-tier entries: refresh the hits
        // first and adopt no more than the rest of the capacity, so the eviction never takes
        // a block of this same prefix.
        self.mgr.touch(&keys[..hits]);
        let room = self
            .mgr
            .capacity(Tier::File)
            .unwrap_or(0)
            .saturating_sub(hits)
            .min(MAX_PROBES_PER_LOOKUP);
        let mut pending = false;
        for k in keys[hits..].iter().take(room) {
            match probe.probe(*k) {
                ProbeAnswer::Absent => break,
                // Keep asking past a pending answer, so the probes of one prefix run together.
                ProbeAnswer::Pending => pending = true,
                ProbeAnswer::Present if pending => {}
                ProbeAnswer::Present => match self.mgr.adopt_probed(*k) {
                    Some(evicted) => self.meta.evict_file.extend(evicted),
                    None => break,
                },
            }
        }
        if pending {
            return Lookup::Retry;
        }
        self.mgr.lookup(keys)
    }

    /// Forget the file-tier blocks a new listing of the shared tier shows gone (another node
    /// removed them): a lookup must not claim them, and a node that computes one again must
    /// write it again.
    pub(super) fn forget_unlisted(&mut self) {
        let Some(listing) = self.probe.as_ref().and_then(|p| p.listing()) else {
            return;
        };
        if listing.pass <= self.listing_pass {
            return;
        }
        self.listing_pass = listing.pass;
        let gone = self.mgr.forget_absent_file(&listing.keys, listing.started);
        if !gone.is_empty() {
            debug!(
                blocks = gone.len(),
                "file-tier blocks gone from the shared mount"
            );
        }
        self.meta.evict_file.extend(gone);
    }

    /// A write-back ended: written blocks are in the file tier, with their last use here as
    /// their recency on the mount.
    pub(super) fn write_back_done(&mut self, r: &JobResult, used: &[(BlockKey, SystemTime)]) {
        let failed: Vec<BlockKey> = r.failed.iter().map(|f| f.0).collect();
        self.mgr.complete_store(Tier::File, &r.ok, true);
        self.mgr.complete_store(Tier::File, &failed, false);
        if let Some(p) = &self.probe {
            let ok: FxHashSet<BlockKey> = r.ok.iter().copied().collect();
            for (k, at) in used.iter().filter(|(k, _)| ok.contains(k)) {
                p.last_used(*k, *at);
            }
        }
    }
}
