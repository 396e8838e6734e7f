//! Errors of kvx-cuda.

use kvx_core::CoreError;

/// What went wrong talking to CUDA or setting up the backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver library (`libcuda.so`) cannot be loaded on this machine.
    #[error("no CUDA: {reason}")]
    NoCuda {
        /// What was looked for.
        reason: String,
    },
    /// The driver library loaded, but lacks a function kvx calls (a driver older than needed).
    #[error("no CUDA: the driver library has no symbol {symbol} (driver too old)")]
    MissingSymbol {
        /// The missing symbol.
        symbol: &'static str,
    },
    /// The driver loaded, but there is no usable device with this ordinal.
    #[error("no CUDA device {ordinal}: {reason}")]
    NoDevice {
        /// Device ordinal asked for.
        ordinal: u32,
        /// Why (e.g. `CUDA_ERROR_NO_DEVICE`, or how many devices there are).
        reason: String,
    },
    /// A driver call failed.
    #[error("{call} failed: {name} ({code})")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The CUresult's name.
        name: String,
        /// The CUresult's numeric value.
        code: u32,
    },
    /// The driver refused to page-lock (pin) a chunk of a pinned pool.
    #[error(
        "pinning host memory failed: cuMemHostRegister of a {chunk_bytes}-byte chunk was refused \
         ({pinned_bytes} of the pool's {total_bytes} bytes were pinned): {reason}; use a smaller \
         pool or pin chunk (pin_chunk_bytes), or raise the locked-memory limit (ulimit -l)"
    )]
    PinFailed {
        /// Bytes of the chunk the driver refused.
        chunk_bytes: usize,
        /// Bytes pinned before it (unregistered again).
        pinned_bytes: usize,
        /// Bytes of the whole pool.
        total_bytes: usize,
        /// The driver's answer.
        reason: String,
    },
    /// A configuration value that makes no sense.
    #[error("invalid kvx-cuda configuration: {0}")]
    BadConfig(String),
    /// A KV layout this backend cannot serve (host regions, another device).
    #[error("invalid layout for the CUDA backend: {0}")]
    BadLayout(String),
    /// A device-memory access outside an allocation.
    #[error(
        "device memory access out of bounds: offset {offset} + {len} bytes > allocation of {size}"
    )]
    OutOfBounds {
        /// Start of the access.
        offset: usize,
        /// Bytes accessed.
        len: usize,
        /// Size of the allocation.
        size: usize,
    },
    /// A copy did not finish before the given time (benchmarks and helpers only).
    #[error("{what} did not complete within {secs} s")]
    Stuck {
        /// What was waited for.
        what: String,
        /// How long.
        secs: u64,
    },
    /// A copy the benchmark rig or a helper ran came back with failed blocks.
    #[error("copy failed: {0}")]
    CopyFailed(String),
    /// A thread could not be started.
    #[error("cannot spawn {what}: {reason}")]
    Spawn {
        /// Which thread.
        what: String,
        /// The OS error.
        reason: String,
    },
    /// An error from kvx-core (buffer allocation, layout).
    #[error(transparent)]
    Core(#[from] CoreError),
}

impl CudaError {
    /// True when the error means "no usable CUDA here" (no library, old driver, no device),
    /// as opposed to a failure of a working CUDA installation.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            CudaError::NoCuda { .. } | CudaError::MissingSymbol { .. } | CudaError::NoDevice { .. }
        )
    }
}
