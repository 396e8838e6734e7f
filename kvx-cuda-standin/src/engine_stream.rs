//! A stream for tests that play the engine: a CUDA stream of its own on a device's primary
//! context (the one kvx-cuda and engines use), and a "forward" on it that keeps the stream busy
//! for a while (a host function that sleeps) and then writes its bytes into device memory.
//!
//! It calls whichever CUDA driver library this process loaded, the stand-in or a real driver,
//! so a test written with it runs on a GPU too. Open a `kvx_cuda::CudaDevice` first (that loads
//! the library and initialises the driver).
//!
//! ```no_run
//! # use std::time::Duration;
//! # let (ordinal, block_address, bytes) = (1, 0u64, vec![0u8; 16]);
//! use kvx_cuda_standin::engine_stream::EngineStream;
//! let engine = EngineStream::open(ordinal)?;
//! // Busy for 250 ms, then the block's final bytes land; returns at once.
//! engine.forward(Duration::from_millis(250), &[(block_address, &bytes)])?;
//! let stream = engine.raw(); // what the engine hands kvx as its current stream
//! engine.synchronize()?;
//! # Ok::<(), String>(())
//! ```

use std::ffi::{CStr, c_int, c_uint, c_void};
use std::time::Duration;

use cudarc::driver::sys::{CUcontext, CUdevice, CUdeviceptr, CUhostFn, CUresult, CUstream};

use crate::loaded::{symbol, with_driver};

/// `CU_STREAM_NON_BLOCKING`: like an engine's side stream, it does not synchronise with the
/// legacy default stream.
const NON_BLOCKING: c_uint = 0x1;

type DeviceGet = unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult;
type Retain = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult;
type Release = unsafe extern "C" fn(CUdevice) -> CUresult;
type SetCurrent = unsafe extern "C" fn(CUcontext) -> CUresult;
type Create = unsafe extern "C" fn(*mut CUstream, c_uint) -> CUresult;
type OnStream = unsafe extern "C" fn(CUstream) -> CUresult;
type LaunchHost = unsafe extern "C" fn(CUstream, CUhostFn, *mut c_void) -> CUresult;
type CopyIn = unsafe extern "C" fn(CUdeviceptr, *const c_void, usize, CUstream) -> CUresult;
type Register = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult;
type Unregister = unsafe extern "C" fn(*mut c_void) -> CUresult;

/// The driver functions this helper calls, from the loaded library.
#[derive(Clone, Copy)]
struct Api {
    device_get: DeviceGet,
    retain: Retain,
    release: Release,
    set_current: SetCurrent,
    create: Create,
    destroy: OnStream,
    synchronize: OnStream,
    launch_host: LaunchHost,
    copy_in: CopyIn,
    register: Register,
    unregister: Unregister,
}

impl Api {
    fn loaded() -> Option<Api> {
        with_driver(|lib| {
            let sym = |name: &CStr| symbol(lib, name);
            let p = (
                sym(c"cuDeviceGet")?,
                sym(c"cuDevicePrimaryCtxRetain")?,
                sym(c"cuDevicePrimaryCtxRelease_v2")?,
                sym(c"cuCtxSetCurrent")?,
                sym(c"cuStreamCreate")?,
                sym(c"cuStreamDestroy_v2")?,
                sym(c"cuStreamSynchronize")?,
                sym(c"cuLaunchHostFunc")?,
                sym(c"cuMemcpyHtoDAsync_v2")?,
                sym(c"cuMemHostRegister_v2")?,
                sym(c"cuMemHostUnregister")?,
            );
            type P = *mut c_void;
            // SAFETY: each symbol is the driver's function of that name, whose C signature
            // (CUDA's driver API, as cudarc declares it) is the pointer type it becomes here.
            unsafe {
                Some(Api {
                    device_get: std::mem::transmute::<P, DeviceGet>(p.0),
                    retain: std::mem::transmute::<P, Retain>(p.1),
                    release: std::mem::transmute::<P, Release>(p.2),
                    set_current: std::mem::transmute::<P, SetCurrent>(p.3),
                    create: std::mem::transmute::<P, Create>(p.4),
                    destroy: std::mem::transmute::<P, OnStream>(p.5),
                    synchronize: std::mem::transmute::<P, OnStream>(p.6),
                    launch_host: std::mem::transmute::<P, LaunchHost>(p.7),
                    copy_in: std::mem::transmute::<P, CopyIn>(p.8),
                    register: std::mem::transmute::<P, Register>(p.9),
                    unregister: std::mem::transmute::<P, Unregister>(p.10),
                })
            }
        })
    }
}

/// `Err` naming the call unless `r` is success.
fn check(call: &str, r: CUresult) -> Result<(), String> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(()),
        r => Err(format!("{call} failed: {r:?}")),
    }
}

/// The host function of a forward: sleeps for `data` microseconds.
extern "C" fn sleep_micros(data: *mut c_void) {
    std::thread::sleep(Duration::from_micros(data as u64));
}

/// Bytes a forward writes, in page-aligned host memory registered with the driver (an
/// asynchronous copy from pageable memory would make the CPU wait for the stream).
struct Source {
    buf: Vec<u8>,
    offset: usize,
    len: usize,
}

impl Source {
    const PAGE: usize = 4096;

    fn ptr(&mut self) -> *mut c_void {
        self.buf[self.offset..].as_mut_ptr().cast()
    }
}

/// A stream of its own on device `ordinal`'s primary context; see the module docs.
pub struct EngineStream {
    api: Api,
    dev: CUdevice,
    ctx: CUcontext,
    raw: CUstream,
    /// Registered sources of the forwards queued since the last `synchronize`.
    sources: std::cell::RefCell<Vec<Source>>,
}

impl EngineStream {
    /// Retain device `ordinal`'s primary context, make it current on this thread, and create
    /// a non-blocking stream on it. `Err` when no driver library is loaded or a call fails.
    pub fn open(ordinal: u32) -> Result<EngineStream, String> {
        let api = Api::loaded().ok_or("no CUDA driver library is loaded (open a device first)")?;
        let (mut dev, mut ctx, mut raw): (CUdevice, CUcontext, CUstream) =
            (0, std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: the driver's functions with live out-pointers; the driver was initialised by
        // the device the caller opened.
        unsafe {
            check("cuDeviceGet", (api.device_get)(&mut dev, ordinal as c_int))?;
            check("cuDevicePrimaryCtxRetain", (api.retain)(&mut ctx, dev))?;
            let made = check("cuCtxSetCurrent", (api.set_current)(ctx))
                .and_then(|()| check("cuStreamCreate", (api.create)(&mut raw, NON_BLOCKING)));
            if let Err(e) = made {
                (api.release)(dev);
                return Err(e);
            }
        }
        Ok(EngineStream {
            api,
            dev,
            ctx,
            raw,
            sources: std::cell::RefCell::new(Vec::new()),
        })
    }

    /// The stream's handle as an engine hands it over (PyTorch's `cuda_stream`).
    pub fn raw(&self) -> usize {
        self.raw as usize
    }

    fn bind(&self) -> Result<(), String> {
        // SAFETY: `ctx` is the primary context this value retained.
        check("cuCtxSetCurrent", unsafe {
            (self.api.set_current)(self.ctx)
        })
    }

    /// Queue a forward and return at once: the stream is busy for `busy` (nothing queued on it
    /// later runs before), then each `(device address, bytes)` of `writes` lands, in order.
    /// The bytes are copied into registered host memory first, held until
    /// [`EngineStream::synchronize`].
    pub fn forward(&self, busy: Duration, writes: &[(u64, &[u8])]) -> Result<(), String> {
        self.bind()?;
        let mut sources = self.sources.borrow_mut();
        let first = sources.len();
        for (_, bytes) in writes {
            let mut buf = vec![0u8; bytes.len() + Source::PAGE];
            let offset = buf.as_ptr().align_offset(Source::PAGE);
            buf[offset..offset + bytes.len()].copy_from_slice(bytes);
            let mut s = Source {
                buf,
                offset,
                len: bytes.len(),
            };
            // SAFETY: `s.ptr()..+len` lies in `s.buf`, which stays alive (and unmoved: its heap
            // allocation is not touched again) until it is unregistered.
            check("cuMemHostRegister", unsafe {
                (self.api.register)(s.ptr(), s.len, 0)
            })?;
            sources.push(s);
        }
        let micros = busy.as_micros().min(usize::MAX as u128) as usize;
        // SAFETY: `sleep_micros` takes the argument as a number, never as a pointer; the
        // stream is live.
        check("cuLaunchHostFunc", unsafe {
            (self.api.launch_host)(self.raw, Some(sleep_micros), micros as *mut c_void)
        })?;
        for ((dev, _), s) in writes.iter().zip(&mut sources[first..]) {
            // SAFETY: the source is registered memory of `len` bytes held until the stream
            // passed this copy (`synchronize` or drop); the device range is the caller's.
            check("cuMemcpyHtoDAsync", unsafe {
                (self.api.copy_in)(*dev, s.ptr(), s.len, self.raw)
            })?;
        }
        Ok(())
    }

    /// Wait until every forward queued so far ran; their sources are let go.
    pub fn synchronize(&self) -> Result<(), String> {
        self.bind()?;
        // SAFETY: a live stream.
        check("cuStreamSynchronize", unsafe {
            (self.api.synchronize)(self.raw)
        })?;
        for mut s in self.sources.borrow_mut().drain(..) {
            // SAFETY: registered in `forward`; the stream passed every copy from it.
            let _ = unsafe { (self.api.unregister)(s.ptr()) };
        }
        Ok(())
    }
}

impl Drop for EngineStream {
    fn drop(&mut self) {
        if self.synchronize().is_err() {
            // The copies' fate is unknown: keep their sources rather than free them under
            // the device.
            std::mem::forget(self.sources.take());
        }
        // SAFETY: the stream was created and the context retained in `open`, each let go once.
        unsafe {
            (self.api.destroy)(self.raw);
            (self.api.release)(self.dev);
        }
    }
}
