//! The engine's KV pool, described once: regions, memory kind, block stride.

use serde::{Deserialize, Serialize};

use crate::error::CoreError;
use crate::ids::EngineBlockId;

/// Where a region's memory lives.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub enum MemoryKind {
    /// Ordinary (or pinned) CPU memory.
    Cpu,
    /// Memory of CUDA device `n`.
    Cuda(u32),
}

/// One region of the engine's KV pool.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Region {
    /// Address of block 0's segment.
    pub base: usize,
    /// Host or device memory.
    pub kind: MemoryKind,
    /// Distance in bytes between the segments of consecutive blocks.
    pub stride: usize,
    /// Bytes of one block in this region.
    pub segment_len: usize,
}

/// The registered layout of the engine's KV pool.
///
/// Per-layer engines register one region per layer (and K/V), block `i` at `base + i * stride`
/// in each; cross-layer engines register one region where a block is one contiguous run. A
/// block's bytes, as kvx stores them, are its segments concatenated in region order.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct KvLayout {
    regions: Vec<Region>,
    num_blocks: u32,
    block_bytes: usize,
}

impl KvLayout {
    /// A layout of `regions`, each holding one segment of each of `num_blocks` blocks.
    pub fn new(regions: Vec<Region>, num_blocks: u32) -> Result<KvLayout, CoreError> {
        if regions.is_empty() {
            return Err(CoreError::BadLayout("no regions".into()));
        }
        if num_blocks == 0 {
            return Err(CoreError::BadLayout("zero blocks".into()));
        }
        for (i, r) in regions.iter().enumerate() {
            if r.segment_len == 0 {
                return Err(CoreError::BadLayout(format!(
                    "region {i}: zero segment length"
                )));
            }
            if r.stride < r.segment_len && num_blocks > 1 {
                return Err(CoreError::BadLayout(format!(
                    "region {i}: stride {} is smaller than segment length {}",
                    r.stride, r.segment_len
                )));
            }
            if r.base == 0 {
                return Err(CoreError::BadLayout(format!(
                    "region {i}: null base address"
                )));
            }
        }
        let block_bytes = regions.iter().map(|r| r.segment_len).sum();
        Ok(KvLayout {
            regions,
            num_blocks,
            block_bytes,
        })
    }

    /// A cross-layer layout: one region, each block `block_bytes` contiguous bytes.
    pub fn contiguous(
        base: usize,
        kind: MemoryKind,
        block_bytes: usize,
        num_blocks: u32,
    ) -> Result<KvLayout, CoreError> {
        KvLayout::new(
            vec![Region {
                base,
                kind,
                stride: block_bytes,
                segment_len: block_bytes,
            }],
            num_blocks,
        )
    }

    /// The regions, in the order their segments are concatenated.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Bytes of one block (all its segments).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Check that `block` is inside the pool.
    pub fn check(&self, block: EngineBlockId) -> Result<(), CoreError> {
        if block.0 < self.num_blocks {
            Ok(())
        } else {
            Err(CoreError::BlockOutOfRange {
                block,
                num_blocks: self.num_blocks,
            })
        }
    }

    /// `(address, length)` of each segment of `block`, in region order.
    pub fn segments(
        &self,
        block: EngineBlockId,
    ) -> Result<impl Iterator<Item = (usize, usize)> + '_, CoreError> {
        self.check(block)?;
        let i = block.0 as usize;
        Ok(self
            .regions
            .iter()
            .map(move |r| (r.base + i * r.stride, r.segment_len)))
    }

    /// True when every region is host memory.
    pub fn is_cpu(&self) -> bool {
        self.regions.iter().all(|r| r.kind == MemoryKind::Cpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_layer_segments_are_strided() {
        let regions = (0..3)
            .map(|l| Region {
                base: 0x10000 * (l + 1),
                kind: MemoryKind::Cpu,
                stride: 256,
                segment_len: 128,
            })
            .collect();
        let layout = KvLayout::new(regions, 10).unwrap();
        assert_eq!(layout.block_bytes(), 384);
        let segs: Vec<_> = layout.segments(EngineBlockId(2)).unwrap().collect();
        assert_eq!(
            segs,
            vec![
                (0x10000 + 512, 128),
                (0x20000 + 512, 128),
                (0x30000 + 512, 128)
            ]
        );
        assert!(matches!(
            layout.segments(EngineBlockId(10)),
            Err(CoreError::BlockOutOfRange { .. })
        ));
    }

    #[test]
    fn nonsense_layouts_are_rejected() {
        assert!(KvLayout::new(vec![], 1).is_err());
        assert!(KvLayout::contiguous(0x1000, MemoryKind::Cpu, 64, 0).is_err());
        assert!(KvLayout::contiguous(0, MemoryKind::Cpu, 64, 4).is_err());
        let overlap = Region {
            base: 0x1000,
            kind: MemoryKind::Cpu,
            stride: 32,
            segment_len: 64,
        };
        assert!(KvLayout::new(vec![overlap], 4).is_err());
    }
}
