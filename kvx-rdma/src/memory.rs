//! The only code of kvx-rdma that reads engine memory on the producer side.
//!
//! Ownership rule: the engine registered its KV pool with the `unsafe` [`crate::Exporter::new`],
//! promising that every region is live host memory for as long as the exporter lives, and that
//! it does not write or free an exported block before the exporter reports the request
//! released. A [`PinnedRead`] exists only while the request's lease bookkeeping counts it
//! (`ExportTable::begin_read` .. `end_read`), and a release is reported only after every pin is
//! dropped, so the bytes a pinned read sees are still the exported request's.

use kvx_core::{EngineBlockId, KvLayout};

use crate::error::RdmaError;

/// The engine's host memory, as registered for export.
#[derive(Debug)]
pub(crate) struct EngineMemory {
    layout: KvLayout,
}

impl EngineMemory {
    /// Wrap a host layout (device memory is refused: the TCP transport copies with the CPU).
    pub(crate) fn new(layout: KvLayout) -> Result<EngineMemory, RdmaError> {
        if !layout.is_cpu() {
            return Err(RdmaError::BadLayout(
                "the exporter serves host memory only".into(),
            ));
        }
        Ok(EngineMemory { layout })
    }

    /// The layout.
    pub(crate) fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// `(address, length)` pieces of `block`'s bytes `offset..offset+len` (segments
    /// concatenated in region order). The caller checked the range against the block size.
    pub(crate) fn ranges(
        &self,
        block: EngineBlockId,
        offset: u64,
        len: u64,
    ) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let (mut skip, mut want) = (offset as usize, len as usize);
        let Ok(segs) = self.layout.segments(block) else {
            return out;
        };
        for (addr, seg) in segs {
            if want == 0 {
                break;
            }
            if skip >= seg {
                skip -= seg;
                continue;
            }
            let n = (seg - skip).min(want);
            out.push((addr + skip, n));
            want -= n;
            skip = 0;
        }
        out
    }
}

/// A read admitted by the lease bookkeeping: its byte ranges stay the request's until it drops.
pub(crate) struct PinnedRead {
    ranges: Vec<(usize, usize)>,
    unpin: Option<Box<dyn FnOnce() + Send>>,
}

impl PinnedRead {
    /// A pin over `ranges` that calls `unpin` when dropped (it must decrement the pin count).
    pub(crate) fn new(ranges: Vec<(usize, usize)>, unpin: Box<dyn FnOnce() + Send>) -> PinnedRead {
        PinnedRead {
            ranges,
            unpin: Some(unpin),
        }
    }

    /// Total bytes.
    pub(crate) fn len(&self) -> u64 {
        self.ranges.iter().map(|(_, n)| *n as u64).sum()
    }

    /// The pinned bytes, piece by piece. They live as long as `self`.
    pub(crate) fn slices(&self) -> impl Iterator<Item = &[u8]> + '_ {
        self.ranges.iter().map(|&(addr, n)| {
            // SAFETY: see the module docs: `addr..addr+n` lies in a registered host region
            // (`EngineMemory::ranges` derived it from the layout, bounds-checked by the export
            // table), and while this pin lives the engine neither frees nor writes the block.
            // The returned slice borrows `self`, so it cannot outlive the pin.
            unsafe { std::slice::from_raw_parts(addr as *const u8, n) }
        })
    }
}

impl Drop for PinnedRead {
    fn drop(&mut self) {
        if let Some(f) = self.unpin.take() {
            f()
        }
    }
}

#[cfg(test)]
mod tests {
    use kvx_core::CpuArena;

    use super::*;

    #[test]
    fn ranges_follow_segments_of_a_per_layer_layout() {
        let arena = CpuArena::per_layer(3, 100, 4).unwrap();
        let m = EngineMemory::new(arena.layout().clone()).unwrap();
        let base: Vec<usize> = arena.layout().regions().iter().map(|r| r.base).collect();
        let r = m.ranges(EngineBlockId(2), 150, 100);
        assert_eq!(r, vec![(base[1] + 200 + 50, 50), (base[2] + 200, 50)]);
        assert_eq!(m.ranges(EngineBlockId(0), 0, 300).len(), 3);
        let total: usize = m.ranges(EngineBlockId(3), 0, 300).iter().map(|x| x.1).sum();
        assert_eq!(total, 300);
    }
}
