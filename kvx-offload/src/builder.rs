//! One call that sets kvx up for an engine: driver, backends, pools, file tier, both sides.

use std::sync::Arc;
use std::time::Duration;

use kvx_core::{
    Backend, BufferPool, CpuBackend, CpuBackendConfig, DEFAULT_ALIGN, Driver, DriverBuilder,
    DriverConfig, DriverHandle, KvLayout,
};

use crate::config::OffloadConfig;
use crate::error::OffloadError;
use crate::file_hook::{FileTierHook, FileTierProbe};
use crate::scheduler::SchedulerSide;
use crate::worker::{RemotePart, TierRoutes, WorkerConfig, WorkerSide};

/// The engine's KV memory, and the backend that copies blocks in and out of it.
pub struct EngineMemory {
    kind: MemoryKind,
}

enum MemoryKind {
    Cpu(KvLayout),
    #[cfg(feature = "cuda")]
    Cuda(kvx_cuda::CudaDevice, KvLayout),
    Backend {
        backend: Box<dyn Backend>,
        block_bytes: usize,
        blocks: u32,
    },
}

impl EngineMemory {
    /// Engine memory in CPU RAM, copied by kvx-core's CPU backend.
    ///
    /// # Safety
    /// As for [`CpuBackend::new`]: every region of `layout` must stay valid for reads and
    /// writes until [`OffloadRuntime::shutdown`] returns (or the runtime is dropped), and the
    /// engine must not touch a block while a load or store on it is outstanding (it waits for
    /// the load's report, `finished_sending`, or a preemption fence).
    pub unsafe fn cpu(layout: KvLayout) -> EngineMemory {
        EngineMemory {
            kind: MemoryKind::Cpu(layout),
        }
    }

    /// Engine memory on a CUDA device, copied by kvx-cuda on its own streams; the pool's
    /// buffers are pinned and registered with the device (in chunks, `kvx_cuda::
    /// DEFAULT_PIN_CHUNK`; a refused chunk fails `build` with an error naming its size).
    ///
    /// Ordering: kvx copies on streams of its own. Stores of the blocks saved in a step are
    /// submitted at the start of the next `start_step`; they come after the kernels that wrote
    /// the blocks when the engine synchronised its stream before that call, or called
    /// [`WorkerSide::order_after_engine_stream`] with its stream first (no CPU wait: for an
    /// engine whose CPU runs a step ahead, vLLM's asynchronous scheduling). The engine reads
    /// loaded blocks only once the load is reported.
    ///
    /// # Safety
    /// As for `kvx_cuda::CudaBackend::new`: every region of `layout` is device memory of
    /// `device`, valid until the runtime shuts down; the engine does not touch a block while an
    /// op on it is outstanding, and the kernels that write a block come before the
    /// `start_step` that submits its store (finished, or ordered before it by
    /// `order_after_engine_stream`).
    #[cfg(feature = "cuda")]
    pub unsafe fn cuda(device: &kvx_cuda::CudaDevice, layout: KvLayout) -> EngineMemory {
        EngineMemory {
            kind: MemoryKind::Cuda(device.clone(), layout),
        }
    }

    /// Engine memory served by a backend built by the caller (its own constructor carried the
    /// safety promise), with blocks of `block_bytes`, `blocks` of them.
    pub fn backend(backend: Box<dyn Backend>, block_bytes: usize, blocks: u32) -> EngineMemory {
        EngineMemory {
            kind: MemoryKind::Backend {
                backend,
                block_bytes,
                blocks,
            },
        }
    }
}

/// Sets kvx up for an engine from an [`OffloadConfig`] and its [`EngineMemory`].
pub struct OffloadBuilder {
    cfg: OffloadConfig,
    memory: EngineMemory,
    driver: DriverConfig,
    shard: Option<kvx_posix::Shard>,
}

/// What [`OffloadBuilder::build`] returns: both sides of the connector and the runtime.
pub struct Offload {
    /// The scheduler side.
    pub scheduler: SchedulerSide,
    /// The worker side.
    pub worker: WorkerSide,
    /// The driver thread and the file tier; shut it down after the last engine step.
    pub runtime: OffloadRuntime,
}

/// The running parts behind the two sides: the driver thread (which owns the backends) and
/// the file tier's handle.
pub struct OffloadRuntime {
    /// The remote tier's server (a producer's), stopped before the driver and the memory.
    server: Option<kvx_rdma::TcpServer>,
    driver: Option<Driver>,
    files: Option<kvx_posix::PosixHandle>,
    /// The shared mount's collector on this node, stopped when the runtime drops.
    _collector: Option<kvx_posix::Collector>,
    /// The pinned pools of a GPU engine (the host tier's, the export staging buffers), kept
    /// until after the server and the driver stop.
    #[cfg(feature = "cuda")]
    _pinned: Vec<kvx_cuda::PinnedPool>,
    adopted: usize,
    direct: bool,
}

fn setup(what: &'static str) -> impl Fn(String) -> OffloadError {
    move |reason| OffloadError::Setup { what, reason }
}

impl OffloadBuilder {
    /// A builder for `memory` with `cfg`.
    pub fn new(cfg: OffloadConfig, memory: EngineMemory) -> OffloadBuilder {
        OffloadBuilder {
            cfg,
            memory,
            driver: DriverConfig::default(),
            shard: None,
        }
    }

    /// This worker holds `shard` of each block (a tensor- or pipeline-parallel rank): its file
    /// tier lives in the shard's directory under each root (created if missing; see
    /// [`kvx_posix::shard`]). A layout of one worker keeps the roots as they are.
    pub fn shard(mut self, shard: kvx_posix::Shard) -> OffloadBuilder {
        self.shard = (shard.world() > 1).then_some(shard);
        self
    }

    /// Driver settings other than the defaults (tracker limits).
    pub fn driver_config(mut self, driver: DriverConfig) -> OffloadBuilder {
        self.driver = driver;
        self
    }

    /// Validate the config, open the file tier (its startup scan), start the driver with the
    /// engine and file backends, size the pool, build both sides, adopt the blocks the scan
    /// found, and install the file-tier hook that removes evicted and corrupt block files.
    pub fn build(self) -> Result<Offload, OffloadError> {
        let OffloadBuilder {
            mut cfg,
            memory,
            driver: driver_cfg,
            shard,
        } = self;
        cfg.validate()?;
        if let (Some(s), Some(f)) = (shard, cfg.file.as_mut()) {
            f.roots = shard_roots(s, &f.roots)?;
        }
        let mut b = DriverBuilder::new(driver_cfg);
        #[cfg(feature = "cuda")]
        let mut pinned = Vec::new();
        #[cfg(feature = "cuda")]
        let mut engine_order = None;
        // A GPU engine's exports are staged in host buffers the server reads from.
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut staging = None;
        let rank = shard.map_or(0, |s| s.rank());
        // The producer's server reads a host engine's memory directly, and a GPU engine's
        // exports from staging buffers.
        let producer = cfg.remote.as_ref().filter(|r| r.listen.is_some());
        let mut exporter = None;
        let (engine, block_bytes, pool) = match memory.kind {
            MemoryKind::Cpu(layout) => {
                if producer.is_some() {
                    // SAFETY: the caller of `EngineMemory::cpu` promised the regions stay
                    // valid until the runtime shuts down, which drops the server first; the
                    // engine frees an exported block only once its release is reported.
                    let e = unsafe { kvx_rdma::Exporter::new(layout.clone()) }
                        .map_err(|e| setup("remote exporter")(e.to_string()))?;
                    exporter = Some(e);
                }
                if !layout.is_cpu() {
                    return Err(OffloadError::config(
                        "engine memory",
                        "EngineMemory::cpu needs a layout of CPU memory",
                    ));
                }
                let (bytes, blocks) = (layout.block_bytes(), layout.num_blocks());
                let host = CpuBackendConfig {
                    threads: cfg.copy_threads,
                    ..CpuBackendConfig::default()
                };
                // SAFETY: the caller of `EngineMemory::cpu` promised what `CpuBackend::new`
                // needs; the backend lives in the driver, which the runtime stops before the
                // promise ends.
                let backend = unsafe { CpuBackend::new(layout, host) }
                    .map_err(|e| setup("CPU backend")(e.to_string()))?;
                let pool = BufferPool::new(cfg.pool_buffers(blocks), bytes, DEFAULT_ALIGN)
                    .map_err(|e| setup("buffer pool")(e.to_string()))?;
                (b.backend(Box::new(backend)), bytes, pool)
            }
            #[cfg(feature = "cuda")]
            MemoryKind::Cuda(device, layout) => {
                let (bytes, blocks) = (layout.block_bytes(), layout.num_blocks());
                // SAFETY: the caller of `EngineMemory::cuda` promised what `CudaBackend::new`
                // needs, until the runtime stops the driver that owns the backend.
                let mut gpu = unsafe {
                    kvx_cuda::CudaBackend::new(
                        &device,
                        layout,
                        kvx_cuda::CudaBackendConfig::default(),
                    )
                }
                .map_err(|e| setup("CUDA backend")(e.to_string()))?;
                engine_order = Some(
                    gpu.engine_order()
                        .map_err(|e| setup("CUDA backend")(e.to_string()))?,
                );
                let p = gpu
                    .pinned_pool(cfg.pool_buffers(blocks), bytes)
                    .map_err(|e| setup("pinned pool")(e.to_string()))?;
                let pool = (*p).clone();
                pinned.push(p);
                if let Some(r) = producer {
                    let p = gpu
                        .pinned_pool(r.export_blocks, bytes)
                        .map_err(|e| setup("export staging buffers")(e.to_string()))?;
                    let area = p
                        .layout()
                        .map_err(|e| setup("export staging buffers")(e.to_string()))?;
                    // SAFETY: the buffers' memory lives as long as a handle to their pool:
                    // the runtime holds one (`pinned`) until after the server stops. A buffer
                    // is written only by its copy out of engine memory, before its export
                    // starts, and reused only after the exporter released it.
                    let e = unsafe { kvx_rdma::Exporter::new(area) }
                        .map_err(|e| setup("remote exporter")(e.to_string()))?;
                    exporter = Some(e);
                    staging = Some(crate::worker::Staging::new((*p).clone()));
                    pinned.push(p);
                }
                (b.backend(Box::new(gpu)), bytes, pool)
            }
            MemoryKind::Backend {
                backend,
                block_bytes,
                blocks,
            } => {
                let pool = BufferPool::new(cfg.pool_buffers(blocks), block_bytes, DEFAULT_ALIGN)
                    .map_err(|e| setup("buffer pool")(e.to_string()))?;
                (b.backend(backend), block_bytes, pool)
            }
        };
        if producer.is_some() && exporter.is_none() {
            return Err(OffloadError::config(
                "remote.listen",
                "a producer serves engine memory in CPU RAM or on a GPU (this engine's is neither)",
            ));
        }
        let files = open_file_tier(&cfg, block_bytes, &mut b)?;
        let importer = match &cfg.remote {
            Some(r) => {
                let imp = kvx_rdma::Importer::new(kvx_rdma::ImporterConfig {
                    reader: rank,
                    token: r.token.clone(),
                    // The scheduler side's lease keeper renews the leases.
                    heartbeats: false,
                    threads: r
                        .threads
                        .unwrap_or(kvx_rdma::ImporterConfig::default().threads),
                    ..kvx_rdma::ImporterConfig::default()
                })
                .map_err(|e| setup("remote importer")(e.to_string()))?;
                let handle = imp.handle();
                Some((handle, b.backend(Box::new(imp))))
            }
            None => None,
        };
        let driver = b.spawn().map_err(|e| setup("driver")(e.to_string()))?;
        let server = match (
            &exporter,
            cfg.remote.as_ref().and_then(|r| r.listen_addr(rank)),
        ) {
            (Some(e), Some(listen)) => Some(
                kvx_rdma::TcpServer::start(
                    e.clone(),
                    kvx_rdma::ServerConfig {
                        listen,
                        token: cfg.remote.as_ref().and_then(|r| r.token.clone()),
                        threads: cfg
                            .remote
                            .as_ref()
                            .and_then(|r| r.threads)
                            .unwrap_or(kvx_rdma::ServerConfig::default().threads),
                        ..kvx_rdma::ServerConfig::default()
                    },
                )
                .map_err(|e| setup("remote server")(e.to_string()))?,
            ),
            _ => None,
        };
        let mut scheduler = SchedulerSide::new(cfg.scheduler())?;
        let adopted = scheduler.adopt_file_blocks(files.keys());
        if let Some(p) = &files.probe {
            scheduler.set_file_probe(p.clone());
        }
        if cfg
            .file
            .as_ref()
            .and_then(|f| f.shared.as_ref())
            .is_some_and(|m| m.write_back)
        {
            scheduler.set_write_back();
        }
        let mut worker = WorkerSide::new(
            driver.handle(),
            TierRoutes {
                engine,
                file: files.route,
            },
            pool,
            files.hook.clone(),
            WorkerConfig {
                block_tokens: cfg.block_tokens,
                block_bytes,
                timeouts: cfg.timeouts,
                policy: cfg.load_failure,
                preempt_wait: Duration::from_millis(cfg.preempt_wait_ms),
            },
        )?;
        #[cfg(feature = "cuda")]
        if let Some(order) = engine_order {
            worker.set_engine_order(order);
        }
        if let (Some(r), Some((handle, backend))) = (&cfg.remote, importer) {
            worker.set_remote(RemotePart::new(
                exporter,
                handle,
                backend,
                rank,
                kvx_policy::LeaseConfig {
                    ttl_ms: r.lease_ttl_ms,
                    heartbeat_interval_ms: r.heartbeat_ms,
                    expected_readers: 1,
                },
                Duration::from_millis(r.load_ms),
                staging,
            ));
        }
        Ok(Offload {
            scheduler,
            worker,
            runtime: OffloadRuntime {
                server,
                driver: Some(driver),
                files: files.handle,
                _collector: files.collector,
                #[cfg(feature = "cuda")]
                _pinned: pinned,
                adopted,
                direct: files.direct,
            },
        })
    }
}

/// The scheduler side alone, for an engine whose scheduler runs in a process of its own (vLLM's
/// scheduler process; the worker process builds the rest with [`OffloadBuilder::build`]): `cfg`
/// validated, and the blocks the file tier's startup scan finds adopted into its index. The
/// scan opens the tier with one psync thread and no spare files, and closes it again.
///
/// A shared mount is refused: a scheduler side of its own has no store to probe the mount with.
pub fn scheduler_side(cfg: &OffloadConfig) -> Result<SchedulerSide, OffloadError> {
    cfg.validate()?;
    let mut side = SchedulerSide::new(cfg.scheduler())?;
    if let Some(f) = &cfg.file {
        if f.shared.is_some() {
            return Err(OffloadError::config(
                "file.shared",
                "a scheduler side built on its own cannot probe a shared mount (build both \
                 sides in one process with OffloadBuilder)",
            ));
        }
        let mut p = posix_config(f, 0);
        p.io_engine = kvx_posix::IoEngine::Psync;
        p.queue_depth = 1;
        p.spare_files = 0;
        let store =
            kvx_posix::PosixStore::open(p).map_err(|e| setup("file tier")(e.to_string()))?;
        side.adopt_file_blocks(store.handle().keys());
    }
    Ok(side)
}

/// The scheduler side of an engine whose KV cache is split over `tp_size × pp_size` workers,
/// each with its own shard of every block ([`OffloadBuilder::shard`]): as [`scheduler_side`],
/// with the job results of all ranks merged ([`SchedulerSide::set_world`]), and a block the file
/// tier holds adopted only when every shard directory holds it (a block some worker never wrote
/// cannot be loaded; `kvx gc` and `kvx verify --repair` remove such leftovers). A layout of one
/// worker is exactly [`scheduler_side`].
pub fn scheduler_side_sharded(
    cfg: &OffloadConfig,
    tp_size: u32,
    pp_size: u32,
) -> Result<SchedulerSide, OffloadError> {
    let shards = kvx_posix::Shard::all(tp_size, pp_size);
    if shards.is_empty() {
        return Err(OffloadError::config(
            "parallel layout",
            format!("tensor size {tp_size} x pipeline size {pp_size}: both must be at least 1"),
        ));
    }
    if shards.len() == 1 {
        return scheduler_side(cfg);
    }
    cfg.validate()?;
    let mut side = SchedulerSide::new(cfg.scheduler())?;
    side.set_world(shards.len() as u32);
    let Some(f) = &cfg.file else {
        return Ok(side);
    };
    if f.shared.is_some() {
        return Err(OffloadError::config(
            "file.shared",
            "a scheduler side built on its own cannot probe a shared mount (build both \
             sides in one process with OffloadBuilder)",
        ));
    }
    let mut complete: Option<rustc_hash::FxHashSet<kvx_core::BlockKey>> = None;
    for s in shards {
        let mut fs = f.clone();
        fs.roots = shard_roots(s, &f.roots)?;
        let mut p = posix_config(&fs, 0);
        p.io_engine = kvx_posix::IoEngine::Psync;
        p.queue_depth = 1;
        p.spare_files = 0;
        let store =
            kvx_posix::PosixStore::open(p).map_err(|e| setup("file tier")(e.to_string()))?;
        let keys = store.handle().keys().into_iter();
        complete = Some(match complete {
            None => keys.collect(),
            Some(c) => keys.filter(|k| c.contains(k)).collect(),
        });
    }
    side.adopt_file_blocks(complete.unwrap_or_default());
    Ok(side)
}

/// `shard`'s directory under each of `roots`, created if missing.
fn shard_roots(
    shard: kvx_posix::Shard,
    roots: &[std::path::PathBuf],
) -> Result<Vec<std::path::PathBuf>, OffloadError> {
    let dirs = shard.roots(roots);
    for d in &dirs {
        std::fs::create_dir_all(d).map_err(|e| {
            OffloadError::config("file.roots", format!("cannot create {}: {e}", d.display()))
        })?;
    }
    Ok(dirs)
}

/// The file tier as the builder set it up (all empty without one).
#[derive(Default)]
struct FileTier {
    route: Option<kvx_core::BackendId>,
    hook: Option<Arc<dyn FileTierHook>>,
    /// Set on a shared mount.
    probe: Option<Arc<dyn FileTierProbe>>,
    direct: bool,
    handle: Option<kvx_posix::PosixHandle>,
    collector: Option<kvx_posix::Collector>,
}

impl FileTier {
    /// Blocks the startup scan found.
    fn keys(&self) -> Vec<kvx_core::BlockKey> {
        if let Some(h) = &self.handle {
            return h.keys();
        }
        Vec::new()
    }
}

/// Open the configured file tier (its startup scan runs here) and register its backend.
fn open_file_tier(
    cfg: &OffloadConfig,
    block_bytes: usize,
    b: &mut DriverBuilder,
) -> Result<FileTier, OffloadError> {
    let Some(f) = &cfg.file else {
        return Ok(FileTier::default());
    };
    let store = kvx_posix::PosixStore::open(posix_config(f, block_bytes))
        .map_err(|e| setup("file tier")(e.to_string()))?;
    let handle = store.handle();
    let probe: Option<Arc<dyn FileTierProbe>> = match &f.shared {
        Some(_) => Some(Arc::new(handle.clone())),
        None => None,
    };
    let collector = match f
        .shared
        .as_ref()
        .and_then(|m| m.quota_bytes.map(|q| (m, q)))
    {
        Some((m, quota)) => {
            let c = kvx_posix::CollectorConfig {
                quota_bytes: quota,
                interval: m.collect_interval,
                stale_temp_age: Duration::from_secs(f.stale_temp_s),
            };
            Some(
                kvx_posix::Collector::spawn(handle.clone(), c)
                    .map_err(|e| setup("file tier collector")(e.to_string()))?,
            )
        }
        None => None,
    };
    Ok(FileTier {
        direct: store.capabilities().direct,
        hook: Some(Arc::new(handle.clone())),
        probe,
        handle: Some(handle),
        collector,
        route: Some(b.backend(Box::new(store))),
    })
}

/// The file tier's store settings; its spare files are preallocated for `block_bytes` blocks.
fn posix_config(f: &crate::config::FileTierConfig, block_bytes: usize) -> kvx_posix::PosixConfig {
    let mut p = kvx_posix::PosixConfig::new(f.roots[0].clone());
    p.roots = f.roots.clone();
    p.io_engine = f.io_engine;
    p.direct = f.direct;
    p.queue_depth = f.queue_depth;
    p.fdatasync = f.fdatasync;
    p.spare_files = f.spare_files;
    p.spare_block_bytes = block_bytes;
    p.breaker = f.breaker;
    p.stale_temp_age = Duration::from_secs(f.stale_temp_s);
    p.shared = f.shared.clone();
    p
}

impl OffloadRuntime {
    /// The driver's handle (tracker counters, fences).
    pub fn driver(&self) -> Option<&DriverHandle> {
        self.driver.as_deref()
    }

    /// The file tier's handle: lookups, counters, health of each root.
    pub fn files(&self) -> Option<&kvx_posix::PosixHandle> {
        self.files.as_ref()
    }

    /// Blocks the file tier's startup scan found and the index adopted.
    pub fn adopted_blocks(&self) -> usize {
        self.adopted
    }

    /// True when the file tier uses O_DIRECT on every root.
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    /// Stop the driver thread and drop the backends. When this returns no kvx thread touches
    /// engine memory any more (ops still in a backend are drained or abandoned with their
    /// buffers); later calls on the two sides return an error.
    pub fn shutdown(mut self) {
        self.server.take();
        self.driver.take();
    }

    /// Where the remote tier's server listens (a producer's), if any.
    pub fn remote_addr(&self) -> Option<std::net::SocketAddr> {
        self.server.as_ref().map(|s| s.local_addr())
    }
}
