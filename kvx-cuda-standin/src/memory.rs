//! "Device" memory and registered host memory, and the range checks every copy goes through.
//!
//! Each `cuMemAlloc` is an anonymous mapping of its own, handed out at a *device address*: a
//! number in a per-device window of non-canonical addresses (`0xDE00_0000_0000_0000` plus one
//! TiB per ordinal) that no host pointer can be, so code that dereferences a device pointer on
//! the host faults at once. Allocations are spaced with a gap, so a copy that runs past the end
//! of one falls into no allocation and is refused.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUresult;
use kvx_core::lock;

/// First device address of device 0.
pub const DEVICE_BASE: u64 = 0xDE00_0000_0000_0000;
/// Address window of one device.
const DEVICE_WINDOW: u64 = 1 << 40;
/// Allocation granularity and the unmapped gap after each allocation.
const GRANULE: u64 = 2 << 20;

/// Hands out device addresses of one device (never reused: a freed pointer stays invalid).
pub(crate) struct AddressSpace {
    next: AtomicU64,
    end: u64,
}

impl AddressSpace {
    pub(crate) fn for_device(ordinal: i32) -> AddressSpace {
        let base = DEVICE_BASE + ordinal as u64 * DEVICE_WINDOW;
        AddressSpace {
            next: AtomicU64::new(base),
            end: base + DEVICE_WINDOW,
        }
    }

    /// Reserve addresses for `len` bytes (plus the gap).
    fn reserve(&self, len: usize) -> Result<u64, CUresult> {
        let span = (len as u64).div_ceil(GRANULE).saturating_add(1) * GRANULE;
        let start = self.next.fetch_add(span, Ordering::Relaxed);
        match start.checked_add(span) {
            Some(end) if end <= self.end => Ok(start),
            _ => Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        }
    }
}

/// One device allocation: an anonymous mapping, unmapped when the last copy holding it ends.
pub struct Mapping {
    host: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; concurrent copies into it are the
// caller's ordering problem exactly as on a GPU (the stand-in only moves bytes).
unsafe impl Send for Mapping {}
// SAFETY: see above; `Mapping` exposes no references, only the raw base for copies.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(len: usize) -> Result<Mapping, CUresult> {
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing; no
        // existing memory is affected. The result is checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(Mapping {
            host: p.cast(),
            len,
        })
    }

    /// Host address of byte `offset` (in bounds: checked by the caller's resolution).
    pub(crate) fn at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.len);
        self.host.wrapping_add(offset)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `host..host+len` is the mapping made in `new`, unmapped once here; nothing
        // refers to it any more (copies hold an Arc<Mapping>).
        unsafe { libc::munmap(self.host.cast(), self.len) };
    }
}

/// The allocations of one context, by device address.
#[derive(Default)]
pub(crate) struct DeviceAllocs {
    by_start: Mutex<BTreeMap<u64, Arc<Mapping>>>,
}

impl DeviceAllocs {
    /// `cuMemAlloc`.
    pub(crate) fn alloc(&self, space: &AddressSpace, len: usize) -> Result<u64, CUresult> {
        if len == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let mapping = Arc::new(Mapping::new(len)?);
        let start = space.reserve(len)?;
        lock(&self.by_start).insert(start, mapping);
        Ok(start)
    }

    /// `cuMemFree`: only the start of a live allocation.
    pub(crate) fn free(&self, ptr: u64) -> Result<(), CUresult> {
        lock(&self.by_start)
            .remove(&ptr)
            .map(drop)
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
    }

    /// The allocation holding all of `addr..addr+len`, and the offset of `addr` in it.
    pub(crate) fn resolve(&self, addr: u64, len: usize) -> Option<(Arc<Mapping>, usize)> {
        let end = addr.checked_add(len as u64)?;
        let map = lock(&self.by_start);
        let (&start, m) = map.range(..=addr).next_back()?;
        (end <= start + m.len as u64).then(|| (m.clone(), (addr - start) as usize))
    }
}

/// A registered host range: where it ends, and the context that registered it.
struct Registered {
    end: usize,
    ctx: usize,
}

/// Host ranges registered with `cuMemHostRegister`, by start. Usable from every context (as
/// `PORTABLE` registrations are); they go away with the context that made them.
fn registrations() -> &'static Mutex<BTreeMap<usize, Registered>> {
    static R: OnceLock<Mutex<BTreeMap<usize, Registered>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// `cuMemHostRegister` in context `ctx`: refuse null, empty and overlapping ranges.
pub(crate) fn register_host(ctx: usize, start: usize, len: usize) -> Result<(), CUresult> {
    let end = start
        .checked_add(len)
        .filter(|_| start != 0 && len != 0)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let mut r = lock(registrations());
    let before = r.range(..end).next_back();
    if before.is_some_and(|(_, reg)| reg.end > start) {
        return Err(CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    }
    r.insert(start, Registered { end, ctx });
    Ok(())
}

/// Drop the registrations context `ctx` made (it is being destroyed).
pub(crate) fn unregister_context(ctx: usize) {
    lock(registrations()).retain(|_, reg| reg.ctx != ctx);
}

/// `cuMemHostUnregister`: `start` must be the start of a registration.
pub(crate) fn unregister_host(start: usize) -> Result<(), CUresult> {
    lock(registrations())
        .remove(&start)
        .map(drop)
        .ok_or(CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
}

/// True when `addr..addr+len` lies inside one registered host range.
pub(crate) fn host_registered(addr: usize, len: usize) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let r = lock(registrations());
    r.range(..=addr)
        .next_back()
        .is_some_and(|(_, reg)| end <= reg.end)
}

/// One side of a copy.
#[derive(Clone)]
pub(crate) enum Place {
    /// Device memory: the allocation and an offset in it.
    Device(Arc<Mapping>, usize),
    /// Host memory at this address.
    Host(usize),
}

impl Place {
    /// A device address of `ctx`'s allocations, checked for `len` bytes.
    pub(crate) fn device(allocs: &DeviceAllocs, addr: u64, len: usize) -> Result<Place, CUresult> {
        allocs
            .resolve(addr, len)
            .map(|(m, off)| Place::Device(m, off))
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
    }

    /// A host address inside registered memory (what an asynchronous copy needs).
    pub(crate) fn pinned(addr: usize, len: usize) -> Result<Place, CUresult> {
        if host_registered(addr, len) {
            Ok(Place::Host(addr))
        } else {
            Err(CUresult::CUDA_ERROR_INVALID_VALUE)
        }
    }

    /// A unified address (batch copies): device if it is in a device window, else pinned host.
    pub(crate) fn unified(allocs: &DeviceAllocs, addr: u64, len: usize) -> Result<Place, CUresult> {
        if addr >= DEVICE_BASE {
            Place::device(allocs, addr, len)
        } else {
            Place::pinned(addr as usize, len)
        }
    }

    /// Where the bytes are, if they are still there: a host range must still be registered
    /// when the copy runs (unregistered memory may be freed: the copy must not touch it).
    fn ptr(&self, len: usize) -> Option<*mut u8> {
        match self {
            Place::Device(m, off) => Some(m.at(*off)),
            Place::Host(addr) => host_registered(*addr, len).then_some(*addr as *mut u8),
        }
    }
}

/// Move `len` bytes from `src` to `dst`; `false` when a host side is no longer registered.
pub(crate) fn copy(dst: &Place, src: &Place, len: usize) -> bool {
    let (Some(d), Some(s)) = (dst.ptr(len), src.ptr(len)) else {
        return false;
    };
    // SAFETY: both ranges were checked for `len` bytes: device sides lie in a live mapping
    // (held by the Arc in the Place), host sides in memory registered right now, whose owner
    // promised (as with DMA) to keep it allocated while registered. `copy` allows overlap.
    unsafe { std::ptr::copy(s.cast_const(), d, len) };
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ranges_resolve_only_inside_an_allocation() {
        let space = AddressSpace::for_device(15);
        let allocs = DeviceAllocs::default();
        let a = allocs.alloc(&space, 5000).unwrap();
        let b = allocs.alloc(&space, 100).unwrap();
        assert!(
            a >= DEVICE_BASE && b > a + 5000,
            "a gap between allocations"
        );
        assert_eq!(allocs.resolve(a, 5000).map(|r| r.1), Some(0));
        assert_eq!(allocs.resolve(a + 10, 4990).map(|r| r.1), Some(10));
        assert!(allocs.resolve(a + 10, 4991).is_none(), "runs past the end");
        assert!(allocs.resolve(a - 1, 2).is_none(), "starts before");
        assert!(allocs.resolve(u64::MAX - 1, 4).is_none(), "overflow");
        allocs.free(a).unwrap();
        assert!(allocs.resolve(a, 1).is_none(), "freed");
        assert_eq!(allocs.free(a), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(allocs.free(b + 1), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
    }

    #[test]
    fn host_registration_refuses_overlap_and_unknown_starts() {
        let buf = vec![0u8; 3 * 4096];
        let p = buf.as_ptr() as usize;
        register_host(1, p, 4096).unwrap();
        assert_eq!(
            register_host(1, p + 100, 10),
            Err(CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
        );
        assert!(host_registered(p, 4096) && !host_registered(p, 4097));
        assert_eq!(
            unregister_host(p + 1),
            Err(CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
        );
        unregister_host(p).unwrap();
        assert!(!host_registered(p, 1));
        assert_eq!(
            register_host(1, 0, 10),
            Err(CUresult::CUDA_ERROR_INVALID_VALUE)
        );
    }
}
