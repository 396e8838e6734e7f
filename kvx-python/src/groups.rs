//! `KvCacheGroups`: kvx-connector's hybrid-model state ([`kvx_connector::groups::Hybrid`]) for
//! Python, over a [`SchedulerSide`]'s kvx-offload scheduler side.

use std::sync::Mutex;

use kvx_connector::Namespace;
use kvx_connector::groups::{Group, Groups, Hybrid};
use kvx_connector::keys::key_bytes;
use kvx_core::{EngineBlockId, RequestId, lock};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PySequence};

use crate::keys_from_bytes;
use crate::scheduler::SchedulerSide;

/// Several KV cache groups (a hybrid model): each request's keys per group, the hits waiting
/// for the engine's allocation, the sliding-window blocks a queued store may still read.
#[pyclass(module = "kvx._native")]
pub struct KvCacheGroups {
    inner: Mutex<Hybrid>,
}

#[pymethods]
impl KvCacheGroups {
    /// Groups given as `(window, extra_retained)` (`window` `None`: full attention), each
    /// group's key `namespaces`, `block_tokens` per block, and `hashes_per_block` engine
    /// block hashes per block. A `ValueError` names what kvx cannot serve.
    #[new]
    fn new(
        groups: Vec<(Option<u64>, u64)>,
        namespaces: Vec<Vec<u8>>,
        block_tokens: u64,
        hashes_per_block: usize,
    ) -> PyResult<KvCacheGroups> {
        let groups = groups
            .into_iter()
            .map(|(window, extra)| match window {
                None => Group::FULL,
                Some(w) => Group::sliding(w, extra),
            })
            .collect();
        let groups =
            Groups::new(groups, block_tokens).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let namespaces = namespaces.iter().map(|n| Namespace::new(n)).collect();
        let inner =
            Hybrid::new(groups, namespaces, hashes_per_block).map_err(PyValueError::new_err)?;
        Ok(KvCacheGroups {
            inner: Mutex::new(inner),
        })
    }

    /// Take in the engine's block hashes of request `req` (its whole list: only those not yet
    /// seen are read).
    fn extend_keys(&self, req: u64, block_hashes: &Bound<'_, PySequence>) -> PyResult<()> {
        let mut h = lock(&self.inner);
        let seen = h.hashes_seen(RequestId(req));
        let n = block_hashes.len()?;
        let mut new: Vec<Vec<u8>> = Vec::with_capacity(n.saturating_sub(seen));
        for i in seen..n {
            new.push(block_hashes.get_item(i)?.extract()?);
        }
        h.extend_keys(RequestId(req), new.iter().map(Vec::as_slice));
        Ok(())
    }

    /// Group `group`'s keys of request `req`'s full blocks (16 bytes each).
    fn keys<'py>(&self, py: Python<'py>, req: u64, group: usize) -> Bound<'py, PyBytes> {
        let h = lock(&self.inner);
        PyBytes::new(py, &key_bytes(h.keys(RequestId(req), group)))
    }

    /// Full blocks of `req` with keys.
    fn key_blocks(&self, req: u64) -> u64 {
        lock(&self.inner).key_blocks(RequestId(req))
    }

    /// The longest hit of blocks `[first, end)` every group can serve, as `(tokens, host
    /// blocks, file blocks)`, pending with `side` until the engine allocates; `None`: ask
    /// again later. The GIL is free while the tiers are looked up.
    fn lookup(
        &self,
        py: Python<'_>,
        side: &SchedulerSide,
        req: u64,
        first: u64,
        end: u64,
    ) -> Option<(u64, usize, usize)> {
        py.detach(|| {
            let mut h = lock(&self.inner);
            let hit = h.lookup(&mut lock(&side.inner), RequestId(req), first, end)?;
            Some((hit.tokens, hit.host_blocks, hit.file_blocks))
        })
    }

    /// The engine allocated `tables` (one block table per group) for `req`'s last hit: its
    /// load is queued. The engine blocks it loads, or `None` when no hit was waiting; a
    /// `RuntimeError` (nothing queued) for an allocation that does not match the hit.
    fn allocated(
        &self,
        side: &SchedulerSide,
        req: u64,
        tables: Vec<Vec<u32>>,
    ) -> PyResult<Option<Vec<u32>>> {
        let mut h = lock(&self.inner);
        let blocks = h
            .allocated(&mut lock(&side.inner), RequestId(req), &tables)
            .map_err(|e| PyRuntimeError::new_err(format!("KvxConnector: request {req}: {e}")))?;
        Ok(blocks.map(|b| b.into_iter().map(|b| b.0).collect()))
    }

    /// Queue the store of what a step that completes blocks `[first, upto)` of `req` stores,
    /// `computed` tokens of it computed once the step ran; true if a store was queued.
    fn save(
        &self,
        side: &SchedulerSide,
        req: u64,
        first: u64,
        upto: u64,
        computed: u64,
        tables: Vec<Vec<u32>>,
    ) -> bool {
        let mut h = lock(&self.inner);
        h.save(
            &mut lock(&side.inner),
            RequestId(req),
            first,
            upto,
            computed,
            &tables,
        )
    }

    /// Of `handed_out` (engine blocks given to requests this step), those to fence before the
    /// step's stores are queued, sorted.
    fn fence(&self, handed_out: Vec<u32>) -> Vec<u32> {
        let mut h = lock(&self.inner);
        h.fence(handed_out.into_iter().map(EngineBlockId))
            .into_iter()
            .map(|b| b.0)
            .collect()
    }

    /// The lowest block index, in any group, of the failed keys `failed` (16 bytes each) of a
    /// load of `req`.
    fn first_failed(&self, req: u64, failed: &[u8]) -> PyResult<Option<u64>> {
        let failed = keys_from_bytes(failed)?;
        Ok(lock(&self.inner).first_failed(RequestId(req), &failed))
    }

    /// The engine is done with `req`.
    fn forget(&self, req: u64) {
        lock(&self.inner).forget(RequestId(req));
    }

    /// Blocks fenced so far.
    #[getter]
    fn fenced_blocks(&self) -> u64 {
        lock(&self.inner).fenced_blocks()
    }

    /// Requests with keys or a waiting hit (0 when the engine is idle).
    fn request_count(&self) -> usize {
        lock(&self.inner).request_count()
    }
}
