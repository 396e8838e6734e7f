//! How the two sides reach a file tier without knowing its backend: the worker side removes
//! blocks ([`FileTierHook`]), the scheduler side asks a shared mount about blocks its index
//! lacks ([`FileTierProbe`]).

use std::sync::Arc;
use std::time::SystemTime;

use kvx_core::BlockKey;
use kvx_posix::{Listing, ProbeAnswer};

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

/// Asks a file tier shared with other nodes whether it holds a block; must answer at once (a
/// probe that takes time answers [`ProbeAnswer::Pending`] and runs in the background).
pub trait FileTierProbe: Send + Sync {
    /// Whether `key` is in the tier.
    fn probe(&self, key: BlockKey) -> ProbeAnswer;

    /// The newest complete listing of the tier, if something walks it (default: `None`).
    fn listing(&self) -> Option<Arc<Listing>> {
        None
    }

    /// `key`, just written into the tier, was last used at `at`: its recency on the tier
    /// (default: ignored). Must not block.
    fn last_used(&self, key: BlockKey, at: SystemTime) {
        let _ = (key, at);
    }
}

/// kvx-posix's handle unlinks through its I/O engine, so a stuck mount never blocks the caller.
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
impl FileTierProbe for kvx_posix::PosixHandle {
    fn probe(&self, key: BlockKey) -> ProbeAnswer {
        kvx_posix::PosixHandle::probe(self, key)
    }

    fn listing(&self) -> Option<Arc<Listing>> {
        kvx_posix::PosixHandle::listing(self)
    }

    fn last_used(&self, key: BlockKey, at: SystemTime) {
        kvx_posix::PosixHandle::set_last_use(self, key, at);
    }
}
