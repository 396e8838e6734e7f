//! The engine's KV cache tensors, described by where each block's bytes are.
//!
//! An engine hands kvx its KV cache as strided tensors (PyTorch views): a logical shape, the
//! strides of its dimensions and an element size. One dimension indexes blocks. The physical
//! order of the others may differ from their logical order (vLLM's `LBNHC` keeps the logical
//! shape `[blocks, 2, tokens, heads, head_size]` and permutes the strides), and K/V or the
//! layers of a cross-layer cache may sit before or after the block dimension. [`KvLayout::from_tensors`]
//! finds, for each tensor, the contiguous run each block occupies and the regions those runs
//! repeat in, whatever the order of the dimensions.

use crate::layout::{KvLayout, MemoryKind, Region};

/// Most regions one engine may register (layers × K/V planes × runs of a scattered block).
pub const MAX_REGIONS: usize = 1 << 16;

/// One KV cache tensor as the engine registered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorView {
    /// The engine's name for it (a layer name), used in errors.
    pub name: String,
    /// Address of element 0.
    pub ptr: usize,
    /// Sizes of the dimensions, in logical order.
    pub shape: Vec<i64>,
    /// Strides of the dimensions, in elements.
    pub strides: Vec<i64>,
    /// Bytes of one element.
    pub elem_size: usize,
    /// Where the tensor's memory lives.
    pub kind: MemoryKind,
}

/// Why a tensor cannot be part of a kvx layout; names the tensor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("KV cache tensor {name:?}: {reason}")]
pub struct TensorLayoutError {
    /// The tensor.
    pub name: String,
    /// What is wrong with it.
    pub reason: String,
}

/// One dimension: its logical index, size and stride in elements.
#[derive(Clone, Copy, Debug)]
struct Dim {
    index: usize,
    size: usize,
    stride: usize,
}

impl TensorView {
    fn error(&self, reason: impl Into<String>) -> TensorLayoutError {
        TensorLayoutError {
            name: self.name.clone(),
            reason: reason.into(),
        }
    }

    fn dims(&self) -> Result<Vec<Dim>, TensorLayoutError> {
        if self.shape.len() != self.strides.len() {
            return Err(self.error("shape and strides differ in length"));
        }
        if self.elem_size == 0 || self.ptr == 0 {
            return Err(self.error("no storage (null pointer or zero element size)"));
        }
        let mut dims = Vec::with_capacity(self.shape.len());
        for (index, (&size, &stride)) in self.shape.iter().zip(&self.strides).enumerate() {
            let size = usize::try_from(size)
                .map_err(|_| self.error(format!("dimension {index} has negative size {size}")))?;
            let stride = usize::try_from(stride).map_err(|_| {
                self.error(format!("dimension {index} has negative stride {stride}"))
            })?;
            if size == 0 {
                return Err(self.error(format!("dimension {index} is empty")));
            }
            dims.push(Dim {
                index,
                size,
                stride,
            });
        }
        Ok(dims)
    }

    /// Refuse a tensor whose elements may share bytes (a broadcast stride of 0, dimensions
    /// that interleave): taken by increasing stride, each dimension's stride must reach past
    /// every element the smaller ones span. Returns the last element's offset.
    fn check_no_overlap(&self, dims: &[Dim]) -> Result<usize, TensorLayoutError> {
        let mut sorted: Vec<Dim> = dims.iter().copied().filter(|d| d.size > 1).collect();
        sorted.sort_by_key(|d| d.stride);
        let mut span = 0usize;
        for d in sorted {
            if d.stride <= span || d.stride == 0 {
                return Err(self.error(format!(
                    "dimension {} overlaps the others (shape {:?}, strides {:?})",
                    d.index, self.shape, self.strides
                )));
            }
            span = (d.size - 1)
                .checked_mul(d.stride)
                .and_then(|s| s.checked_add(span))
                .ok_or_else(|| self.error("tensor size overflows"))?;
        }
        Ok(span)
    }

    /// The regions of this tensor. The dimension of size `num_blocks` indexes blocks (the
    /// first such, in logical order). The other dimensions, taken by increasing stride, tile
    /// one contiguous run of each block as long as each stride equals the run so far, in any
    /// logical order (NHD and HND, K/V inside the block). Every dimension left over (K/V
    /// planes before the block dimension, the layers of a cross-layer tensor, or a block that
    /// really is scattered) gives one region per index, each holding one run of every block;
    /// regions come in the logical order of those dimensions.
    pub fn regions(&self, num_blocks: u32) -> Result<Vec<Region>, TensorLayoutError> {
        let dims = self.dims()?;
        let Some(block_dim) = dims.iter().position(|d| d.size == num_blocks as usize) else {
            return Err(self.error(format!(
                "no dimension of size num_blocks={num_blocks} in shape {:?}",
                self.shape
            )));
        };
        // The last element's offset: every address computed below lies within this range.
        let span = self.check_no_overlap(&dims)?;
        span.checked_add(1)
            .and_then(|n| n.checked_mul(self.elem_size))
            .and_then(|n| n.checked_add(self.ptr))
            .ok_or_else(|| self.error("the tensor's address range overflows"))?;
        let mut by_stride: Vec<Dim> = dims
            .iter()
            .copied()
            .filter(|d| d.index != block_dim && d.size > 1)
            .collect();
        by_stride.sort_by_key(|d| d.stride);
        let mut run_elems = 1usize;
        let mut in_run = Vec::new();
        for d in by_stride {
            if d.stride != run_elems {
                break;
            }
            run_elems *= d.size; // cannot overflow: check_no_overlap bounded the span
            in_run.push(d.index);
        }
        let bytes = |elems: usize| {
            elems
                .checked_mul(self.elem_size)
                .ok_or_else(|| self.error("size in bytes overflows"))
        };
        let stride = bytes(dims[block_dim].stride)?;
        let segment_len = bytes(run_elems)?;
        let mut bases = vec![self.ptr];
        for d in &dims {
            if d.index == block_dim || d.size == 1 || in_run.contains(&d.index) {
                continue;
            }
            let step = bytes(d.stride)?;
            bases = bases
                .iter()
                .flat_map(|b| (0..d.size).map(move |i| b + i * step))
                .collect();
            if bases.len() > MAX_REGIONS {
                return Err(self.error(format!(
                    "a block falls into more than {MAX_REGIONS} runs: shape {:?}, strides {:?}",
                    self.shape, self.strides
                )));
            }
        }
        Ok(bases
            .into_iter()
            .map(|base| Region {
                base,
                kind: self.kind,
                stride,
                segment_len,
            })
            .collect())
    }
}

impl KvLayout {
    /// One layout for all `tensors`, in the order given: each tensor's regions
    /// ([`TensorView::regions`]); regions that follow each other in memory with the same
    /// stride (the layers of a cross-layer cache, V right after K inside a block) merge into
    /// one, so a cross-layer cache is one contiguous run per block. A tensor registered twice
    /// (layers sharing a KV cache) counts once.
    pub fn from_tensors(
        tensors: &[TensorView],
        num_blocks: u32,
    ) -> Result<KvLayout, TensorLayoutError> {
        let first = tensors.first().ok_or_else(|| TensorLayoutError {
            name: String::new(),
            reason: "no KV cache tensors registered".into(),
        })?;
        let mut regions: Vec<Region> = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            let same =
                |o: &TensorView| o.ptr == t.ptr && o.shape == t.shape && o.strides == t.strides;
            if tensors[..i].iter().any(same) {
                continue;
            }
            for r in t.regions(num_blocks)? {
                match regions.last_mut() {
                    Some(last)
                        if last.kind == r.kind
                            && last.stride == r.stride
                            && last.base + last.segment_len == r.base =>
                    {
                        last.segment_len += r.segment_len;
                    }
                    _ => regions.push(r),
                }
                if regions.len() > MAX_REGIONS {
                    return Err(t.error(format!("more than {MAX_REGIONS} regions")));
                }
            }
        }
        KvLayout::new(regions, num_blocks).map_err(|e| first.error(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::EngineBlockId;

    const BASE: usize = 0x1000_0000;

    fn view(shape: &[i64], strides: &[i64]) -> TensorView {
        TensorView {
            name: "layer0".into(),
            ptr: BASE,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            elem_size: 2,
            kind: MemoryKind::Cpu,
        }
    }

    /// Strides of a dense tensor whose physical order is `order` (outermost first) over
    /// logical `shape`.
    fn strides_for(shape: &[i64], order: &[usize]) -> Vec<i64> {
        let mut strides = vec![0; shape.len()];
        let mut acc = 1;
        for &d in order.iter().rev() {
            strides[d] = acc;
            acc *= shape[d];
        }
        strides
    }

    /// Every element offset of `block`, as byte ranges, in the layout's segment order.
    fn bytes_of(layout: &KvLayout, block: u32) -> Vec<(usize, usize)> {
        layout.segments(EngineBlockId(block)).unwrap().collect()
    }

    #[test]
    fn a_block_first_tensor_in_any_inner_order_is_one_run_per_block() {
        // [blocks, K/V, tokens, heads, head_size] in each physical order of the inner four.
        let shape = [64, 2, 16, 4, 8];
        for order in [
            [0, 1, 2, 3, 4], // NHD, K/V outermost in the block
            [0, 1, 3, 2, 4], // HND
            [0, 2, 1, 3, 4], // K/V inside the token
            [0, 2, 3, 1, 4],
        ] {
            let v = view(&shape, &strides_for(&shape, &order));
            let layout = KvLayout::from_tensors(&[v], 64).unwrap();
            assert_eq!(layout.regions().len(), 1, "order {order:?}");
            assert_eq!(bytes_of(&layout, 3), vec![(BASE + 3 * 1024 * 2, 1024 * 2)]);
        }
    }

    #[test]
    fn the_default_vllm_permutation_that_was_refused_registers() {
        // The case: shape [64, 2, 16, 32] with strides [1024, 32, 64, 1].
        let layout =
            KvLayout::from_tensors(&[view(&[64, 2, 16, 32], &[1024, 32, 64, 1])], 64).unwrap();
        assert_eq!(layout.block_bytes(), 2048);
        assert_eq!(bytes_of(&layout, 1), vec![(BASE + 2048, 2048)]);
    }

    #[test]
    fn kv_first_gives_one_region_per_plane() {
        // [K/V, blocks, tokens, heads, head_size], HND inside the block.
        let shape = [2, 10, 16, 4, 8];
        let v = view(&shape, &strides_for(&shape, &[0, 1, 3, 2, 4]));
        let layout = KvLayout::from_tensors(&[v], 10).unwrap();
        let plane = 10 * 512 * 2;
        assert_eq!(
            bytes_of(&layout, 2),
            vec![(BASE + 2 * 1024, 1024), (BASE + plane + 2 * 1024, 1024)]
        );
    }

    #[test]
    fn layers_of_a_cross_layer_cache_merge_into_one_run() {
        // One buffer [blocks, layers, ...]; each layer a view [blocks, 2, 16, 8] whose block
        // stride spans all layers.
        let layers = 3usize;
        let per_layer = 2 * 16 * 8;
        let tensors: Vec<TensorView> = (0..layers)
            .map(|l| TensorView {
                name: format!("layer{l}"),
                ptr: BASE + l * per_layer * 2,
                shape: vec![20, 2, 16, 8],
                strides: vec![(layers * per_layer) as i64, 128, 8, 1],
                elem_size: 2,
                kind: MemoryKind::Cpu,
            })
            .collect();
        let layout = KvLayout::from_tensors(&tensors, 20).unwrap();
        assert_eq!(layout.regions().len(), 1);
        assert_eq!(
            bytes_of(&layout, 5),
            vec![(BASE + 5 * layers * per_layer * 2, layers * per_layer * 2)]
        );
    }

    #[test]
    fn a_scattered_block_gives_one_region_per_run() {
        // [heads, blocks, tokens, head_size]: each block is one run per head.
        let shape = [4, 10, 16, 8];
        let v = view(&shape, &strides_for(&shape, &[0, 1, 2, 3]));
        let layout = KvLayout::from_tensors(&[v], 10).unwrap();
        assert_eq!(layout.regions().len(), 4);
        let segs = bytes_of(&layout, 1);
        assert_eq!(segs.len(), 4);
        assert_eq!(segs[0], (BASE + 128 * 2, 128 * 2));
        assert_eq!(segs[3], (BASE + 3 * 10 * 128 * 2 + 128 * 2, 128 * 2));
    }

    #[test]
    fn a_tensor_registered_twice_counts_once() {
        let v = view(&[8, 2, 16, 8], &[256, 128, 8, 1]);
        let layout = KvLayout::from_tensors(&[v.clone(), v], 8).unwrap();
        assert_eq!(layout.block_bytes(), 512);
    }

    #[test]
    fn overlapping_or_broken_tensors_are_refused_naming_the_tensor() {
        let cases: [(&[i64], &[i64], &str); 5] = [
            (&[8, 2, 16], &[32, 0, 1], "overlaps"),
            (&[8, 2, 16], &[16, 8, 1], "overlaps"),
            (&[8, 2, 16], &[32, -16, 1], "negative stride"),
            (&[7, 2, 16], &[32, 16, 1], "num_blocks=8"),
            (&[8, 2], &[2], "differ in length"),
        ];
        let huge = view(&[8, 9, 16], &[16, 1 << 60, 1]);
        let e = KvLayout::from_tensors(&[huge], 8).unwrap_err();
        assert!(e.reason.contains("overflows"), "{e}");
        for (shape, strides, want) in cases {
            let e = KvLayout::from_tensors(&[view(shape, strides)], 8).unwrap_err();
            assert_eq!(e.name, "layer0");
            assert!(e.to_string().contains(want), "{shape:?} {strides:?}: {e}");
        }
        let e = KvLayout::from_tensors(&[], 8).unwrap_err();
        assert!(e.reason.contains("no KV cache tensors"), "{e}");
    }
}
