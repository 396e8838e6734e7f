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
//! share a page.
//!
//! **Chunks.** A pool's buffers are one memory; it is registered in chunks of at most
//! `chunk_bytes` ([`DEFAULT_PIN_CHUNK`], 1 GiB, unless configured: `CudaBackendConfig::
//! pin_chunk_bytes`, [`crate::CudaDevice::pinned_pool_in_chunks`]), each a whole number of
//! buffers, because one `cuMemHostRegister` of hundreds of GiB fails on real machines. When the
//! driver refuses a chunk, building the pool fails with [`CudaError::PinFailed`], which names the
//! chunk size and how much was pinned; what was pinned is unregistered again (no fallback to
//! pageable memory: asynchronous copies need pinned buffers). A copy run never crosses a chunk
//! boundary ([`PinnedRanges::split`]): one DMA stays inside one registration.

use std::sync::Arc;

use cudarc::driver::sys;
use kvx_core::{BufferPool, PoolBuf};

use crate::driver::{Ctx, check};
use crate::error::CudaError;
use crate::plan::Run;

/// Page granularity of pinned buffers (size and alignment).
pub const PAGE_SIZE: usize = 4096;

/// Most bytes pinned by one `cuMemHostRegister` call unless configured otherwise (1 GiB).
pub const DEFAULT_PIN_CHUNK: usize = 1 << 30;

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

/// Check a registration chunk size: a non-zero multiple of [`PAGE_SIZE`].
pub(crate) fn validate_chunk(chunk_bytes: usize) -> Result<(), CudaError> {
    if chunk_bytes == 0 || chunk_bytes % PAGE_SIZE != 0 {
        return Err(CudaError::BadConfig(format!(
            "pin chunk size {chunk_bytes} must be a non-zero multiple of {PAGE_SIZE} bytes"
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
    /// Register every buffer of `pool` (all must be in the pool right now), in chunks of at most
    /// `chunk_bytes` (each at least one buffer).
    fn register(
        ctx: Arc<Ctx>,
        pool: &BufferPool,
        chunk_bytes: usize,
    ) -> Result<Registration, CudaError> {
        let bufs: Vec<PoolBuf> = std::iter::from_fn(|| pool.take()).collect();
        if bufs.len() != pool.capacity() {
            return Err(CudaError::BadConfig(format!(
                "{} of {} buffers are lent out; register a pool before using it",
                pool.capacity() - bufs.len(),
                pool.capacity()
            )));
        }
        ctx.bind()?;
        let mut spans: Vec<(usize, usize)> = bufs
            .iter()
            .map(|b| (b.as_ptr() as usize, b.as_ptr() as usize + b.capacity()))
            .collect();
        spans.sort_unstable();
        let chunks = chunks(&spans, chunk_bytes);
        let total: usize = chunks.iter().map(|&(s, e)| e - s).sum();
        let mut reg = Registration {
            ctx,
            ranges: Vec::with_capacity(chunks.len()),
            _pool: pool.clone(),
        };
        for (start, end) in chunks {
            // SAFETY: `start..end` is whole buffers we hold (taken from the pool above), page-
            // aligned and whole pages, disjoint from every other chunk, so no other registration
            // covers these pages. The pool memory stays allocated until `reg` (which holds the
            // pool) is dropped, and `Drop` unregisters it first.
            let r = unsafe {
                sys::cuMemHostRegister_v2(
                    start as *mut std::ffi::c_void,
                    end - start,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            };
            if let Err(e) = check("cuMemHostRegister", r) {
                // `reg` drops here and unregisters the chunks pinned so far.
                return Err(CudaError::PinFailed {
                    chunk_bytes: end - start,
                    pinned_bytes: reg.ranges.iter().map(|&(s, e)| e - s).sum(),
                    total_bytes: total,
                    reason: e.to_string(),
                });
            }
            reg.ranges.push((start, end));
        }
        drop(bufs);
        Ok(reg)
    }
}

/// Cut sorted buffer ranges into registration chunks: runs of adjacent buffers, each at most
/// `chunk_bytes` long unless one buffer alone is longer.
fn chunks(bufs: &[(usize, usize)], chunk_bytes: usize) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &(start, end) in bufs {
        match out.last_mut() {
            Some(last) if last.1 == start && end - last.0 <= chunk_bytes => last.1 = end,
            _ => out.push((start, end)),
        }
    }
    out
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
        chunk_bytes: usize,
    ) -> Result<PinnedPool, CudaError> {
        validate_pool_shape(count, buf_size)?;
        validate_chunk(chunk_bytes)?;
        let pool = BufferPool::new(count, buf_size, PAGE_SIZE)?;
        let reg = Arc::new(Registration::register(ctx, &pool, chunk_bytes)?);
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

    /// How many `cuMemHostRegister` chunks the pool was pinned in.
    pub fn pinned_chunks(&self) -> usize {
        self.reg.ranges.len()
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

    /// `runs` with every run that crosses the end of a registered range cut there, so each
    /// copy stays inside one registration.
    pub(crate) fn split(&self, runs: Vec<Run>) -> Vec<Run> {
        split_runs(&self.ranges, runs)
    }
}

/// [`PinnedRanges::split`] over sorted, disjoint `ranges`.
fn split_runs(ranges: &[(usize, usize)], runs: Vec<Run>) -> Vec<Run> {
    let mut out = Vec::with_capacity(runs.len());
    for mut r in runs {
        loop {
            let i = ranges.partition_point(|&(start, _)| start <= r.host);
            let end = if i > 0 { ranges[i - 1].1 } else { usize::MAX };
            if r.host >= end || r.host + r.len <= end {
                out.push(r);
                break;
            }
            let head = end - r.host;
            out.push(Run { len: head, ..r });
            r = Run {
                dev: r.dev + head as u64,
                host: end,
                len: r.len - head,
            };
        }
    }
    out
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
    fn chunks_hold_whole_adjacent_buffers_up_to_the_size() {
        let bufs: Vec<(usize, usize)> = (0..5).map(|i| (i * 100, i * 100 + 100)).collect();
        assert_eq!(chunks(&bufs, 250), vec![(0, 200), (200, 400), (400, 500)]);
        assert_eq!(chunks(&bufs, 1000), vec![(0, 500)]);
        assert_eq!(
            chunks(&bufs, 50).len(),
            5,
            "a buffer larger than a chunk is one chunk"
        );
        let gap = [(0, 100), (200, 300)];
        assert_eq!(chunks(&gap, 1000), gap.to_vec(), "never across a gap");
        assert!(validate_chunk(0).is_err() && validate_chunk(5000).is_err());
        assert!(validate_chunk(PAGE_SIZE).is_ok());
    }

    #[test]
    fn runs_are_cut_at_registration_ends() {
        let ranges = [(0x1000, 0x3000), (0x3000, 0x5000)];
        let run = Run {
            dev: 0xD000,
            host: 0x2000,
            len: 0x2800,
        };
        assert_eq!(
            split_runs(&ranges, vec![run]),
            vec![
                Run {
                    dev: 0xD000,
                    host: 0x2000,
                    len: 0x1000
                },
                Run {
                    dev: 0xE000,
                    host: 0x3000,
                    len: 0x1800
                },
            ]
        );
        let inside = Run {
            dev: 1,
            host: 0x3000,
            len: 0x2000,
        };
        assert_eq!(split_runs(&ranges, vec![inside]), vec![inside]);
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
