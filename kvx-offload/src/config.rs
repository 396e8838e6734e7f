//! Everything the builder needs to know, settable from code or from a TOML / JSON file.

use std::path::PathBuf;
use std::time::Duration;

use kvx_policy::{BreakerConfig, LoadFailurePolicy, TimeoutConfig};
use kvx_posix::{IoEngine, SharedMount};
use serde::{Deserialize, Serialize};

use crate::error::OffloadError;
use crate::eviction::EvictionKind;
use crate::remote::RemoteTierConfig;
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
///
/// [remote]                     # no [remote] section: no remote tier (see RemoteTierConfig)
/// listen = "10.0.0.5:7400"     # a producer's server (prefill); leave out on a consumer
/// lease_ttl_ms = 480000
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OffloadConfig {
    /// Tokens per engine block (default 16).
    pub block_tokens: u32,
    /// Host tier capacity in blocks (default 4096).
    pub host_blocks: usize,
    /// Pool buffers beyond the host tier: staging for file loads, for stores of blocks the
    /// host tier had no room for (file tier only), and write-through buffers whose host block
    /// was evicted meanwhile (default `None`: engine blocks + max(host_blocks / 2, 256)).
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
    /// For an engine that can take a load before the forward of the step that schedules its
    /// request (vLLM's synchronous loads): a hit whose every block is in the host tier is
    /// loaded that way, the step's start waiting for the copy (at most the load deadline),
    /// instead of the request waiting one more engine step for it. Hits with a block in
    /// another tier stay asynchronous (default false).
    pub host_loads_in_step: bool,
    /// The file tier (default: none).
    pub file: Option<FileTierConfig>,
    /// The remote tier: export finished requests to remote readers, and load from remote
    /// producers (default: none).
    pub remote: Option<RemoteTierConfig>,
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
            host_loads_in_step: false,
            file: None,
            remote: None,
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
    /// A temporary file of another process older than this many seconds is a leftover the
    /// startup scan (and a shared mount's collector) removes (default 600).
    #[serde(default = "default_stale_temp_s")]
    pub stale_temp_s: u64,
    /// The roots are shared with other engine nodes (`None`, the default: this node owns them).
    /// A lookup that misses this node's index probes the mount (never waited for: the lookup
    /// answers "ask again later" while the probe runs); an eviction from this node's index only
    /// forgets the block; capacity is the collector's quota, which any node may enforce.
    #[serde(default)]
    pub shared: Option<SharedMount>,
}

fn default_stale_temp_s() -> u64 {
    600
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
            stale_temp_s: default_stale_temp_s(),
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

    /// Read a JSON config and validate it. A key or value serde refuses is named by its dotted
    /// path (`file.io_engine`), as [`OffloadConfig::validate`] names the settings it refuses.
    pub fn from_json(text: &str) -> Result<OffloadConfig, OffloadError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| OffloadError::config("(json)", e))?;
        Self::from_json_value(value)
    }

    /// [`OffloadConfig::from_json`] of an already parsed JSON value.
    pub fn from_json_value(value: serde_json::Value) -> Result<OffloadConfig, OffloadError> {
        // One key per line, so that the line serde stops at names the key.
        let pretty =
            serde_json::to_string_pretty(&value).map_err(|e| OffloadError::config("(json)", e))?;
        let cfg: OffloadConfig = serde_json::from_str(&pretty).map_err(|e| {
            let msg = e.to_string();
            let msg = msg.split(" at line ").next().unwrap_or(&msg).to_string();
            OffloadError::config(key_at_line(&pretty, e.line()), msg)
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// This config as JSON (every key, defaults included).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an OffloadConfig is plain data")
    }

    /// Check every setting; the error names the first bad one.
    pub fn validate(&self) -> Result<(), OffloadError> {
        if self.request_idle_ms == 0 {
            return Err(OffloadError::config("request_idle_ms", "must be positive"));
        }
        self.validate_file()?;
        if let Some(r) = &self.remote {
            r.validate()?;
        }
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
                m.validate().map_err(|e| {
                    OffloadError::config(format!("file.shared.{}", e.key), e.reason)
                })?;
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

/// The dotted key path of the value on line `line` (from 1) of pretty-printed JSON (two spaces
/// of indent per level, one key per line); `(json)` when the line holds no key.
fn key_at_line(pretty: &str, line: usize) -> String {
    let mut path: Vec<&str> = Vec::new();
    for l in pretty.lines().take(line) {
        let body = l.trim_start();
        let depth = (l.len() - body.len()) / 2;
        if let Some(key) = body.strip_prefix('"').and_then(|b| b.split_once("\":")) {
            path.truncate(depth.saturating_sub(1));
            path.push(key.0);
        }
    }
    if path.is_empty() {
        "(json)".to_string()
    } else {
        path.join(".")
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
    fn json_values_serde_refuses_are_named_by_their_path() {
        for (text, field, words) in [
            (r#"{"host_blocks": "8"}"#, "host_blocks", "invalid type"),
            (r#"{"eviction": "fifo"}"#, "eviction", "fifo"),
            (
                r#"{"file": {"roots": ["/x"], "blocks": 3, "io_engine": "aio"}}"#,
                "file.io_engine",
                "aio",
            ),
            (
                r#"{"file": {"roots": ["/x"], "blocks": 3, "shared": {"probe_ttl_ms": -1}}}"#,
                "file.shared.probe_ttl_ms",
                "-1",
            ),
            (
                r#"{"timeouts": {"load_ms": 1.5}}"#,
                "timeouts.load_ms",
                "1.5",
            ),
            (
                r#"{"file": {"roots": "/x", "blocks": 3}}"#,
                "file.roots",
                "sequence",
            ),
            (r#"{"hots_blocks": 3}"#, "hots_blocks", "unknown field"),
        ] {
            let e = field_of(OffloadConfig::from_json(text));
            assert!(e.starts_with(&format!("{field}: ")), "{text}: {e}");
            assert!(e.contains(words), "{text}: {e}");
            assert!(!e.contains(" at line "), "{text}: {e}");
        }
    }

    #[test]
    fn to_json_reads_back_the_same_config() {
        let mut c = OffloadConfig::default();
        let mut f = FileTierConfig::new("/x", 7);
        f.shared = Some(SharedMount::default());
        c.file = Some(f);
        assert_eq!(OffloadConfig::from_json(&c.to_json()).unwrap(), c);
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
