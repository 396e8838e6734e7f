//! `SchedulerHalf`: kvx-offload's scheduler side for Python (vLLM's scheduler process).

use std::path::PathBuf;
use std::sync::Mutex;

use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_offload::{EvictionKind, Lookup, SchedulerConfig, SchedulerSide, Tier};
use kvx_posix::{IoEngine, PosixConfig, PosixStore};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::codec;
use crate::{KvxError, keys_from_bytes};

/// Parse an eviction name (`lru`, `arc`).
pub fn eviction_kind(name: &str) -> PyResult<EvictionKind> {
    match name {
        "lru" => Ok(EvictionKind::Lru),
        "arc" => Ok(EvictionKind::Arc),
        other => Err(PyValueError::new_err(format!(
            "eviction: unknown policy {other:?} (expected \"lru\" or \"arc\")"
        ))),
    }
}

/// Check that every directory of a file tier exists and is a directory; the store's own probe
/// then proves it writable.
pub fn check_file_dirs(dirs: &[PathBuf]) -> PyResult<()> {
    if dirs.is_empty() {
        return Err(PyValueError::new_err(
            "file_dirs: empty list (leave the key out for no file tier)",
        ));
    }
    for d in dirs {
        if !d.is_dir() {
            return Err(PyValueError::new_err(format!(
                "file_dirs: {} does not exist or is not a directory",
                d.display()
            )));
        }
    }
    Ok(())
}

/// The keys of the blocks a file tier already holds (its startup scan).
fn scan_file_tier(dirs: Vec<PathBuf>) -> PyResult<Vec<BlockKey>> {
    check_file_dirs(&dirs)?;
    let mut cfg = PosixConfig::new(dirs[0].clone());
    cfg.roots = dirs;
    cfg.engine = IoEngine::Psync;
    cfg.queue_depth = 1;
    let store =
        PosixStore::open(cfg).map_err(|e| PyValueError::new_err(format!("file_dirs: {e}")))?;
    Ok(store.handle().keys())
}

/// The scheduler half: decides per step what to load and store, keeps the tier index.
#[pyclass(module = "kvx._native")]
pub struct SchedulerHalf {
    inner: Mutex<SchedulerSide>,
    block_tokens: u64,
}

impl SchedulerHalf {
    fn side(&self) -> std::sync::MutexGuard<'_, SchedulerSide> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl SchedulerHalf {
    /// A scheduler half. `file_dirs` (with `file_blocks`) adds a file tier whose existing
    /// blocks are adopted into the index.
    #[new]
    #[pyo3(signature = (block_tokens, host_blocks, eviction, file_dirs=None, file_blocks=None))]
    fn new(
        block_tokens: u32,
        host_blocks: usize,
        eviction: &str,
        file_dirs: Option<Vec<PathBuf>>,
        file_blocks: Option<usize>,
    ) -> PyResult<SchedulerHalf> {
        let eviction = eviction_kind(eviction)?;
        let found = match &file_dirs {
            Some(d) => scan_file_tier(d.clone())?,
            None => Vec::new(),
        };
        let mut side = SchedulerSide::new(SchedulerConfig {
            block_tokens,
            host_blocks,
            file_blocks: file_dirs.as_ref().and(file_blocks),
            eviction,
            ..SchedulerConfig::default()
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
        side.adopt_file_blocks(found);
        Ok(SchedulerHalf {
            inner: Mutex::new(side),
            block_tokens: u64::from(block_tokens),
        })
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
        let mut s = self.side();
        let skip = ((num_computed / self.block_tokens) as usize).min(keys.len());
        let Lookup::Hit(tiers) = s.manager().lookup(&keys[skip..]) else {
            return Ok(None);
        };
        let Some(tokens) = s.get_num_new_matched_tokens(RequestId(req), &keys, num_computed) else {
            return Ok(None);
        };
        let host = tiers.iter().filter(|t| **t == Tier::Host).count();
        Ok(Some((tokens, host, tiers.len() - host)))
    }

    /// The engine allocated `blocks` for the tokens matched last: queue the load. True if a
    /// load was queued.
    fn update_state_after_alloc(&self, req: u64, blocks: Vec<u32>) -> PyResult<bool> {
        let blocks: Vec<EngineBlockId> = blocks.into_iter().map(EngineBlockId).collect();
        self.side()
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
        Ok(self.side().save_blocks(RequestId(req), &pairs).is_some())
    }

    /// The engine preempted a request.
    fn request_preempted(&self, req: u64) {
        self.side().request_preempted(RequestId(req));
    }

    /// The engine is done with a request; true when its blocks must stay until it is reported
    /// in `finished_sending`.
    fn request_finished(&self, req: u64) -> bool {
        self.side().request_finished(RequestId(req))
    }

    /// This step's instructions, encoded, with the requests that load and the requests whose
    /// freeing is delayed. Requests in `undelay` are taken out of the delayed set first (the
    /// engine itself delays their freeing until their load is reported).
    fn build_meta<'py>(
        &self,
        py: Python<'py>,
        undelay: Vec<u64>,
    ) -> (Bound<'py, PyBytes>, Vec<u64>, Vec<u64>) {
        let mut m = self.side().build_meta();
        m.delayed_free.retain(|r| !undelay.contains(&r.0));
        let loads = m.loads.iter().map(|l| l.request.0).collect();
        let delayed = m.delayed_free.iter().map(|r| r.0).collect();
        (PyBytes::new(py, &codec::encode_meta(&m)), loads, delayed)
    }

    /// Take in the job outcomes a worker reported. Returns, for each load that did not fully
    /// succeed, its request and the keys that failed (16 bytes each, concatenated).
    fn update_from_worker<'py>(
        &self,
        py: Python<'py>,
        jobs: &[u8],
    ) -> PyResult<Vec<(u64, Bound<'py, PyBytes>)>> {
        let jobs = codec::decode_jobs(jobs).map_err(|e| KvxError::new_err(e.to_string()))?;
        let failed_loads = jobs
            .iter()
            .filter(|j| j.part == kvx_offload::JobPart::Load && !j.failed.is_empty())
            .map(|j| {
                let keys: Vec<u8> = j.failed.iter().flat_map(|(k, _)| k.to_be_bytes()).collect();
                (j.request.0, PyBytes::new(py, &keys))
            })
            .collect();
        let out = kvx_offload::WorkerOutput {
            jobs,
            ..Default::default()
        };
        self.side().update_from_worker(&out);
        Ok(failed_loads)
    }

    /// Requests with state here.
    fn request_count(&self) -> usize {
        self.side().request_count()
    }

    /// Jobs not yet fully reported.
    fn job_count(&self) -> usize {
        self.side().job_count()
    }

    /// True when nothing is pinned, stored or promoted in the index.
    fn is_quiet(&self) -> bool {
        self.side().manager().is_quiet()
    }

    /// Blocks held by the host tier and by the file tier.
    fn tier_sizes(&self) -> (usize, usize) {
        let s = self.side();
        let m = s.manager();
        (m.blocks(Tier::Host), m.blocks(Tier::File))
    }
}
