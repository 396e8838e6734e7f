//! The stand-in's global state: devices, their primary contexts, the handles it gave out, and
//! each thread's current context.
//!
//! Handles (`CUcontext`, `CUstream`, `CUevent`) are numbers looked up in a table, never
//! pointers the stand-in dereferences, so a stale or made-up handle is
//! `CUDA_ERROR_INVALID_HANDLE` / `CUDA_ERROR_INVALID_CONTEXT`, not a crash.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use kvx_core::lock;

use cudarc::driver::sys::CUresult;

use crate::DEVICES;
use crate::knobs::Knobs;
use crate::memory::{AddressSpace, DeviceAllocs};
use crate::stream::{EventState, StreamShared};

/// One device: its knobs, its address window and its primary context.
pub(crate) struct Device {
    pub(crate) ordinal: i32,
    pub(crate) knobs: Knobs,
    pub(crate) space: AddressSpace,
    primary: Mutex<Primary>,
}

#[derive(Default)]
struct Primary {
    ctx: Option<Arc<Context>>,
    retains: u32,
}

/// A (primary) context: its device, its allocations, its streams, and its sticky error.
pub(crate) struct Context {
    pub(crate) handle: usize,
    pub(crate) device: &'static Device,
    pub(crate) allocs: DeviceAllocs,
    streams: Mutex<Vec<Weak<StreamShared>>>,
    /// The default stream (handle 0 or `CU_STREAM_LEGACY`), made on first use.
    default_stream: Mutex<Option<Arc<StreamShared>>>,
    /// 0, or the CUresult every later call on this context returns.
    sticky: AtomicU32,
}

impl Context {
    /// `Err(sticky error)` once the context failed.
    pub(crate) fn check(&self) -> Result<(), CUresult> {
        match self.sticky.load(Ordering::Acquire) {
            0 => Ok(()),
            _ => Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
        }
    }

    /// Fail the context for good (as a faulting kernel or DMA does on a GPU).
    pub(crate) fn poison(&self) {
        self.sticky.store(
            CUresult::CUDA_ERROR_ILLEGAL_ADDRESS as u32,
            Ordering::Release,
        );
    }

    pub(crate) fn add_stream(&self, s: &Arc<StreamShared>) {
        let mut v = lock(&self.streams);
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(s));
    }

    /// The context's live streams.
    pub(crate) fn streams(&self) -> Vec<Arc<StreamShared>> {
        lock(&self.streams)
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// The context's default stream, started on first use. It is a stream like the others:
    /// the stand-in does not make it synchronise with other streams as CUDA's legacy stream
    /// does with blocking ones (kvx's streams are non-blocking, so nothing here relies on it).
    fn default_stream(self: &Arc<Self>) -> Result<Arc<StreamShared>, CUresult> {
        let mut slot = lock(&self.default_stream);
        if let Some(s) = &*slot {
            return Ok(s.clone());
        }
        let s = StreamShared::spawn(self.clone())?;
        *slot = Some(s.clone());
        Ok(s)
    }
}

/// What a handle stands for.
#[derive(Clone)]
pub(crate) enum Handle {
    Stream(Arc<StreamShared>),
    Event(Arc<EventState>),
}

/// The whole driver.
pub(crate) struct Driver {
    initialized: AtomicBool,
    devices: Vec<&'static Device>,
    contexts: Mutex<HashMap<usize, Arc<Context>>>,
    handles: Mutex<HashMap<usize, Handle>>,
    next_handle: AtomicU64,
    /// Whether `cuGetProcAddress` hands out `cuMemcpyBatchAsync`.
    pub(crate) batch_copy: AtomicBool,
}

/// `CU_STREAM_LEGACY`: the legacy default stream, by its reserved handle value.
pub(crate) const LEGACY_STREAM: usize = 0x1;

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// The driver (created on first use).
pub(crate) fn driver() -> &'static Driver {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    DRIVER.get_or_init(|| Driver {
        initialized: AtomicBool::new(false),
        devices: (0..DEVICES)
            .map(|ordinal| {
                &*Box::leak(Box::new(Device {
                    ordinal,
                    knobs: Knobs::default(),
                    space: AddressSpace::for_device(ordinal),
                    primary: Mutex::new(Primary::default()),
                }))
            })
            .collect(),
        contexts: Mutex::new(HashMap::new()),
        handles: Mutex::new(HashMap::new()),
        next_handle: AtomicU64::new(1),
        batch_copy: AtomicBool::new(std::env::var_os("KVX_CUDA_STANDIN_NO_BATCH").is_none()),
    })
}

impl Driver {
    /// `cuInit`.
    pub(crate) fn init(&self) {
        self.initialized.store(true, Ordering::Release);
    }

    /// `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
    pub(crate) fn check_init(&self) -> Result<(), CUresult> {
        if self.initialized.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(CUresult::CUDA_ERROR_NOT_INITIALIZED)
        }
    }

    /// Device `ordinal`, or `CUDA_ERROR_INVALID_DEVICE`.
    pub(crate) fn device(&self, ordinal: i32) -> Result<&'static Device, CUresult> {
        usize::try_from(ordinal)
            .ok()
            .and_then(|i| self.devices.get(i).copied())
            .ok_or(CUresult::CUDA_ERROR_INVALID_DEVICE)
    }

    /// A fresh handle value (never 0, never reused).
    pub(crate) fn new_handle(&self) -> usize {
        // Spaced out so a handle off by a few is no other handle.
        (self.next_handle.fetch_add(1, Ordering::Relaxed) as usize) << 4
    }

    /// `cuDevicePrimaryCtxRetain`: the device's primary context, created when none is held.
    pub(crate) fn retain_primary(&self, dev: &'static Device) -> Arc<Context> {
        let mut p = lock(&dev.primary);
        p.retains += 1;
        if let Some(ctx) = &p.ctx {
            return ctx.clone();
        }
        let ctx = Arc::new(Context {
            handle: self.new_handle(),
            device: dev,
            allocs: DeviceAllocs::default(),
            streams: Mutex::new(Vec::new()),
            default_stream: Mutex::new(None),
            sticky: AtomicU32::new(0),
        });
        lock(&self.contexts).insert(ctx.handle, ctx.clone());
        p.ctx = Some(ctx.clone());
        ctx
    }

    /// `cuDevicePrimaryCtxRelease`: the last release destroys the context (and with it a
    /// sticky error, its allocations and its streams).
    pub(crate) fn release_primary(&self, dev: &'static Device) -> Result<(), CUresult> {
        let mut p = lock(&dev.primary);
        if p.retains == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        p.retains -= 1;
        if p.retains == 0
            && let Some(ctx) = p.ctx.take()
        {
            lock(&self.contexts).remove(&ctx.handle);
            // The default stream holds the context: let go of it so both can be freed.
            lock(&ctx.default_stream).take();
            for s in ctx.streams() {
                s.close();
            }
            crate::memory::unregister_context(ctx.handle);
            let mut handles = lock(&self.handles);
            handles.retain(|_, h| match h {
                Handle::Stream(s) => !Arc::ptr_eq(&s.ctx, &ctx),
                Handle::Event(e) => !Arc::ptr_eq(&e.ctx, &ctx),
            });
        }
        Ok(())
    }

    /// The context behind a `CUcontext` handle.
    pub(crate) fn context(&self, handle: usize) -> Result<Arc<Context>, CUresult> {
        lock(&self.contexts)
            .get(&handle)
            .cloned()
            .ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)
    }

    /// `cuCtxSetCurrent` (0 unbinds).
    pub(crate) fn set_current(&self, handle: usize) -> Result<(), CUresult> {
        if handle != 0 {
            self.context(handle)?;
        }
        CURRENT.with(|c| c.set(handle));
        Ok(())
    }

    /// The calling thread's current context, checked for a sticky error.
    pub(crate) fn current(&self) -> Result<Arc<Context>, CUresult> {
        let ctx = self.current_even_failed()?;
        ctx.check()?;
        Ok(ctx)
    }

    /// The calling thread's current context, even one with a sticky error (for teardown).
    pub(crate) fn current_even_failed(&self) -> Result<Arc<Context>, CUresult> {
        self.check_init()?;
        self.context(self.current_handle())
    }

    /// The handle of the calling thread's current context (0: none).
    pub(crate) fn current_handle(&self) -> usize {
        CURRENT.with(Cell::get)
    }

    pub(crate) fn insert(&self, h: Handle) -> usize {
        let handle = self.new_handle();
        lock(&self.handles).insert(handle, h);
        handle
    }

    pub(crate) fn remove(&self, handle: usize) -> Option<Handle> {
        lock(&self.handles).remove(&handle)
    }

    pub(crate) fn stream(&self, handle: usize) -> Result<Arc<StreamShared>, CUresult> {
        match lock(&self.handles).get(&handle) {
            Some(Handle::Stream(s)) => Ok(s.clone()),
            _ => Err(CUresult::CUDA_ERROR_INVALID_HANDLE),
        }
    }

    /// A stream by handle, where 0 and `CU_STREAM_LEGACY` name the current context's
    /// default stream.
    pub(crate) fn stream_or_default(&self, handle: usize) -> Result<Arc<StreamShared>, CUresult> {
        if handle == 0 || handle == LEGACY_STREAM {
            return self.current()?.default_stream();
        }
        self.stream(handle)
    }

    pub(crate) fn event(&self, handle: usize) -> Result<Arc<EventState>, CUresult> {
        match lock(&self.handles).get(&handle) {
            Some(Handle::Event(e)) => Ok(e.clone()),
            _ => Err(CUresult::CUDA_ERROR_INVALID_HANDLE),
        }
    }
}
