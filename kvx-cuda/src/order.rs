//! The ordering point between the engine's CUDA stream and the backend's copy streams.
//!
//! The backend copies on streams of its own, which nothing orders against the engine's
//! kernels. An engine whose CPU runs ahead of its GPU (vLLM's asynchronous scheduling) starts
//! step N+1, and with it kvx's copies of the blocks step N computed, while step N's forward may
//! still run. [`EngineOrder::order_after`] closes that gap on the device: it records an event
//! on the engine's stream (capturing everything the engine queued there so far) and makes
//! every copy stream of the backend, in both directions, wait for it. Copies queued on those
//! streams after the call start only once that work is done; nothing waits on the CPU.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use crate::driver::Ctx;
use crate::error::CudaError;
use crate::stream::{Event, Stream};

/// The handle that orders a [`crate::CudaBackend`]'s copies after an engine's CUDA stream
/// ([`crate::CudaBackend::engine_order`]). Cheap to clone; usable from any thread, also after
/// the backend moved into a driver.
#[derive(Clone)]
pub struct EngineOrder {
    inner: Arc<Inner>,
}

struct Inner {
    ctx: Arc<Ctx>,
    /// Every copy stream of the backend: its loads' and its stores' (an op's copies go to any
    /// of them, one part per stream).
    streams: Vec<Arc<Stream>>,
    /// Recorded on the engine's stream at each call; a wait captures the record made before
    /// it, so reusing the event never loosens an earlier wait. The lock keeps two callers'
    /// records and waits from interleaving.
    event: Mutex<Event>,
}

impl EngineOrder {
    pub(crate) fn new(ctx: Arc<Ctx>, streams: Vec<Arc<Stream>>) -> Result<EngineOrder, CudaError> {
        let event = Event::new(ctx.clone())?;
        Ok(EngineOrder {
            inner: Arc::new(Inner {
                ctx,
                streams,
                event: Mutex::new(event),
            }),
        })
    }

    /// Order every copy the backend queues from now on after all the work queued on
    /// `engine_stream` so far, on the device: `cuEventRecord` on the engine's stream, then one
    /// `cuStreamWaitEvent` on each of the backend's `2 × copy_streams` streams (an op's copies
    /// may go to any of its direction's streams). A copy queued after this call returned, on
    /// any thread that the return happened before (the driver thread, for tasks submitted
    /// after it: its queue is handed over under a lock), starts only once that work is done;
    /// copies queued earlier are not affected.
    ///
    /// Cost and bound: it never waits for the device or the engine's stream. It makes
    /// `2 + 2 × copy_streams` driver calls (18 by default: `cuCtxGetCurrent`, the record, 16
    /// waits), each of which only queues work, plus two `cuCtxSetCurrent` when another context
    /// was current on the calling thread (it is made current again before the call returns).
    ///
    /// Errors: a failed driver call, named ([`CudaError::Driver`]); e.g. a stream of another
    /// device is `CUDA_ERROR_INVALID_HANDLE`, a context broken by a sticky error
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`. A failed record orders nothing; a failed wait leaves the
    /// streams before it ordered. Either way kvx's next copies are not known to come after
    /// the engine's work: synchronise the engine's stream instead before submitting them.
    ///
    /// # Safety
    /// `engine_stream` is a CUDA stream handle as the driver API takes it (`CUstream` as an
    /// integer, PyTorch's `torch.cuda.current_stream().cuda_stream`): `0` (the legacy default
    /// stream), `CU_STREAM_LEGACY` (1), `CU_STREAM_PER_THREAD` (2), or a stream of the
    /// backend's device's primary context that stays alive for the call. The driver does not
    /// check a handle before using it.
    pub unsafe fn order_after(&self, engine_stream: usize) -> Result<(), CudaError> {
        let inner = &*self.inner;
        let _bound = inner.ctx.bind_for_call()?;
        let event = kvx_core::lock(&inner.event);
        // SAFETY: the stream handle is the caller's promise; the event is of this context.
        unsafe { event.record_on_raw(engine_stream as sys::CUstream) }?;
        for s in &inner.streams {
            s.wait_for(&event)?;
        }
        Ok(())
    }

    /// How many copy streams [`EngineOrder::order_after`] makes wait (both directions).
    pub fn streams(&self) -> usize {
        self.inner.streams.len()
    }
}

impl std::fmt::Debug for EngineOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineOrder")
            .field("device", &self.inner.ctx.ordinal())
            .field("streams", &self.streams())
            .finish()
    }
}
