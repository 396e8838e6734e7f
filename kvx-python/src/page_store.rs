//! `PageStore`: kvx-offload's blocking page store for Python, under an engine's own host cache
//! (`kvx.sglang`, SGLang's HiCache storage backend). The host cache is described by its
//! regions (where page 0 of each run of a page is, the distance between pages, the bytes of
//! one run), checked to lie inside the tensors that hold it; each call releases the GIL while
//! kvx works, and returns by its deadline.

use std::sync::{Arc, Mutex};

use kvx_core::{EngineBlockId, KvLayout, MemoryKind, Region, lock};
use kvx_offload::{EngineMemory, OffloadConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde_json::Value;

use crate::{KvxError, keys_from_bytes, kvx_err};

/// The store's config: `config` (a JSON object of kvx-offload's `OffloadConfig` keys) with the
/// engine's page size as `block_tokens`.
fn store_config(config: &str, page_tokens: u32) -> PyResult<OffloadConfig> {
    let bad = |r: String| PyValueError::new_err(format!("kvx config: {r}"));
    let mut value: Value = serde_json::from_str(config).map_err(|e| bad(e.to_string()))?;
    let Some(keys) = value.as_object_mut() else {
        return Err(bad(format!("expected a JSON object, got {config}")));
    };
    if keys.contains_key("block_tokens") {
        return Err(bad(
            "block_tokens: not a setting here: it is the engine's page size".into(),
        ));
    }
    keys.insert("block_tokens".into(), page_tokens.into());
    OffloadConfig::from_json_value(value).map_err(|e| bad(e.to_string()))
}

/// The layout of `num_pages` pages over `regions` (base, stride, bytes), each of which must
/// lie inside one of `spans` (address, bytes): the memory of the tensors the caller holds.
fn page_layout(
    regions: &[(usize, usize, usize)],
    num_pages: u32,
    spans: &[(usize, usize)],
) -> Result<KvLayout, String> {
    let mut out = Vec::with_capacity(regions.len());
    for (i, &(base, stride, len)) in regions.iter().enumerate() {
        let end = (num_pages as usize - 1)
            .checked_mul(stride)
            .and_then(|o| o.checked_add(base))
            .and_then(|o| o.checked_add(len))
            .ok_or_else(|| format!("region {i}: its extent overflows"))?;
        let inside = spans
            .iter()
            .any(|&(at, bytes)| base >= at && at.checked_add(bytes).is_some_and(|e| end <= e));
        if !inside {
            return Err(format!(
                "region {i} ({base:#x}, stride {stride}, {len} bytes, {num_pages} pages) lies \
                 outside the host pool's tensors"
            ));
        }
        out.push(Region {
            base,
            kind: MemoryKind::Cpu,
            stride,
            segment_len: len,
        });
    }
    KvLayout::new(out, num_pages).map_err(|e| e.to_string())
}

/// Pages of an engine's host cache in and out of kvx's tiers.
#[pyclass(module = "kvx._native")]
pub struct PageStore {
    /// Declared before `owners`: the store (its driver) goes before the tensors are let go.
    store: Mutex<Option<Arc<kvx_offload::PageStore>>>,
    /// The tensor objects that hold the host cache, kept while kvx may copy in or out.
    owners: Mutex<Vec<Py<PyAny>>>,
}

impl PageStore {
    fn get(&self) -> PyResult<Arc<kvx_offload::PageStore>> {
        lock(&self.store)
            .clone()
            .ok_or_else(|| KvxError::new_err("the kvx page store is closed"))
    }
}

fn pages(ids: Vec<u32>) -> Vec<EngineBlockId> {
    ids.into_iter().map(EngineBlockId).collect()
}

#[pymethods]
impl PageStore {
    /// A store with kvx's `config` (JSON) over `num_pages` pages of `page_tokens` tokens each:
    /// page `p` is the runs `base + p * stride` (`bytes` long) of each of `regions`, inside the
    /// memory `spans` (address, bytes) of the tensors `owners`, which it holds until `close`.
    /// `shard`: this rank's place in a parallel layout, (tensor rank, tensor size, pipeline
    /// rank, pipeline size): its file tier is the shard's own directory under each root.
    #[new]
    #[pyo3(signature = (config, page_tokens, regions, num_pages, spans, owners, shard=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        config: &str,
        page_tokens: u32,
        regions: Vec<(usize, usize, usize)>,
        num_pages: u32,
        spans: Vec<(usize, usize)>,
        owners: Vec<Py<PyAny>>,
        shard: Option<(u32, u32, u32, u32)>,
    ) -> PyResult<PageStore> {
        let cfg = store_config(config, page_tokens)?;
        let shard = shard
            .map(|(t, tn, p, pn)| kvx_offload::Shard::new(t, tn, p, pn))
            .transpose()
            .map_err(|e| PyValueError::new_err(format!("shard: {e}")))?;
        if num_pages == 0 {
            return Err(PyValueError::new_err(
                "num_pages: the host pool has no pages",
            ));
        }
        let layout = page_layout(&regions, num_pages, &spans).map_err(PyValueError::new_err)?;
        let store = py.detach(move || {
            // SAFETY: every region lies inside the tensors in `owners` (checked above), which
            // this object holds until after the store's driver stopped (`close`, or the drop
            // order of the fields). kvx touches a page only inside a call that names it, and
            // the engine reuses a page only after that call returned (kvx.sglang's contract
            // with SGLang: a batch call's host indices stay the engine's until it returns).
            let memory = unsafe { EngineMemory::cpu(layout) };
            kvx_offload::PageStore::new(cfg, memory, shard).map_err(|e| e.to_string())
        });
        let store = store.map_err(PyValueError::new_err)?;
        Ok(PageStore {
            store: Mutex::new(Some(Arc::new(store))),
            owners: Mutex::new(owners),
        })
    }

    /// How many of `keys` (16 bytes each, concatenated), from the first, kvx holds.
    fn exists(&self, py: Python<'_>, keys: &[u8]) -> PyResult<usize> {
        let keys = keys_from_bytes(keys)?;
        let s = self.get()?;
        py.detach(|| s.exists(&keys)).map_err(kvx_err)
    }

    /// Load `keys` into `pages` (one page per key): a verdict per page, by the load deadline.
    fn load(&self, py: Python<'_>, keys: &[u8], pages: Vec<u32>) -> PyResult<Vec<bool>> {
        let keys = keys_from_bytes(keys)?;
        let s = self.get()?;
        let pages = self::pages(pages);
        py.detach(|| s.load(&keys, &pages)).map_err(kvx_err)
    }

    /// Store `pages` under `keys`: a verdict per page, by the store deadline.
    fn store(&self, py: Python<'_>, keys: &[u8], pages: Vec<u32>) -> PyResult<Vec<bool>> {
        let keys = keys_from_bytes(keys)?;
        let s = self.get()?;
        let pages = self::pages(pages);
        py.detach(|| s.store(&keys, &pages)).map_err(kvx_err)
    }

    /// Forget every block kvx holds (their files are removed).
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.get()?;
        py.detach(|| s.clear()).map_err(kvx_err)
    }

    /// What was moved since the last call, as the connector's stats dict (`{}` while idle).
    fn take_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.get()?.take_stats();
        crate::stats::to_dict(py, &stats)
    }

    /// Stop kvx's threads (no copy touches the host pool once this returns) and let go of the
    /// tensors. Idempotent; later calls raise `KvxError`.
    fn close(&self, py: Python<'_>) {
        let store = lock(&self.store).take();
        if let Some(s) = store {
            py.detach(|| s.close());
        }
        lock(&self.owners).clear();
    }
}
