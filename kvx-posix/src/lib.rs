//! kvx-posix: a file block store with strict deadlines, even on a stuck mount.
//!
//! One file per block under one or more roots (`root/ab/<32 hex>.kvb`, the root chosen by
//! key), a checksummed header padded to 4096 bytes, then the payload. Stores write a temporary
//! file and rename it into place only after every byte succeeded, so a crash, an error or a
//! timeout never leaves a visible torn block; loads verify the header and checksum and fail only
//! the block that does not match.
//!
//! Two I/O engines run the file operations: `uring` (io_uring, every op submitted with
//! `IOSQE_ASYNC` so no thread of the caller blocks on a frozen mount) and `psync` (a thread pool
//! whose stuck threads are written off and replaced). Buffers stay with the op until the kernel
//! gives them back, so a timed-out op's buffer is quarantined, never reused under the kernel.
//! A health breaker per root fails new ops at once while a root is known to hang.
//!
//! Removes (evictions, cleanups) run on a lane of their own: they have no deadline, are never
//! written off and never take a load's or a store's place. A block of another format version
//! is a miss, never deleted.
//!
//! Many engine nodes may share one root (NFS, Lustre, CephFS, or processes on one disk): with
//! [`SharedMount`] settings the index is a cache of the mount. A key it lacks is probed on the
//! mount ([`PosixHandle::probe`]: a header read on the maintenance lane, never waited for, with
//! a deadline and a bounded cache); a successful load sets the block file's mtime, the recency
//! signal of the [`Collector`] that any node may run to keep each root under a quota; temporary
//! names carry host and pid, and another node's stale ones are removed by age.
//!
//! The source is grouped by idea: `store/` (the backend: `setup`, `submit`, `completion`, the
//! handle and index), `io/` (the I/O engines `uring`, `psync` and `noop`, and
//! the syscalls they run), `job/` (one block's file operation as a machine of syscalls: load,
//! store, remove, header probe), `spare/` (spare files and recycling), `shared_mount/` (probe
//! cache, touch lane, the last listing), `collector` (a shared mount's quota, above the store),
//! `health` (the roots' breakers), `maintenance/` (the operator's `verify` and `gc`), and
//! `testing` (feature `faults`: the one test rig, with faults injected around the engine).
//!
//! [`PosixStore`] is a kvx [`Backend`](kvx_core::Backend); a file load is routed
//! `[posix, host]`: file → staging buffer → engine memory. Feature `bench` adds `bench`, the
//! closed-loop rig behind `kvx bench posix` and the criterion benchmarks.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvx_core::*;
//! use kvx_posix::{PosixConfig, PosixStore};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let store = PosixStore::open(PosixConfig::new(dir.path())).unwrap();
//! let files = store.handle();
//! let pool = BufferPool::new(2, 8192, DEFAULT_ALIGN).unwrap();
//!
//! let mut b = DriverBuilder::new(DriverConfig::default());
//! let posix = b.backend(Box::new(store));
//! let driver = b.spawn().unwrap();
//! let soon = || Instant::now() + Duration::from_secs(10);
//!
//! // Store one block (a staging buffer filled by the engine tier, here by hand).
//! let key = BlockKey::chain(None, b"tokens");
//! let mut buf = pool.take().unwrap();
//! buf.as_mut_slice().fill(7);
//! let t = driver.submit(TaskSpec {
//!     request: RequestId(1), dir: Direction::Store, route: vec![posix],
//!     blocks: vec![OpBlock { key, engine: None, buf: Buf::Owned(buf) }],
//!     deadline: soon(), deferred: false,
//! }).unwrap();
//! assert!(driver.wait_report(t, soon()).unwrap().is_ok());
//! assert_eq!(files.lookup(&[key, BlockKey(1)]), 1);
//!
//! // Load it back into another buffer, verified.
//! let t = driver.submit(TaskSpec {
//!     request: RequestId(1), dir: Direction::Load, route: vec![posix],
//!     blocks: vec![OpBlock { key, engine: None, buf: Buf::Owned(pool.take().unwrap()) }],
//!     deadline: soon(), deferred: false,
//! }).unwrap();
//! let report = driver.wait_report(t, soon()).unwrap();
//! assert!(report.is_ok());
//! assert_eq!(report.blocks[0].buf.as_ref().unwrap().as_slice(), &[7u8; 8192][..]);
//! ```
#![warn(missing_docs)]
// Jobs stay boxed everywhere: the kernel holds pointers into them, so they must never move.
#![allow(clippy::vec_box)]

#[cfg(feature = "bench")]
pub mod bench;
pub mod collector;
mod config;
mod error;
pub mod format;
mod health;
mod io;
mod job;
pub mod maintenance;
mod paths;
pub mod shard;
mod shared_mount;
mod spare;
mod store;
#[cfg(any(test, feature = "faults"))]
pub mod testing;
#[cfg(test)]
mod tests;

pub use collector::{CollectReport, Collector, CollectorConfig, Listing};
pub use config::{BadSetting, Capabilities, IoEngine, PosixConfig, SharedMount};
pub use error::PosixError;
pub use shard::Shard;
pub use shared_mount::probe_cache::ProbeAnswer;
pub use store::PosixStore;
pub use store::handle::{PosixHandle, PosixStats};
