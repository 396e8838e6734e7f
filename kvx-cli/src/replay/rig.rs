//! The tiers a replay runs on: engine memory (a host arena), the host tier (kvx-owned buffers),
//! the file tier (kvx-posix in a fresh directory, optionally behind a FUSE stall mount), the
//! driver with both backends, and both halves of the connector. Torn down in a safe order:
//! connector, driver (no op left on the arena), mount, then the directories.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvx_core::{CpuArena, DriverHandle};
use kvx_fusefs::{Backing, StallFs, StallMount, fuse_available};
use kvx_offload::{
    EngineMemory, FileTierConfig, Offload, OffloadBuilder, OffloadConfig, OffloadRuntime,
    SchedulerSide, SharedMount, WorkerSide,
};
use kvx_policy::{BreakerConfig, TimeoutConfig};
use kvx_posix::PosixHandle;
use tempfile::TempDir;

use super::args::{Settings, SharedWrites};
use super::error::ReplayError;
use super::trace::TRACE_BLOCK_TOKENS;

/// Where the file tier's blocks live.
pub enum FileDir {
    /// A fresh directory, removed at exit unless kept.
    Fresh(TempDir),
    /// A directory the user named (never removed).
    User(PathBuf),
}

impl FileDir {
    /// The directory.
    pub fn path(&self) -> &Path {
        match self {
            FileDir::Fresh(t) => t.path(),
            FileDir::User(p) => p,
        }
    }
}

/// Engine memory, tiers, driver and connector of one replay.
pub struct Rig {
    /// Scheduler half of the connector.
    pub sched: SchedulerSide,
    /// Worker half (taken on teardown).
    pub worker: Option<WorkerSide>,
    /// The driver and the file tier (taken on teardown, after the worker).
    pub runtime: Option<OffloadRuntime>,
    /// The file tier's handle.
    pub files: Option<PosixHandle>,
    /// Engine memory: must outlive the driver.
    pub arena: CpuArena,
    /// The FUSE mount under the file tier, with `--fault stall-disk`.
    pub mount: Option<StallMount>,
    mount_dir: Option<TempDir>,
    /// The file tier's directory.
    pub file_dir: Option<FileDir>,
    /// Blocks found in the file tier at start and adopted into the index.
    pub adopted: usize,
    /// Engine blocks.
    pub engine_blocks: u32,
    /// Whether the file tier uses O_DIRECT.
    pub direct: bool,
}

/// The connector's settings for `s` (the file tier under `root`, if any).
fn offload_config(s: &Settings, root: Option<&Path>) -> OffloadConfig {
    OffloadConfig {
        block_tokens: TRACE_BLOCK_TOKENS as u32,
        host_blocks: s.host_blocks,
        eviction: s.eviction,
        timeouts: TimeoutConfig {
            load_ms: s.load_deadline_ms,
            store_ms: s.store_deadline_ms,
        },
        load_failure: s.policy,
        file: root.map(|root| FileTierConfig {
            io_engine: s.io_engine,
            breaker: BreakerConfig {
                failure_threshold: 3,
                window_ms: 10_000,
                cool_down_ms: 1_000,
                probe_deadline_ms: s.load_deadline_ms,
            },
            shared: (s.nodes > 1).then(|| shared_mount(s)),
            ..FileTierConfig::new(root, s.file_blocks)
        }),
        ..OffloadConfig::default()
    }
}

/// The file tier's settings when `s.nodes` engines share it: a probe gets the load deadline
/// (a lookup waits for it no longer than a load of the block would take) and its answer is
/// reused for 50 ms; every node runs a collector that keeps the directory under the file
/// tier's capacity in bytes (header included); blocks are written back or through as
/// `--shared-writes` says.
fn shared_mount(s: &Settings) -> SharedMount {
    let block_file = s.blocks.block_bytes.div_ceil(4096) * 4096 + 4096;
    SharedMount {
        probe_deadline: Duration::from_millis(s.load_deadline_ms),
        probe_ttl: Duration::from_millis(50),
        quota_bytes: Some(s.file_blocks as u64 * block_file),
        collect_interval: Duration::from_secs(1),
        write_back: s.shared_writes == SharedWrites::Back,
        ..SharedMount::default()
    }
}

/// Buffers of the worker's pool: the host tier, staging for file loads (at most one per engine
/// block) and write-through buffers still held by file stores after their host block was
/// evicted.
pub fn pool_buffers(s: &Settings, engine_blocks: u32) -> usize {
    offload_config(s, None).pool_buffers(engine_blocks)
}

fn setup(e: impl std::fmt::Display) -> ReplayError {
    ReplayError::Setup(e.to_string())
}

impl Rig {
    /// Build the tiers for `s` with an engine pool of `engine_blocks`.
    pub fn new(s: &Settings, engine_blocks: u32) -> Result<Rig, ReplayError> {
        // K and V regions, as an engine lays out one layer.
        let arena = CpuArena::per_layer(2, s.blocks.block_bytes as usize / 2, engine_blocks)
            .map_err(setup)?;
        let (mut mount, mut mount_dir, mut file_dir, mut root) = (None, None, None, None);
        if s.file_blocks > 0 {
            let dir = match &s.dir {
                Some(d) => {
                    std::fs::create_dir_all(d)
                        .map_err(|e| setup(format!("cannot create {}: {e}", d.display())))?;
                    FileDir::User(d.clone())
                }
                None => FileDir::Fresh(
                    tempfile::Builder::new()
                        .prefix("kvx-replay-")
                        .tempdir()
                        .map_err(|e| setup(format!("cannot create a temp dir: {e}")))?,
                ),
            };
            root = Some(if s.stalls.is_empty() {
                dir.path().to_owned()
            } else {
                fuse_available().map_err(ReplayError::NoFuse)?;
                let at = tempfile::Builder::new()
                    .prefix("kvx-replay-mnt-")
                    .tempdir()
                    .map_err(|e| setup(format!("cannot create a mount point: {e}")))?;
                let m = StallFs::mount(at.path(), Backing::Passthrough(dir.path().to_owned()))
                    .map_err(|e| ReplayError::NoFuse(e.to_string()))?;
                let root = m.path().to_owned();
                mount = Some(m);
                mount_dir = Some(at);
                root
            });
            file_dir = Some(dir);
        }
        // SAFETY: the arena outlives the driver (`Rig` drops the worker and the runtime first,
        // and `arena` is declared after them); the engine model reads or writes an engine block
        // only when no op on it is outstanding (free blocks, finished loads, fenced requests).
        let memory = unsafe { EngineMemory::cpu(arena.layout().clone()) };
        let cfg = offload_config(s, root.as_deref());
        let Offload {
            scheduler,
            worker,
            runtime,
        } = OffloadBuilder::new(cfg, memory).build()?;
        Ok(Rig {
            sched: scheduler,
            worker: Some(worker),
            files: runtime.files().cloned(),
            adopted: runtime.adopted_blocks(),
            direct: runtime.direct_io(),
            runtime: Some(runtime),
            arena,
            mount,
            mount_dir,
            file_dir,
            engine_blocks,
        })
    }

    /// The driver.
    pub fn driver(&self) -> Result<&DriverHandle, ReplayError> {
        self.runtime
            .as_ref()
            .and_then(|r| r.driver())
            .ok_or_else(|| ReplayError::Accounting("the driver is gone".into()))
    }

    /// The worker half.
    pub fn worker(&mut self) -> Result<&mut WorkerSide, ReplayError> {
        self.worker
            .as_mut()
            .ok_or_else(|| ReplayError::Accounting("the worker is gone".into()))
    }

    /// Tear down: connector, driver, mount; then remove the fresh directory unless `keep`.
    /// Returns the file tier's directory if it is left on disk.
    pub fn teardown(mut self, keep: bool) -> Option<PathBuf> {
        self.worker.take();
        if let Some(r) = self.runtime.take() {
            r.shutdown();
        }
        self.files.take();
        if let Some(m) = self.mount.take() {
            m.thaw();
            drop(m);
        }
        self.mount_dir.take();
        match self.file_dir.take() {
            Some(FileDir::Fresh(t)) if keep => Some(t.keep()),
            Some(FileDir::Fresh(t)) => {
                let path = t.keep();
                if let Err(e) = super::cleanup::remove_tree(&path) {
                    eprintln!("kvx replay: could not remove {}: {e}", path.display());
                }
                None
            }
            Some(FileDir::User(p)) => Some(p),
            None => None,
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.worker.take();
        self.runtime.take();
        if let Some(m) = self.mount.take() {
            m.thaw();
        }
    }
}
