//! A GPU engine's ordering point: kvx's copies of engine memory come after the engine's
//! kernels on the device, also when the engine's CPU runs a step ahead of its GPU (vLLM's
//! asynchronous scheduling). See `kvx_cuda::EngineOrder`.

use super::WorkerSide;

impl WorkerSide {
    /// Order by `order` (the builder gives a worker over CUDA engine memory its backend's).
    pub(crate) fn set_engine_order(&mut self, order: kvx_cuda::EngineOrder) {
        self.engine_order = Some(order);
    }

    /// Make every copy of engine memory that kvx submits from now on come, on the device,
    /// after the work the engine queued on `stream` so far.
    ///
    /// Call it once per step, with the engine's current stream (PyTorch's
    /// `torch.cuda.current_stream().cuda_stream`, which holds the previous step's forward),
    /// **before** any call of the step that may submit a copy: [`WorkerSide::start_step`]
    /// (it releases the stores queued last step and starts loads, exports and preemption
    /// flushes) and [`WorkerSide::handle_preemptions`], and a driver `fence_blocks` (it
    /// flushes queued stores). Every copy those calls submit, and every one submitted later
    /// (a file load's copy into engine memory once its read is done), waits on the device for
    /// that work; copies already submitted are not affected.
    ///
    /// Cost and bound: it never waits for the device, the engine's stream or the driver
    /// thread: one `cuEventRecord` on `stream` and one `cuStreamWaitEvent` per copy stream of
    /// kvx-cuda (16 by default), each only queued, plus `cuCtxGetCurrent` (the calling
    /// thread's current context is left as it was). Engine memory not on a CUDA device (host
    /// memory, a caller's backend): nothing to order, `Ok` at once.
    ///
    /// Errors: a failed driver call (`kvx_cuda::CudaError::Driver`, e.g. a stream of another
    /// device, or a context broken by a sticky error). The step's copies are then not known to
    /// come after the engine's work: synchronise `stream` before calling `start_step`.
    ///
    /// # Safety
    /// `stream` is a `CUstream` handle as an integer: 0 (the legacy default stream), 1
    /// (`CU_STREAM_LEGACY`), 2 (`CU_STREAM_PER_THREAD`), or a live stream of the engine
    /// memory's device (its primary context, which PyTorch uses), alive for the call. The
    /// CUDA driver does not check a handle before using it.
    pub unsafe fn order_after_engine_stream(
        &self,
        stream: usize,
    ) -> Result<(), kvx_cuda::CudaError> {
        match &self.engine_order {
            // SAFETY: the stream is the caller's promise.
            Some(order) => unsafe { order.order_after(stream) },
            None => Ok(()),
        }
    }
}
