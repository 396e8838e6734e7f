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
    /// Health breaker of each root.
    #[serde(default)]
    pub breaker: BreakerConfig,
}

fn default_direct() -> bool {
    true
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
            breaker: BreakerConfig::default(),
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
            if !(1..=4096).contains(&f.queue_depth) {
                return Err(OffloadError::config(
                    "file.queue_depth",
                    format!("must be 1..=4096, got {}", f.queue_depth),
                ));
            }
            f.breaker
                .validate()
                .map_err(|e| OffloadError::config("file.breaker", e))?;
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
