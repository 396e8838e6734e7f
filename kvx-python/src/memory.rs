//! Engine memory from tensors: a description of each KV cache tensor (data pointer, shape,
//! strides, element size, device) becomes one kvx-core [`KvLayout`], and the host backend over
//! it. The only unsafe code of the crate is here.

use kvx_core::{KvLayout, MemoryKind, TensorLayoutError, TensorView};
use kvx_offload::EngineMemory;

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

/// Why tensors cannot be described as one kvx layout (names the tensor).
pub type LayoutError = TensorLayoutError;

impl TensorDesc {
    /// The tensor as kvx-core describes it; only host memory is wired in this build.
    fn view(&self) -> Result<TensorView, LayoutError> {
        let reason = match self.device.as_str() {
            "cpu" => None,
            d if d.starts_with("cuda") => {
                Some("CUDA tensors need the kvx-cuda backend: not wired in this build".into())
            }
            d => Some(format!("unsupported device {d:?} (only cpu)")),
        };
        if let Some(reason) = reason {
            return Err(LayoutError {
                name: self.name.clone(),
                reason,
            });
        }
        Ok(TensorView {
            name: self.name.clone(),
            ptr: self.ptr,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            elem_size: self.elem_size,
            kind: MemoryKind::Host,
        })
    }
}

/// One layout for all `tensors` (in the order given), from where each block's bytes are
/// ([`KvLayout::from_tensors`]): any order of the dimensions inside a block, K/V-first or
/// block-first, per-layer or cross-layer.
pub fn describe(tensors: &[TensorDesc], num_blocks: u32) -> Result<KvLayout, LayoutError> {
    let views = tensors
        .iter()
        .map(TensorDesc::view)
        .collect::<Result<Vec<_>, _>>()?;
    KvLayout::from_tensors(&views, num_blocks)
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
