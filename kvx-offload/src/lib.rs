//! kvx-offload: the tiered offload manager and the engine connector.
//!
//! The connector mirrors an engine step in two halves (the shape of vLLM's KV connector v1):
//! the [`SchedulerSide`] decides what to load and store and keeps the tier index
//! ([`OffloadManager`]); the [`WorkerSide`] turns its [`StepMeta`] into kvx-core tasks and
//! reports a [`WorkerOutput`] back. Tiers compose through the kvx-core `Backend` trait only:
//! engine memory → host tier (kvx-owned buffers) → file tier (written through).
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvx_core::*;
//! use kvx_offload::*;
//!
//! let mut arena = HostArena::contiguous(4096, 8).unwrap();
//! arena.write_block(EngineBlockId(0), &[42; 4096]).unwrap();
//! let mut b = DriverBuilder::new(DriverConfig::default());
//! // SAFETY: the arena outlives the driver; blocks are read only after fences/finished loads.
//! let engine = b.backend(Box::new(unsafe {
//!     HostBackend::new(arena.layout().clone(), HostBackendConfig::default()).unwrap()
//! }));
//! let driver = b.spawn().unwrap();
//! let mut sched = SchedulerSide::new(SchedulerConfig {
//!     block_tokens: 16, host_blocks: 4, file_blocks: None, eviction: EvictionKind::Lru,
//! }).unwrap();
//! let mut worker = WorkerSide::new(
//!     driver.handle(),
//!     TierRoutes { engine, file: None },
//!     BufferPool::new(8, 4096, DEFAULT_ALIGN).unwrap(),
//!     None,
//!     WorkerConfig { block_tokens: 16, timeouts: Default::default(), policy: Default::default() },
//! );
//! let key = BlockKey::chain(None, b"prompt tokens");
//!
//! // Step 1: request 1 computed block 0; save it. Step 2 submits the queued store.
//! sched.save_blocks(RequestId(1), &[(key, EngineBlockId(0))]);
//! worker.start_step(sched.build_meta()).unwrap();
//! worker.start_step(sched.build_meta()).unwrap();
//! let out = worker.drain(Duration::from_secs(5));
//! sched.update_from_worker(&out);
//!
//! // Request 2 has the same prefix: 16 tokens can be loaded into its engine block 5.
//! assert_eq!(sched.get_num_new_matched_tokens(RequestId(2), &[key], 0), Some(16));
//! sched.update_state_after_alloc(RequestId(2), &[EngineBlockId(5)]).unwrap();
//! worker.start_step(sched.build_meta()).unwrap();
//! let out = worker.drain(Duration::from_secs(5));
//! assert_eq!(out.finished_recving, vec![RequestId(2)]);
//! assert!(out.invalid_blocks.is_empty());
//! drop(worker);
//! drop(driver);
//! assert_eq!(arena.read_block(EngineBlockId(5)).unwrap(), vec![42; 4096]);
//! ```
#![warn(missing_docs)]

pub mod error;
pub mod eviction;
pub mod manager;
pub mod meta;
pub mod scheduler;
pub mod tier;
pub mod worker;

pub use error::OffloadError;
pub use eviction::{ArcOrder, EvictionKind, EvictionOrder, LruOrder};
pub use manager::{Lookup, OffloadManager, StoreDecision};
pub use meta::{JobId, JobKind, JobResult, LoadBlock, LoadJob, StepMeta, StoreJob, WorkerOutput};
pub use scheduler::{SchedulerConfig, SchedulerSide};
pub use tier::{StorePlan, Tier, TierIndex};
pub use worker::{FileTierHook, TierRoutes, WorkerConfig, WorkerSide};
