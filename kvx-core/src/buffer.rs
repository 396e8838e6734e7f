//! Owned, aligned buffers and the pool that lends them to ops.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::CoreError;
use crate::pool_memory::PoolMemory;
use crate::sync::lock;

/// Default alignment: what O_DIRECT needs on common filesystems and devices.
pub const DEFAULT_ALIGN: usize = 4096;

/// A heap allocation of fixed capacity and alignment, with a current length.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    align: usize,
    len: usize,
    /// Allocated by `new` (freed on drop), or a range of a pool's memory (freed with the memory).
    owned: bool,
}

// SAFETY: AlignedBuf uniquely owns its allocation (like Vec<u8>); moving it between threads moves
// that ownership, and shared references only give out `&[u8]`.
unsafe impl Send for AlignedBuf {}
// SAFETY: see above; `&AlignedBuf` only allows reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocate `cap` zeroed bytes aligned to `align` (a power of two). Length starts at `cap`.
    pub fn new(cap: usize, align: usize) -> Result<AlignedBuf, CoreError> {
        let layout = Layout::from_size_align(cap.max(1), align)
            .map_err(|_| CoreError::BadAlignment { align, size: cap })?;
        // SAFETY: layout has a non-zero size. The pointer is owned by the returned AlignedBuf and
        // freed exactly once, in Drop, with the same layout.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(CoreError::OutOfMemory { bytes: cap })?;
        Ok(AlignedBuf {
            ptr,
            cap,
            align,
            len: cap,
            owned: true,
        })
    }

    /// A buffer over `cap` zeroed bytes at `ptr` (aligned to `align`) that it does not free.
    ///
    /// # Safety
    /// The bytes must stay allocated, and be used through no other buffer or reference, for as
    /// long as the returned buffer lives.
    unsafe fn carved(ptr: NonNull<u8>, cap: usize, align: usize) -> AlignedBuf {
        AlignedBuf {
            ptr,
            cap,
            align,
            len: cap,
            owned: false,
        }
    }

    /// Bytes this buffer can hold.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Alignment of the start of the buffer.
    pub fn align(&self) -> usize {
        self.align
    }

    /// Bytes currently valid.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no byte is valid.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Set how many bytes are valid (clamped to the capacity).
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.cap);
    }

    /// The valid bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialised (zeroed at allocation) bytes, owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The valid bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The whole capacity, writable (for I/O that fills the buffer; then call `set_len`).
    pub fn as_mut_full(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap initialised bytes; `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }

    /// Raw pointer to the start, for I/O submitted to the kernel or a device.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Raw mutable pointer to the start, for I/O submitted to the kernel or a device.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: allocated in `new` with exactly this size/alignment and not freed before.
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.cap.max(1), self.align),
            )
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .field("align", &self.align)
            .finish()
    }
}

/// Distance between the starts of consecutive buffers of a pool.
fn stride(buf_size: usize, align: usize) -> usize {
    buf_size.max(1).div_ceil(align) * align
}

struct PoolState {
    free: Vec<(usize, AlignedBuf)>,
    lent: Vec<bool>,
}

struct PoolInner {
    buf_size: usize,
    align: usize,
    count: usize,
    /// Holds the buffers (free ones here, lent ones in their `PoolBuf`): declared before the
    /// memory, so they are dropped before it.
    state: Mutex<PoolState>,
    /// The memory of every buffer; lives as long as the pool or any buffer lent from it
    /// (each `PoolBuf` holds the pool).
    memory: PoolMemory,
}

/// A fixed set of equal, aligned buffers. Cloning gives another handle to the same pool.
///
/// The ownership rule (tokio-uring's model): a buffer moved into an [`crate::Op`] belongs to that
/// op until the backend hands the op back in its completion. A [`PoolBuf`] returns itself to its
/// pool only when dropped, so a buffer held by an outstanding (or zombie) op can never be in the
/// pool at the same time.
#[derive(Clone)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

impl BufferPool {
    /// A pool of `count` buffers of `buf_size` bytes aligned to `align`, allocated now as one
    /// memory (huge pages where the kernel gives them, see `pool_memory.rs`).
    pub fn new(count: usize, buf_size: usize, align: usize) -> Result<BufferPool, CoreError> {
        if !align.is_power_of_two() {
            return Err(CoreError::BadAlignment {
                align,
                size: buf_size,
            });
        }
        let stride = stride(buf_size, align);
        let bytes = stride
            .checked_mul(count)
            .ok_or(CoreError::OutOfMemory { bytes: usize::MAX })?;
        let memory = PoolMemory::new(bytes, align)?;
        let mut free = Vec::with_capacity(count);
        for i in (0..count).rev() {
            // SAFETY: buffer i covers bytes [i * stride, i * stride + buf_size) of the memory,
            // inside it (count * stride bytes) and disjoint from every other buffer's; the memory
            // is dropped only after every buffer (see `PoolInner`).
            let buf = unsafe {
                let ptr = NonNull::new_unchecked(memory.ptr().as_ptr().add(i * stride));
                AlignedBuf::carved(ptr, buf_size, align)
            };
            free.push((i, buf));
        }
        Ok(BufferPool {
            inner: Arc::new(PoolInner {
                buf_size,
                align,
                count,
                state: Mutex::new(PoolState {
                    free,
                    lent: vec![false; count],
                }),
                memory,
            }),
        })
    }

    /// Lend one buffer (length reset to its full size), or `None` when all are lent.
    pub fn take(&self) -> Option<PoolBuf> {
        let mut st = lock(&self.inner.state);
        let (index, mut buf) = st.free.pop()?;
        st.lent[index] = true;
        drop(st);
        buf.set_len(self.inner.buf_size);
        Some(PoolBuf {
            buf: Some(buf),
            index,
            pool: self.inner.clone(),
        })
    }

    /// Size of each buffer.
    pub fn buf_size(&self) -> usize {
        self.inner.buf_size
    }

    /// Alignment of each buffer.
    pub fn align(&self) -> usize {
        self.inner.align
    }

    /// Total buffers in the pool.
    pub fn capacity(&self) -> usize {
        self.inner.count
    }

    /// Buffers ready to lend.
    pub fn available(&self) -> usize {
        lock(&self.inner.state).free.len()
    }

    /// Buffers lent out (to ops, tiers or callers).
    pub fn lent(&self) -> usize {
        self.inner.count - self.available()
    }

    /// Whether buffer `index` is lent out right now.
    pub fn is_lent(&self, index: usize) -> bool {
        lock(&self.inner.state)
            .lent
            .get(index)
            .copied()
            .unwrap_or(false)
    }

    /// True when every buffer is back.
    pub fn is_whole(&self) -> bool {
        self.available() == self.inner.count
    }

    /// The pool's memory as a host layout: block `i` is buffer `i`'s `buf_size` bytes. The
    /// memory lives as long as any handle to the pool; what a lent buffer holds is its
    /// owner's to read or write.
    pub fn layout(&self) -> Result<crate::KvLayout, CoreError> {
        let inner = &self.inner;
        let blocks = u32::try_from(inner.count).map_err(|_| {
            CoreError::BadLayout(format!(
                "{} buffers are more than a layout holds",
                inner.count
            ))
        })?;
        crate::KvLayout::new(
            vec![crate::Region {
                base: inner.memory.ptr().as_ptr() as usize,
                kind: crate::MemoryKind::Cpu,
                stride: stride(inner.buf_size, inner.align),
                segment_len: inner.buf_size,
            }],
            blocks,
        )
    }
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("buf_size", &self.inner.buf_size)
            .field("capacity", &self.inner.count)
            .field("available", &self.available())
            .finish()
    }
}

/// A buffer lent by a [`BufferPool`]; it goes back to the pool when dropped.
pub struct PoolBuf {
    buf: Option<AlignedBuf>,
    index: usize,
    pool: Arc<PoolInner>,
}

impl PoolBuf {
    /// The buffer's index in its pool.
    pub fn index(&self) -> usize {
        self.index
    }

    fn inner(&self) -> &AlignedBuf {
        self.buf
            .as_ref()
            .expect("PoolBuf holds its buffer until dropped")
    }

    fn inner_mut(&mut self) -> &mut AlignedBuf {
        self.buf
            .as_mut()
            .expect("PoolBuf holds its buffer until dropped")
    }
}

impl std::ops::Deref for PoolBuf {
    type Target = AlignedBuf;
    fn deref(&self) -> &AlignedBuf {
        self.inner()
    }
}

impl std::ops::DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut AlignedBuf {
        self.inner_mut()
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let mut st = lock(&self.pool.state);
            st.lent[self.index] = false;
            st.free.push((self.index, buf));
        }
    }
}

impl std::fmt::Debug for PoolBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolBuf")
            .field("index", &self.index)
            .field("len", &self.len())
            .finish()
    }
}

/// The buffer of one block in an op: owned (the op may write it) or shared (read-only source,
/// e.g. a block held by a host tier that several loads read at once).
#[derive(Debug)]
pub enum Buf {
    /// Exclusively owned by the op: a destination or a source.
    Owned(PoolBuf),
    /// Shared, read-only: only a source.
    Shared(Arc<PoolBuf>),
}

impl Buf {
    /// Valid bytes.
    pub fn len(&self) -> usize {
        match self {
            Buf::Owned(b) => b.len(),
            Buf::Shared(b) => b.len(),
        }
    }

    /// True when no byte is valid.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Capacity of the underlying buffer.
    pub fn capacity(&self) -> usize {
        match self {
            Buf::Owned(b) => b.capacity(),
            Buf::Shared(b) => b.capacity(),
        }
    }

    /// The valid bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Buf::Owned(b) => b.as_slice(),
            Buf::Shared(b) => b.as_slice(),
        }
    }

    /// The owned buffer, writable; `None` for a shared one.
    pub fn as_owned_mut(&mut self) -> Option<&mut PoolBuf> {
        match self {
            Buf::Owned(b) => Some(b),
            Buf::Shared(_) => None,
        }
    }

    /// Turn an owned buffer into a shared one (for a tier that lends it to many readers).
    pub fn into_shared(self) -> Arc<PoolBuf> {
        match self {
            Buf::Owned(b) => Arc::new(b),
            Buf::Shared(b) => b,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_lends_and_takes_back_on_drop() {
        let pool = BufferPool::new(2, 8192, DEFAULT_ALIGN).unwrap();
        let a = pool.take().unwrap();
        assert_eq!(a.as_ptr() as usize % DEFAULT_ALIGN, 0);
        assert!(pool.is_lent(a.index()));
        let b = pool.take().unwrap();
        assert!(pool.take().is_none());
        assert_eq!(pool.lent(), 2);
        drop(a);
        assert_eq!(pool.available(), 1);
        let shared = Buf::Owned(b).into_shared();
        let second = shared.clone();
        drop(shared);
        assert_eq!(pool.available(), 1, "still held by the second reference");
        drop(second);
        assert!(pool.is_whole());
    }

    /// Block `i` of the pool's layout is buffer `i`'s memory, whatever the padding between
    /// buffers.
    #[test]
    fn the_layout_of_a_pool_addresses_its_buffers() {
        let pool = BufferPool::new(3, 5000, DEFAULT_ALIGN).unwrap();
        let layout = pool.layout().unwrap();
        assert_eq!(layout.num_blocks(), 3);
        assert_eq!(layout.block_bytes(), 5000);
        let bufs: Vec<PoolBuf> = (0..3).map(|_| pool.take().unwrap()).collect();
        for b in &bufs {
            let segments: Vec<_> = layout
                .segments(crate::EngineBlockId(b.index() as u32))
                .unwrap()
                .collect();
            assert_eq!(segments, vec![(b.as_ptr() as usize, 5000)]);
        }
    }

    #[test]
    fn bad_alignment_is_an_error() {
        assert!(matches!(
            AlignedBuf::new(10, 3),
            Err(CoreError::BadAlignment { align: 3, .. })
        ));
        assert!(matches!(
            BufferPool::new(2, 10, 3),
            Err(CoreError::BadAlignment { align: 3, .. })
        ));
    }

    #[test]
    fn pool_buffers_are_aligned_zeroed_disjoint_and_outlive_the_pool_handle() {
        // 5000 bytes: a stride of two 4 KiB pages; 600 buffers make a pool memory of huge pages.
        let pool = BufferPool::new(600, 5000, DEFAULT_ALIGN).unwrap();
        let mut all: Vec<PoolBuf> = (0..600).map(|_| pool.take().unwrap()).collect();
        for (i, b) in all.iter_mut().enumerate() {
            assert_eq!(b.as_ptr() as usize % DEFAULT_ALIGN, 0);
            assert_eq!(b.capacity(), 5000);
            assert!(b.as_slice().iter().all(|x| *x == 0), "zeroed");
            b.as_mut_slice().fill(i as u8);
        }
        let mut starts: Vec<usize> = all.iter().map(|b| b.as_ptr() as usize).collect();
        starts.sort_unstable();
        assert!(starts.windows(2).all(|w| w[1] - w[0] >= 5000), "disjoint");
        drop(pool);
        // The pool handle is gone; the lent buffers still hold their bytes.
        for (i, b) in all.iter().enumerate() {
            assert!(b.as_slice().iter().all(|x| *x == i as u8), "buffer {i}");
        }
    }

    #[test]
    fn set_len_clamps_to_capacity() {
        let mut b = AlignedBuf::new(100, 64).unwrap();
        b.set_len(1000);
        assert_eq!(b.len(), 100);
        b.set_len(10);
        b.as_mut_slice().copy_from_slice(&[7; 10]);
        assert_eq!(b.as_slice(), &[7; 10]);
    }
}
