//! How the worker half removes blocks from a file tier.

use kvx_core::BlockKey;

/// Removes blocks from a file tier: evicted blocks, and blocks that failed verification.
pub trait FileTierHook: Send + Sync {
    /// Forget `key` and remove its file; must not block on the device.
    fn remove(&self, key: BlockKey);
}

/// kvx-posix's handle unlinks through its I/O engine, so a stuck mount never blocks the caller.
#[cfg(feature = "file")]
impl FileTierHook for kvx_posix::PosixHandle {
    fn remove(&self, key: BlockKey) {
        kvx_posix::PosixHandle::remove(self, key);
    }
}
