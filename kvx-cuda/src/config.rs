//! Settings of the CUDA backend.

use std::time::Duration;

use crate::error::CudaError;

/// The default [`CudaBackendConfig::completion_poll`]: 20 µs.
pub const DEFAULT_COMPLETION_POLL: Duration = Duration::from_micros(20);

/// How runs left after coalescing are submitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchMode {
    /// One `cuMemcpyBatchAsync` per op where the driver has it (12.8+), else one call per run.
    Auto,
    /// Always one `cuMemcpy*Async` call per run (for comparison and old drivers).
    Never,
}

/// Settings of [`crate::CudaBackend`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaBackendConfig {
    /// Name in logs and errors (default `cuda`).
    pub name: String,
    /// Ops in flight at once (both directions); past it `submit` refuses with `Busy`
    /// (default 1024). Bounds the driver's queue so `submit` never blocks on a full push buffer.
    pub max_inflight_ops: usize,
    /// Batched or per-run copies (default `Auto`).
    pub batch: BatchMode,
    /// Fewest runs for which a batch call is used; fewer go one call each (default 2).
    pub min_batch_runs: usize,
    /// Most bytes [`crate::CudaBackend::pinned_pool`] pins per `cuMemHostRegister` call
    /// (default [`crate::DEFAULT_PIN_CHUNK`], 1 GiB; a multiple of [`crate::PAGE_SIZE`]).
    pub pin_chunk_bytes: usize,
    /// How a completer learns that an op's copies ended. `Some(interval)` (default
    /// [`DEFAULT_COMPLETION_POLL`]): it asks the op's event every `interval` while the op is in
    /// flight, so the op completes within about `interval` of its last byte, for a few per cent
    /// of a core per busy stream. `None`: it sleeps in `cuEventSynchronize` (blocking sync, no
    /// CPU spent) and the driver's interrupt wakes it, later: on an H200, a 64 MiB op took
    /// 0.18-0.24 ms longer that way (`kvx bench cuda`).
    pub completion_poll: Option<Duration>,
    /// Streams per direction an op's copies are spread over (default 8; an op gets one per
    /// 32 runs at most). A copy engine pays a fixed cost per
    /// copy, so one stream's 1,024 scattered 64 KiB copies ran at 0.58x a contiguous copy on an
    /// H200, 4 streams at 0.85x and 8 at 0.90x (a CUDA program, same run).
    pub copy_streams: usize,
}

impl Default for CudaBackendConfig {
    fn default() -> Self {
        CudaBackendConfig {
            name: "cuda".into(),
            max_inflight_ops: 1024,
            batch: BatchMode::Auto,
            min_batch_runs: 2,
            pin_chunk_bytes: crate::DEFAULT_PIN_CHUNK,
            completion_poll: Some(DEFAULT_COMPLETION_POLL),
            copy_streams: 8,
        }
    }
}

impl CudaBackendConfig {
    /// Reject settings that make no sense.
    pub fn validate(&self) -> Result<(), CudaError> {
        if self.name.trim().is_empty() {
            return Err(CudaError::BadConfig("the backend name is empty".into()));
        }
        if self.max_inflight_ops == 0 {
            return Err(CudaError::BadConfig(
                "max_inflight_ops is 0: the backend could never accept an op".into(),
            ));
        }
        if self.min_batch_runs == 0 {
            return Err(CudaError::BadConfig(
                "min_batch_runs is 0; use 1 to batch every op, or BatchMode::Never".into(),
            ));
        }
        if self.copy_streams == 0 {
            return Err(CudaError::BadConfig(
                "copy_streams is 0: a direction needs at least one stream".into(),
            ));
        }
        if self.completion_poll == Some(Duration::ZERO) {
            return Err(CudaError::BadConfig(
                "completion_poll is 0 (a spinning completer); use an interval, or None to block"
                    .into(),
            ));
        }
        crate::pinned::validate_chunk(self.pin_chunk_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_nonsense_is_rejected() {
        assert!(CudaBackendConfig::default().validate().is_ok());
        let bad = [
            CudaBackendConfig {
                name: " ".into(),
                ..Default::default()
            },
            CudaBackendConfig {
                max_inflight_ops: 0,
                ..Default::default()
            },
            CudaBackendConfig {
                min_batch_runs: 0,
                ..Default::default()
            },
            CudaBackendConfig {
                pin_chunk_bytes: 1000,
                ..Default::default()
            },
            CudaBackendConfig {
                completion_poll: Some(Duration::ZERO),
                ..Default::default()
            },
            CudaBackendConfig {
                copy_streams: 0,
                ..Default::default()
            },
        ];
        for cfg in bad {
            let err = cfg.validate().unwrap_err();
            assert!(matches!(err, CudaError::BadConfig(_)), "{cfg:?} gave {err}");
        }
        let one = CudaBackendConfig {
            min_batch_runs: 1,
            batch: BatchMode::Never,
            completion_poll: None,
            ..Default::default()
        };
        assert!(one.validate().is_ok());
    }
}
