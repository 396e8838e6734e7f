//! The knobs' Rust API for tests: finds the stand-in among the libraries this process loaded
//! as `libcuda` and calls its `kvx_standin_*` functions.
//!
//! ```no_run
//! # use std::time::Duration;
//! // After kvx-cuda opened a device (which loaded the driver library):
//! if let Some(standin) = kvx_cuda_standin::control::Standin::loaded() {
//!     standin.set_copy_delay(3, Duration::from_millis(20)); // device 3's copies are slow
//! }
//! ```

use std::ffi::{CStr, c_int, c_void};
use std::time::Duration;

use crate::loaded::{symbol, with_driver};

/// The stand-in, found loaded in this process as the CUDA driver library.
#[derive(Clone, Copy)]
pub struct Standin {
    reset: extern "C" fn(c_int) -> c_int,
    delay: extern "C" fn(c_int, u64) -> c_int,
    stalled: extern "C" fn(c_int, c_int) -> c_int,
    fail_after: extern "C" fn(c_int, i64) -> c_int,
    register_limit: extern "C" fn(c_int, u64) -> c_int,
    copies: extern "C" fn(c_int) -> u64,
    batch: extern "C" fn(c_int),
}

impl Standin {
    /// The stand-in, when the `libcuda` loaded in this process is it; `None` on a real driver
    /// or when no driver library is loaded (open a `CudaDevice` first).
    pub fn loaded() -> Option<Standin> {
        with_driver(Standin::from_library)
    }

    fn from_library(lib: *mut c_void) -> Option<Standin> {
        let sym = |name: &CStr| symbol(lib, name);
        let (reset, delay, stalled, fail_after, register_limit, copies, batch) = (
            sym(c"kvx_standin_reset")?,
            sym(c"kvx_standin_set_copy_delay_us")?,
            sym(c"kvx_standin_set_stalled")?,
            sym(c"kvx_standin_fail_after_copies")?,
            sym(c"kvx_standin_set_register_limit")?,
            sym(c"kvx_standin_copies")?,
            sym(c"kvx_standin_set_batch_copy")?,
        );
        type P = *mut c_void;
        // SAFETY: each symbol is the stand-in's exported function of that name (knobs.rs),
        // whose signature is exactly the function-pointer type it is turned into here.
        unsafe {
            Some(Standin {
                reset: std::mem::transmute::<P, extern "C" fn(c_int) -> c_int>(reset),
                delay: std::mem::transmute::<P, extern "C" fn(c_int, u64) -> c_int>(delay),
                stalled: std::mem::transmute::<P, extern "C" fn(c_int, c_int) -> c_int>(stalled),
                fail_after: std::mem::transmute::<P, extern "C" fn(c_int, i64) -> c_int>(
                    fail_after,
                ),
                register_limit: std::mem::transmute::<P, extern "C" fn(c_int, u64) -> c_int>(
                    register_limit,
                ),
                copies: std::mem::transmute::<P, extern "C" fn(c_int) -> u64>(copies),
                batch: std::mem::transmute::<P, extern "C" fn(c_int)>(batch),
            })
        }
    }

    /// Every knob of device `ordinal` back to its default, its copy count to 0.
    pub fn reset(&self, ordinal: u32) {
        (self.reset)(ordinal as c_int);
    }

    /// Sleep `delay` before each copy a stream of device `ordinal` runs.
    pub fn set_copy_delay(&self, ordinal: u32, delay: Duration) {
        (self.delay)(ordinal as c_int, delay.as_micros() as u64);
    }

    /// Stop (a hung copy) or resume the streams of device `ordinal`.
    pub fn set_stalled(&self, ordinal: u32, stalled: bool) {
        (self.stalled)(ordinal as c_int, c_int::from(stalled));
    }

    /// After `copies` more stream copies the next one fails device `ordinal`'s context with
    /// a sticky `CUDA_ERROR_ILLEGAL_ADDRESS`; `None` turns it off.
    pub fn fail_after_copies(&self, ordinal: u32, copies: Option<u64>) {
        let n = copies.map_or(-1, |c| i64::try_from(c).unwrap_or(i64::MAX));
        (self.fail_after)(ordinal as c_int, n);
    }

    /// Refuse host registrations of more than `bytes` on device `ordinal` (`None`: no limit).
    pub fn set_register_limit(&self, ordinal: u32, bytes: Option<usize>) {
        (self.register_limit)(ordinal as c_int, bytes.map_or(0, |b| b.max(1) as u64));
    }

    /// Stream copies device `ordinal` started since its last reset.
    pub fn copies(&self, ordinal: u32) -> u64 {
        (self.copies)(ordinal as c_int)
    }

    /// Whether the driver hands out `cuMemcpyBatchAsync` to devices opened from now on.
    pub fn set_batch_copy(&self, available: bool) {
        (self.batch)(c_int::from(available));
    }
}

impl std::fmt::Debug for Standin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Standin")
    }
}
