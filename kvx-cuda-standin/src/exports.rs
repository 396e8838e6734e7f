//! The driver functions, exported under the names cudarc resolves in `libcuda.so`.
//!
//! Each one checks its arguments (null out-pointers, unknown handles, bad ranges) and answers
//! with a `CUresult` as the real driver does; none of them panics across the C boundary.
//! Unsafe rule of this module: a pointer argument is written or read only after a null check,
//! and only for the size its C signature gives it (the caller's promise, as with libcuda).

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdeviceptr, CUdriverProcAddressQueryResult, CUevent, CUhostFn,
    CUmemcpyAttributes, CUresult, CUstream, cuuint64_t,
};

use crate::memory::{Place, register_host, unregister_host};
use crate::registry::{Handle, LEGACY_STREAM, driver};
use crate::stream::{Copy, EventState, HostCall, StreamShared};
use crate::{DEVICES, DRIVER_VERSION};

/// `Result` → `CUresult`.
fn answer(r: Result<(), CUresult>) -> CUresult {
    r.err().unwrap_or(CUresult::CUDA_SUCCESS)
}

/// Write `v` through `out`, or `CUDA_ERROR_INVALID_VALUE` for a null pointer.
///
/// # Safety
/// `out` is null or valid for a write of one `T` (the caller's promise, as with libcuda).
unsafe fn put<T>(out: *mut T, v: T) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for one T by the caller's promise.
    unsafe { out.write(v) };
    Ok(())
}

fn handle_of<T>(p: *mut T) -> usize {
    p as usize
}

/// Initialise the driver (flags must be 0).
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    if flags != 0 {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    driver().init();
    CUresult::CUDA_SUCCESS
}

/// The driver version (12080).
///
/// # Safety
/// `v` is null or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    // SAFETY: forwarded from the caller.
    answer(unsafe { put(v, DRIVER_VERSION) })
}

/// How many devices (16).
///
/// # Safety
/// `count` is null or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    // SAFETY: forwarded from the caller.
    answer(
        driver()
            .check_init()
            .and_then(|()| unsafe { put(count, DEVICES) }),
    )
}

/// The device handle of `ordinal` (the ordinal itself).
///
/// # Safety
/// `dev` is null or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    let d = driver();
    answer(d.check_init().and_then(|()| {
        let device = d.device(ordinal)?;
        // SAFETY: forwarded from the caller.
        unsafe { put(dev, device.ordinal) }
    }))
}

/// The device's name, NUL-terminated, cut to `len` bytes.
///
/// # Safety
/// `name` is null or valid for `len` bytes of writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    let d = driver();
    answer(d.check_init().and_then(|()| {
        let device = d.device(dev)?;
        let len = usize::try_from(len).map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let text = format!("kvx CUDA stand-in (CPU) {}", device.ordinal);
        let n = text.len().min(len - 1);
        // SAFETY: `name` is valid for `len` bytes (caller); we write n + 1 <= len bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    }))
}

/// Retain the device's primary context (created on the first retain).
///
/// # Safety
/// `ctx` is null or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let d = driver();
    answer(d.check_init().and_then(|()| {
        let device = d.device(dev)?;
        if ctx.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let c = d.retain_primary(device);
        // SAFETY: checked non-null; valid for one write (caller).
        unsafe { put(ctx, c.handle as CUcontext) }
    }))
}

/// Release the primary context; the last release destroys it.
#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    let d = driver();
    answer(
        d.check_init()
            .and_then(|()| d.device(dev))
            .and_then(|device| d.release_primary(device)),
    )
}

/// Make `ctx` current on this thread (null unbinds).
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    let d = driver();
    answer(d.check_init().and_then(|()| d.set_current(handle_of(ctx))))
}

/// The calling thread's current context (null when none is).
///
/// # Safety
/// `ctx` is null or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut CUcontext) -> CUresult {
    let d = driver();
    // SAFETY: forwarded from the caller.
    answer(
        d.check_init()
            .and_then(|()| unsafe { put(ctx, d.current_handle() as CUcontext) }),
    )
}

/// Wait for every stream of the current context.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    answer(driver().current().and_then(|ctx| {
        ctx.streams()
            .iter()
            .try_for_each(|s| s.synchronize())
            .and_then(|()| ctx.check())
    }))
}

/// Create a stream of the current context (its own thread).
///
/// # Safety
/// `stream` is null or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut CUstream, _flags: c_uint) -> CUresult {
    let d = driver();
    answer(d.current().and_then(|ctx| {
        if stream.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let s = StreamShared::spawn(ctx)?;
        let h = d.insert(Handle::Stream(s));
        // SAFETY: checked non-null; valid for one write (caller).
        unsafe { put(stream, h as CUstream) }
    }))
}

/// Destroy a stream: queued work still runs.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(stream: CUstream) -> CUresult {
    let d = driver();
    answer(d.stream(handle_of(stream)).map(|s| {
        d.remove(handle_of(stream));
        s.close();
    }))
}

/// Wait until the stream ran everything queued on it.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(stream: CUstream) -> CUresult {
    answer(
        driver()
            .stream_or_default(handle_of(stream))
            .and_then(|s| s.synchronize()),
    )
}

/// Make `stream` run nothing queued after this call until `event`'s latest record (as of this
/// call) was reached; returns at once. Flags must be 0. The event may be of another context.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(stream: CUstream, event: CUevent, flags: c_uint) -> CUresult {
    let d = driver();
    answer((|| {
        if flags != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let ev = d.event(handle_of(event))?;
        let s = d.stream_or_default(handle_of(stream))?;
        s.ctx.check()?;
        s.wait_event(&ev)
    })())
}

/// Queue `f(user_data)` on `stream`: it runs on the stream's thread when the stream gets
/// there, and the stream runs nothing else until it returns (a slow "kernel" for tests).
#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchHostFunc(
    stream: CUstream,
    f: CUhostFn,
    user_data: *mut c_void,
) -> CUresult {
    answer((|| {
        let f = f.ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        let s = async_stream(stream)?;
        s.host(HostCall {
            f,
            data: user_data as usize,
        })
    })())
}

/// Create an event of the current context.
///
/// # Safety
/// `event` is null or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(event: *mut CUevent, _flags: c_uint) -> CUresult {
    let d = driver();
    answer(d.current().and_then(|ctx| {
        if event.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let h = d.insert(Handle::Event(EventState::new(ctx)));
        // SAFETY: checked non-null; valid for one write (caller).
        unsafe { put(event, h as CUevent) }
    }))
}

/// Destroy an event.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(event: CUevent) -> CUresult {
    let d = driver();
    answer(d.event(handle_of(event)).map(|_| {
        d.remove(handle_of(event));
    }))
}

/// Record `event` on `stream`: it completes when the stream's thread gets there.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(event: CUevent, stream: CUstream) -> CUresult {
    let d = driver();
    answer((|| {
        let ev = d.event(handle_of(event))?;
        let s = d.stream_or_default(handle_of(stream))?;
        if !std::sync::Arc::ptr_eq(&ev.ctx, &s.ctx) {
            return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
        }
        s.ctx.check()?;
        s.record(&ev)
    })())
}

/// `CUDA_SUCCESS` when the event's latest record was reached, else `CUDA_ERROR_NOT_READY`.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(event: CUevent) -> CUresult {
    answer(driver().event(handle_of(event)).and_then(|ev| {
        ev.ctx.check()?;
        if ev.is_complete() {
            Ok(())
        } else {
            Err(CUresult::CUDA_ERROR_NOT_READY)
        }
    }))
}

/// Wait until the event's latest record was reached.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(event: CUevent) -> CUresult {
    answer(
        driver()
            .event(handle_of(event))
            .and_then(|ev| ev.synchronize()),
    )
}

/// Register (pin) host memory; refused past the device's registration limit.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostRegister_v2(p: *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    answer(driver().current().and_then(|ctx| {
        if !ctx.device.knobs.may_register(bytes) {
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        register_host(ctx.handle, p as usize, bytes)
    }))
}

/// Unregister host memory registered at `p`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    answer(driver().current().and_then(|_| unregister_host(p as usize)))
}

/// Allocate "device" memory: a mapping of its own at a device address.
///
/// # Safety
/// `ptr` is null or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    answer(driver().current().and_then(|ctx| {
        if ptr.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let a = ctx.allocs.alloc(&ctx.device.space, bytes)?;
        // SAFETY: checked non-null; valid for one write (caller).
        unsafe { put(ptr, a) }
    }))
}

/// Free an allocation (only its start address); works on a failed context, as unregistering.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(ptr: CUdeviceptr) -> CUresult {
    answer(
        driver()
            .current_even_failed()
            .and_then(|ctx| ctx.allocs.free(ptr)),
    )
}

/// Run one copy now on the calling thread (the synchronous calls); any host memory will do.
fn copy_now(dst: Place, src: Place, len: usize) -> Result<(), CUresult> {
    let ctx = driver().current()?;
    ctx.check()?;
    let ok = match (&dst, &src) {
        (Place::Device(m, off), Place::Host(h)) => {
            // SAFETY: the device side was resolved for `len` bytes; the host side is the
            // caller's buffer, valid for `len` bytes of reads (libcuda's contract).
            unsafe { std::ptr::copy(*h as *const u8, m.at(*off), len) };
            true
        }
        (Place::Host(h), Place::Device(m, off)) => {
            // SAFETY: as above, with the host side valid for `len` bytes of writes.
            unsafe { std::ptr::copy(m.at(*off).cast_const(), *h as *mut u8, len) };
            true
        }
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(CUresult::CUDA_ERROR_INVALID_VALUE)
    }
}

/// Synchronous host → device copy (any host memory).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, len: usize) -> CUresult {
    answer(driver().current().and_then(|ctx| {
        if src.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        copy_now(
            Place::device(&ctx.allocs, dst, len)?,
            Place::Host(src as usize),
            len,
        )
    }))
}

/// Synchronous device → host copy (any host memory).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, len: usize) -> CUresult {
    answer(driver().current().and_then(|ctx| {
        if dst.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        copy_now(
            Place::Host(dst as usize),
            Place::device(&ctx.allocs, src, len)?,
            len,
        )
    }))
}

/// The stream of an async call (0 or `CU_STREAM_LEGACY`: the default stream), checked to
/// belong to the current context.
fn async_stream(stream: CUstream) -> Result<std::sync::Arc<StreamShared>, CUresult> {
    let d = driver();
    let ctx = d.current()?;
    let s = d.stream_or_default(handle_of(stream))?;
    if !std::sync::Arc::ptr_eq(&s.ctx, &ctx) {
        return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    Ok(s)
}

/// Queue a host → device copy on `stream`; the host range must be registered.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    len: usize,
    stream: CUstream,
) -> CUresult {
    answer(async_stream(stream).and_then(|s| {
        let c = Copy {
            dst: Place::device(&s.ctx.allocs, dst, len)?,
            src: Place::pinned(src as usize, len)?,
            len,
        };
        s.copy(vec![c])
    }))
}

/// Queue a device → host copy on `stream`; the host range must be registered.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    len: usize,
    stream: CUstream,
) -> CUresult {
    answer(async_stream(stream).and_then(|s| {
        let c = Copy {
            dst: Place::pinned(dst as usize, len)?,
            src: Place::device(&s.ctx.allocs, src, len)?,
            len,
        };
        s.copy(vec![c])
    }))
}

/// Set `len` bytes of device memory to `value` (synchronously).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, value: u8, len: usize) -> CUresult {
    answer(driver().current().and_then(|ctx| {
        let Place::Device(m, off) = Place::device(&ctx.allocs, dst, len)? else {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        };
        // SAFETY: resolved for `len` bytes inside a live mapping we hold.
        unsafe { std::ptr::write_bytes(m.at(off), value, len) };
        Ok(())
    }))
}

/// `cuMemcpyBatchAsync` (CUDA 12.8 signature): every copy is checked before any is queued; on
/// a bad one `*fail_idx` names it and nothing is queued.
///
/// # Safety
/// The arrays hold `count` entries (`attrs`/`attr_idxs` hold `num_attrs`); `fail_idx` is null
/// or valid for one write.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cu_memcpy_batch_async(
    dsts: *mut CUdeviceptr,
    srcs: *mut CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut CUmemcpyAttributes,
    attr_idxs: *mut usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    stream: CUstream,
) -> CUresult {
    answer((|| {
        // As on a GPU, the batch copy needs a created stream, not the legacy default one.
        if [0, LEGACY_STREAM].contains(&handle_of(stream)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let s = async_stream(stream)?;
        if count == 0
            || num_attrs == 0
            || num_attrs > count
            || [dsts.is_null(), srcs.is_null(), sizes.is_null()]
                .into_iter()
                .any(|n| n)
            || attrs.is_null()
            || attr_idxs.is_null()
        {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null, and the caller promised `num_attrs` entries.
        if unsafe { *attr_idxs } != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let mut copies = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: non-null arrays of `count` entries (caller); i < count.
            let (dst, src, len) = unsafe { (*dsts.add(i), *srcs.add(i), *sizes.add(i)) };
            let places = Place::unified(&s.ctx.allocs, dst, len)
                .and_then(|d| Ok((d, Place::unified(&s.ctx.allocs, src, len)?)));
            match places {
                Ok((dst, src)) => copies.push(Copy { dst, src, len }),
                Err(e) => {
                    if !fail_idx.is_null() {
                        // SAFETY: checked non-null; valid for one write (caller).
                        unsafe { fail_idx.write(i) };
                    }
                    return Err(e);
                }
            }
        }
        s.copy(copies)
    })())
}

/// Hands out `cuMemcpyBatchAsync` (12.8+, unless switched off); every other name is not found.
///
/// # Safety
/// `symbol` is null or NUL-terminated; `pfn` and `status` are null or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    _flags: cuuint64_t,
    status: *mut CUdriverProcAddressQueryResult,
) -> CUresult {
    answer((|| {
        driver().check_init()?;
        if symbol.is_null() || pfn.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null and NUL-terminated (caller).
        let name = unsafe { CStr::from_ptr(symbol) };
        let found = name == c"cuMemcpyBatchAsync"
            && version >= DRIVER_VERSION
            && driver()
                .batch_copy
                .load(std::sync::atomic::Ordering::Relaxed);
        let (f, st) = if found {
            let batch: unsafe extern "C" fn(
                *mut CUdeviceptr,
                *mut CUdeviceptr,
                *mut usize,
                usize,
                *mut CUmemcpyAttributes,
                *mut usize,
                usize,
                *mut usize,
                CUstream,
            ) -> CUresult = cu_memcpy_batch_async;
            (
                batch as *mut c_void,
                CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS,
            )
        } else {
            (
                std::ptr::null_mut(),
                CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
            )
        };
        // SAFETY: `pfn` checked non-null; `status` null or valid (caller).
        unsafe {
            pfn.write(f);
            if !status.is_null() {
                status.write(st);
            }
        }
        if found {
            Ok(())
        } else {
            Err(CUresult::CUDA_ERROR_NOT_FOUND)
        }
    })())
}

/// The name of a CUresult (a static string).
///
/// # Safety
/// `out` is null or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(r: CUresult, out: *mut *const c_char) -> CUresult {
    let name: &'static CStr = match r {
        CUresult::CUDA_SUCCESS => c"CUDA_SUCCESS",
        CUresult::CUDA_ERROR_INVALID_VALUE => c"CUDA_ERROR_INVALID_VALUE",
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => c"CUDA_ERROR_OUT_OF_MEMORY",
        CUresult::CUDA_ERROR_NOT_INITIALIZED => c"CUDA_ERROR_NOT_INITIALIZED",
        CUresult::CUDA_ERROR_INVALID_DEVICE => c"CUDA_ERROR_INVALID_DEVICE",
        CUresult::CUDA_ERROR_INVALID_CONTEXT => c"CUDA_ERROR_INVALID_CONTEXT",
        CUresult::CUDA_ERROR_INVALID_HANDLE => c"CUDA_ERROR_INVALID_HANDLE",
        CUresult::CUDA_ERROR_NOT_FOUND => c"CUDA_ERROR_NOT_FOUND",
        CUresult::CUDA_ERROR_NOT_READY => c"CUDA_ERROR_NOT_READY",
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS => c"CUDA_ERROR_ILLEGAL_ADDRESS",
        CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => {
            c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"
        }
        CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED => c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        _ => return CUresult::CUDA_ERROR_INVALID_VALUE,
    };
    // SAFETY: forwarded from the caller.
    answer(unsafe { put(out, name.as_ptr()) })
}
