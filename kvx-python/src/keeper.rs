//! `LeaseKeeper`: kvx-rdma's consumer lease keeper for vLLM's scheduler process (a decode
//! engine renews the leases of the requests it will load from prefill engines, from the moment
//! it sees them until their load ended).

use kvx_offload::RemoteSource;
use kvx_rdma::{KeeperConfig, KeptLease, TcpClientConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::time::Duration;

use crate::config::connector_config;
use crate::kvx_err;

/// Renews remote requests' leases and tells producers when their reader is done; no call waits
/// on the network.
#[pyclass(module = "kvx._native")]
pub struct LeaseKeeper {
    inner: kvx_rdma::LeaseKeeper,
}

#[pymethods]
impl LeaseKeeper {
    /// A keeper with the connector's settings `config` (the `remote` section: token, export
    /// grace).
    #[new]
    fn new(py: Python<'_>, config: &str, block_tokens: u32) -> PyResult<LeaseKeeper> {
        let cfg = py.detach(|| connector_config(config, block_tokens))?;
        let remote = cfg.remote.unwrap_or_default();
        let inner = kvx_rdma::LeaseKeeper::new(KeeperConfig {
            tcp: TcpClientConfig {
                token: remote.token,
                ..TcpClientConfig::default()
            },
            export_grace: Duration::from_millis(remote.export_grace_ms),
            ..KeeperConfig::default()
        })
        .map_err(kvx_err)?;
        Ok(LeaseKeeper { inner })
    }

    /// Start renewing `source`'s lease (JSON, as the producer handed it) under `id`; a
    /// `ValueError` for a source that does not parse, or an id kept already.
    fn keep(&self, id: u64, source: &str) -> PyResult<()> {
        let s =
            RemoteSource::from_json(source).map_err(|e| PyValueError::new_err(e.to_string()))?;
        self.inner
            .keep(id, s.descriptors())
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// `"pending"`, `"live"`, or `"lost: <why>"`; `None` when `id` is not kept.
    fn status(&self, id: u64) -> Option<String> {
        self.inner.status(id).map(|s| match s {
            KeptLease::Pending => "pending".to_string(),
            KeptLease::Live => "live".to_string(),
            KeptLease::Lost(why) => format!("lost: {why}"),
        })
    }

    /// Stop renewing `id`'s lease; with `done`, tell the producers (in the background). False
    /// when `id` was not kept.
    fn release(&self, id: u64, done: bool) -> bool {
        self.inner.release(id, done)
    }

    /// Requests kept now.
    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// Check a remote source a producer handed out (JSON): its namespace, its keys (16 bytes each,
/// concatenated) and how many producer ranks it names; a `ValueError` saying what is wrong.
#[pyfunction]
pub fn remote_source<'py>(
    py: Python<'py>,
    source: &str,
) -> PyResult<(String, Bound<'py, PyBytes>, usize)> {
    let s = RemoteSource::from_json(source).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let keys: Vec<u8> = s.keys.iter().flat_map(|k| k.to_be_bytes()).collect();
    Ok((s.namespace, PyBytes::new(py, &keys), s.producers.len()))
}
