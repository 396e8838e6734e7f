//! Per-device knobs that make the stand-in misbehave on purpose, and the C functions tests
//! turn them with (through [`crate::control::Standin`], which finds them in the loaded
//! library).
//!
//! Knobs live on the device, not on its context, so they outlast a context that is released
//! and retained again. Defaults: no delay, running, no failure, no registration limit.

use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use kvx_core::lock;

use crate::registry::driver;

/// The misbehaviour of one device.
pub(crate) struct Knobs {
    /// Sleep before each copy a stream runs (nanoseconds).
    copy_delay_ns: AtomicU64,
    /// While true the device's streams run nothing (a hung copy).
    stalled: Mutex<bool>,
    resumed: Condvar,
    /// Stream copies that still succeed before the context fails (`u64::MAX`: never).
    copies_left: AtomicU64,
    /// Stream copies started since the device was last reset.
    copies: AtomicU64,
    /// Most bytes one `cuMemHostRegister` may pin (`usize::MAX`: no limit).
    register_limit: AtomicUsize,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            copy_delay_ns: AtomicU64::new(0),
            stalled: Mutex::new(false),
            resumed: Condvar::new(),
            copies_left: AtomicU64::new(u64::MAX),
            copies: AtomicU64::new(0),
            register_limit: AtomicUsize::new(usize::MAX),
        }
    }
}

/// What a stream does with its next copy.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum CopyVerdict {
    /// Run it.
    Run,
    /// The sticky error strikes here: fail the context instead.
    Fault,
}

impl Knobs {
    /// Called by a stream thread before each command: waits while the device is stalled.
    pub(crate) fn wait_running(&self) {
        let mut stalled = lock(&self.stalled);
        while *stalled {
            stalled = kvx_core::sync::wait(&self.resumed, stalled);
        }
    }

    /// Called by a stream thread before each copy: count it as started, sleep the delay, then
    /// say whether it runs or faults.
    pub(crate) fn before_copy(&self) -> CopyVerdict {
        self.copies.fetch_add(1, Ordering::Relaxed);
        let ns = self.copy_delay_ns.load(Ordering::Relaxed);
        if ns > 0 {
            std::thread::sleep(Duration::from_nanos(ns));
        }
        let left = self
            .copies_left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n != u64::MAX).then(|| n.saturating_sub(1))
            });
        match left {
            Ok(0) => {
                self.copies_left.store(u64::MAX, Ordering::Release);
                CopyVerdict::Fault
            }
            _ => CopyVerdict::Run,
        }
    }

    /// True when `len` bytes may be pinned in one registration.
    pub(crate) fn may_register(&self, len: usize) -> bool {
        len <= self.register_limit.load(Ordering::Relaxed)
    }

    fn set_stalled(&self, on: bool) {
        *lock(&self.stalled) = on;
        self.resumed.notify_all();
    }

    fn reset(&self) {
        self.copy_delay_ns.store(0, Ordering::Relaxed);
        self.set_stalled(false);
        self.copies_left.store(u64::MAX, Ordering::Release);
        self.copies.store(0, Ordering::Relaxed);
        self.register_limit.store(usize::MAX, Ordering::Relaxed);
    }
}

/// Run `f` on device `ordinal`'s knobs; 0 on success, -1 for a device that does not exist.
fn with_knobs(ordinal: c_int, f: impl FnOnce(&Knobs)) -> c_int {
    match driver().device(ordinal) {
        Ok(d) => {
            f(&d.knobs);
            0
        }
        Err(_) => -1,
    }
}

/// Every knob of device `ordinal` back to its default (running, no delay, no failure, no
/// limit) and its copy count to 0. Does not clear a sticky error: release the context for that.
#[unsafe(no_mangle)]
pub extern "C" fn kvx_standin_reset(ordinal: c_int) -> c_int {
    with_knobs(ordinal, Knobs::reset)
}

/// Sleep `micros` before each copy a stream of device `ordinal` runs.
#[unsafe(no_mangle)]
pub extern "C" fn kvx_standin_set_copy_delay_us(ordinal: c_int, micros: u64) -> c_int {
    with_knobs(ordinal, |k| {
        k.copy_delay_ns
            .store(micros.saturating_mul(1000), Ordering::Relaxed)
    })
}

/// Stop (`stalled != 0`) or resume the streams of device `ordinal`: stopped, a stream runs
/// nothing, so everything queued on it, and every event behind it, stays incomplete.
#[unsafe(no_mangle)]
pub extern "C" fn kvx_standin_set_stalled(ordinal: c_int, stalled: c_int) -> c_int {
    with_knobs(ordinal, |k| k.set_stalled(stalled != 0))
}

/// After `copies` more stream copies on device `ordinal`, the next one fails its context with
/// `CUDA_ERROR_ILLEGAL_ADDRESS` (sticky); a negative count turns the knob off.
#[unsafe(no_mangle)]
pub extern "C" fn kvx_standin_fail_after_copies(ordinal: c_int, copies: i64) -> c_int {
    with_knobs(ordinal, |k| {
        k.copies_left
            .store(u64::try_from(copies).unwrap_or(u64::MAX), Ordering::Release)
    })
}

/// Refuse `cuMemHostRegister` calls of more than `bytes` on device `ordinal`'s context with
/// `CUDA_ERROR_OUT_OF_MEMORY` (as a driver does past what it can lock); 0 removes the limit.
#[unsafe(no_mangle)]
pub extern "C" fn kvx_standin_set_register_limit(ordinal: c_int, bytes: u64) -> c_int {
    let limit = match bytes {
        0 => usize::MAX,
        b => usize::try_from(b).unwrap_or(usize::MAX),
    };
    with_knobs(ordinal, |k| {
        k.register_limit.store(limit, Ordering::Relaxed)
    })
}

/// Stream copies device `ordinal` started since its last reset (`u64::MAX` for no such
/// device).
#[unsafe(no_mangle)]
pub extern "C" fn kvx_standin_copies(ordinal: c_int) -> u64 {
    driver()
        .device(ordinal)
        .map_or(u64::MAX, |d| d.knobs.copies.load(Ordering::Relaxed))
}

/// Whether `cuGetProcAddress` hands out `cuMemcpyBatchAsync` (process-wide; also off when
/// `KVX_CUDA_STANDIN_NO_BATCH` is set at load). Affects contexts opened afterwards.
#[unsafe(no_mangle)]
pub extern "C" fn kvx_standin_set_batch_copy(available: c_int) {
    driver().batch_copy.store(available != 0, Ordering::Relaxed);
}
