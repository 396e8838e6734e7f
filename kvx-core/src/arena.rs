//! `CpuArena`: an engine KV pool in host memory, owned by Rust code.

use crate::buffer::AlignedBuf;
use crate::error::CoreError;
use crate::ids::EngineBlockId;
use crate::layout::{KvLayout, MemoryKind, Region};

/// Engine memory in CPU RAM: `num_blocks` blocks laid out per layer or cross-layer.
///
/// CPU engines, tests and the replay tool use it as "engine memory". Ownership rule: while an op
/// that touches a block is outstanding, only that op may access the block; the arena's owner
/// reads or writes a block only after its task ended and any fence on it holds.
pub struct CpuArena {
    /// Owns the memory the layout's regions point into (accessed through raw segment pointers).
    _mem: AlignedBuf,
    layout: KvLayout,
}

impl CpuArena {
    /// A cross-layer arena: each block is `block_bytes` contiguous bytes.
    pub fn contiguous(block_bytes: usize, num_blocks: u32) -> Result<CpuArena, CoreError> {
        CpuArena::per_layer(1, block_bytes, num_blocks)
    }

    /// A per-layer arena: `layers` regions, each holding a `segment_len`-byte segment per block.
    pub fn per_layer(
        layers: usize,
        segment_len: usize,
        num_blocks: u32,
    ) -> Result<CpuArena, CoreError> {
        if layers == 0 || segment_len == 0 || num_blocks == 0 {
            return Err(CoreError::BadLayout("empty arena".into()));
        }
        let region_bytes = segment_len * num_blocks as usize;
        let mut mem = AlignedBuf::new(region_bytes * layers, crate::buffer::DEFAULT_ALIGN)?;
        let base = mem.as_mut_ptr() as usize;
        let regions = (0..layers)
            .map(|l| Region {
                base: base + l * region_bytes,
                kind: MemoryKind::Cpu,
                stride: segment_len,
                segment_len,
            })
            .collect();
        let layout = KvLayout::new(regions, num_blocks)?;
        Ok(CpuArena { _mem: mem, layout })
    }

    /// The layout to register with a backend.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// A copy of `block`'s bytes (segments concatenated).
    pub fn read_block(&self, block: EngineBlockId) -> Result<Vec<u8>, CoreError> {
        let mut out = vec![0u8; self.layout.block_bytes()];
        let mut pos = 0;
        for (addr, len) in self.layout.segments(block)? {
            // SAFETY: `addr..addr+len` lies inside `self.mem` (the layout was built from it);
            // per the module's ownership rule no op touches this block now. Raw copies touch
            // only this block's bytes, never the rest of the arena.
            unsafe {
                std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr().add(pos), len)
            };
            pos += len;
        }
        Ok(out)
    }

    /// Overwrite `block` with `data` (segments concatenated; must be exactly one block).
    pub fn write_block(&mut self, block: EngineBlockId, data: &[u8]) -> Result<(), CoreError> {
        if data.len() != self.layout.block_bytes() {
            return Err(CoreError::BadLayout(format!(
                "block data is {} bytes, blocks are {}",
                data.len(),
                self.layout.block_bytes()
            )));
        }
        let mut pos = 0;
        for (addr, len) in self.layout.segments(block)? {
            // SAFETY: as in `read_block`; `&mut self` and the ownership rule make this block
            // ours, and `data` holds `pos + len` bytes (its length was checked above).
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(pos), addr as *mut u8, len) };
            pos += len;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_layer_round_trip() {
        let mut a = CpuArena::per_layer(4, 64, 8).unwrap();
        let data: Vec<u8> = (0..256).map(|i| i as u8).collect();
        a.write_block(EngineBlockId(3), &data).unwrap();
        assert_eq!(a.read_block(EngineBlockId(3)).unwrap(), data);
        assert_eq!(a.read_block(EngineBlockId(2)).unwrap(), vec![0; 256]);
        assert!(a.write_block(EngineBlockId(3), &data[..10]).is_err());
        assert!(a.read_block(EngineBlockId(8)).is_err());
    }
}
