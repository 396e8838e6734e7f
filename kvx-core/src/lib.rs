//! kvx-core: ids, owned buffers, the sans-IO task/deadline/preemption [`Tracker`], the
//! [`Backend`] trait, a CPU-memory backend and the threaded [`Driver`].
//!
//! A load and a store through the CPU backend, polled to completion:
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvx_core::*;
//!
//! // Engine memory: 4 blocks of 4 KiB in CPU RAM; a pool of kvx-owned staging buffers.
//! let mut arena = CpuArena::contiguous(4096, 4).unwrap();
//! arena.write_block(EngineBlockId(0), &[7u8; 4096]).unwrap();
//! let pool = BufferPool::new(8, 4096, DEFAULT_ALIGN).unwrap();
//!
//! let mut b = DriverBuilder::new(DriverConfig::default());
//! // SAFETY: the arena outlives the driver and is only read after the tasks finished.
//! let host = b.backend(Box::new(unsafe {
//!     CpuBackend::new(arena.layout().clone(), CpuBackendConfig::default()).unwrap()
//! }));
//! let driver = b.spawn().unwrap();
//! let deadline = || Instant::now() + Duration::from_secs(5);
//!
//! // Store engine block 0 into a kvx buffer.
//! let key = BlockKey::chain(None, b"first block");
//! let store = driver.submit(TaskSpec {
//!     request: RequestId(1), dir: Direction::Store, route: vec![host],
//!     blocks: vec![OpBlock { key, engine: Some(EngineBlockId(0)), buf: Buf::Owned(pool.take().unwrap()) }],
//!     deadline: deadline(), deferred: false,
//! }).unwrap();
//! let report = driver.wait_report(store, deadline()).unwrap();
//! assert_eq!(report.state, TaskState::Done);
//! let saved = report.blocks.into_iter().next().unwrap().buf.unwrap();
//!
//! // Load it back into engine block 3.
//! let load = driver.submit(TaskSpec {
//!     request: RequestId(1), dir: Direction::Load, route: vec![host],
//!     blocks: vec![OpBlock { key, engine: Some(EngineBlockId(3)), buf: saved }],
//!     deadline: deadline(), deferred: false,
//! }).unwrap();
//! assert!(driver.wait_report(load, deadline()).unwrap().is_ok());
//! // Finishing never blocks: the request comes back as released once nothing of it is out.
//! driver.finish(RequestId(1)).unwrap();
//! let (mut released, until) = (Vec::new(), Instant::now() + Duration::from_secs(1));
//! while released.is_empty() && Instant::now() < until {
//!     released = driver.get_finished().released;
//! }
//! assert_eq!(released, [RequestId(1)]);
//! drop(driver);
//! assert_eq!(arena.read_block(EngineBlockId(3)).unwrap(), vec![7u8; 4096]);
//! assert!(pool.is_whole());
//! ```
#![warn(missing_docs)]

mod arena;
mod backend;
mod buffer;
mod completions;
mod cpu;
mod driver;
mod error;
mod ids;
mod layout;
pub mod metrics;
mod op;
mod pool_memory;
pub mod sync;
mod task;
mod tensor_layout;
mod tracker;

pub use arena::CpuArena;
pub use backend::{Backend, Notifier, SubmitError, SubmitErrorKind, WaitOutcome};
pub use buffer::{AlignedBuf, Buf, BufferPool, DEFAULT_ALIGN, PoolBuf};
pub use completions::CompletionBoard;
pub use cpu::{CpuBackend, CpuBackendConfig};
#[cfg(feature = "tokio")]
pub use driver::TaskFuture;
pub use driver::{
    Driver, DriverBuilder, DriverConfig, DriverHandle, FenceHandle, FenceWait, Finished, Stopped,
    TICK,
};
pub use error::CoreError;
pub use ids::*;
pub use layout::{KvLayout, MemoryKind, Region};
pub use op::{BlockError, Op, OpBlock, OpCompletion};
pub use sync::{lock, wait_timeout};
pub use task::{BlockReport, FailReason, TaskReport, TaskSpec, TaskState};
pub use tensor_layout::{TensorLayoutError, TensorView};
pub use tracker::{BackendCommand, Event, Fence, Tracker, TrackerConfig, TrackerStats};
