//! kvx-cuda: a kvx-core [`Backend`](kvx_core::Backend) that copies KV blocks between engine
//! memory on a CUDA device and page-locked host buffers, each op's copies spread over up to
//! `copy_streams` streams of its direction and tracked by one CUDA event per stream.
//!
//! Store engine block 3 into a pinned buffer and load it back into block 5 (needs a GPU; on a
//! machine without CUDA, `CudaDevice::open` returns [`CudaError::NoCuda`] instead of panicking):
//!
//! ```no_run
//! use std::time::{Duration, Instant};
//! use kvx_core::*;
//! use kvx_cuda::{CudaBackend, CudaBackendConfig, CudaDevice};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let device = CudaDevice::open(0)?;
//! let block = 2 << 20;
//! let engine = device.alloc(64 * block)?; // stands in for the engine's KV cache
//! let layout = KvLayout::contiguous(engine.ptr() as usize, MemoryKind::Cuda(0), block, 64)?;
//! // SAFETY: `engine` outlives the driver; no block is touched while a task on it runs.
//! let mut gpu = unsafe { CudaBackend::new(&device, layout, CudaBackendConfig::default())? };
//! let pool = gpu.pinned_pool(8, block)?; // the op buffers must be pinned
//!
//! let mut b = DriverBuilder::new(DriverConfig::default());
//! let gpu = b.backend(Box::new(gpu));
//! let driver = b.spawn()?;
//! let soon = || Instant::now() + Duration::from_secs(2);
//! let key = BlockKey::chain(None, b"tokens");
//! let store = driver.submit(TaskSpec {
//!     request: RequestId(1), dir: Direction::Store, route: vec![gpu],
//!     blocks: vec![OpBlock { key, engine: Some(EngineBlockId(3)), buf: Buf::Owned(pool.take().unwrap()) }],
//!     deadline: soon(), deferred: false,
//! })?;
//! let report = driver.wait_report(store, soon()).expect("store report");
//! let buf = report.blocks.into_iter().next().unwrap().buf.unwrap();
//! let load = driver.submit(TaskSpec {
//!     request: RequestId(1), dir: Direction::Load, route: vec![gpu],
//!     blocks: vec![OpBlock { key, engine: Some(EngineBlockId(5)), buf }],
//!     deadline: soon(), deferred: false,
//! })?;
//! assert!(driver.wait_report(load, soon()).expect("load report").is_ok());
//! # Ok(()) }
//! ```
//!
//! # How it works
//!
//! - **Loading CUDA.** cudarc with `dynamic-loading`: the crate builds without CUDA, and
//!   [`CudaDevice::open`] checks that `libcuda` loads and has every symbol used before the first
//!   driver call (cudarc panics otherwise), returning [`CudaError::NoCuda`] /
//!   [`CudaError::MissingSymbol`] / [`CudaError::NoDevice`].
//! - **CUDA version feature: `cuda-12080`.** It is the oldest of cudarc's bindings that declare
//!   `cuMemcpyBatchAsync` (CUDA 12.8, r570 drivers), which turns the runs of an op into one
//!   call. Everything else called here exists since CUDA 11 or earlier, and symbols are resolved
//!   at run time, so older drivers work too: batching is used only when the driver reports
//!   ≥ 12080 **and** `cuGetProcAddress` hands out the 12.8 entry point (asked for by version,
//!   so a CUDA 13 driver gives the signature this crate calls, and a missing symbol is a `None`,
//!   not cudarc's panic); otherwise each run is one `cuMemcpy*Async` call. A batch call that
//!   fails is redone run by run and batching is switched off.
//! - **Pinned memory.** [`PinnedPool`] is a kvx-core `BufferPool` whose buffers are registered
//!   with `cuMemHostRegister`, so the op's own buffers are what the DMA reads or writes; see
//!   `pinned.rs` for the ownership rule. Ops with buffers outside accepted pools fail per block.
//!   A pool is pinned in chunks ([`DEFAULT_PIN_CHUNK`], 1 GiB, or
//!   [`CudaBackendConfig::pin_chunk_bytes`]); a refused chunk is [`CudaError::PinFailed`],
//!   naming the chunk size, and nothing stays pinned.
//! - **Scatter/gather.** `plan.rs` sorts an op's segments by device address and merges runs that
//!   are contiguous on both sides; the rest go in one batched call.
//! - **Completion.** Each direction has `copy_streams` non-blocking streams (default 8): an op
//!   of many runs is cut into parts of at least 32 runs, one per stream, since a copy engine
//!   pays a fixed cost per copy and streams run side by side. An event (no timing) is recorded
//!   after each part; a completer thread per direction waits for the ops' events in order
//!   (polling each every [`CudaBackendConfig::completion_poll`], 20 µs by default, or sleeping
//!   in `cuEventSynchronize`), completes the ops and calls the driver's Notifier. `poll` never
//!   blocks; `wait` sleeps on a condition variable until the named ops' events completed (the
//!   preemption flush).
//! - **Deadlines.** Kept by kvx-core's tracker: a task whose copy never returns (a wedged
//!   stream) still gets its verdict at its deadline. A queued copy cannot be withdrawn, so
//!   `cancel` only marks the op abandoned (counted in [`CudaStats::abandoned_ops`]); the op keeps
//!   its buffers (a zombie, quarantined, [`CudaStats::zombies`]) until its event completed, a
//!   preemption fence still waits for it, and only then does the backend give the buffers back.
//!
//! # Ordering against the engine's writes
//!
//! The backend's streams are its own: by themselves, nothing orders a store's device→host
//! copy after the engine's kernels that wrote the block, or a load's host→device copy after
//! the kernels that still use the block. kvx-offload queues a store when the engine saves
//! blocks and submits it at the start of the *next* step, and reports a load finished only
//! after its event completed. That step boundary is a CPU one: it orders the copies on the
//! device only when the engine synchronised its stream before the next step.
//!
//! An engine whose CPU runs ahead of its GPU (vLLM's asynchronous scheduling) orders them
//! with an [`EngineOrder`] ([`CudaBackend::engine_order`]): at the start of each step, before
//! anything of that step may submit a copy, [`EngineOrder::order_after`] with the engine's
//! current stream records an event there and makes every copy stream of the backend wait for
//! it on the device (one `cuEventRecord` and `2 × copy_streams` `cuStreamWaitEvent`s; the CPU
//! waits for nothing). The engine still reads loaded blocks only once the load is reported.
//!
//! # Trying it without a GPU
//!
//! `kvx-cuda-standin` is a CPU stand-in for the driver library (test-only):
//! `scripts/cuda-standin.sh cargo test -p kvx-cuda --test gpu` runs the GPU tests on it, with
//! asynchronous streams, range-checked copies and fault knobs.
//!
//! # As a tier
//!
//! A GPU tier is this backend on a route: a store to host is `[cuda]` with pinned buffers from
//! [`PinnedPool`]; a load from a file is `[posix, cuda]` when the file backend fills buffers of
//! a pool the CUDA backend accepted ([`CudaBackend::accept_pool`]).
#![warn(missing_docs)]

mod backend;
#[cfg(feature = "bench")]
pub mod bench;
mod config;
mod device;
mod driver;
mod error;
mod order;
mod pinned;
mod plan;
mod stream;

pub use backend::{CudaBackend, CudaStats, CudaStatsHandle};
pub use config::{BatchMode, CudaBackendConfig, DEFAULT_COMPLETION_POLL};
pub use device::{CudaDevice, DeviceMem};
pub use driver::cuda_available;
pub use error::CudaError;
pub use order::EngineOrder;
pub use pinned::{DEFAULT_PIN_CHUNK, PAGE_SIZE, PinnedPool};
