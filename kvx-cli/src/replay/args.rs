//! Command-line options of `kvx replay`, and the settings they resolve to.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use kvx_offload::EvictionKind;
use kvx_policy::LoadFailurePolicy;
use kvx_posix::IoEngine;

use super::error::ReplayError;
use super::fault::{StallSpec, parse_fault};
use super::model::{BlockSize, block_size};

/// Options of `kvx replay`.
#[derive(Args, Debug, Clone)]
pub struct ReplayArgs {
    /// Mooncake-format trace (one JSON object per line); without it, the embedded default trace.
    pub trace: Option<PathBuf>,
    /// Model preset for KV bytes per token: llama3-8b, qwen2.5-7b, llama3.2-1b, qwen2.5-0.5b.
    #[arg(long, default_value = "llama3-8b")]
    pub model: String,
    /// KV bytes per token (instead of a preset).
    #[arg(long)]
    pub bytes_per_token: Option<u64>,
    /// Bytes moved per 512-token block: a size (multiple of 4096; K/M/G suffixes) or `model`
    /// for full-size blocks. Default: the model block / 1024.
    #[arg(long)]
    pub block_bytes: Option<String>,
    /// Host tier capacity in GiB of model blocks.
    #[arg(long, default_value_t = 32.0)]
    pub host_gib: f64,
    /// Host tier capacity in blocks (instead of --host-gib).
    #[arg(long)]
    pub host_blocks: Option<usize>,
    /// File tier capacity in GiB of model blocks (0: no file tier).
    #[arg(long, default_value_t = 256.0)]
    pub file_gib: f64,
    /// File tier capacity in blocks (instead of --file-gib; 0: no file tier).
    #[arg(long)]
    pub file_blocks: Option<usize>,
    /// Engine KV pool in blocks (default: max(1024, 2 × the largest request)).
    #[arg(long)]
    pub engine_blocks: Option<u32>,
    /// Arrival times are divided by this.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Take only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Modelled prefill speed of the engine, tokens per second (for time to first token).
    #[arg(long, default_value_t = 10_000.0)]
    pub prefill_tokens_per_s: f64,
    /// Load deadline in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub deadline_ms: u64,
    /// Store deadline in milliseconds (default: the load deadline).
    #[arg(long)]
    pub store_deadline_ms: Option<u64>,
    /// What a request does when a load fails: recompute, fail, or `auto:<max recompute tokens>`.
    #[arg(long, default_value = "recompute")]
    pub on_load_failure: String,
    /// Eviction order of both tiers.
    #[arg(long, value_enum, default_value_t = Eviction::Lru)]
    pub eviction: Eviction,
    /// File tier I/O engine.
    #[arg(long, default_value_t = IoEngine::Uring)]
    pub io_engine: IoEngine,
    /// Inject a fault: stall-disk@T+D freezes the file tier (on a FUSE mount) from T to T+D s.
    #[arg(long)]
    pub fault: Vec<String>,
    /// File tier directory (default: a fresh directory under the system temp dir).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Keep the file tier's fresh directory at exit.
    #[arg(long)]
    pub keep: bool,
    /// Skip malformed trace lines instead of stopping at the first.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Seed of the embedded trace.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Write the trace (embedded or read, after --limit) as JSON lines to this file and exit.
    #[arg(long)]
    pub emit_trace: Option<PathBuf>,
    /// Print one JSON object with the results on the last line.
    #[arg(long)]
    pub json: bool,
    /// Serve kvx's metrics in the Prometheus text format at http://ADDR/metrics while the
    /// replay runs (e.g. 127.0.0.1:9464; port 0 picks a free one, printed on stderr).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
    /// Engine nodes, each a separate process, sharing one file-tier directory (a collector on
    /// every node keeps it under the file tier's capacity); 1: one engine in this process.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// How requests are spread over the nodes: round-robin, or by a hash of the first block
    /// (a conversation stays on one node, so its hits are that node's own).
    #[arg(long, value_enum, default_value_t = Spread::RoundRobin)]
    pub spread: Spread,
    /// When a node writes a block into the shared file tier: `back`, as it leaves the node's
    /// host tier (host tiers and the mount hold different blocks, so their capacities add
    /// up), or `through`, as soon as it is stored (other nodes see it at once; every host
    /// block is also on the mount).
    #[arg(long, value_enum, default_value_t = SharedWrites::Back)]
    pub shared_writes: SharedWrites,
    /// The shared file tier's directory as node I sees it, given once per node in node order
    /// (instead of --dir): each node's own mount of one shared volume (GlusterFS, NFS, ...).
    /// They are checked to show one directory before the nodes start.
    #[arg(long, value_name = "DIR", conflicts_with = "dir")]
    pub node_dir: Vec<PathBuf>,
    /// Internal: run as node I of --nodes (set by the parent process).
    #[arg(long, hide = true)]
    pub node_index: Option<usize>,
    /// Internal: the shared file-tier directory of the nodes.
    #[arg(long, hide = true)]
    pub shared_dir: Option<PathBuf>,
    /// Internal: start replaying at this Unix time in ms, so that all nodes share one clock.
    #[arg(long, hide = true)]
    pub start_unix_ms: Option<u64>,
}

/// `--spread`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spread {
    /// Request i goes to node i mod N.
    RoundRobin,
    /// A request goes to the node its first block's key hashes to.
    Hash,
}

impl Spread {
    /// The option's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Spread::RoundRobin => "round-robin",
            Spread::Hash => "hash",
        }
    }
}

/// `--shared-writes`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedWrites {
    /// A block is written into the shared tier as it leaves the node's host tier.
    Back,
    /// A block is written into the shared tier as soon as it is stored.
    Through,
}

impl SharedWrites {
    /// The option's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SharedWrites::Back => "back",
            SharedWrites::Through => "through",
        }
    }
}

/// `--eviction`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eviction {
    /// Least recently used.
    Lru,
    /// Adaptive replacement cache.
    Arc,
}

/// Everything a replay needs to know, resolved and checked.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Block sizes.
    pub blocks: BlockSize,
    /// Host tier capacity in blocks.
    pub host_blocks: usize,
    /// File tier capacity in blocks (0: none).
    pub file_blocks: usize,
    /// Engine KV pool in blocks (`None`: from the trace).
    pub engine_blocks: Option<u32>,
    /// Arrival time divisor.
    pub speedup: f64,
    /// Prefill tokens per second.
    pub prefill_tps: f64,
    /// Load deadline (ms).
    pub load_deadline_ms: u64,
    /// Store deadline (ms).
    pub store_deadline_ms: u64,
    /// Load failure policy.
    pub policy: LoadFailurePolicy,
    /// Eviction order.
    pub eviction: EvictionKind,
    /// File tier I/O engine.
    pub io_engine: IoEngine,
    /// Stalls of the file tier.
    pub stalls: Vec<StallSpec>,
    /// File tier directory given by the user.
    pub dir: Option<PathBuf>,
    /// The file tier's directory as each node sees it (`--node-dir`; empty: `dir` for all).
    pub node_dirs: Vec<PathBuf>,
    /// Keep the fresh file tier directory.
    pub keep: bool,
    /// Draw a progress bar (when stderr is a terminal).
    pub progress: bool,
    /// Engine nodes sharing the file tier (1: this process alone).
    pub nodes: usize,
    /// How requests are spread over the nodes.
    pub spread: Spread,
    /// When nodes write blocks into the shared file tier.
    pub shared_writes: SharedWrites,
    /// This process is node `i` of `nodes` (a child of a multi-node replay).
    pub node: Option<usize>,
    /// Start replaying at this Unix time in ms (a child of a multi-node replay).
    pub start_unix_ms: Option<u64>,
    /// Arrival times count from this trace time in ms (default: the first request's).
    pub time_origin_ms: Option<f64>,
}

fn tier_blocks(
    flag: &str,
    gib: f64,
    blocks: Option<usize>,
    block: u64,
) -> Result<usize, ReplayError> {
    if let Some(b) = blocks {
        return Ok(b);
    }
    if !gib.is_finite() || gib < 0.0 {
        return Err(ReplayError::BadOption(format!(
            "--{flag}-gib {gib} must be a non-negative number"
        )));
    }
    Ok((gib * (1u64 << 30) as f64 / block as f64).floor() as usize)
}

fn policy(s: &str) -> Result<LoadFailurePolicy, ReplayError> {
    match s {
        "recompute" => Ok(LoadFailurePolicy::Recompute),
        "fail" => Ok(LoadFailurePolicy::Fail),
        _ => s
            .strip_prefix("auto:")
            .and_then(|n| n.parse::<u64>().ok())
            .map(|max_recompute_tokens| LoadFailurePolicy::Auto {
                max_recompute_tokens,
            })
            .ok_or_else(|| {
                ReplayError::BadOption(format!(
                    "--on-load-failure {s:?}: expected recompute, fail or auto:<tokens>"
                ))
            }),
    }
}

impl ReplayArgs {
    /// Check the options and resolve them.
    pub fn settings(&self) -> Result<Settings, ReplayError> {
        let blocks = block_size(
            &self.model,
            self.bytes_per_token,
            self.block_bytes.as_deref(),
        )?;
        let host_blocks = tier_blocks(
            "host",
            self.host_gib,
            self.host_blocks,
            blocks.model_block_bytes,
        )?;
        if host_blocks == 0 {
            return Err(ReplayError::BadOption(format!(
                "the host tier holds no block: one block of {} is {} MiB",
                blocks.model,
                blocks.model_block_bytes >> 20
            )));
        }
        let file_blocks = tier_blocks(
            "file",
            self.file_gib,
            self.file_blocks,
            blocks.model_block_bytes,
        )?;
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(ReplayError::BadOption(format!(
                "--speedup {} must be a positive number",
                self.speedup
            )));
        }
        if !(self.prefill_tokens_per_s.is_finite() && self.prefill_tokens_per_s > 0.0) {
            return Err(ReplayError::BadOption(format!(
                "--prefill-tokens-per-s {} must be a positive number",
                self.prefill_tokens_per_s
            )));
        }
        let store_deadline_ms = self.store_deadline_ms.unwrap_or(self.deadline_ms);
        if self.deadline_ms == 0 || store_deadline_ms == 0 {
            return Err(ReplayError::BadOption("deadlines must be positive".into()));
        }
        if self.engine_blocks == Some(0) {
            return Err(ReplayError::BadOption(
                "--engine-blocks must be positive".into(),
            ));
        }
        if self.limit == Some(0) {
            return Err(ReplayError::BadOption("--limit must be positive".into()));
        }
        let stalls = self
            .fault
            .iter()
            .map(|f| parse_fault(f))
            .collect::<Result<Vec<_>, _>>()?;
        if self.nodes == 0 || self.nodes > 64 {
            return Err(ReplayError::BadOption(format!(
                "--nodes {} must be 1..=64",
                self.nodes
            )));
        }
        if self.nodes > 1 && file_blocks == 0 {
            return Err(ReplayError::BadOption(
                "--nodes > 1 shares the file tier: it needs one (--file-gib > 0)".into(),
            ));
        }
        if self.nodes > 1 && !self.fault.is_empty() {
            return Err(ReplayError::BadOption(
                "--fault is not supported with --nodes > 1".into(),
            ));
        }
        if self.node_index.is_some_and(|i| i >= self.nodes) {
            return Err(ReplayError::BadOption(
                "--node-index must be below --nodes".into(),
            ));
        }
        if !self.node_dir.is_empty() {
            super::node_dirs::for_nodes(&self.node_dir, self.nodes)
                .map_err(ReplayError::BadOption)?;
        }
        if !stalls.is_empty() && file_blocks == 0 {
            return Err(ReplayError::BadOption(
                "--fault stall-disk needs a file tier (--file-gib > 0)".into(),
            ));
        }
        Ok(Settings {
            blocks,
            host_blocks,
            file_blocks,
            engine_blocks: self.engine_blocks,
            speedup: self.speedup,
            prefill_tps: self.prefill_tokens_per_s,
            load_deadline_ms: self.deadline_ms,
            store_deadline_ms,
            policy: policy(&self.on_load_failure)?,
            eviction: match self.eviction {
                Eviction::Lru => EvictionKind::Lru,
                Eviction::Arc => EvictionKind::Arc,
            },
            io_engine: self.io_engine,
            stalls,
            dir: self
                .shared_dir
                .clone()
                .or_else(|| self.dir.clone())
                .or_else(|| self.node_dir.first().filter(|_| self.nodes == 1).cloned()),
            node_dirs: self.node_dir.clone(),
            keep: self.keep,
            progress: self.node_index.is_none(),
            nodes: self.nodes,
            spread: self.spread,
            shared_writes: self.shared_writes,
            node: self.node_index,
            start_unix_ms: self.start_unix_ms,
            time_origin_ms: None,
        })
    }
}
