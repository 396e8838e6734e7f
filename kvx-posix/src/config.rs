//! Settings of a [`crate::PosixStore`] and what it reports about itself.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use kvx_policy::BreakerConfig;
use serde::{Deserialize, Serialize};

use crate::error::PosixError;

/// Which I/O engine runs the store's file operations (in a config file: `"uring"` or `"psync"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoEngine {
    /// io_uring: every open, read, write, sync, close, rename, unlink and mkdir is a ring op
    /// submitted with `IOSQE_ASYNC` (Linux only; the default there).
    Uring,
    /// A thread pool doing blocking syscalls; a thread stuck in the kernel is written off and
    /// replaced, up to a bound.
    Psync,
}

impl IoEngine {
    /// `uring` or `psync`.
    pub fn as_str(self) -> &'static str {
        match self {
            IoEngine::Uring => "uring",
            IoEngine::Psync => "psync",
        }
    }
}

impl Default for IoEngine {
    fn default() -> Self {
        if cfg!(target_os = "linux") {
            IoEngine::Uring
        } else {
            IoEngine::Psync
        }
    }
}

impl std::fmt::Display for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for IoEngine {
    type Err = PosixError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "uring" | "io_uring" => Ok(IoEngine::Uring),
            "psync" => Ok(IoEngine::Psync),
            other => Err(PosixError::BadConfig(format!(
                "unknown engine {other:?} (expected uring or psync)"
            ))),
        }
    }
}

/// Settings of a file block store.
#[derive(Debug, Clone)]
pub struct PosixConfig {
    /// Root directories (one per disk or mount); blocks are spread over them by key.
    pub roots: Vec<PathBuf>,
    /// I/O engine (default: uring on Linux).
    pub io_engine: IoEngine,
    /// Block I/Os in flight per ring (uring) or worker threads (psync); default 32.
    pub queue_depth: usize,
    /// Rings, each with its own thread (uring only); ops go to them in turn; default 1.
    pub rings: usize,
    /// Most I/Os written off as stuck (past their deadline or cancelled but still in the
    /// kernel) before new ops are refused with `Busy`; default 256. psync runs at most
    /// `queue_depth + max_stuck` load and store threads (plus 4 for removes) and keeps
    /// `queue_depth` of them live after any stall.
    pub max_stuck: usize,
    /// Loads and stores queued for the engine, not yet started, before new ops are refused
    /// with `Busy` (default 16384; removes have their own queue and never count here).
    pub max_queued: usize,
    /// Try O_DIRECT (default true); a root whose filesystem refuses it falls back to buffered
    /// I/O with one warning.
    pub direct: bool,
    /// fdatasync each block before renaming it into place (default false).
    pub fdatasync: bool,
    /// On roots whose file system is a local block file system (ext4, XFS, Btrfs, F2FS,
    /// tmpfs), issue io_uring ops inline (the kernel hands an op that would block to its
    /// workers) and read a block without a statx first (its header carries the length);
    /// default true. Other roots (FUSE, NFS, CIFS, Ceph, Lustre, GPFS, ...) always send every
    /// op through the kernel's workers, so a stuck mount never blocks the ring thread.
    pub inline_io: bool,
    /// Files kept ready per root for stores to write into (made at open, topped up by a
    /// thread of their own), so that a store does not create its file: on ext4 an inode
    /// allocation can cost as much as writing a MiB. Only on roots with inline I/O of a store
    /// that owns its roots (not on a shared mount); default 0 (stores create their files).
    /// A store that ends before it opens its spare gives it back, so a root may hold a few
    /// more for a while (at most one per store queued or in flight).
    pub spare_files: usize,
    /// Payload bytes of the blocks this store holds (an engine's blocks are all one size):
    /// each spare file is then preallocated (`fallocate`) to exactly the file of such a block,
    /// header included, so that its store writes into allocated space, waits on no block
    /// allocation, and lands next to the block stored before it. A store of another size
    /// creates its own file. A removed block file of that length (an eviction) then becomes a
    /// spare instead of being unlinked, while the root has fewer than `spare_files`, so stores
    /// after evictions overwrite space written before. Default 0: spares are empty and fit
    /// any store, and removed files are unlinked.
    pub spare_block_bytes: usize,
    /// Top the spare files up in the background when half are used (default true); false
    /// keeps only those made at open (a benchmark that makes its files before its clock
    /// starts, as fio and NIXL do, and makes none while it runs).
    pub spare_refill: bool,
    /// Health breaker of each root.
    pub breaker: BreakerConfig,
    /// A temporary file of another process older than this is removed by the startup scan
    /// (one of a process that no longer runs on this host is removed at any age); default 10 min.
    pub stale_temp_age: Duration,
    /// A store whose rename lands less than this before its deadline is undone, so that a block
    /// the tracker reports as timed out is never left visible; default 10 ms.
    pub visibility_margin: Duration,
    /// Settings for a root shared by many nodes (`None`, the default: this process owns the
    /// roots, and its index is the truth).
    pub shared: Option<SharedMount>,
}

/// Settings of a store whose roots many nodes share (see [`crate::PosixHandle::probe`]), and of
/// the layers above that use such a mount. In a config file (kvx-offload's `[file.shared]`) every
/// field may be left out; durations are whole milliseconds under keys ending in `_ms`.
///
/// The index is then a cache of what is on the mount: a key it lacks is probed on the mount
/// (a header read on the engine's maintenance lane), the answer cached for a while; a load that
/// succeeds sets the block file's mtime to now (on the touch lane, never in the engine step), so
/// mtime is the recency signal any node's collector orders blocks by.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SharedMount {
    /// A probe not answered within this counts as a failure of its root's breaker and the
    /// lookup answers "miss"; default 200 ms.
    #[serde(rename = "probe_deadline_ms", with = "millis")]
    pub probe_deadline: Duration,
    /// How long a probe's answer (present or absent) is reused; default 1000 ms.
    #[serde(rename = "probe_ttl_ms", with = "millis")]
    pub probe_ttl: Duration,
    /// Most probe answers and probes in flight remembered at once; past that, new keys answer
    /// "miss" without a probe until answers expire; default 65536.
    pub probe_entries: usize,
    /// Set the block file's mtime on every successful load (the recency signal of the
    /// collector); default true.
    pub touch_on_load: bool,
    /// Run a [`crate::Collector`] on this node keeping each root under this many bytes of block
    /// files (default `None`: another node, or `kvx gc`, enforces the quota).
    pub quota_bytes: Option<u64>,
    /// Time between two collector passes; default 5000 ms.
    #[serde(rename = "collect_interval_ms", with = "millis")]
    pub collect_interval: Duration,
    /// For the layer above (kvx-offload's scheduler): write a block into the mount when it
    /// leaves this node's host tier, with its last use there as its recency, instead of writing
    /// it through when it is stored (default false). The nodes' host tiers and the mount then
    /// hold different blocks, so their capacities add up; another node sees a block only once
    /// its node's host tier lets it go.
    pub write_back: bool,
}

impl Default for SharedMount {
    fn default() -> Self {
        SharedMount {
            probe_deadline: Duration::from_millis(200),
            probe_ttl: Duration::from_secs(1),
            probe_entries: 65536,
            touch_on_load: true,
            quota_bytes: None,
            collect_interval: Duration::from_secs(5),
            write_back: false,
        }
    }
}

impl SharedMount {
    /// Check the settings; the error names the bad one by its config key.
    pub fn validate(&self) -> Result<(), BadSetting> {
        let bad = |key, reason: &str| {
            Err(BadSetting {
                key,
                reason: reason.to_string(),
            })
        };
        if self.probe_deadline.is_zero() {
            return bad("probe_deadline_ms", "must be positive");
        }
        if self.probe_entries == 0 || self.probe_entries > 1 << 24 {
            return bad(
                "probe_entries",
                &format!("must be 1..=16777216, got {}", self.probe_entries),
            );
        }
        if self.collect_interval.is_zero() {
            return bad("collect_interval_ms", "must be positive");
        }
        if self.quota_bytes == Some(0) {
            return bad(
                "quota_bytes",
                "0 would remove every block; leave it out for no collector on this node",
            );
        }
        Ok(())
    }
}

/// A setting that makes no sense: its config key and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct BadSetting {
    /// The setting's key in a config file.
    pub key: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

/// A [`Duration`] in a config file: whole milliseconds.
mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis().try_into().unwrap_or(u64::MAX))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

impl PosixConfig {
    /// Defaults with one root.
    pub fn new(root: impl Into<PathBuf>) -> PosixConfig {
        PosixConfig {
            roots: vec![root.into()],
            io_engine: IoEngine::default(),
            queue_depth: 32,
            rings: 1,
            max_stuck: 256,
            max_queued: 16384,
            direct: true,
            fdatasync: false,
            inline_io: true,
            spare_files: 0,
            spare_block_bytes: 0,
            spare_refill: true,
            breaker: BreakerConfig::default(),
            stale_temp_age: Duration::from_secs(600),
            visibility_margin: Duration::from_millis(10),
            shared: None,
        }
    }

    /// The length spare files are preallocated to (see [`PosixConfig::spare_block_bytes`]):
    /// the file of a `spare_block_bytes` block written with O_DIRECT; 0 for empty spares.
    pub(crate) fn spare_file_len(&self) -> u64 {
        if self.spare_block_bytes == 0 {
            return 0;
        }
        (crate::format::HEADER_LEN + crate::format::round_up(self.spare_block_bytes)) as u64
    }

    /// Check the settings.
    pub fn validate(&self) -> Result<(), PosixError> {
        if self.roots.is_empty() {
            return Err(PosixError::NoRoots);
        }
        if self.queue_depth == 0 || self.queue_depth > 4096 {
            return Err(PosixError::BadConfig(format!(
                "queue_depth must be 1..=4096, got {}",
                self.queue_depth
            )));
        }
        if self.rings == 0 || self.rings > 64 {
            return Err(PosixError::BadConfig(format!(
                "rings must be 1..=64, got {}",
                self.rings
            )));
        }
        if self.max_stuck == 0 || self.max_stuck > 8192 {
            return Err(PosixError::BadConfig(format!(
                "max_stuck must be 1..=8192, got {}",
                self.max_stuck
            )));
        }
        if self.max_queued == 0 || self.max_queued > 1 << 20 {
            return Err(PosixError::BadConfig(format!(
                "max_queued must be 1..=1048576, got {}",
                self.max_queued
            )));
        }
        if self.spare_files > 1 << 20 {
            return Err(PosixError::BadConfig(format!(
                "spare_files must be 0..=1048576, got {}",
                self.spare_files
            )));
        }
        if self.spare_block_bytes > 1 << 30 {
            return Err(PosixError::BadConfig(format!(
                "spare_block_bytes must be 0..=1073741824, got {}",
                self.spare_block_bytes
            )));
        }
        if let Some(m) = &self.shared {
            m.validate()
                .map_err(|e| PosixError::BadConfig(format!("shared.{e}")))?;
        }
        self.breaker
            .validate()
            .map_err(|e| PosixError::BadConfig(e.to_string()))
    }
}

/// What a store found out about itself when it opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// The I/O engine in use.
    pub io_engine: IoEngine,
    /// True when every root uses O_DIRECT.
    pub direct: bool,
    /// O_DIRECT per root, in the order of the configuration.
    pub direct_per_root: Vec<bool>,
    /// Inline I/O per root (see [`PosixConfig::inline_io`]), in the order of the configuration.
    pub inline_per_root: Vec<bool>,
    /// Blocks found by the startup scan.
    pub scanned_blocks: usize,
    /// Stale temporary files the startup scan removed.
    pub removed_temps: usize,
}
