//! How the two halves reach a file tier without knowing its backend: the worker half removes
//! blocks ([`FileTierHook`]), the scheduler half asks a shared mount about blocks its index
//! lacks ([`FileTierProbe`]).

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use kvx_core::BlockKey;
use rustc_hash::FxHashSet;

/// Removes blocks from a file tier: evicted blocks, and blocks that failed verification.
pub trait FileTierHook: Send + Sync {
    /// Forget `key` and remove its file; must not block on the device.
    fn remove(&self, key: BlockKey);

    /// `key` left this node's index of the tier (an eviction). Default: [`FileTierHook::remove`];
    /// on a shared mount only forget it (the collector owns the mount's capacity).
    fn evict(&self, key: BlockKey) {
        self.remove(key);
    }
}

/// What a file tier says about a block the scheduler half's index lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileProbe {
    /// The block is there (another node stored it): it may be loaded.
    Present,
    /// It is not there, or the tier cannot tell in time: a miss.
    Absent,
    /// The answer is on its way: ask again later.
    Pending,
}

/// Every block a shared file tier held at one time: a complete walk of the mount (a collector
/// pass).
#[derive(Debug, Clone)]
pub struct FileListing {
    /// Number of the walk: a newer one has a larger number.
    pub pass: u64,
    /// When the walk began: an index entry taken before this and absent from `keys` is stale.
    pub started: Instant,
    /// The blocks the walk found (less those it is removing).
    pub keys: Arc<FxHashSet<BlockKey>>,
}

/// Asks a file tier shared with other nodes whether it holds a block; must answer at once (a
/// probe that takes time answers [`FileProbe::Pending`] and runs in the background).
pub trait FileTierProbe: Send + Sync {
    /// Whether `key` is in the tier.
    fn probe(&self, key: BlockKey) -> FileProbe;

    /// The newest complete listing of the tier, if something walks it (default: `None`).
    fn listing(&self) -> Option<FileListing> {
        None
    }

    /// `key`, just written into the tier, was last used at `at`: its recency on the tier
    /// (default: ignored). Must not block.
    fn last_used(&self, key: BlockKey, at: SystemTime) {
        let _ = (key, at);
    }
}

/// kvx-posix's handle unlinks through its I/O engine, so a stuck mount never blocks the caller.
#[cfg(feature = "file")]
impl FileTierHook for kvx_posix::PosixHandle {
    fn remove(&self, key: BlockKey) {
        kvx_posix::PosixHandle::remove(self, key);
    }

    fn evict(&self, key: BlockKey) {
        if self.is_shared() {
            self.forget(key);
        } else {
            kvx_posix::PosixHandle::remove(self, key);
        }
    }
}

/// kvx-posix probes on its engine's maintenance lane, with a deadline and a cache.
#[cfg(feature = "file")]
impl FileTierProbe for kvx_posix::PosixHandle {
    fn probe(&self, key: BlockKey) -> FileProbe {
        match kvx_posix::PosixHandle::probe(self, key) {
            kvx_posix::ProbeAnswer::Present => FileProbe::Present,
            kvx_posix::ProbeAnswer::Absent => FileProbe::Absent,
            kvx_posix::ProbeAnswer::Pending => FileProbe::Pending,
        }
    }

    fn listing(&self) -> Option<FileListing> {
        kvx_posix::PosixHandle::listing(self).map(|l| FileListing {
            pass: l.pass,
            started: l.started,
            keys: l.keys.clone(),
        })
    }

    fn last_used(&self, key: BlockKey, at: SystemTime) {
        kvx_posix::PosixHandle::set_last_use(self, key, at);
    }
}
