//! [`PosixHandle`], the thread-safe side of a store (lookup, remove, health, counters), and
//! what it shares with the store.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kvx_core::{BlockKey, OpId};
use kvx_policy::BreakerState;

use crate::config::Capabilities;
use crate::health::Health;
use crate::io::{Engine, JobBoard};
use crate::job::{BlockJob, FileOp, JobParams};
use crate::paths::Layout;
use crate::shared_mount::probe_cache::{Begin, ProbeAnswer, ProbeTable};
use crate::shared_mount::touch::TouchLane;
use crate::store::index::Index;

/// Counters of a store (all since it opened).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[must_use = "counters read and dropped unread tell nothing"]
pub struct PosixStats {
    /// Block I/Os accepted by the engine and not yet returned.
    pub in_flight: usize,
    /// Of those, I/Os written off as stuck (cancelled or past their deadline).
    pub written_off: usize,
    /// Blocks loaded and verified.
    pub loaded: u64,
    /// Blocks stored and renamed into place.
    pub stored: u64,
    /// Blocks that failed verification.
    pub corrupt: u64,
    /// Blocks failed at once because their root's breaker was open.
    pub rejected: u64,
    /// Renames undone because they landed after the deadline or a cancel.
    pub undone: u64,
    /// Removed block files recycled as spare files instead of unlinked (see
    /// [`crate::PosixConfig::spare_block_bytes`]).
    pub recycled: u64,
    /// Removes (evictions, cleanups) queued or running; once zero, the store's next poll takes
    /// in every one that finished.
    pub maintenance: usize,
    /// Loads and stores queued for the engine, not yet started.
    pub queued: usize,
    /// Loads and stores the engine can run at once right now (psync: live worker threads;
    /// uring: queue-depth slots free of stuck ops).
    pub workers: usize,
    /// What `workers` is when nothing is stuck (the queue depth, times the rings for uring).
    pub target_workers: usize,
    /// Probes of the shared mount started (keys missing from the index).
    pub probes: u64,
    /// Probe answers and probes in flight remembered right now.
    pub probe_entries: usize,
    /// Touches (mtime updates after a load) dropped because the touch queue was full.
    pub touches_dropped: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) loaded: AtomicU64,
    pub(crate) stored: AtomicU64,
    pub(crate) corrupt: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) undone: AtomicU64,
    pub(crate) recycled: AtomicU64,
    pub(crate) probes: AtomicU64,
}

/// What a store shares with its handles: the index, the breakers, the I/O engine and the
/// lanes beside it.
pub(crate) struct StoreState {
    pub(crate) index: Index,
    pub(crate) health: Health,
    pub(crate) layout: Layout,
    pub(crate) io_engine: Box<dyn Engine>,
    /// Finished jobs, for the store's next poll.
    pub(crate) board: Arc<JobBoard>,
    pub(crate) caps: Capabilities,
    pub(crate) counters: Counters,
    /// Probe answers, on a shared mount.
    pub(crate) probes: Option<ProbeTable>,
    /// The touch lane, on a shared mount with `touch_on_load`.
    pub(crate) touch: Option<TouchLane>,
    /// Removes in flight per key, against the loads and stores of the same key.
    pub(crate) key_order: crate::store::key_order::KeyOrder,
    /// Spare files for stores (see `PosixConfig::spare_files`).
    pub(crate) spares: Option<crate::spare::Spares>,
    /// What the newest collector pass found on the mount.
    pub(crate) listing: std::sync::Mutex<Option<Arc<crate::shared_mount::listing::Listing>>>,
}

impl StoreState {
    /// A store's spare file it never opened goes back to the spares (else it would sit in the
    /// spare folder, nobody's, until the store is reopened).
    pub(crate) fn give_back_spare(&self, job: &mut BlockJob) {
        if let (Some(spares), Some(spare)) = (&self.spares, job.take_unused_spare()) {
            spares.give_back(job.core.root, spare);
        }
    }

    /// Forget `key` at once and unlink its file in the background, on the engine's
    /// maintenance lane (a cache entry: losing it only costs a reload), or recycle it as a
    /// spare file (see `crate::spare`); true if the index held it. Counted in
    /// [`StoreState::key_order`] first, so no load or store of `key` in flight puts it back
    /// in the index and no store of `key` starts until the remove is over.
    pub(crate) fn remove(&self, key: BlockKey) -> bool {
        self.key_order.remove_started(key);
        let had = self.index.remove(key);
        self.submit_remove(key, None);
        had
    }

    /// Remove `key`'s file in the background only if it is the one the write with `nonce`
    /// made (the undo of a store that must not stay visible); never recycled, never counted
    /// in [`StoreState::key_order`] (it never takes another write's file).
    /// (`nonce` is `None` only for a job that wrote nothing: then nothing is removed.)
    pub(crate) fn remove_own(&self, key: BlockKey, nonce: Option<u64>) {
        if nonce.is_some() {
            self.submit_remove(key, nonce);
        }
    }

    fn submit_remove(&self, key: BlockKey, nonce: Option<u64>) {
        let mut job = Box::new(BlockJob::new(
            OpId(0),
            0,
            FileOp::Remove,
            key,
            None,
            // A guarded remove moves the block aside under a temporary name first.
            self.layout.paths(key, nonce.is_some()),
            JobParams::remove(nonce),
        ));
        if nonce.is_none()
            && let Some((spare, len)) = self
                .spares
                .as_ref()
                .and_then(|s| s.recycle_name(job.core.root))
        {
            job.recycle_into(spare, len);
        }
        if let Err(mut r) = self.io_engine.submit(job) {
            tracing::error!(%key, reason = %r.reason, "posix: cannot remove a block");
            if let (Some(_), Some(s)) = (r.job.take_recycle(), &self.spares) {
                s.release(r.job.core.root);
            }
            if nonce.is_none() {
                self.key_order.remove_ended(key);
            }
        }
    }
}

/// The thread-safe side of a store: lookups, removal, health and counters. Cheap to clone.
#[derive(Clone)]
#[must_use = "a handle dropped at once does nothing"]
pub struct PosixHandle {
    pub(crate) state: Arc<StoreState>,
}

impl PosixHandle {
    /// How many of `keys`, from the first, the store holds.
    pub fn lookup(&self, keys: &[BlockKey]) -> usize {
        self.state.index.lookup(keys)
    }

    /// Whether the store holds `key`.
    pub fn contains(&self, key: BlockKey) -> bool {
        self.state.index.contains(key)
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.state.index.len()
    }

    /// True when no block is held.
    pub fn is_empty(&self) -> bool {
        self.state.index.is_empty()
    }

    /// Every key held.
    pub fn keys(&self) -> Vec<BlockKey> {
        self.state.index.keys()
    }

    /// Whether `key`'s block is there: the index, else (on a shared mount) a probe of the
    /// mount. Never blocks: a probe runs on the engine's maintenance lane and this answers
    /// [`ProbeAnswer::Pending`] while it is in flight; asked again, it answers what the probe
    /// found (cached for `probe_ttl`), or [`ProbeAnswer::Absent`] once `probe_deadline` passed
    /// without an answer (a failure of the root's breaker) or while the breaker is open.
    /// Without [`crate::SharedMount`] settings a key missing from the index is `Absent`.
    pub fn probe(&self, key: BlockKey) -> ProbeAnswer {
        if self.state.index.contains(key) {
            return ProbeAnswer::Present;
        }
        let Some(table) = &self.state.probes else {
            return ProbeAnswer::Absent;
        };
        let root = self.state.layout.root_of(key);
        match table.begin(key, root, Instant::now(), &self.state.health) {
            Begin::Answer(a) => a,
            Begin::Start => {
                let job = Box::new(BlockJob::new(
                    OpId(0),
                    0,
                    FileOp::Probe,
                    key,
                    None,
                    self.state.layout.paths(key, false),
                    JobParams::remove(None),
                ));
                match self.state.io_engine.submit(job) {
                    Ok(()) => {
                        self.state.counters.probes.fetch_add(1, Ordering::Relaxed);
                        ProbeAnswer::Pending
                    }
                    Err(r) => {
                        tracing::debug!(%key, reason = %r.reason, "posix: probe refused");
                        table.refused(key);
                        ProbeAnswer::Absent
                    }
                }
            }
        }
    }

    /// The probe deadline, on a shared mount.
    pub fn probe_deadline(&self) -> Option<std::time::Duration> {
        self.state.probes.as_ref().map(ProbeTable::deadline)
    }

    /// Forget `key` in this node's index without touching its file (on a shared mount the
    /// collector, not a node's eviction, decides what leaves the mount); true if it was held.
    pub fn forget(&self, key: BlockKey) -> bool {
        if let Some(t) = &self.state.probes {
            t.forget(key);
        }
        self.state.index.remove(key)
    }

    /// Set `key`'s block file's recency (its mtime, which collectors order blocks by) back to
    /// `at`, just after this node wrote it: a block written back from a node's host tier was
    /// last used there at `at`, not when its file was written. Skipped if the file's mtime is
    /// already later than this call (a node loaded it since: that use stands). Queued on the
    /// touch lane (a shared mount with `touch_on_load`; without it nothing happens); never
    /// blocks.
    pub fn set_last_use(&self, key: BlockKey, at: std::time::SystemTime) {
        if let Some(t) = &self.state.touch {
            let stamp = crate::shared_mount::touch::Stamp::Back {
                to: at,
                unless_after: std::time::SystemTime::now(),
            };
            t.touch(&self.state.layout.block_path(key), stamp);
        }
    }

    /// True when the roots are shared with other nodes ([`crate::SharedMount`] settings).
    pub fn is_shared(&self) -> bool {
        self.state.probes.is_some()
    }

    /// Forget `key` at once and unlink its file through the engine (never blocks); true if the
    /// store held it.
    pub fn remove(&self, key: BlockKey) -> bool {
        self.state.remove(key)
    }

    /// Where `key`'s block file lives.
    pub fn block_path(&self, key: BlockKey) -> std::path::PathBuf {
        self.state.layout.block_path(key)
    }

    /// What the store found out when it opened.
    pub fn capabilities(&self) -> &Capabilities {
        &self.state.caps
    }

    /// Spare files ready for stores, per root (see [`crate::PosixConfig::spare_files`]).
    pub fn spare_files_ready(&self) -> Vec<usize> {
        self.state.spares.as_ref().map_or_else(
            || vec![0; self.state.layout.roots().len()],
            crate::spare::Spares::ready,
        )
    }

    /// State of the breaker of root `root`.
    pub fn breaker_state(&self, root: usize) -> Option<BreakerState> {
        self.state.health.state(root)
    }

    /// The root that holds `key`.
    pub fn root_of(&self, key: BlockKey) -> usize {
        self.state.layout.root_of(key)
    }

    /// The engine's counters, for the crate's tests.
    #[cfg(test)]
    pub(crate) fn engine_snapshot(&self) -> crate::io::EngineSnapshot {
        self.state.io_engine.snapshot()
    }

    /// Counters.
    pub fn stats(&self) -> PosixStats {
        let c = &self.state.counters;
        let e = self.state.io_engine.snapshot();
        PosixStats {
            in_flight: e.in_flight,
            written_off: e.written_off,
            maintenance: e.maintenance,
            queued: e.queued,
            workers: e.workers,
            target_workers: e.target,
            loaded: c.loaded.load(Ordering::Relaxed),
            stored: c.stored.load(Ordering::Relaxed),
            corrupt: c.corrupt.load(Ordering::Relaxed),
            rejected: c.rejected.load(Ordering::Relaxed),
            undone: c.undone.load(Ordering::Relaxed),
            recycled: c.recycled.load(Ordering::Relaxed),
            probes: c.probes.load(Ordering::Relaxed),
            probe_entries: self.state.probes.as_ref().map_or(0, ProbeTable::len),
            touches_dropped: self.state.touch.as_ref().map_or(0, TouchLane::dropped),
        }
    }
}
