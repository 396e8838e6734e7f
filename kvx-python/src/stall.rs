//! A test fixture for Python: kvx-fusefs's freezable FUSE mount, to freeze a file tier for
//! real. Not part of the connector.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use kvx_core::lock;
use kvx_fusefs::{Backing, StallFs, StallMount};
use pyo3::prelude::*;

use crate::KvxError;

/// A FUSE mount (files passed through to a directory) that can be frozen and thawed.
#[pyclass(module = "kvx._native")]
pub struct FrozenMount {
    mount: Mutex<Option<StallMount>>,
}

impl FrozenMount {
    fn with<T>(&self, f: impl FnOnce(&StallMount) -> T) -> PyResult<T> {
        match lock(&self.mount).as_ref() {
            Some(m) => Ok(f(m)),
            None => Err(KvxError::new_err("the mount is closed")),
        }
    }
}

#[pymethods]
impl FrozenMount {
    /// Why FUSE cannot be used here, or `None` when it can.
    #[staticmethod]
    fn unavailable() -> Option<String> {
        kvx_fusefs::fuse_available().err()
    }

    /// Mount at `mountpoint`, passing every operation through to `backing_dir`.
    #[new]
    fn new(py: Python<'_>, mountpoint: PathBuf, backing_dir: PathBuf) -> PyResult<FrozenMount> {
        let m = py
            .detach(|| StallFs::mount(&mountpoint, Backing::Passthrough(backing_dir)))
            .map_err(|e| KvxError::new_err(e.to_string()))?;
        Ok(FrozenMount {
            mount: Mutex::new(Some(m)),
        })
    }

    /// Make every following filesystem request block until `thaw`.
    fn freeze(&self) -> PyResult<()> {
        self.with(|m| m.freeze())
    }

    /// Let every blocked request finish.
    fn thaw(&self) -> PyResult<()> {
        self.with(|m| m.thaw())
    }

    /// Requests blocked in the frozen filesystem now.
    fn blocked_requests(&self) -> PyResult<usize> {
        self.with(|m| m.blocked_requests())
    }

    /// Wait up to `timeout_s` until at least `n` requests are blocked.
    fn wait_blocked(&self, py: Python<'_>, n: usize, timeout_s: f64) -> PyResult<bool> {
        py.detach(|| self.with(|m| m.wait_blocked(n, Duration::from_secs_f64(timeout_s))))
    }

    /// Abort the connection and unmount (releases anything stuck). Idempotent.
    fn close(&self, py: Python<'_>) {
        let m = lock(&self.mount).take();
        py.detach(move || drop(m));
    }
}
