//! Everything the builder needs to know, settable from code or from a TOML / JSON file.

use std::path::PathBuf;
use std::time::Duration;

use kvx_policy::{BreakerConfig, LoadFailurePolicy, TimeoutConfig};
use serde::{Deserialize, Serialize};

use crate::error::OffloadError;
use crate::eviction::EvictionKind;
use crate::scheduler::SchedulerConfig;

/// kvx set up for an engine. Every field may be left out of a file and takes the default
/// written next to it; unknown keys are refused.
///
/// ```toml
/// block_tokens = 16            # default 16
/// host_blocks = 4096           # default 4096
/// eviction = "arc"             # lru (default) or arc
/// load_failure = "recompute"   # fail, recompute (default) or { auto = { max_recompute_tokens = 2048 } }
///
/// [timeouts]
/// load_ms = 2000               # default 10 000
/// store_ms = 10000             # default 30 000
///
/// [file]                       # no [file] section: no file tier
/// roots = ["/mnt/nvme0/kv", "/mnt/nvme1/kv"]
/// blocks = 1000000
/// io_engine = "uring"          # uring (default on Linux) or psync
/// direct = true                # O_DIRECT where the filesystem allows it; default true
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OffloadConfig {
    /// Tokens per engine block (default 16).
    pub block_tokens: u32,
    /// Host tier capacity in blocks (default 4096).
    pub host_blocks: usize,
    /// Pool buffers beyond the host tier: staging for file loads and write-through buffers
    /// whose host block was evicted meanwhile (default `None`: engine blocks +
    /// max(host_blocks / 2, 256)).
    pub extra_buffers: Option<usize>,
    /// Eviction order of both tiers (default `lru`).
    pub eviction: EvictionKind,
    /// Deadlines of loads and stores.
    pub timeouts: TimeoutConfig,
    /// What the engine does with a load that did not fully succeed (default `recompute`).
    pub load_failure: LoadFailurePolicy,
    /// Threads copying between host engine memory and kvx buffers (default 2).
    pub copy_threads: usize,
    /// Request state nothing names for this long is dropped with a warning (default 600 000).
    pub request_idle_ms: u64,
    /// Longest `start_step` waits for a preemption's fence before handing it back to poll
    /// (default 1; at most 1000).
    pub preempt_wait_ms: u64,
    /// The file tier (default: none).
    pub file: Option<FileTierConfig>,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        let s = SchedulerConfig::default();
        OffloadConfig {
            block_tokens: s.block_tokens,
            host_blocks: s.host_blocks,
            extra_buffers: None,
            eviction: s.eviction,
            timeouts: TimeoutConfig::default(),
            load_failure: LoadFailurePolicy::default(),
            copy_threads: 2,
            request_idle_ms: s.request_idle.as_millis() as u64,
            preempt_wait_ms: crate::worker::DEFAULT_PREEMPT_WAIT.as_millis() as u64,
            file: None,
        }
    }
}

/// Which I/O engine runs the file tier's operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoEngine {
    /// io_uring (Linux; the default there).
    Uring,
    /// A thread pool doing blocking syscalls, stuck threads written off.
    Psync,
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

/// The file tier: one verified file per block, spread over the roots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTierConfig {
    /// Root directories, one per disk or mount (required).
    pub roots: Vec<PathBuf>,
    /// Capacity in blocks (required, at least 1).
    pub blocks: usize,
    /// I/O engine (default `uring` on Linux).
    #[serde(default)]
    pub io_engine: IoEngine,
    /// O_DIRECT where the filesystem allows it (default true).
    #[serde(default = "default_direct")]
    pub direct: bool,
    /// Block I/Os in flight per ring, or psync threads (default 32).
    #[serde(default = "default_queue_depth")]
    pub queue_depth: usize,
    /// fdatasync each block before it becomes visible (default false).
    #[serde(default)]
    pub fdatasync: bool,
    /// Files kept ready per root (on a local block file system of a tier this node owns) for
    /// stores to write into: preallocated to one block's file by a thread of their own, or
    /// the files of evicted blocks, recycled, so that no store creates its file or allocates
    /// its blocks (default 64; 0: stores create their files and evictions unlink them).
    #[serde(default = "default_spare_files")]
    pub spare_files: usize,
    /// Health breaker of each root.
    #[serde(default)]
    pub breaker: BreakerConfig,
    /// The roots are shared with other engine nodes (`None`, the default: this node owns them).
    #[serde(default)]
    pub shared: Option<SharedMountConfig>,
}

/// A file tier whose roots many engine nodes share (NFS, Lustre, CephFS, a local disk shared by
/// processes). A lookup that misses this node's index probes the mount (never waited for: the
/// lookup answers "ask again later" while the probe runs); an eviction from this node's index
/// only forgets the block; capacity is the collector's quota, which any node may enforce.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedMountConfig {
    /// A probe not answered within this many ms is a miss and a breaker failure (default 200).
    #[serde(default = "default_probe_deadline_ms")]
    pub probe_deadline_ms: u64,
    /// How long a probe's answer, present or absent, is reused, in ms (default 1000).
    #[serde(default = "default_probe_ttl_ms")]
    pub probe_ttl_ms: u64,
    /// Most probe answers remembered (default 65536).
    #[serde(default = "default_probe_entries")]
    pub probe_entries: usize,
    /// Run a collector on this node keeping each root under this many bytes of block files
    /// (default `None`: another node, or `kvx gc`, enforces the quota).
    #[serde(default)]
    pub quota_bytes: Option<u64>,
    /// Time between two collector passes, in ms (default 5000).
    #[serde(default = "default_collect_interval_ms")]
    pub collect_interval_ms: u64,
    /// Another node's temporary file older than this many seconds is a leftover (default 600).
    #[serde(default = "default_stale_temp_s")]
    pub stale_temp_s: u64,
    /// Write a block into the shared tier when it leaves this node's host tier, with its last
    /// use there as its recency, instead of writing it through when it is stored (default
    /// false). The nodes' host tiers and the mount then hold different blocks, so their
    /// capacities add up; another node sees a block only once its node's host tier lets it go.
    #[serde(default)]
    pub write_back: bool,
}

fn default_probe_deadline_ms() -> u64 {
    200
}

fn default_probe_ttl_ms() -> u64 {
    1000
}

fn default_probe_entries() -> usize {
    65536
}

fn default_collect_interval_ms() -> u64 {
    5000
}

fn default_stale_temp_s() -> u64 {
    600
}

impl Default for SharedMountConfig {
    fn default() -> Self {
        SharedMountConfig {
            probe_deadline_ms: default_probe_deadline_ms(),
            probe_ttl_ms: default_probe_ttl_ms(),
            probe_entries: default_probe_entries(),
            quota_bytes: None,
            collect_interval_ms: default_collect_interval_ms(),
            stale_temp_s: default_stale_temp_s(),
            write_back: false,
        }
    }
}

impl SharedMountConfig {
    /// Check the settings; the error names the bad field.
    pub fn validate(&self) -> Result<(), OffloadError> {
        if self.probe_deadline_ms == 0 {
            return Err(OffloadError::config(
                "file.shared.probe_deadline_ms",
                "must be positive",
            ));
        }
        if !(1..=1 << 24).contains(&self.probe_entries) {
            return Err(OffloadError::config(
                "file.shared.probe_entries",
                format!("must be 1..=16777216, got {}", self.probe_entries),
            ));
        }
        if self.collect_interval_ms == 0 {
            return Err(OffloadError::config(
                "file.shared.collect_interval_ms",
                "must be positive",
            ));
        }
        if self.quota_bytes == Some(0) {
            return Err(OffloadError::config(
                "file.shared.quota_bytes",
                "Some(0) would remove every block; use None for no collector on this node",
            ));
        }
        Ok(())
    }
}

fn default_direct() -> bool {
    true
}

fn default_spare_files() -> usize {
    64
}

fn default_queue_depth() -> usize {
    32
}

impl FileTierConfig {
    /// A file tier of `blocks` under one root, other settings at their defaults.
    pub fn new(root: impl Into<PathBuf>, blocks: usize) -> FileTierConfig {
        FileTierConfig {
            roots: vec![root.into()],
            blocks,
            io_engine: IoEngine::default(),
            direct: default_direct(),
            queue_depth: default_queue_depth(),
            fdatasync: false,
            spare_files: default_spare_files(),
            breaker: BreakerConfig::default(),
            shared: None,
        }
    }
}

impl OffloadConfig {
    /// Read a TOML config and validate it.
    pub fn from_toml(text: &str) -> Result<OffloadConfig, OffloadError> {
        let cfg: OffloadConfig =
            toml::from_str(text).map_err(|e| OffloadError::config("(toml)", e.message()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Read a JSON config and validate it.
    pub fn from_json(text: &str) -> Result<OffloadConfig, OffloadError> {
        let cfg: OffloadConfig =
            serde_json::from_str(text).map_err(|e| OffloadError::config("(json)", e))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check every setting; the error names the first bad one.
    pub fn validate(&self) -> Result<(), OffloadError> {
        if self.request_idle_ms == 0 {
            return Err(OffloadError::config("request_idle_ms", "must be positive"));
        }
        self.validate_file()?;
        self.scheduler().validate()?;
        if self.preempt_wait_ms > 1000 {
            return Err(OffloadError::config(
                "preempt_wait_ms",
                format!("at most 1000, got {}", self.preempt_wait_ms),
            ));
        }
        self.timeouts
            .validate()
            .map_err(|e| OffloadError::config("timeouts", e))?;
        self.load_failure
            .validate()
            .map_err(|e| OffloadError::config("load_failure", e))?;
        if !(1..=64).contains(&self.copy_threads) {
            return Err(OffloadError::config(
                "copy_threads",
                format!("must be 1..=64, got {}", self.copy_threads),
            ));
        }
        Ok(())
    }

    fn validate_file(&self) -> Result<(), OffloadError> {
        if let Some(f) = &self.file {
            if f.roots.is_empty() {
                return Err(OffloadError::config("file.roots", "names no directory"));
            }
            if f.blocks == 0 {
                return Err(OffloadError::config(
                    "file.blocks",
                    "must be at least 1 (leave [file] out for no file tier)",
                ));
            }
            if f.spare_files > 1 << 20 {
                return Err(OffloadError::config(
                    "file.spare_files",
                    format!("must be 0..=1048576, got {}", f.spare_files),
                ));
            }
            if !(1..=4096).contains(&f.queue_depth) {
                return Err(OffloadError::config(
                    "file.queue_depth",
                    format!("must be 1..=4096, got {}", f.queue_depth),
                ));
            }
            f.breaker
                .validate()
                .map_err(|e| OffloadError::config("file.breaker", e))?;
            if let Some(m) = &f.shared {
                m.validate()?;
            }
        }
        Ok(())
    }

    /// The scheduler half's settings.
    pub(crate) fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig {
            block_tokens: self.block_tokens,
            host_blocks: self.host_blocks,
            file_blocks: self.file.as_ref().map(|f| f.blocks),
            eviction: self.eviction,
            request_idle: Duration::from_millis(self.request_idle_ms),
        }
    }

    /// Buffers the worker's pool gets for an engine of `engine_blocks`: the host tier plus
    /// [`OffloadConfig::extra_buffers`].
    pub fn pool_buffers(&self, engine_blocks: u32) -> usize {
        let extra = self
            .extra_buffers
            .unwrap_or(engine_blocks as usize + (self.host_blocks / 2).max(256));
        self.host_blocks + extra
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(r: Result<OffloadConfig, OffloadError>) -> String {
        match r {
            Err(OffloadError::Config { field, reason }) => format!("{field}: {reason}"),
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn an_empty_file_is_the_default() {
        assert_eq!(
            OffloadConfig::from_toml("").unwrap(),
            OffloadConfig::default()
        );
        assert_eq!(
            OffloadConfig::from_json("{}").unwrap(),
            OffloadConfig::default()
        );
        let d = OffloadConfig::default();
        assert_eq!(
            (d.block_tokens, d.host_blocks, d.copy_threads),
            (16, 4096, 2)
        );
        assert_eq!(d.pool_buffers(100), 4096 + 100 + 2048);
    }

    #[test]
    fn the_documented_example_parses() {
        let text = r#"
block_tokens = 16
host_blocks = 4096
eviction = "arc"
load_failure = "recompute"

[timeouts]
load_ms = 2000
store_ms = 10000

[file]
roots = ["/mnt/nvme0/kv", "/mnt/nvme1/kv"]
blocks = 1000000
io_engine = "uring"
direct = true
"#;
        let c = OffloadConfig::from_toml(text).unwrap();
        let f = c.file.unwrap();
        assert_eq!(f.roots.len(), 2);
        assert_eq!(
            (f.blocks, f.io_engine, f.queue_depth),
            (1_000_000, IoEngine::Uring, 32)
        );
        assert_eq!(c.eviction, EvictionKind::Arc);
        assert_eq!(c.timeouts.store_ms, 10_000);
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let e = field_of(OffloadConfig::from_toml("hots_blocks = 3"));
        assert!(e.contains("hots_blocks"), "{e}");
        let e = field_of(OffloadConfig::from_toml(
            "[file]\nroots = [\"/x\"]\nblocks = 3\nodirect = true",
        ));
        assert!(e.contains("odirect"), "{e}");
        let e = field_of(OffloadConfig::from_json(r#"{"timeouts": {"load": 5}}"#));
        assert!(e.contains("load"), "{e}");
    }

    #[test]
    fn bad_values_name_the_field() {
        for (text, field) in [
            ("[file]\nroots = [\"/x\"]\nblocks = 0", "file.blocks"),
            ("[file]\nroots = []\nblocks = 3", "file.roots"),
            (
                "[file]\nroots = [\"/x\"]\nblocks = 3\nqueue_depth = 0",
                "file.queue_depth",
            ),
            (
                "[file]\nroots = [\"/x\"]\nblocks = 3\nspare_files = 2000000",
                "file.spare_files",
            ),
            ("host_blocks = 0", "host_blocks"),
            ("block_tokens = 0", "block_tokens"),
            ("copy_threads = 0", "copy_threads"),
            ("request_idle_ms = 0", "request_idle_ms"),
            ("preempt_wait_ms = 30000", "preempt_wait_ms"),
            ("[timeouts]\nload_ms = 0", "timeouts"),
        ] {
            let e = field_of(OffloadConfig::from_toml(text));
            assert!(e.starts_with(&format!("{field}:")), "{text:?}: {e}");
        }
    }
}
