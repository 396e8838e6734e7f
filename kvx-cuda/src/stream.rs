//! Streams, events and the copy calls: the only code that hands host and device addresses to
//! the DMA engines.
//!
//! Ownership rule the unsafe code here relies on (owned-buffer model): a run's host range lies
//! in a pinned buffer owned by an op that the backend keeps until an event recorded **after**
//! the run's copy has completed; its device range is engine memory whose owner promised (the
//! `unsafe` [`crate::CudaBackend::new`]) to keep it alive and untouched while an op names it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use crate::driver::{Ctx, check};
use crate::error::CudaError;
use crate::plan::Run;

/// A non-blocking stream (does not synchronise with the legacy default stream).
pub(crate) struct Stream {
    ctx: Arc<Ctx>,
    raw: sys::CUstream,
}

// SAFETY: a CUstream is a handle the thread-safe driver API accepts from any thread (with the
// context bound); Stream has no interior data besides it.
unsafe impl Send for Stream {}
// SAFETY: see above.
unsafe impl Sync for Stream {}

impl Stream {
    pub(crate) fn new(ctx: Arc<Ctx>) -> Result<Stream, CudaError> {
        ctx.bind()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: context open and current; `raw` is a live local.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream { ctx, raw })
    }

    /// Make the stream run nothing queued after this call until `event`'s latest record (as
    /// of this call) completed (`cuStreamWaitEvent`): queued on the device, never waited for
    /// here.
    pub(crate) fn wait_for(&self, event: &Event) -> Result<(), CudaError> {
        // SAFETY: both handles are live (the event may be recorded on another context's
        // stream, which the driver allows).
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.raw, event.raw, 0)
        })
    }

    /// Block the calling thread until all work queued on the stream finished.
    pub(crate) fn synchronize(&self) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: `raw` is a live stream of this context.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        // SAFETY: created in `new`, destroyed once. (Work still queued would finish first; the
        // backend drops streams only after its completers saw every event.)
        unsafe { sys::cuStreamDestroy_v2(self.raw) };
    }
}

/// An event with blocking sync (a waiting thread sleeps instead of spinning) and no timing.
pub(crate) struct Event {
    ctx: Arc<Ctx>,
    raw: sys::CUevent,
}

// SAFETY: as for Stream: a driver handle usable from any thread with the context bound.
unsafe impl Send for Event {}
// SAFETY: see above.
unsafe impl Sync for Event {}

impl Event {
    pub(crate) fn new(ctx: Arc<Ctx>) -> Result<Event, CudaError> {
        ctx.bind()?;
        let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: context open and current; `raw` is a live local.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Event { ctx, raw })
    }

    /// Record the event after everything queued on `stream` so far.
    pub(crate) fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        // SAFETY: both handles are live and belong to the same (bound) context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw)
        })
    }

    /// Record the event after everything queued so far on a stream that is not kvx's (an
    /// engine's, by its raw handle).
    ///
    /// # Safety
    /// `stream` is `0` (the legacy default stream), `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`,
    /// or a live stream of this event's context, and stays live for the call: the driver does
    /// not check a handle before it uses it.
    pub(crate) unsafe fn record_on_raw(&self, stream: sys::CUstream) -> Result<(), CudaError> {
        // SAFETY: a live event; the stream is the caller's promise.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream)
        })
    }

    /// Whether the recorded work completed (`cuEventQuery`); never waits.
    pub(crate) fn query(&self) -> Result<bool, CudaError> {
        // SAFETY: live event handle.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| true),
        }
    }

    /// Wait until the recorded work completed: with `poll`, by asking every `poll` (growing to
    /// 1/64 of the time waited so far, at most 10 ms, so a hung copy costs next to nothing);
    /// without, in [`Event::synchronize`]. Must be called on a thread with the context bound.
    pub(crate) fn wait(&self, poll: Option<Duration>) -> Result<(), CudaError> {
        let Some(interval) = poll else {
            return self.synchronize();
        };
        let start = Instant::now();
        while !self.query()? {
            let grown = (start.elapsed() / 64).min(Duration::from_millis(10));
            std::thread::sleep(interval.max(grown));
        }
        Ok(())
    }

    /// Block (sleeping, thanks to `CU_EVENT_BLOCKING_SYNC`) until the recorded work completed.
    /// Must be called on a thread with the context bound.
    pub(crate) fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: live event handle.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        // SAFETY: created in `new`, destroyed once; nobody waits on it any more (the completer
        // returns an event to the pool only after synchronising it).
        unsafe { sys::cuEventDestroy_v2(self.raw) };
    }
}

/// Which way a batch of runs copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyDir {
    /// Host → device (loads).
    HtoD,
    /// Device → host (stores).
    DtoH,
}

/// Driver calls one `enqueue` made.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Calls {
    /// Copy calls issued (a batch counts one).
    pub(crate) api_calls: u64,
    /// Batch calls among them.
    pub(crate) batch_calls: u64,
    /// Batch calls that failed and were redone run by run.
    pub(crate) batch_fallbacks: u64,
    /// Why the batch call failed, if it did.
    pub(crate) batch_error: Option<CudaError>,
}

/// Queue `runs` on `stream`: one `cuMemcpyBatchAsync` when `batch` allows it and there are at
/// least `min_batch` runs, else one async copy per run. A failed batch call is redone run by run
/// (copies are idempotent: same bytes to the same place) and, if that works, `batch` is switched
/// off for the backend.
///
/// # Safety
/// Every run must satisfy the module's ownership rule: host ranges pinned and owned by an op the
/// caller keeps until an event recorded after this call completed; device ranges live engine
/// memory of this context.
pub(crate) unsafe fn enqueue(
    ctx: &Ctx,
    stream: &Stream,
    dir: CopyDir,
    runs: &[Run],
    batch: &AtomicBool,
    min_batch: usize,
) -> Result<Calls, CudaError> {
    let mut calls = Calls::default();
    if batch.load(Ordering::Relaxed) && runs.len() >= min_batch.max(1) {
        calls.api_calls += 1;
        calls.batch_calls += 1;
        // SAFETY: forwarded from the caller.
        match unsafe { enqueue_batch(ctx, stream, dir, runs) } {
            Ok(()) => return Ok(calls),
            Err(e) => {
                calls.batch_fallbacks += 1;
                // SAFETY: forwarded from the caller.
                unsafe { enqueue_each(stream, dir, runs, &mut calls) }?;
                tracing::warn!(error = %e, "cuMemcpyBatchAsync failed, per-run copies worked: batching disabled");
                batch.store(false, Ordering::Relaxed);
                calls.batch_error = Some(e);
                return Ok(calls);
            }
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { enqueue_each(stream, dir, runs, &mut calls) }?;
    Ok(calls)
}

/// One async copy per run.
///
/// # Safety
/// As for [`enqueue`].
unsafe fn enqueue_each(
    stream: &Stream,
    dir: CopyDir,
    runs: &[Run],
    calls: &mut Calls,
) -> Result<(), CudaError> {
    for r in runs {
        calls.api_calls += 1;
        match dir {
            // SAFETY: the caller's ownership rule: `r.host..+len` is pinned memory held until the
            // op's event completes, `r.dev..+len` live engine memory; async copies from pinned
            // memory return at once and read the source in stream order.
            CopyDir::HtoD => check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    r.dev,
                    r.host as *const std::ffi::c_void,
                    r.len,
                    stream.raw,
                )
            })?,
            // SAFETY: as above; the op owns the destination buffer exclusively (Owned).
            CopyDir::DtoH => check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(r.host as *mut std::ffi::c_void, r.dev, r.len, stream.raw)
            })?,
        }
    }
    Ok(())
}

/// All runs in one `cuMemcpyBatchAsync` (CUDA 12.8 signature).
///
/// # Safety
/// As for [`enqueue`].
unsafe fn enqueue_batch(
    ctx: &Ctx,
    stream: &Stream,
    dir: CopyDir,
    runs: &[Run],
) -> Result<(), CudaError> {
    let Some(batch_fn) = ctx.batch_fn() else {
        return Err(CudaError::MissingSymbol {
            symbol: crate::driver::BATCH_SYMBOL,
        });
    };
    let n = runs.len();
    let mut dsts = Vec::with_capacity(n);
    let mut srcs = Vec::with_capacity(n);
    let mut sizes = Vec::with_capacity(n);
    for r in runs {
        let host = r.host as sys::CUdeviceptr; // UVA: a pinned host pointer is its own address
        match dir {
            CopyDir::HtoD => {
                dsts.push(r.dev);
                srcs.push(host);
            }
            CopyDir::DtoH => {
                dsts.push(host);
                srcs.push(r.dev);
            }
        }
        sizes.push(r.len);
    }
    let device = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ctx.ordinal() as i32,
    };
    let host = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
        id: 0,
    };
    let (src_loc, dst_loc) = match dir {
        CopyDir::HtoD => (host, device),
        CopyDir::DtoH => (device, host),
    };
    let mut attrs = [sys::CUmemcpyAttributes {
        // Sources are read in stream order, after earlier work on this stream.
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: src_loc,
        dstLocHint: dst_loc,
        flags: 0,
    }];
    let mut attr_idx = [0usize];
    let mut fail_idx = usize::MAX;
    // SAFETY: `batch_fn` is the driver's 12.8 entry point (see `Ctx::batch_fn`). The five
    // arrays are live locals of the lengths passed (n copies, 1 attribute applying from copy 0),
    // read during the call only. The addresses follow the caller's ownership rule; the stream is
    // a created (non-legacy) stream, as the API requires.
    let r = unsafe {
        batch_fn(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            n,
            attrs.as_mut_ptr(),
            attr_idx.as_mut_ptr(),
            1,
            &mut fail_idx,
            stream.raw,
        )
    };
    check("cuMemcpyBatchAsync", r).inspect_err(|e| {
        let run = (fail_idx < n).then(|| runs[fail_idx]);
        tracing::debug!(error = %e, fail_idx, ?run, "cuMemcpyBatchAsync rejected the batch");
    })
}
