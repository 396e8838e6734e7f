//! `WorkerHalf`: kvx-offload's worker side for Python (each vLLM worker), wired to the engine's
//! KV tensors (host backend), a host tier and an optional file tier (kvx-posix).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use kvx_core::{
    BlockKey, BufferPool, DEFAULT_ALIGN, Driver, DriverBuilder, DriverConfig, KvLayout,
};
use kvx_offload::{FileTierHook, TierRoutes, WorkerConfig, WorkerSide};
use kvx_policy::{LoadFailurePolicy, TimeoutConfig};
use kvx_posix::{EngineKind, PosixConfig, PosixHandle, PosixStore};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::memory::{self, TensorDesc};
use crate::scheduler::check_file_dirs;
use crate::{KvxError, codec, keys_from_bytes};

/// Staging buffers beyond the host tier (file loads that are not promoted, stores in flight).
const STAGING_BUFFERS: usize = 64;

/// Host backend copy threads.
const COPY_THREADS: usize = 2;

struct Hook(PosixHandle);

impl FileTierHook for Hook {
    fn remove(&self, key: BlockKey) {
        self.0.remove(key);
    }
}

/// The running parts. Field order is drop order: the worker half, then the driver (which joins
/// its backends' threads), then the file handle.
struct Running {
    worker: WorkerSide,
    driver: Driver,
    files: Option<PosixHandle>,
}

/// The worker half over the engine's KV tensors.
#[pyclass(module = "kvx._native")]
pub struct WorkerHalf {
    /// Declared before `tensors`: dropped (driver stopped) before the tensors are let go.
    running: Mutex<Option<Running>>,
    /// The tensor objects described at construction, kept alive while kvx may copy into them.
    tensors: Mutex<Vec<Py<PyAny>>>,
    layout: KvLayout,
}

impl WorkerHalf {
    fn lock(&self) -> MutexGuard<'_, Option<Running>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn with<T>(&self, f: impl FnOnce(&mut Running) -> PyResult<T>) -> PyResult<T> {
        match self.lock().as_mut() {
            Some(r) => f(r),
            None => Err(KvxError::new_err("the kvx worker half is closed")),
        }
    }
}

type TensorTuple = (String, usize, Vec<i64>, Vec<i64>, usize, String);

#[pymethods]
impl WorkerHalf {
    /// A worker half. `tensors` describes each KV tensor as (name, data pointer, shape,
    /// strides in elements, element size, device); `owners` are the tensor objects themselves,
    /// held until `close`.
    #[new]
    #[pyo3(signature = (tensors, owners, num_blocks, block_tokens, host_blocks, load_ms, store_ms,
                        io_engine, file_dirs=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        tensors: Vec<TensorTuple>,
        owners: Vec<Py<PyAny>>,
        num_blocks: u32,
        block_tokens: u32,
        host_blocks: usize,
        load_ms: u64,
        store_ms: u64,
        io_engine: &str,
        file_dirs: Option<Vec<PathBuf>>,
    ) -> PyResult<WorkerHalf> {
        let descs: Vec<TensorDesc> = tensors
            .into_iter()
            .map(
                |(name, ptr, shape, strides, elem_size, device)| TensorDesc {
                    name,
                    ptr,
                    shape,
                    strides,
                    elem_size,
                    device,
                },
            )
            .collect();
        let layout = memory::describe(&descs, num_blocks)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let engine_kind: EngineKind = io_engine
            .parse()
            .map_err(|e| PyValueError::new_err(format!("io_engine: {e}")))?;
        if let Some(d) = &file_dirs {
            check_file_dirs(d)?;
        }
        let lay = layout.clone();
        let running = py
            .detach(move || {
                start(
                    lay,
                    block_tokens,
                    host_blocks,
                    load_ms,
                    store_ms,
                    engine_kind,
                    file_dirs,
                )
            })
            .map_err(PyValueError::new_err)?;
        Ok(WorkerHalf {
            running: Mutex::new(Some(running)),
            tensors: Mutex::new(owners),
            layout,
        })
    }

    /// Start a step with the scheduler half's encoded instructions: drop evicted blocks, start
    /// loads, queue stores, flush and fence preempted requests (waits at most the store
    /// deadline for that), pass finished requests on.
    fn start_step(&self, py: Python<'_>, meta: &[u8]) -> PyResult<()> {
        let meta = codec::decode_meta(meta).map_err(|e| KvxError::new_err(e.to_string()))?;
        py.detach(|| {
            self.with(|r| {
                r.worker
                    .start_step(meta)
                    .map_err(|e| KvxError::new_err(e.to_string()))
            })
        })
    }

    /// What finished since the last call (never blocks): (finished_sending,
    /// finished_recving, invalid engine blocks, encoded job outcomes for the scheduler half
    /// (empty when none), requests whose load job ended — abandoned ones included).
    #[allow(clippy::type_complexity)]
    fn get_finished<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Vec<u64>, Vec<u64>, Vec<u32>, Bound<'py, PyBytes>, Vec<u64>)> {
        let out = self.with(|r| Ok(r.worker.get_finished()))?;
        let jobs = if out.jobs.is_empty() {
            Vec::new()
        } else {
            codec::encode_jobs(&out.jobs)
        };
        Ok((
            out.finished_sending.iter().map(|r| r.0).collect(),
            out.finished_recving.iter().map(|r| r.0).collect(),
            out.invalid_blocks.iter().map(|b| b.0).collect(),
            PyBytes::new(py, &jobs),
            out.jobs
                .iter()
                .filter(|j| j.kind == kvx_offload::JobKind::Load)
                .map(|j| j.request.0)
                .collect(),
        ))
    }

    /// Jobs and requests in flight here (0 when idle).
    fn in_flight(&self) -> PyResult<usize> {
        self.with(|r| Ok(r.worker.in_flight()))
    }

    /// True when the driver's tracker holds no task, request, timer or zombie.
    fn tracker_idle(&self) -> PyResult<bool> {
        self.with(|r| {
            r.driver
                .stats()
                .map(|(_, empty)| empty)
                .map_err(|e| KvxError::new_err(e.to_string()))
        })
    }

    /// Counters: the driver's tracker (tasks, zombies, timeouts, late completions) and the file
    /// tier's (blocks loaded, stored, corrupt, rejected by an open breaker, I/Os in flight).
    fn stats(&self) -> PyResult<Vec<(&'static str, u64)>> {
        self.with(|r| {
            let (t, _) = r
                .driver
                .stats()
                .map_err(|e| KvxError::new_err(e.to_string()))?;
            let mut out = vec![
                ("live_tasks", t.live_tasks as u64),
                ("active_ops", t.active_ops as u64),
                ("zombie_ops", t.zombie_ops as u64),
                ("zombie_bytes", t.zombie_bytes),
                ("late_completions", t.late_completions),
                ("timed_out", t.timed_out),
                ("host_blocks", r.worker.host_blocks() as u64),
            ];
            if let Some(f) = &r.files {
                let p = f.stats();
                out.extend([
                    ("file_blocks", f.len() as u64),
                    ("file_in_flight", p.in_flight as u64),
                    ("file_written_off", p.written_off as u64),
                    ("file_loaded", p.loaded),
                    ("file_stored", p.stored),
                    ("file_corrupt", p.corrupt),
                    ("file_rejected", p.rejected),
                ]);
            }
            Ok(out)
        })
    }

    /// Blocks held in the host tier.
    fn host_blocks(&self) -> PyResult<usize> {
        self.with(|r| Ok(r.worker.host_blocks()))
    }

    /// Buffers lent out of the pool (host tier + staging + in flight).
    fn pool_lent(&self) -> PyResult<usize> {
        self.with(|r| Ok(r.worker.pool().lent()))
    }

    /// Bytes of one engine block, as kvx stores it.
    fn block_bytes(&self) -> usize {
        self.layout.block_bytes()
    }

    /// The registered regions: (base address, block stride, segment length) each.
    fn regions(&self) -> Vec<(usize, usize, usize)> {
        self.layout
            .regions()
            .iter()
            .map(|r| (r.base, r.stride, r.segment_len))
            .collect()
    }

    /// Blocks the file tier holds (0 without one).
    fn file_blocks(&self) -> PyResult<usize> {
        self.with(|r| Ok(r.files.as_ref().map_or(0, |f| f.len())))
    }

    /// Path of the file that holds the block keyed `key` (16 bytes), without a file tier `None`.
    fn file_block_path(&self, key: &[u8]) -> PyResult<Option<PathBuf>> {
        let k = keys_from_bytes(key)?;
        let [k] = k[..] else {
            return Err(PyValueError::new_err("file_block_path: one 16-byte key"));
        };
        self.with(|r| Ok(r.files.as_ref().map(|f| f.block_path(k))))
    }

    /// Stop the driver and its backends, then let go of the tensors. Idempotent.
    fn close(&self, py: Python<'_>) {
        let running = self.lock().take();
        py.detach(move || drop(running));
        self.tensors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

fn start(
    layout: KvLayout,
    block_tokens: u32,
    host_blocks: usize,
    load_ms: u64,
    store_ms: u64,
    engine_kind: EngineKind,
    file_dirs: Option<Vec<PathBuf>>,
) -> Result<Running, String> {
    let buf_size = layout.block_bytes().div_ceil(DEFAULT_ALIGN) * DEFAULT_ALIGN;
    let mut b = DriverBuilder::new(DriverConfig::default());
    // SAFETY: the layout describes the tensors `WorkerHalf` holds in `tensors` until after this
    // driver is dropped (see `memory::host_backend`).
    let host = unsafe { memory::host_backend(layout, COPY_THREADS) }.map_err(|e| e.to_string())?;
    let engine = b.backend(Box::new(host));
    let (file, files) = match file_dirs {
        Some(dirs) => {
            let mut cfg = PosixConfig::new(dirs[0].clone());
            cfg.roots = dirs;
            cfg.engine = engine_kind;
            let store = PosixStore::open(cfg).map_err(|e| format!("file_dirs: {e}"))?;
            let handle = store.handle();
            (Some(b.backend(Box::new(store))), Some(handle))
        }
        None => (None, None),
    };
    let pool = BufferPool::new(host_blocks + STAGING_BUFFERS, buf_size, DEFAULT_ALIGN)
        .map_err(|e| format!("host_blocks: {e}"))?;
    let driver = b.spawn().map_err(|e| e.to_string())?;
    let worker = WorkerSide::new(
        driver.handle(),
        TierRoutes { engine, file },
        pool,
        files
            .clone()
            .map(|f| Arc::new(Hook(f)) as Arc<dyn FileTierHook>),
        WorkerConfig {
            block_tokens,
            timeouts: TimeoutConfig { load_ms, store_ms },
            // The exact failed blocks go to the engine; its own policy decides.
            policy: LoadFailurePolicy::Fail,
        },
    );
    Ok(Running {
        worker,
        driver,
        files,
    })
}
