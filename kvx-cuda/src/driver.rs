//! The boundary to the CUDA driver library: is it there, does it have every function kvx calls,
//! and the primary context of one device.
//!
//! cudarc loads `libcuda` at run time and **panics** when the library, or a symbol, is missing.
//! So nothing in this crate calls cudarc before [`Ctx::open`] succeeded, and `open` checks, in
//! order: the library can be loaded ([`cuda_available`]), every symbol in [`REQUIRED_SYMBOLS`]
//! resolves, `cuInit` works and the device exists. The optional batch copy is looked up by
//! version with `cuGetProcAddress` and only used when present ([`Ctx::batch_fn`]).
//!
//! Unsafe rule of this module: a `cudarc::driver::sys` function is only called on a path that
//! went through `Ctx::open` (the library is loaded and the symbol resolved, so cudarc's lazy
//! loader cannot panic), with pointer arguments that point to live locals.

use std::ffi::{CStr, c_char, c_int};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

use crate::error::CudaError;

/// Every driver function kvx-cuda calls, by the exact name cudarc resolves. Checked at `open` so
/// an old driver gives [`CudaError::MissingSymbol`] instead of a panic inside cudarc.
pub(crate) const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxSynchronize",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemsetD8_v2",
    "cuGetErrorName",
];

/// The batched copy (CUDA 12.8 drivers, r570+). Optional: without it, runs are copied one call
/// each.
pub(crate) const BATCH_SYMBOL: &str = "cuMemcpyBatchAsync";
/// First driver version (as `cuDriverGetVersion` reports it) with [`BATCH_SYMBOL`].
pub(crate) const BATCH_MIN_DRIVER: i32 = 12080;
/// How the batch entry point is found: `cuGetProcAddress_v2` (CUDA 12.0+).
const PROC_ADDRESS_SYMBOL: &str = "cuGetProcAddress_v2";

/// `cuMemcpyBatchAsync` with its CUDA 12.8 signature (CUDA 13 renamed the new signature `_v2`
/// and keeps this one for programs built against 12.8).
pub(crate) type BatchFn = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

/// True when the CUDA driver library can be loaded on this machine (checked once, cached).
///
/// This is the only probe that is safe without CUDA; everything else in this crate goes through
/// a [`crate::CudaDevice`], whose `open` calls this first.
pub fn cuda_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the candidate library names (and closes
    // them again); it calls nothing inside the library and cannot panic.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

fn has_symbol(name: &str) -> bool {
    // SAFETY: only called after `cuda_available()` returned true, so `culib()` finds the library
    // (it would panic otherwise). Looking a symbol up does not call it.
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(name.as_bytes())
            .is_ok()
    }
}

/// The 12.8 `cuMemcpyBatchAsync` entry point, asked for by version through `cuGetProcAddress`
/// so a newer driver hands out the signature this crate calls. `None` when the driver is older
/// or does not have it. Only called after the library and required symbols were checked.
fn batch_entry_point(driver_version: i32) -> Option<BatchFn> {
    if driver_version < BATCH_MIN_DRIVER || !has_symbol(PROC_ADDRESS_SYMBOL) {
        return None;
    }
    let mut pfn: *mut std::ffi::c_void = std::ptr::null_mut();
    let mut status = sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    // SAFETY: the symbol was resolved just above (so cudarc's loader cannot panic); the name is
    // a NUL-terminated literal and both out-pointers are live locals.
    let r = unsafe {
        sys::cuGetProcAddress_v2(
            c"cuMemcpyBatchAsync".as_ptr(),
            &mut pfn,
            BATCH_MIN_DRIVER,
            sys::CUdriverProcAddress_flags::CU_GET_PROC_ADDRESS_DEFAULT as u64,
            &mut status,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS
        || status != sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS
        || pfn.is_null()
    {
        return None;
    }
    // SAFETY: the driver returned the entry point of cuMemcpyBatchAsync as of CUDA 12.8, the
    // version asked for, whose C signature `BatchFn` spells out (cudarc's 12.8 binding).
    Some(unsafe { std::mem::transmute::<*mut std::ffi::c_void, BatchFn>(pfn) })
}

/// Turn a CUresult into a `Result`, naming the call.
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(CudaError::Driver {
        call,
        name: error_name(r),
        code: r as u32,
    })
}

fn error_name(r: sys::CUresult) -> String {
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: `check` is only reached after the library and symbols were verified (module
    // rule); `p` is a live local the driver writes a pointer to a static string into.
    let ok = unsafe { sys::cuGetErrorName(r, &mut p) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: on success the driver set `p` to a NUL-terminated string with static lifetime.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("{r:?}")
    }
}

/// The retained primary context of one device, plus what `open` learned about the driver.
///
/// Engines (PyTorch, vLLM) allocate the KV cache in the device's primary context, so kvx uses
/// that context too. Dropping the last `Arc<Ctx>` releases the retain.
pub(crate) struct Ctx {
    raw: sys::CUcontext,
    dev: sys::CUdevice,
    ordinal: u32,
    name: String,
    driver_version: i32,
    batch_copy: Option<BatchFn>,
}

// SAFETY: a CUcontext handle is a plain token that the (thread-safe) driver API accepts from any
// thread once made current there with `bind`; Ctx never hands out interior references.
unsafe impl Send for Ctx {}
// SAFETY: see above; all methods take `&self` and only pass the handle to the driver.
unsafe impl Sync for Ctx {}

impl Ctx {
    /// Load the driver, check it, and retain device `ordinal`'s primary context.
    pub(crate) fn open(ordinal: u32) -> Result<Arc<Ctx>, CudaError> {
        Ctx::open_with(ordinal, cuda_available())
    }

    /// `open`, with the library probe's answer given (so the no-CUDA path is testable on any
    /// machine).
    pub(crate) fn open_with(ordinal: u32, library_present: bool) -> Result<Arc<Ctx>, CudaError> {
        if !library_present {
            return Err(CudaError::NoCuda {
                reason: "libcuda (the NVIDIA driver library) cannot be loaded".into(),
            });
        }
        if let Some(symbol) = REQUIRED_SYMBOLS.iter().find(|s| !has_symbol(s)) {
            return Err(CudaError::MissingSymbol { symbol });
        }
        // SAFETY: the library is loaded and every symbol resolved (checked just above).
        let r = unsafe { sys::cuInit(0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::NoDevice {
                ordinal,
                reason: format!("cuInit: {}", error_name(r)),
            });
        }
        let mut driver_version: c_int = 0;
        // SAFETY: the symbol is resolved (checked above); every pointer argument is a live local.
        check("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&mut driver_version)
        })?;
        let mut count: c_int = 0;
        // SAFETY: the symbol is resolved (checked above); every pointer argument is a live local.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        if i64::from(ordinal) >= i64::from(count) {
            return Err(CudaError::NoDevice {
                ordinal,
                reason: format!("the driver sees {count} device(s)"),
            });
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: the symbol is resolved (checked above); every pointer argument is a live local.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal as c_int)
        })?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: the symbol is resolved (checked above); every pointer argument is a live local.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, dev)
        })?;
        // SAFETY: cuDeviceGetName wrote a NUL-terminated string into `buf` (at most len bytes);
        // the last byte is still 0 from initialisation if it truncated.
        let name = unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut raw: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the symbol is resolved (checked above); every pointer argument is a live local.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut raw, dev)
        })?;
        let batch_copy = batch_entry_point(driver_version);
        let ctx = Arc::new(Ctx {
            raw,
            dev,
            ordinal,
            name,
            driver_version,
            batch_copy,
        });
        ctx.bind()?;
        Ok(ctx)
    }

    /// Make this context current on the calling thread (cheap; call before driver work on any
    /// thread that may not have it current).
    pub(crate) fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `self` exists only after `open` verified the library and symbols; `raw` is a
        // retained primary context, valid until `Drop` releases it.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.raw) })
    }

    /// Make this context current on the calling thread until the guard drops, which makes the
    /// context that was current before current again: for calls on a thread that is not
    /// kvx's (an engine's), whose current context is left as it was. One `cuCtxGetCurrent`,
    /// plus two `cuCtxSetCurrent` when another context was current.
    pub(crate) fn bind_for_call(&self) -> Result<BoundForCall, CudaError> {
        let mut before: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: module rule; `before` is a live local.
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut before)
        })?;
        if before == self.raw {
            return Ok(BoundForCall { restore: None });
        }
        self.bind()?;
        Ok(BoundForCall {
            restore: Some(before),
        })
    }

    /// Wait for all work in the context (used after synchronous helpers whose DMA may lag).
    pub(crate) fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: module rule; the context is current on this thread.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Device ordinal.
    pub(crate) fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Device name as the driver reports it.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// `cuDriverGetVersion` (e.g. 12080 for 12.8).
    pub(crate) fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// Whether `cuMemcpyBatchAsync` may be called.
    pub(crate) fn batch_copy(&self) -> bool {
        self.batch_copy.is_some()
    }

    /// The 12.8 `cuMemcpyBatchAsync`, when the driver has it.
    pub(crate) fn batch_fn(&self) -> Option<BatchFn> {
        self.batch_copy
    }
}

/// What [`Ctx::bind_for_call`] hands back: puts the earlier current context back on drop.
pub(crate) struct BoundForCall {
    /// The context current before (possibly none), when it was not this one.
    restore: Option<sys::CUcontext>,
}

impl Drop for BoundForCall {
    fn drop(&mut self) {
        if let Some(before) = self.restore {
            // SAFETY: module rule (a guard exists only after `Ctx::open`); `before` was current
            // on this thread when the guard was made (null: none was), and the caller keeps it
            // alive meanwhile, as it did before.
            let r = unsafe { sys::cuCtxSetCurrent(before) };
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(result = ?r, "cuCtxSetCurrent could not restore the caller's context");
            }
        }
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: the context was retained in `open` and is released exactly once here; nothing
        // that uses it outlives the last Arc<Ctx> (streams, events, registrations hold one).
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(ordinal = self.ordinal, result = ?r, "cuDevicePrimaryCtxRelease failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_library_is_a_no_cuda_error_not_a_panic() {
        match Ctx::open_with(0, false) {
            Err(e @ CudaError::NoCuda { .. }) => {
                assert!(e.is_unavailable());
                assert!(e.to_string().contains("no CUDA"), "{e}");
            }
            Err(other) => panic!("expected NoCuda, got {other}"),
            Ok(_) => panic!("opened a device without a driver library"),
        }
    }

    #[test]
    fn required_symbols_are_unique_and_batch_is_optional() {
        let mut names = REQUIRED_SYMBOLS.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), REQUIRED_SYMBOLS.len());
        assert!(!REQUIRED_SYMBOLS.contains(&BATCH_SYMBOL));
    }
}
