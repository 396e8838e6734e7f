//! A CUDA device handle, and plain device allocations (for tests, benchmarks and callers
//! without an engine of their own).

use std::sync::Arc;

use cudarc::driver::sys;

use crate::driver::{Ctx, check};
use crate::error::CudaError;
use crate::pinned::{DEFAULT_PIN_CHUNK, PinnedPool};

/// One CUDA device (its primary context). Cheap to clone.
///
/// `open` is the gate every CUDA path in this crate goes through: on a machine without CUDA it
/// returns [`CudaError::NoCuda`] (or `MissingSymbol` / `NoDevice`) and never panics.
#[derive(Clone)]
pub struct CudaDevice {
    ctx: Arc<Ctx>,
}

impl CudaDevice {
    /// Open device `ordinal`: load the driver, check its symbols, retain the primary context.
    pub fn open(ordinal: u32) -> Result<CudaDevice, CudaError> {
        Ok(CudaDevice {
            ctx: Ctx::open(ordinal)?,
        })
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ctx.ordinal()
    }

    /// Device name (e.g. "NVIDIA H100 80GB HBM3").
    pub fn name(&self) -> &str {
        self.ctx.name()
    }

    /// Driver version as `cuDriverGetVersion` reports it (e.g. 12080 for CUDA 12.8).
    pub fn driver_version(&self) -> i32 {
        self.ctx.driver_version()
    }

    /// Whether the driver has `cuMemcpyBatchAsync` (CUDA 12.8+ drivers).
    pub fn batch_copy_available(&self) -> bool {
        self.ctx.batch_copy()
    }

    /// Allocate `len` bytes of device memory (`cuMemAlloc`).
    pub fn alloc(&self, len: usize) -> Result<DeviceMem, CudaError> {
        if len == 0 {
            return Err(CudaError::BadConfig(
                "a device allocation needs at least one byte".into(),
            ));
        }
        self.ctx.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is open and current (driver module rule); `ptr` is a live local.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len) })?;
        Ok(DeviceMem {
            ctx: self.ctx.clone(),
            ptr,
            len,
        })
    }

    /// A pool of `count` page-locked host buffers of `buf_size` bytes (see [`PinnedPool`]),
    /// pinned in chunks of at most [`crate::DEFAULT_PIN_CHUNK`] bytes.
    pub fn pinned_pool(&self, count: usize, buf_size: usize) -> Result<PinnedPool, CudaError> {
        self.pinned_pool_in_chunks(count, buf_size, DEFAULT_PIN_CHUNK)
    }

    /// [`CudaDevice::pinned_pool`], pinned by `cuMemHostRegister` calls of at most
    /// `chunk_bytes` each (a multiple of [`crate::PAGE_SIZE`]; a buffer larger than that is
    /// one chunk). Fails with [`CudaError::PinFailed`] when the driver refuses a chunk.
    pub fn pinned_pool_in_chunks(
        &self,
        count: usize,
        buf_size: usize,
        chunk_bytes: usize,
    ) -> Result<PinnedPool, CudaError> {
        PinnedPool::new(self.ctx.clone(), count, buf_size, chunk_bytes)
    }

    pub(crate) fn ctx(&self) -> &Arc<Ctx> {
        &self.ctx
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal())
            .field("name", &self.name())
            .field("driver_version", &self.driver_version())
            .finish()
    }
}

/// An owned device allocation, freed on drop. Its reads and writes are synchronous.
///
/// Ownership rule: while a backend op names memory inside this allocation (as engine memory),
/// the allocation must stay alive and the caller must not read or write those bytes until the
/// op's task ended (see [`crate::CudaBackend::new`]).
pub struct DeviceMem {
    ctx: Arc<Ctx>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceMem {
    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty allocation (never: `alloc` refuses zero bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn bounds(&self, offset: usize, len: usize) -> Result<(), CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copy `data` to `offset` and wait until it has landed.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        self.bounds(offset, data.len())?;
        self.ctx.bind()?;
        // SAFETY: `offset..offset+len` is inside this live allocation (checked); `data` is a
        // borrowed host slice valid for the call, and the copy below reads it before returning
        // (pageable copies are staged during the call).
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, data.as_ptr().cast(), data.len())
        })?;
        // A pageable HtoD may return before the DMA landed; the backend's streams do not order
        // against the legacy stream, so wait here.
        self.ctx.synchronize()
    }

    /// Copy `out.len()` bytes from `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        self.bounds(offset, out.len())?;
        self.ctx.synchronize()?;
        // SAFETY: bounds checked; `out` is exclusively borrowed for the call, and a DtoH into
        // host memory returns only after the bytes arrived.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr + offset as u64, out.len())
        })
    }

    /// Set every byte to `byte` and wait until done.
    pub fn fill(&self, byte: u8) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: the whole range is this live allocation.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.ptr, byte, self.len)
        })?;
        self.ctx.synchronize()
    }

    /// A plain synchronous `cuMemcpyHtoD` of `len` bytes from `src` to `offset`: the physical
    /// baseline the benchmark compares the backend with.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes for the duration of the call.
    #[cfg(feature = "bench")]
    pub(crate) unsafe fn copy_from_host_raw(
        &self,
        offset: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), CudaError> {
        self.bounds(offset, len)?;
        self.ctx.bind()?;
        // SAFETY: bounds checked; the caller vouches for `src`. From pinned memory this call is
        // synchronous with respect to the host.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, src.cast(), len)
        })
    }

    /// A plain synchronous `cuMemcpyDtoH` of `len` bytes from `offset` to `dst` (the baseline of
    /// the store direction).
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes, and not accessed by anyone else, for the
    /// duration of the call.
    #[cfg(feature = "bench")]
    pub(crate) unsafe fn copy_to_host_raw(
        &self,
        offset: usize,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), CudaError> {
        self.bounds(offset, len)?;
        self.ctx.bind()?;
        // SAFETY: bounds checked; the caller vouches for `dst`; DtoH returns after the copy.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.cast(), self.ptr + offset as u64, len)
        })
    }
}

impl std::fmt::Debug for DeviceMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMem")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        // SAFETY: allocated by cuMemAlloc in `alloc`, freed exactly once here. The ownership rule
        // above keeps backend ops off it by now.
        let r = unsafe { sys::cuMemFree_v2(self.ptr) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(result = ?r, "cuMemFree failed");
        }
    }
}
