//! `WorkerSide`: kvx-offload's worker side for Python (each vLLM worker), built by
//! kvx-offload's `OffloadBuilder` over the engine's KV tensors (host memory, or a CUDA device
//! through kvx-cuda), a host tier and an optional file tier (kvx-posix).

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvx_core::{EngineBlockId, FenceWait, KvLayout, RequestId, TICK, lock};
use kvx_offload::{
    JobResult, LoadHoldBack, OffloadBuilder, OffloadRuntime, ReleasedLoads, StepStarted,
    WorkerOutput,
};
use kvx_policy::BreakerState;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::config::connector_config;
use crate::memory::{self, TensorDesc};
use kvx_connector::codec;
use kvx_connector::worker::WorkerRequests;

use crate::{FenceNotHeldError, KvxError, keys_from_bytes, kvx_err};

/// The running parts. Field order is drop order: the worker side, then the runtime (its driver
/// joins the backends' threads).
struct Running {
    worker: kvx_offload::WorkerSide,
    runtime: OffloadRuntime,
    /// How long a step waits for a fence beyond the copies it waits for (`preempt_wait_ms`).
    fence_grace: Duration,
    /// How long a step waits for the loads its forward reads: the load deadline and a second.
    in_step_wait: Duration,
    /// The engine's id of each request a step named, until it is reported.
    requests: WorkerRequests,
    /// Engine blocks whose load failed, since the engine last asked.
    invalid: Vec<u32>,
    /// Job outcomes for the scheduler side, since they were last taken.
    jobs: Vec<JobResult>,
    /// Ended loads (local and remote) held back until no copy can write their blocks.
    hold_back: LoadHoldBack,
    /// The file tier's roots with a breaker not closed, as the last `take_stats` said.
    breakers_open: usize,
    /// What `wait_loads` took from the worker side, for the next `get_finished`.
    taken: Taken,
}

/// A worker output with the loads the hold-back released from it.
#[derive(Default)]
struct Taken {
    out: WorkerOutput,
    released: ReleasedLoads,
}

impl Running {
    /// Everything that finished since the last call, this call's and what `wait_loads` took.
    fn take_finished(&mut self) -> PyResult<Taken> {
        let out = self.worker.get_finished().map_err(kvx_err)?;
        let released = self.hold_back.take(&out);
        let mut taken = std::mem::take(&mut self.taken);
        taken.out.merge(out);
        taken.released.merge(released);
        Ok(taken)
    }
}

/// The worker side over the engine's KV tensors.
#[pyclass(module = "kvx._native")]
pub struct WorkerSide {
    /// Declared before `tensors`: dropped (driver stopped) before the tensors are let go.
    running: Mutex<Option<Running>>,
    /// The tensor objects described at construction, kept alive while kvx may copy into them.
    tensors: Mutex<Vec<Py<PyAny>>>,
    layout: KvLayout,
    /// This worker's global rank (named in its job reports; 0 for a single worker).
    rank: u32,
}

impl WorkerSide {
    fn with<T>(&self, f: impl FnOnce(&mut Running) -> PyResult<T>) -> PyResult<T> {
        match lock(&self.running).as_mut() {
            Some(r) => f(r),
            None => Err(KvxError::new_err("the kvx worker side is closed")),
        }
    }

    /// Flush the stores queued on engine `blocks` and wait until no copy touches them any
    /// more: `preempt_wait_ms`, and beyond it while those copies are within their deadlines.
    /// `FenceNotHeldError` if the fence does not hold (a copy stuck past its deadline, or the
    /// driver stopped).
    fn fence_over(&self, blocks: &[EngineBlockId]) -> PyResult<()> {
        let (fence, grace) = self.with(|r| {
            let d = r
                .runtime
                .driver()
                .ok_or_else(|| kvx_err("driver stopped"))?;
            Ok((d.fence_blocks(blocks).map_err(kvx_err)?, r.fence_grace))
        })?;
        fence_held(fence.wait_for_copies(grace), || {
            format!("the fence over {} reused engine blocks", blocks.len())
        })
    }

    /// Wait, at most `timeout`, until the engine may hear of the end of each load of
    /// `requests` (none still in flight or held back); what finished meanwhile stays for
    /// `get_finished`. Returns the requests whose load had not ended by then.
    fn wait_loads(&self, requests: &[RequestId], timeout: Duration) -> PyResult<Vec<u64>> {
        let until = Instant::now() + timeout;
        loop {
            let (left, driver) = self.with(|r| {
                let taken = r.take_finished()?;
                r.taken = taken;
                let left: Vec<u64> = requests
                    .iter()
                    .filter(|q| r.hold_back.holds(**q))
                    .map(|q| q.0)
                    .collect();
                Ok((left, r.runtime.driver().cloned()))
            })?;
            let now = Instant::now();
            let Some(driver) = driver.filter(|_| !left.is_empty() && now < until) else {
                return Ok(left);
            };
            // A cut-short load waits for a fence the driver's passes do not announce: look
            // again after one tick at most.
            driver.wait_finished(until.min(now + TICK));
        }
    }
}

type TensorTuple = (String, usize, Vec<i64>, Vec<i64>, usize, String);

/// `store_skipped_<reason>` counters, as the connector's stats name them.
pub(crate) fn skipped(skips: &kvx_offload::StoreSkips) -> impl Iterator<Item = (String, u64)> + '_ {
    skips.iter().map(|(r, n)| (format!("store_skipped_{r}"), n))
}

/// What `get_finished` hands to Python, by the engine's request ids: (finished_sending,
/// finished_recving, failed_recving).
type Finished = (Vec<String>, Vec<String>, Vec<String>);

#[pymethods]
impl WorkerSide {
    /// A worker side with the connector's settings `config` (vLLM's extra config, as JSON) and
    /// vLLM's `block_tokens`, over `num_blocks` engine blocks. `tensors` describes each KV
    /// tensor as (name, data pointer, shape, strides in elements, element size, device);
    /// `owners` are the tensor objects themselves, held until `close`. `shard`: this worker's
    /// place in a parallel layout, (tensor rank, tensor size, pipeline rank, pipeline size): its
    /// file tier is the shard's own directory under each root, and its job reports name its rank.
    #[new]
    #[pyo3(signature = (config, block_tokens, tensors, owners, num_blocks, shard=None))]
    fn new(
        py: Python<'_>,
        config: &str,
        block_tokens: u32,
        tensors: Vec<TensorTuple>,
        owners: Vec<Py<PyAny>>,
        num_blocks: u32,
        shard: Option<(u32, u32, u32, u32)>,
    ) -> PyResult<WorkerSide> {
        let shard = shard
            .map(|(t, tn, p, pn)| kvx_offload::Shard::new(t, tn, p, pn))
            .transpose()
            .map_err(|e| PyValueError::new_err(format!("shard: {e}")))?;
        let rank = shard.map_or(0, |s| s.rank());
        let cfg = py.detach(|| connector_config(config, block_tokens))?;
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
        let fence_grace = Duration::from_millis(cfg.preempt_wait_ms);
        let in_step_wait = Duration::from_millis(cfg.timeouts.load_ms) + Duration::from_secs(1);
        let lay = layout.clone();
        let built = py.detach(move || {
            // SAFETY: the layout describes the tensors `WorkerSide` holds in `tensors` until
            // after this runtime is dropped (see `memory::engine_memory`).
            let memory = unsafe { memory::engine_memory(lay) }?;
            let b = OffloadBuilder::new(cfg, memory);
            match shard {
                Some(s) => b.shard(s).build(),
                None => b.build(),
            }
            .map_err(|e| e.to_string())
        });
        let built = built.map_err(PyValueError::new_err)?;
        drop(built.scheduler); // the scheduler side lives in vLLM's scheduler process
        Ok(WorkerSide {
            running: Mutex::new(Some(Running {
                worker: built.worker,
                runtime: built.runtime,
                fence_grace,
                in_step_wait,
                requests: WorkerRequests::new(),
                invalid: Vec::new(),
                jobs: Vec::new(),
                breakers_open: 0,
                hold_back: LoadHoldBack::new(),
                taken: Taken::default(),
            })),
            tensors: Mutex::new(owners),
            layout,
            rank,
        })
    }

    /// Start the step of the scheduler side's message `msg` (`SchedulerSide.build_meta`), once:
    /// a step handed over again is not started again. In order: the message's fence over
    /// engine blocks handed to another use (sliding-window store sources), then kvx-offload's
    /// step (drop evicted blocks, start loads, queue stores, flush and fence preempted requests,
    /// pass finished requests on), then the wait for the loads this step's forward reads (at
    /// most the load deadline and a second). A fence is waited for `preempt_wait_ms`, and beyond
    /// it while the copies it waits for are within their deadlines (plus one tick); one that
    /// still does not hold (a copy stuck past its deadline, or the driver stopped) raises
    /// `FenceNotHeldError`: the engine must not reuse those blocks. Returns the requests whose
    /// in-step load had not ended by then (empty: all ended). The other methods answer while
    /// it waits.
    fn start_step(&self, py: Python<'_>, msg: &[u8]) -> PyResult<Vec<u64>> {
        let msg = codec::decode_step(msg).map_err(kvx_err)?;
        py.detach(|| {
            if !self.with(|r| Ok(r.requests.start(&msg)))? {
                return Ok(Vec::new());
            }
            if !msg.fence.is_empty() {
                self.fence_over(&msg.fence)?;
            }
            let in_step = msg.in_step;
            let started = self.with(|r| {
                r.hold_back.step_started(&msg.meta);
                let started = r.worker.start_step(msg.meta).map_err(kvx_err)?;
                Ok((started, r.fence_grace, r.in_step_wait))
            })?;
            // The forward may overwrite the preempted requests' blocks right after this call.
            let (started, grace, in_step_wait) = started;
            if let StepStarted::FenceOutstanding(fence) = started {
                let requests = fence.requests().to_vec();
                fence_held(fence.wait_for_copies(grace), || {
                    format!("the preemption fence of {requests:?}")
                })?;
            }
            if in_step.is_empty() {
                return Ok(Vec::new());
            }
            self.wait_loads(&in_step, in_step_wait)
        })
    }

    /// Order every copy of engine memory this side submits from now on after the work the
    /// engine queued so far on its CUDA stream `stream` (`torch.cuda.current_stream(device)
    /// .cuda_stream` of the KV cache's device): call it at the start of each step, before any
    /// call that may submit a copy (`fence_blocks`, `start_step`, `fence_engine`). Never waits
    /// for the device; nothing to do for a CPU KV cache. A `KvxError` if the driver refused
    /// (then synchronize the stream before the step). The handle must be a live stream of the
    /// KV cache's device.
    fn order_after_engine_stream(&self, stream: usize) -> PyResult<()> {
        self.with(|r| {
            // SAFETY: the documented contract of this method: kvx.vllm passes torch's current
            // stream of the KV cache's device.
            unsafe { memory::order_after_engine_stream(&r.worker, stream) }.map_err(kvx_err)
        })
    }

    /// What finished since the last call, by the engine's request ids (never blocks): the
    /// requests whose delayed freeing may happen now, those whose load ended, and of those the
    /// ones whose load failed in a block. A load whose blocks a cut-short copy may still write
    /// is held back until kvx releases them. Failed blocks and job outcomes collect for
    /// `take_invalid` and `take_jobs`.
    fn get_finished(&self) -> PyResult<Finished> {
        self.with(|r| {
            let Taken { out, released } = r.take_finished()?;
            r.invalid
                .extend(released.invalid_blocks.iter().map(|b| b.0));
            r.jobs.extend(out.jobs);
            let told = r.requests.reported(&out.finished_sending, &released);
            Ok((
                told.finished_sending,
                told.finished_recving,
                told.failed_recving,
            ))
        })
    }

    /// Engine blocks whose load failed since the last call (vLLM's
    /// `get_block_ids_with_load_errors`), each once, ascending.
    fn take_invalid(&self) -> PyResult<Vec<u32>> {
        self.with(|r| {
            let mut out = std::mem::take(&mut r.invalid);
            out.sort_unstable();
            out.dedup();
            Ok(out)
        })
    }

    /// The job outcomes reported since the last call, encoded for the scheduler side's
    /// `update_from_worker` (naming this worker's rank); empty bytes when there are none.
    fn take_jobs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let jobs = self.with(|r| Ok(std::mem::take(&mut r.jobs)))?;
        let bytes = if jobs.is_empty() {
            Vec::new()
        } else {
            codec::encode_jobs(self.rank, &jobs)
        };
        Ok(PyBytes::new(py, &bytes))
    }

    /// `(names, loading, sending, abandoned)`: the requests whose report may still come, by
    /// what is still to come (all zero when idle).
    fn request_counts(&self) -> PyResult<[usize; 4]> {
        self.with(|r| Ok(r.requests.counts()))
    }

    /// Jobs and requests in flight here, and loads held back (0 when idle).
    fn in_flight(&self) -> PyResult<usize> {
        self.with(|r| Ok(r.worker.in_flight() + r.hold_back.len()))
    }

    /// True when the driver's tracker holds no task, request, timer or zombie.
    fn tracker_idle(&self) -> PyResult<bool> {
        self.with(|r| {
            let d = r
                .runtime
                .driver()
                .ok_or_else(|| kvx_err("driver stopped"))?;
            d.stats().map(|(_, empty)| empty).map_err(kvx_err)
        })
    }

    /// Counters: the driver's tracker (tasks, zombies, timeouts, late completions), the file
    /// tier's (blocks loaded, stored, corrupt, rejected by an open breaker, I/Os in flight), and
    /// `store_skipped_<reason>`: blocks whose store ended in no tier, by the kind of its last
    /// failure (`unavailable`: no staging buffer or an open breaker; `timed_out`, `io`...).
    fn stats(&self) -> PyResult<Vec<(String, u64)>> {
        self.with(|r| {
            let d = r
                .runtime
                .driver()
                .ok_or_else(|| kvx_err("driver stopped"))?;
            let (t, _) = d.stats().map_err(kvx_err)?;
            let mut out = vec![
                ("live_tasks", t.live_tasks as u64),
                ("active_ops", t.active_ops as u64),
                ("zombie_ops", t.zombie_ops as u64),
                ("zombie_bytes", t.zombie_bytes),
                ("late_completions", t.late_completions),
                ("timed_out", t.timed_out),
                ("host_blocks", r.worker.host_blocks() as u64),
            ];
            if let Some(f) = r.runtime.files() {
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
            let mut out: Vec<(String, u64)> =
                out.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            out.extend(skipped(r.worker.store_skips()));
            Ok(out)
        })
    }

    /// What this worker moved since the last call, as a dict for vLLM's stats (see
    /// `kvx.vllm.stats`), with `file_breakers_open` (the file tier's roots whose breaker is not
    /// closed) whenever that number is not 0 or was not 0 at the last call: `{}` while idle.
    fn take_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (stats, open) = self.with(|r| {
            let open = r.runtime.files().map_or(0, |f| {
                (0..f.capabilities().direct_per_root.len())
                    .filter(|root| f.breaker_state(*root) != Some(BreakerState::Closed))
                    .count()
            });
            let report = (open > 0 || r.breakers_open > 0).then_some(open);
            r.breakers_open = open;
            Ok((r.worker.take_stats(), report))
        })?;
        let d = crate::stats::to_dict(py, &stats)?;
        if let Some(open) = open {
            d.set_item("file_breakers_open", open)?;
        }
        Ok(d)
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
        self.with(|r| Ok(r.runtime.files().map_or(0, |f| f.len())))
    }

    /// Path of the file that holds the block keyed `key` (16 bytes), without a file tier `None`.
    fn file_block_path(&self, key: &[u8]) -> PyResult<Option<PathBuf>> {
        let k = keys_from_bytes(key)?;
        let [k] = k[..] else {
            return Err(PyValueError::new_err("file_block_path: one 16-byte key"));
        };
        self.with(|r| Ok(r.runtime.files().map(|f| f.block_path(k))))
    }

    /// A fence over every engine block (queued stores are copied now), waited for at most
    /// `timeout_ms`: true once no kvx copy into or out of engine memory is out. Before the
    /// engine's KV memory goes away (vLLM's sleep).
    fn fence_engine(&self, py: Python<'_>, timeout_ms: u64) -> PyResult<bool> {
        let blocks: Vec<EngineBlockId> = (0..self.layout.num_blocks()).map(EngineBlockId).collect();
        py.detach(|| {
            let fence = self.with(|r| {
                let d = r
                    .runtime
                    .driver()
                    .ok_or_else(|| kvx_err("driver stopped"))?;
                d.fence_blocks(&blocks).map_err(kvx_err)
            })?;
            Ok(fence.wait(Instant::now() + Duration::from_millis(timeout_ms)))
        })
    }

    /// Stop the driver and its backends, then let go of the tensors. Idempotent.
    fn close(&self, py: Python<'_>) {
        let running = lock(&self.running).take();
        py.detach(move || {
            if let Some(r) = running {
                drop(r.worker);
                r.runtime.shutdown();
            }
        });
        lock(&self.tensors).clear();
    }
}

/// `FenceNotHeldError` unless the fence held; `what` names the fence.
fn fence_held(waited: FenceWait, what: impl FnOnce() -> String) -> PyResult<()> {
    match waited {
        FenceWait::Held => Ok(()),
        FenceWait::Overdue { late } => Err(FenceNotHeldError::new_err(format!(
            "{} did not hold: a copy of its blocks is still out {late:?} past its deadline (a \
             stuck device); the blocks may still be read or written",
            what()
        ))),
        FenceWait::Stopped => Err(FenceNotHeldError::new_err(format!(
            "{} never holds: kvx's driver stopped with copies of its blocks out",
            what()
        ))),
    }
}
