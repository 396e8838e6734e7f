//! One allocation that a [`crate::BufferPool`] carves into its buffers, backed by transparent
//! huge pages where the kernel gives them (`madvise(MADV_HUGEPAGE)`): a 1 MiB buffer inside one
//! 2 MiB page is one physically contiguous segment for a device's DMA, where 256 separate
//! 4 KiB pages exceed a virtio disk's 254 segments and split each I/O in two.

use std::alloc::{Layout, alloc, dealloc};
use std::ptr::NonNull;

use crate::error::CoreError;

/// Size of a transparent huge page on x86-64 and (with 4 KiB base pages) aarch64.
const HUGE_PAGE: usize = 2 << 20;

/// A zeroed allocation of fixed size; freed when dropped.
pub(crate) struct PoolMemory {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: this is plain memory; every buffer carved from it covers a range of its own
// (see `BufferPool::new`), handed out to one owner at a time, so sharing the memory between
// threads shares no byte between two writers.
unsafe impl Send for PoolMemory {}
// SAFETY: as above; a `PoolMemory` itself never reads or writes its bytes.
unsafe impl Sync for PoolMemory {}

impl PoolMemory {
    /// `bytes` zeroed bytes aligned to `align`; from 2 MiB up, aligned to 2 MiB and advised to
    /// use huge pages (a kernel that refuses the advice leaves ordinary pages).
    pub(crate) fn new(bytes: usize, align: usize) -> Result<PoolMemory, CoreError> {
        let huge = bytes >= HUGE_PAGE;
        let (size, align) = if huge {
            (bytes.div_ceil(HUGE_PAGE) * HUGE_PAGE, align.max(HUGE_PAGE))
        } else {
            (bytes.max(1), align)
        };
        let layout = Layout::from_size_align(size, align)
            .map_err(|_| CoreError::BadAlignment { align, size: bytes })?;
        // SAFETY: the layout has a non-zero size; the pointer is owned by the returned memory and
        // freed once, in Drop, with the same layout.
        let raw = unsafe { alloc(layout) };
        let ptr = NonNull::new(raw).ok_or(CoreError::OutOfMemory { bytes: size })?;
        // Advise before the first touch: pages faulted in afterwards come as huge pages.
        #[cfg(target_os = "linux")]
        if huge {
            // SAFETY: the range is this memory's own allocation, 2 MiB aligned and sized; the
            // advice changes how the kernel backs it, never its contents.
            unsafe { libc::madvise(raw.cast(), size, libc::MADV_HUGEPAGE) };
        }
        // SAFETY: `raw` is valid for `size` bytes, owned by us and not yet shared.
        unsafe { std::ptr::write_bytes(raw, 0, size) };
        Ok(PoolMemory { ptr, layout })
    }

    /// The start of the memory.
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
}

impl Drop for PoolMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout and not freed before.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}
