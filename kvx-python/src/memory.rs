//! Engine memory from tensors: a description of each KV cache tensor (data pointer, shape,
//! strides, element size, device) becomes one kvx-core [`KvLayout`], and the host backend over
//! it. The only unsafe code of the crate is here.

use kvx_core::{KvLayout, MemoryKind, Region};
use kvx_offload::EngineMemory;

/// Most regions one engine may register (layers × K/V planes).
const MAX_REGIONS: usize = 1 << 16;

/// One KV cache tensor as the engine registered it.
#[derive(Debug, Clone)]
pub struct TensorDesc {
    /// The engine's name for it (a layer name).
    pub name: String,
    /// Address of element 0.
    pub ptr: usize,
    /// Sizes of the dimensions.
    pub shape: Vec<i64>,
    /// Strides of the dimensions, in elements.
    pub strides: Vec<i64>,
    /// Bytes of one element.
    pub elem_size: usize,
    /// `cpu`, `cuda`, `cuda:1`, ...
    pub device: String,
}

/// Why tensors cannot be described as one kvx layout.
#[derive(Debug, thiserror::Error)]
#[error("KV cache tensor {name:?}: {reason}")]
pub struct LayoutError {
    /// The tensor.
    pub name: String,
    /// What is wrong with it.
    pub reason: String,
}

fn err(t: &TensorDesc, reason: impl Into<String>) -> LayoutError {
    LayoutError {
        name: t.name.clone(),
        reason: reason.into(),
    }
}

fn to_usize(t: &TensorDesc, v: i64, what: &str) -> Result<usize, LayoutError> {
    usize::try_from(v).map_err(|_| err(t, format!("negative {what} {v}")))
}

/// The regions of one tensor: the dimension of size `num_blocks` indexes blocks, the
/// dimensions after it must form one contiguous segment, the dimensions before it (K/V,
/// layers of a cross-layer tensor) each give one region.
fn regions_of(t: &TensorDesc, num_blocks: u32) -> Result<Vec<Region>, LayoutError> {
    match t.device.as_str() {
        "cpu" => {}
        d if d.starts_with("cuda") => {
            return Err(err(
                t,
                "CUDA tensors need the kvx-cuda backend: not wired in this build",
            ));
        }
        d => return Err(err(t, format!("unsupported device {d:?} (only cpu)"))),
    }
    if t.shape.len() != t.strides.len() {
        return Err(err(t, "shape and strides differ in length"));
    }
    if t.elem_size == 0 || t.ptr == 0 {
        return Err(err(t, "no storage (null pointer or zero element size)"));
    }
    let Some(bdim) = t.shape.iter().position(|s| *s == i64::from(num_blocks)) else {
        return Err(err(
            t,
            format!(
                "no dimension of size num_blocks={num_blocks} in shape {:?}",
                t.shape
            ),
        ));
    };
    let mut seg_elems = 1usize;
    for d in (bdim + 1..t.shape.len()).rev() {
        let size = to_usize(t, t.shape[d], "size")?;
        if size != 1 && to_usize(t, t.strides[d], "stride")? != seg_elems {
            return Err(err(
                t,
                format!(
                    "the dimensions after the block dimension ({bdim}) are not contiguous: \
                     shape {:?}, strides {:?}",
                    t.shape, t.strides
                ),
            ));
        }
        seg_elems = seg_elems
            .checked_mul(size)
            .ok_or_else(|| err(t, "segment size overflows"))?;
    }
    let stride = to_usize(t, t.strides[bdim], "stride")?
        .checked_mul(t.elem_size)
        .ok_or_else(|| err(t, "block stride overflows"))?;
    let segment_len = seg_elems * t.elem_size;
    let mut bases = vec![t.ptr];
    for d in 0..bdim {
        let size = to_usize(t, t.shape[d], "size")?;
        let step = to_usize(t, t.strides[d], "stride")? * t.elem_size;
        bases = bases
            .iter()
            .flat_map(|b| (0..size).map(move |i| b + i * step))
            .collect();
        if bases.len() > MAX_REGIONS {
            return Err(err(t, format!("more than {MAX_REGIONS} regions")));
        }
    }
    Ok(bases
        .into_iter()
        .map(|base| Region {
            base,
            kind: MemoryKind::Host,
            stride,
            segment_len,
        })
        .collect())
}

/// One layout for all `tensors` (in the order given): per-layer tensors give strided regions;
/// regions that follow each other in memory (a cross-layer tensor, K right after V) merge into
/// one, so a cross-layer pool is a single contiguous run per block. A tensor registered twice
/// (layers sharing a KV cache) counts once.
pub fn describe(tensors: &[TensorDesc], num_blocks: u32) -> Result<KvLayout, LayoutError> {
    let first = tensors.first().ok_or_else(|| LayoutError {
        name: String::new(),
        reason: "no KV cache tensors registered".into(),
    })?;
    let mut regions: Vec<Region> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let same = |o: &TensorDesc| o.ptr == t.ptr && o.shape == t.shape && o.strides == t.strides;
        if tensors[..i].iter().any(same) {
            continue;
        }
        for r in regions_of(t, num_blocks)? {
            match regions.last_mut() {
                Some(last) if last.stride == r.stride && last.base + last.segment_len == r.base => {
                    last.segment_len += r.segment_len;
                }
                _ => regions.push(r),
            }
            if regions.len() > MAX_REGIONS {
                return Err(err(t, format!("more than {MAX_REGIONS} regions")));
            }
        }
    }
    KvLayout::new(regions, num_blocks).map_err(|e| err(first, e.to_string()))
}

/// The engine memory kvx-offload's builder copies blocks in and out of (host backend).
///
/// # Safety
/// `layout` must come from [`describe`] over tensors whose storage the caller keeps alive (and
/// never reallocates) until the runtime built over it has shut down.
pub unsafe fn engine_memory(layout: KvLayout) -> EngineMemory {
    // SAFETY: ownership rule: the engine (vLLM) keeps its KV cache tensors alive for the whole
    // life of the connector, and `WorkerSide` additionally holds a reference to every tensor
    // object it described until after its runtime (whose driver owns the host backend and joins
    // its copy threads) has been dropped. kvx touches a block only inside a task the engine
    // asked for, and the engine reuses a block only after the task's report, a preemption fence
    // or `finished_sending`, per kvx-offload's contract.
    unsafe { EngineMemory::host(layout) }
}
