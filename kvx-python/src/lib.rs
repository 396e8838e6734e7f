//! The native part of the Python package `kvx` (module `kvx._native`): kvx-offload's scheduler
//! and worker sides (the worker side built by kvx-offload's `OffloadBuilder`, which validates
//! the config), engine memory described from tensors, and the compact step encoding that
//! crosses vLLM's process boundary. `kvx.vllm.KvxConnector` (Python) is built on it; the
//! blocking `PageStore` under an engine's own host cache is what `kvx.sglang` is built on.
//!
//! From Python (the connector does this for vLLM):
//!
//! ```text
//! from kvx import _native
//! config = json.dumps({"host_blocks": 1024, "file": {"roots": ["/mnt/nvme/kvx"], "blocks": 100000}})
//! sched = _native.SchedulerSide(config, 16, [b"model|bf16|16"])
//! worker = _native.WorkerSide(config, 16, [(name, t.data_ptr(), list(t.shape), list(t.stride()),
//!                                          t.element_size(), str(t.device))], [t], num_blocks)
//! meta, loads, delayed, abandoned, in_step = sched.build_meta()
//! worker.start_step(meta)
//! sending, recving, invalid, jobs, ended = worker.get_finished()
//! failed_loads = sched.update_from_worker(jobs)
//! ```
//!
//! This crate is an extension module: libpython's symbols stay unresolved until Python loads
//! it, so it has no cargo tests; it is tested through pytest (`kvx-python/ci.sh`).

mod config;
mod consumer;
mod memory;
mod page_store;
mod scheduler;
#[cfg(feature = "testing")]
mod stall;
mod stats;
mod worker;

use kvx_connector::keys;
use kvx_connector::{KEY_BYTES, Namespace};
use kvx_core::{BlockKey, RequestId};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

create_exception!(
    _native,
    KvxError,
    PyException,
    "A kvx operation failed (closed worker, malformed message, driver stopped, fence not held)."
);

create_exception!(
    _native,
    FenceNotHeldError,
    KvxError,
    "A fence does not hold: a copy of its blocks is still out past its deadline (or the driver stopped) and may still touch them."
);

/// A kvx failure as a Python `KvxError`.
fn kvx_err(e: impl ToString) -> PyErr {
    KvxError::new_err(e.to_string())
}

/// Split concatenated keys (`KEY_BYTES` each).
fn keys_from_bytes(b: &[u8]) -> PyResult<Vec<BlockKey>> {
    keys::keys_from_bytes(b).ok_or_else(|| {
        PyValueError::new_err(format!(
            "block keys: {} bytes is not a multiple of {KEY_BYTES}",
            b.len()
        ))
    })
}

/// kvx block keys (`KEY_BYTES` each, concatenated) of engine block hashes, within `namespace`
/// (a model/layout identity, so two engines sharing a file tier never mix blocks).
/// The requests a step message (`SchedulerSide.build_meta`) names: (loads that start and
/// delayed frees, each as (number, engine id); abandoned loads and loads the step's forward
/// reads, by number; engine blocks fenced first). For tools and tests; a malformed message is
/// a `KvxError`.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn step_requests(msg: &[u8]) -> PyResult<(Named, Named, Vec<u64>, Vec<u64>, Vec<u32>)> {
    let m = kvx_connector::codec::decode_step(msg).map_err(kvx_err)?;
    let named = |v: &[RequestId]| {
        v.iter()
            .map(|r| {
                let name = m.names.iter().find(|(q, _)| q == r).map(|(_, n)| n.clone());
                (r.0, name.unwrap_or_default())
            })
            .collect()
    };
    let ids = |v: &[RequestId]| v.iter().map(|r| r.0).collect();
    Ok((
        named(&m.loads),
        named(&m.delayed),
        ids(&m.abandoned),
        ids(&m.in_step),
        m.fence.iter().map(|b| b.0).collect(),
    ))
}

/// Requests as (number, engine id).
type Named = Vec<(u64, String)>;

#[pyfunction]
fn block_keys<'py>(py: Python<'py>, namespace: &[u8], hashes: Vec<Vec<u8>>) -> Bound<'py, PyBytes> {
    let ns = Namespace::new(namespace);
    let keys: Vec<BlockKey> = hashes.iter().map(|h| ns.key(h)).collect();
    PyBytes::new(py, &keys::key_bytes(&keys))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("KvxError", m.py().get_type::<KvxError>())?;
    m.add("FenceNotHeldError", m.py().get_type::<FenceNotHeldError>())?;
    m.add("KEY_BYTES", KEY_BYTES)?;
    m.add_class::<scheduler::SchedulerSide>()?;
    m.add_class::<worker::WorkerSide>()?;
    m.add_class::<page_store::PageStore>()?;
    #[cfg(feature = "testing")]
    m.add_class::<stall::FrozenMount>()?;
    m.add_function(wrap_pyfunction!(block_keys, m)?)?;
    m.add_function(wrap_pyfunction!(step_requests, m)?)?;
    m.add_function(wrap_pyfunction!(config::parse_config, m)?)?;
    m.add_function(wrap_pyfunction!(config::offload_config, m)?)?;
    Ok(())
}
