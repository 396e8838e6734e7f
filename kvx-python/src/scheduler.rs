//! `SchedulerSide`: kvx-offload's scheduler side for Python (vLLM's scheduler process).

use std::sync::{Arc, Mutex};

use kvx_core::{BlockKey, EngineBlockId, RequestId, lock};
use kvx_offload::{RemoteSource, RemoteTierConfig, Tier};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::config::connector_config;
use crate::{KvxError, keys_from_bytes};
use kvx_connector::codec;

/// The scheduler side: decides per step what to load and store, keeps the tier index.
#[pyclass(module = "kvx._native")]
pub struct SchedulerSide {
    pub(crate) inner: Mutex<kvx_offload::SchedulerSide>,
    /// The remote tier's settings (what a producer's sources name).
    remote: Option<RemoteTierConfig>,
    /// Workers behind this side (a producer names one server per rank).
    world: u32,
    /// `host_loads_in_step` of the config.
    host_loads_in_step: bool,
}

#[pymethods]
impl SchedulerSide {
    /// A scheduler side with the connector's settings `config` (vLLM's extra config, as JSON)
    /// and vLLM's `block_tokens`, for `tp_size × pp_size` workers; a file tier's existing blocks
    /// are adopted into the index (with several workers, those every worker's shard holds).
    /// The GIL is free while the tier is read (a stuck mount holds only this call).
    #[new]
    #[pyo3(signature = (config, block_tokens, tp_size=1, pp_size=1))]
    fn new(
        py: Python<'_>,
        config: &str,
        block_tokens: u32,
        tp_size: u32,
        pp_size: u32,
    ) -> PyResult<SchedulerSide> {
        let (cfg, side) = py.detach(|| {
            let cfg = connector_config(config, block_tokens)?;
            let side = kvx_offload::scheduler_side_sharded(&cfg, tp_size, pp_size)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            Ok::<_, PyErr>((cfg, side))
        })?;
        Ok(SchedulerSide {
            inner: Mutex::new(side),
            remote: cfg.remote,
            world: tp_size * pp_size,
            host_loads_in_step: cfg.host_loads_in_step,
        })
    }

    /// The config's `host_loads_in_step`: a hit wholly in the host tier is loaded before the
    /// forward of the step that schedules its request.
    #[getter]
    fn host_loads_in_step(&self) -> bool {
        self.host_loads_in_step
    }

    /// Tokens beyond `num_computed` that the tiers hold for a request whose full blocks have
    /// `keys` (16 bytes each), with how many of those blocks come from the host and from the
    /// file tier; `None`: ask again later.
    fn get_num_new_matched_tokens(
        &self,
        req: u64,
        keys: &[u8],
        num_computed: u64,
    ) -> PyResult<Option<(u64, usize, usize)>> {
        let keys = keys_from_bytes(keys)?;
        let mut s = lock(&self.inner);
        let Some(tokens) = s.get_num_new_matched_tokens(RequestId(req), &keys, num_computed) else {
            return Ok(None);
        };
        let tiers = s.matched_tiers(RequestId(req));
        let host = tiers.iter().filter(|t| **t == Tier::Host).count();
        Ok(Some((tokens, host, tiers.len() - host)))
    }

    /// The engine allocated `blocks` for the tokens matched last: queue the load. True if a
    /// load was queued.
    fn update_state_after_alloc(&self, req: u64, blocks: Vec<u32>) -> PyResult<bool> {
        let blocks: Vec<EngineBlockId> = blocks.into_iter().map(EngineBlockId).collect();
        lock(&self.inner)
            .update_state_after_alloc(RequestId(req), &blocks)
            .map(|j| j.is_some())
            .map_err(|e| KvxError::new_err(e.to_string()))
    }

    /// Save computed full blocks of a request; true if a store was queued.
    fn save_blocks(&self, req: u64, keys: &[u8], blocks: Vec<u32>) -> PyResult<bool> {
        let keys = keys_from_bytes(keys)?;
        if keys.len() != blocks.len() {
            return Err(PyValueError::new_err(format!(
                "save_blocks: {} keys but {} blocks",
                keys.len(),
                blocks.len()
            )));
        }
        let pairs: Vec<(BlockKey, EngineBlockId)> = keys
            .into_iter()
            .zip(blocks.into_iter().map(EngineBlockId))
            .collect();
        Ok(lock(&self.inner)
            .save_blocks(RequestId(req), &pairs)
            .is_some())
    }

    /// Forget every block the tiers hold (vLLM's `reset_prefix_cache(reset_connector=True)`):
    /// no lookup offers one again; the next step's metadata drops them from the workers' host
    /// tiers and removes their files, and blocks a load or store in flight still touches follow
    /// once it ended. Requests in flight go on.
    fn reset_cache(&self) {
        lock(&self.inner).reset_cache();
    }

    /// Blocks a store put in no tier because no tier had room (every block pinned by a load or
    /// being stored), as `[("store_skipped_no_room", n)]` (empty while none).
    fn store_skips(&self) -> Vec<(String, u64)> {
        crate::worker::skipped(lock(&self.inner).store_skips()).collect()
    }

    /// What this side counted since the last call (blocks no tier had room for), as a dict
    /// for vLLM's stats (see `kvx.vllm.stats`).
    fn take_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = lock(&self.inner).take_stats();
        crate::stats::to_dict(py, &stats)
    }

    /// The engine preempted a request.
    fn request_preempted(&self, req: u64) {
        lock(&self.inner).request_preempted(RequestId(req));
    }

    /// The engine is done with a request; true when its blocks must stay until it is reported
    /// in `finished_sending`.
    fn request_finished(&self, req: u64) -> bool {
        lock(&self.inner).request_finished(RequestId(req))
    }

    /// The engine is done with a request whose `blocks` (keyed `keys`, 16 bytes each) a remote
    /// reader will load: export them under `export` this step (the freeing waits until the
    /// request is reported in `finished_sending`). Returns the source the reader needs, as
    /// JSON, naming `namespace`. A `ValueError` if this engine is not a producer (no
    /// `remote.listen`) or keys and blocks do not pair up; then nothing changed.
    fn export_finished(
        &self,
        req: u64,
        export: u64,
        namespace: String,
        keys: &[u8],
        blocks: Vec<u32>,
    ) -> PyResult<String> {
        let keys = keys_from_bytes(keys)?;
        if keys.is_empty() || keys.len() != blocks.len() {
            return Err(PyValueError::new_err(format!(
                "export_finished: {} keys but {} blocks",
                keys.len(),
                blocks.len()
            )));
        }
        let Some(remote) = &self.remote else {
            return Err(PyValueError::new_err(
                "this engine exports nothing: kv_connector_extra_config has no `remote`",
            ));
        };
        let Some(producers) = remote.producers(self.world) else {
            return Err(PyValueError::new_err(
                "this engine exports nothing: set remote.listen (kv_connector_extra_config)",
            ));
        };
        let source = RemoteSource {
            namespace,
            export,
            producers,
            keys: keys.clone(),
            ttl_ms: remote.lease_ttl_ms,
            heartbeat_ms: remote.heartbeat_ms,
        };
        source
            .validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let pairs: Vec<(BlockKey, EngineBlockId)> = keys
            .into_iter()
            .zip(blocks.into_iter().map(EngineBlockId))
            .collect();
        lock(&self.inner).export_finished(RequestId(req), export, &pairs);
        Ok(source.to_json())
    }

    /// Queue a load of a remote source's blocks `first..first + len(blocks)` into `blocks`
    /// this step. A `ValueError` (nothing queued) for a source that does not parse or names
    /// fewer blocks.
    fn remote_load(&self, req: u64, source: &str, first: u32, blocks: Vec<u32>) -> PyResult<()> {
        let source =
            RemoteSource::from_json(source).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let n = source.keys.len() as u64;
        if blocks.is_empty() || u64::from(first) + blocks.len() as u64 > n {
            return Err(PyValueError::new_err(format!(
                "remote_load: blocks {first}..+{} of a source of {n}",
                blocks.len()
            )));
        }
        let pairs: Vec<(u32, EngineBlockId)> = blocks
            .into_iter()
            .enumerate()
            .map(|(i, b)| (first + i as u32, EngineBlockId(b)))
            .collect();
        lock(&self.inner).remote_load(RequestId(req), Arc::new(source), &pairs);
        Ok(())
    }

    /// This step's instructions, encoded, with the requests that load and the requests whose
    /// freeing is delayed. Requests in `undelay` are taken out of the delayed set first (the
    /// engine itself delays their freeing until their load is reported).
    fn build_meta<'py>(
        &self,
        py: Python<'py>,
        undelay: Vec<u64>,
    ) -> (Bound<'py, PyBytes>, Vec<u64>, Vec<u64>) {
        let mut m = lock(&self.inner).build_meta();
        m.delayed_free.retain(|r| !undelay.contains(&r.0));
        let loads = m
            .loads
            .iter()
            .map(|l| l.request.0)
            .chain(m.remote_loads.iter().map(|l| l.request.0))
            .collect();
        let delayed = m.delayed_free.iter().map(|r| r.0).collect();
        (PyBytes::new(py, &codec::encode_meta(&m)), loads, delayed)
    }

    /// Take in the job outcomes a worker reported (the message names its rank). With several
    /// workers a job counts once every rank reported it (kvx-offload merges them). Returns, for
    /// each load that did not fully succeed on every rank, its request and the keys that failed
    /// (16 bytes each, concatenated).
    fn update_from_worker<'py>(
        &self,
        py: Python<'py>,
        jobs: &[u8],
    ) -> PyResult<Vec<(u64, Bound<'py, PyBytes>)>> {
        let (rank, jobs) =
            codec::decode_jobs(jobs).map_err(|e| KvxError::new_err(e.to_string()))?;
        let out = kvx_offload::WorkerOutput {
            jobs,
            ..Default::default()
        };
        let applied = lock(&self.inner).update_from_rank(rank, &out);
        let failed_loads = applied
            .iter()
            .filter(|j| j.part == kvx_offload::JobPart::Load && !j.failed.is_empty())
            .map(|j| {
                let keys: Vec<u8> = j.failed.iter().flat_map(|(k, _)| k.to_be_bytes()).collect();
                (j.request.0, PyBytes::new(py, &keys))
            })
            .collect();
        Ok(failed_loads)
    }

    /// Requests with state here.
    fn request_count(&self) -> usize {
        lock(&self.inner).request_count()
    }

    /// Jobs not yet fully reported.
    fn job_count(&self) -> usize {
        lock(&self.inner).job_count()
    }

    /// Job parts some workers reported and others not yet (0 with one worker).
    fn partial_count(&self) -> usize {
        lock(&self.inner).partial_count()
    }

    /// Workers behind this scheduler side (tensor × pipeline parallel size).
    fn world(&self) -> u32 {
        lock(&self.inner).world()
    }

    /// True when nothing is pinned, stored or promoted in the index.
    fn is_quiet(&self) -> bool {
        lock(&self.inner).manager().is_quiet()
    }

    /// Blocks held by the host tier and by the file tier.
    fn tier_sizes(&self) -> (usize, usize) {
        let s = lock(&self.inner);
        let m = s.manager();
        (m.blocks(Tier::Host), m.blocks(Tier::File))
    }
}
