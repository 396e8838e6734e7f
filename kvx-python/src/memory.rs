//! Engine memory from tensors: a description of each KV cache tensor (data pointer, shape,
//! strides, element size, device) becomes one kvx-core [`KvLayout`], and the engine memory over
//! it: host memory for `cpu` tensors, kvx-cuda for `cuda:N` tensors (all on one device), and
//! the ordering of its copies after the engine's CUDA stream. The only unsafe code of the crate
//! is here.

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
    /// The tensor as kvx-core describes it: `cpu` is host memory, `cuda:N` (PyTorch's name;
    /// `cuda` alone is device 0) memory of CUDA device N.
    fn view(&self) -> Result<TensorView, LayoutError> {
        let kind = memory_kind(&self.device).map_err(|reason| LayoutError {
            name: self.name.clone(),
            reason,
        })?;
        Ok(TensorView {
            name: self.name.clone(),
            ptr: self.ptr,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            elem_size: self.elem_size,
            kind,
        })
    }
}

/// The memory a PyTorch device name stands for.
fn memory_kind(device: &str) -> Result<MemoryKind, String> {
    match device.split_once(':') {
        None if device == "cpu" => Ok(MemoryKind::Cpu),
        None if device == "cuda" => Ok(MemoryKind::Cuda(0)),
        Some(("cuda", n)) => n
            .parse()
            .map(MemoryKind::Cuda)
            .map_err(|_| format!("unsupported device {device:?} (cpu or cuda:N)")),
        _ => Err(format!("unsupported device {device:?} (cpu or cuda:N)")),
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

/// The engine memory kvx-offload's builder copies blocks in and out of: the CPU backend over
/// host tensors, kvx-cuda over tensors of one CUDA device (its driver is loaded here; without
/// one the error says so).
///
/// # Safety
/// `layout` must come from [`describe`] over tensors whose storage the caller keeps alive (and
/// never reallocates) until the runtime built over it has shut down.
pub unsafe fn engine_memory(layout: KvLayout) -> Result<EngineMemory, String> {
    let devices: Vec<MemoryKind> = layout.regions().iter().map(|r| r.kind).collect();
    let ordinal = match devices.first() {
        Some(MemoryKind::Cuda(n)) => *n,
        _ if layout.is_cpu() => {
            // SAFETY: ownership rule: the engine (vLLM) keeps its KV cache tensors alive for
            // the whole life of the connector, and `WorkerSide` additionally holds a reference
            // to every tensor object it described until after its runtime (whose driver owns the
            // backend and joins its threads) has been dropped. kvx touches a block only inside a
            // task the engine asked for, and the engine reuses a block only after the task's
            // report, a preemption fence or `finished_sending`, per kvx-offload's contract.
            return Ok(unsafe { EngineMemory::cpu(layout) });
        }
        _ => return Err("KV cache tensors on host memory and a GPU at once".into()),
    };
    if devices.iter().any(|k| *k != MemoryKind::Cuda(ordinal)) {
        return Err(format!(
            "KV cache tensors on more than one device ({devices:?}): one worker serves one GPU"
        ));
    }
    let device = kvx_cuda::CudaDevice::open(ordinal)
        .map_err(|e| format!("CUDA KV cache on device {ordinal}: {e}"))?;
    // SAFETY: as for the host case above: the tensors are device memory of `device` (vLLM
    // allocated them there), alive until the runtime is dropped, and touched by kvx only inside
    // tasks the engine asked for. Copies are ordered after the engine's kernels on the device:
    // kvx.vllm calls `order_after_engine_stream` with torch's current stream before each step's
    // first call that may submit a copy (also under vLLM's asynchronous scheduling, where the
    // CPU runs a step ahead of the GPU), and synchronizes that stream if the call fails.
    Ok(unsafe { EngineMemory::cuda(&device, layout) })
}

/// Make every copy of engine memory that `worker` submits from now on come, on the device,
/// after the work the engine queued so far on its CUDA `stream` (a no-op for host memory; see
/// `kvx_offload::WorkerSide::order_after_engine_stream`). Never waits for the device.
///
/// # Safety
/// `stream` is a live CUDA stream handle of the engine memory's device (or 0, 1, 2: the
/// legacy, legacy and per-thread default streams), such as PyTorch's
/// `torch.cuda.current_stream(device).cuda_stream`.
pub unsafe fn order_after_engine_stream(
    worker: &kvx_offload::WorkerSide,
    stream: usize,
) -> Result<(), String> {
    // SAFETY: the handle is the caller's promise (kvx.vllm passes torch's current stream of
    // the KV cache's device, which torch keeps alive).
    unsafe { worker.order_after_engine_stream(stream) }.map_err(|e| e.to_string())
}
