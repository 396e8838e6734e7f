//! Page-locked host buffers: a kvx-core [`BufferPool`] whose every buffer is registered with
//! `cuMemHostRegister`.
//!
//! Why registration rather than `cuMemHostAlloc`: ops carry kvx-core [`PoolBuf`]s, which own
//! `AlignedBuf` heap memory, so the op's own buffers are what must be pinned. A [`PinnedPool`]
//! makes an ordinary pool, takes each buffer once, registers its pages and puts it back.
//!
//! Ownership rule (what keeps the registration sound):
//! - The pool's memory lives as long as its `PoolInner` (free buffers) or a `PoolBuf` (a lent
//!   one). A [`Registration`] holds a clone of the pool, so the memory outlives the registration.
//! - The registration is shared (`Arc`) by the [`PinnedPool`] handle and by every
//!   [`crate::CudaBackend`] that accepted the pool; it is unregistered when the last of them is
//!   dropped. A backend is dropped only after its in-flight copies completed, so no DMA touches
//!   a buffer after its pages are unpinned.
//! - A backend copies only buffers that lie inside ranges it holds a registration for; anything
//!   else is refused per block (`BlockError::Invalid`).
//!
//! Buffers are whole pages (size a multiple of [`PAGE_SIZE`], 4096-aligned), so two buffers never
//! share a page and each registration is independent.

use std::sync::Arc;

use cudarc::driver::sys;
use kvx_core::{BufferPool, PoolBuf};

use crate::driver::{Ctx, check};
use crate::error::CudaError;

/// Page granularity of pinned buffers (size and alignment).
pub const PAGE_SIZE: usize = 4096;

/// Check the shape of a pinned pool before allocating anything.
pub(crate) fn validate_pool_shape(count: usize, buf_size: usize) -> Result<(), CudaError> {
    if count == 0 {
        return Err(CudaError::BadConfig(
            "a pinned pool needs at least one buffer".into(),
        ));
    }
    if buf_size == 0 || buf_size % PAGE_SIZE != 0 {
        return Err(CudaError::BadConfig(format!(
            "pinned buffer size {buf_size} must be a non-zero multiple of {PAGE_SIZE} bytes"
        )));
    }
    if count.checked_mul(buf_size).is_none() {
        return Err(CudaError::BadConfig(format!(
            "{count} pinned buffers of {buf_size} bytes overflow the address space"
        )));
    }
    Ok(())
}

/// Host page ranges registered with the driver, unregistered on drop.
pub(crate) struct Registration {
    ctx: Arc<Ctx>,
    /// `(start, end)` address ranges, sorted by start.
    ranges: Vec<(usize, usize)>,
    /// Keeps the registered memory alive at least until the ranges are unregistered.
    _pool: BufferPool,
}

impl Registration {
    /// Register every buffer of `pool` (all must be in the pool right now).
    fn register(ctx: Arc<Ctx>, pool: &BufferPool) -> Result<Registration, CudaError> {
        let bufs: Vec<PoolBuf> = std::iter::from_fn(|| pool.take()).collect();
        if bufs.len() != pool.capacity() {
            return Err(CudaError::BadConfig(format!(
                "{} of {} buffers are lent out; register a pool before using it",
                pool.capacity() - bufs.len(),
                pool.capacity()
            )));
        }
        ctx.bind()?;
        let mut reg = Registration {
            ctx,
            ranges: Vec::with_capacity(bufs.len()),
            _pool: pool.clone(),
        };
        for b in &bufs {
            let start = b.as_ptr() as usize;
            // SAFETY: `start..start+capacity` is the allocation of a buffer we hold (taken from
            // the pool above), page-aligned and a whole number of pages, so no other
            // registration covers these pages. It stays allocated until `reg` (which holds the
            // pool) is dropped, and `Drop` unregisters it first.
            check("cuMemHostRegister", unsafe {
                sys::cuMemHostRegister_v2(
                    start as *mut std::ffi::c_void,
                    b.capacity(),
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            })?; // on error, `reg` drops and unregisters what was registered so far
            reg.ranges.push((start, start + b.capacity()));
        }
        drop(bufs);
        reg.ranges.sort_unstable();
        Ok(reg)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        for &(start, _) in &self.ranges {
            // SAFETY: `start` was registered by `register` and is unregistered once here; the
            // memory is still allocated (we hold the pool). Every backend holding this
            // registration has been dropped, and a backend drops only after its copies ended.
            let r = unsafe { sys::cuMemHostUnregister(start as *mut std::ffi::c_void) };
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(result = ?r, "cuMemHostUnregister failed");
            }
        }
    }
}

/// A kvx-core buffer pool whose buffers are page-locked (pinned) host memory.
///
/// Derefs to [`BufferPool`]: `take()` lends a buffer for an op, which returns to the pool when
/// dropped, as with any pool. Hand the pool to a backend with
/// [`crate::CudaBackend::accept_pool`] (or create it with
/// [`crate::CudaBackend::pinned_pool`]) so the backend copies from and into it.
pub struct PinnedPool {
    pool: BufferPool,
    reg: Arc<Registration>,
}

impl PinnedPool {
    pub(crate) fn new(
        ctx: Arc<Ctx>,
        count: usize,
        buf_size: usize,
    ) -> Result<PinnedPool, CudaError> {
        validate_pool_shape(count, buf_size)?;
        let pool = BufferPool::new(count, buf_size, PAGE_SIZE)?;
        let reg = Arc::new(Registration::register(ctx, &pool)?);
        Ok(PinnedPool { pool, reg })
    }

    /// The underlying pool (a clone shares the same buffers).
    pub fn pool(&self) -> &BufferPool {
        &self.pool
    }

    pub(crate) fn registration(&self) -> &Arc<Registration> {
        &self.reg
    }

    /// Total pinned bytes.
    pub fn pinned_bytes(&self) -> usize {
        self.pool.capacity() * self.pool.buf_size()
    }
}

impl std::ops::Deref for PinnedPool {
    type Target = BufferPool;
    fn deref(&self) -> &BufferPool {
        &self.pool
    }
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool")
            .field("pool", &self.pool)
            .finish()
    }
}

/// The pinned ranges one backend may copy: a sorted interval table over its registrations.
#[derive(Default)]
pub(crate) struct PinnedRanges {
    ranges: Vec<(usize, usize)>,
    regs: Vec<Arc<Registration>>,
}

impl PinnedRanges {
    /// Accept a registration (idempotent).
    pub(crate) fn add(&mut self, reg: &Arc<Registration>) {
        if self.regs.iter().any(|r| Arc::ptr_eq(r, reg)) {
            return;
        }
        self.regs.push(reg.clone());
        self.ranges.extend_from_slice(&reg.ranges);
        self.ranges.sort_unstable();
    }

    /// True when `addr..addr+len` lies inside one registered range.
    pub(crate) fn contains(&self, addr: usize, len: usize) -> bool {
        range_lookup(&self.ranges, addr, len)
    }
}

/// True when `addr..addr+len` lies inside one of the sorted, disjoint `ranges`.
pub(crate) fn range_lookup(ranges: &[(usize, usize)], addr: usize, len: usize) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let i = ranges.partition_point(|&(start, _)| start <= addr);
    i > 0 && end <= ranges[i - 1].1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_shape_validation() {
        assert!(validate_pool_shape(4, PAGE_SIZE).is_ok());
        assert!(validate_pool_shape(4, 2 << 20).is_ok());
        assert!(matches!(
            validate_pool_shape(0, PAGE_SIZE),
            Err(CudaError::BadConfig(_))
        ));
        assert!(matches!(
            validate_pool_shape(4, 0),
            Err(CudaError::BadConfig(_))
        ));
        assert!(matches!(
            validate_pool_shape(4, 5000),
            Err(CudaError::BadConfig(_))
        ));
        assert!(matches!(
            validate_pool_shape(usize::MAX / 4096, 8192),
            Err(CudaError::BadConfig(_))
        ));
    }

    #[test]
    fn range_lookup_finds_only_whole_containment() {
        let ranges = [(0x1000, 0x3000), (0x5000, 0x6000)];
        assert!(range_lookup(&ranges, 0x1000, 0x2000));
        assert!(range_lookup(&ranges, 0x2000, 0x1000));
        assert!(range_lookup(&ranges, 0x5800, 0x800));
        assert!(!range_lookup(&ranges, 0x2000, 0x1001), "runs past the end");
        assert!(!range_lookup(&ranges, 0x0fff, 0x10), "starts before");
        assert!(!range_lookup(&ranges, 0x3000, 0x10), "in the gap");
        assert!(!range_lookup(&ranges, 0x6000, 1), "just after");
        assert!(!range_lookup(&ranges, usize::MAX, 2), "overflow");
        assert!(!range_lookup(&[], 0x1000, 1));
    }
}
