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
//! sched = _native.SchedulerSide(config, 16)
//! worker = _native.WorkerSide(config, 16, [(name, t.data_ptr(), list(t.shape), list(t.stride()),
//!                                          t.element_size(), str(t.device))], [t], num_blocks)
//! meta, loads, delayed = sched.build_meta([])
//! worker.start_step(meta)
//! sending, recving, invalid, jobs, ended = worker.get_finished()
//! failed_loads = sched.update_from_worker(jobs)
//! ```
//!
//! This crate is an extension module: libpython's symbols stay unresolved until Python loads
//! it, so it has no cargo tests; it is tested through pytest (`kvx-python/ci.sh`).

mod config;
mod keeper;
mod memory;
mod page_store;
mod scheduler;
#[cfg(feature = "testing")]
mod stall;
mod stats;
mod worker;

use kvx_core::BlockKey;
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

/// Split concatenated 16-byte keys.
fn keys_from_bytes(b: &[u8]) -> PyResult<Vec<BlockKey>> {
    if b.len() % 16 != 0 {
        return Err(PyValueError::new_err(format!(
            "block keys: {} bytes is not a multiple of 16",
            b.len()
        )));
    }
    Ok(b.chunks_exact(16)
        .map(|c| BlockKey::from_be_bytes(c.try_into().expect("16 bytes")))
        .collect())
}

/// kvx block keys (16 bytes each, concatenated) of engine block hashes, within `namespace`
/// (a model/layout identity, so two engines sharing a file tier never mix blocks).
#[pyfunction]
fn block_keys<'py>(py: Python<'py>, namespace: &[u8], hashes: Vec<Vec<u8>>) -> Bound<'py, PyBytes> {
    let ns = BlockKey::chain(None, namespace);
    let mut out = Vec::with_capacity(hashes.len() * 16);
    for h in &hashes {
        out.extend_from_slice(&BlockKey::chain(Some(ns), h).to_be_bytes());
    }
    PyBytes::new(py, &out)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("KvxError", m.py().get_type::<KvxError>())?;
    m.add("FenceNotHeldError", m.py().get_type::<FenceNotHeldError>())?;
    m.add_class::<scheduler::SchedulerSide>()?;
    m.add_class::<worker::WorkerSide>()?;
    m.add_class::<keeper::LeaseKeeper>()?;
    m.add_class::<page_store::PageStore>()?;
    m.add_function(wrap_pyfunction!(keeper::remote_source, m)?)?;
    #[cfg(feature = "testing")]
    m.add_class::<stall::FrozenMount>()?;
    m.add_function(wrap_pyfunction!(block_keys, m)?)?;
    m.add_function(wrap_pyfunction!(config::parse_config, m)?)?;
    m.add_function(wrap_pyfunction!(config::offload_config, m)?)?;
    Ok(())
}
