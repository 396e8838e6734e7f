//! kvx-offload: the tiered offload manager and the engine connector.
//!
//! The connector mirrors an engine step in two halves (the shape of vLLM's KV connector v1):
//! the [`SchedulerSide`] decides what to load and store and keeps the tier index
//! ([`OffloadManager`]); the [`WorkerSide`] turns its [`StepMeta`] into kvx-core tasks and
//! reports a [`WorkerOutput`] back. Tiers compose through the kvx-core `Backend` trait only:
//! engine memory → host tier (kvx-owned buffers) → file tier (written through; on a shared mount
//! optionally written back as blocks leave the host tier).
//!
//! [`OffloadBuilder`] sets all of it up from an [`OffloadConfig`] (code, TOML or JSON):
//!
//! ```
//! use std::time::Duration;
//! use kvx_core::{BlockKey, EngineBlockId, CpuArena, RequestId};
//! use kvx_offload::{EngineMemory, FileTierConfig, Offload, OffloadBuilder, OffloadConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let kv_dir = dir.path();
//! let mut arena = CpuArena::contiguous(4096, 8)?; // stands in for the engine's KV cache
//! let cfg = OffloadConfig {
//!     host_blocks: 4,
//!     file: Some(FileTierConfig::new(kv_dir, 1024)), // or OffloadConfig::from_toml(text)?
//!     ..OffloadConfig::default()
//! };
//! // SAFETY: the arena outlives the runtime, and the engine touches a block only when no load
//! // or store on it is outstanding.
//! let memory = unsafe { EngineMemory::cpu(arena.layout().clone()) };
//! let Offload { scheduler: mut sched, mut worker, runtime } =
//!     OffloadBuilder::new(cfg, memory).build()?;
//!
//! // Request 1 computed engine block 0 and saves it; the store runs at the next step.
//! arena.write_block(EngineBlockId(0), &[42; 4096])?;
//! let key = BlockKey::chain(None, b"prompt tokens");
//! sched.save_blocks(RequestId(1), &[(key, EngineBlockId(0))]);
//! sched.request_finished(RequestId(1));
//! // Nothing was preempted, so no preemption fence is outstanding.
//! assert!(worker.start_step(sched.build_meta())?.fence().is_none());
//! let out = worker.drain(Duration::from_secs(5))?;
//! sched.update_from_worker(&out);
//!
//! // Request 2 has the same prefix: 16 tokens can be loaded into its engine block 5.
//! assert_eq!(sched.get_num_new_matched_tokens(RequestId(2), &[key], 0), Some(16));
//! sched.update_state_after_alloc(RequestId(2), &[EngineBlockId(5)])?;
//! assert!(worker.start_step(sched.build_meta())?.fence().is_none());
//! let out = worker.drain(Duration::from_secs(5))?;
//! assert_eq!(out.finished_recving, vec![RequestId(2)]);
//! assert!(out.invalid_blocks.is_empty());
//! runtime.shutdown();
//! assert_eq!(arena.read_block(EngineBlockId(5))?, vec![42; 4096]);
//! # Ok(()) }
//! ```
//!
//! # How long each call takes
//!
//! The [`SchedulerSide`] is bookkeeping only: no lock, no I/O, no driver; each call costs
//! time linear in the blocks and jobs it names.
//!
//! No [`WorkerSide`] call waits for a backend or for the driver thread beyond the time the
//! caller gives it. Each queues commands on the driver or reads what the driver published,
//! under the driver's short locks (microseconds, see `kvx_core::driver`), plus work linear in
//! the jobs it names:
//!
//! - [`WorkerSide::start_step`]: that, plus at most [`WorkerConfig::preempt_wait`] (default
//!   1 ms) when its metadata preempts requests; a fence that does not hold by then is handed
//!   back in [`StepStarted::FenceOutstanding`] to poll;
//! - [`WorkerSide::get_finished`] and [`WorkerSide::reset`]: no waiting at all (`reset` hands
//!   back a fence);
//! - [`WorkerSide::handle_preemptions`]: at most its `budget`; [`WorkerSide::drain`]: at most
//!   its `timeout`.
//!
//! So a step costs around a millisecond when nothing is stuck, and the same when a backend
//! hangs or never completes: a task ends at its deadline plus one [`kvx_core::TICK`], a load's
//! verdict follows within a few milliseconds, and a copy that may still write engine blocks is
//! fenced and its blocks listed in [`WorkerOutput::blocks_in_use`], never waited for. If the
//! driver stops (a backend panicked), every worker call returns
//! [`kvx_core::CoreError::DriverStopped`] with the panic message at once, and
//! [`WorkerSide::stopped`] names the engine blocks an op may still touch.
#![warn(missing_docs)]

mod builder;
mod config;
mod error;
mod eviction;
mod file_hook;
mod hold_back;
mod manager;
mod meta;
mod page_store;
mod remote;
mod scheduler;
mod store_skips;
mod tier;
mod transfer_stats;
mod worker;

pub use builder::{
    EngineMemory, Offload, OffloadBuilder, OffloadRuntime, scheduler_side, scheduler_side_sharded,
};
pub use config::{FileTierConfig, OffloadConfig};
pub use error::OffloadError;
pub use eviction::EvictionKind;
pub use file_hook::{FileTierHook, FileTierProbe};
pub use hold_back::{LoadHoldBack, ReleasedLoads};
pub use kvx_posix::{IoEngine, Listing, ProbeAnswer, Shard, SharedMount};
pub use manager::{Lookup, OffloadManager, StoreDecision, WriteBack};
pub use meta::{
    ExportJob, JobId, JobPart, JobResult, LoadBlock, LoadJob, NO_REQUEST, RemoteLoadJob, StepMeta,
    StoreJob, WorkerOutput, WriteBackJob,
};
pub use page_store::PageStore;
pub use remote::{
    MAX_REMOTE_BLOCKS, REMOTE_TASK_BLOCKS, REMOTE_TASKS, RemoteSource, RemoteTierConfig,
    remote_task_blocks,
};
pub use scheduler::{SchedulerConfig, SchedulerSide};
pub use store_skips::StoreSkips;
pub use tier::Tier;
pub use transfer_stats::TransferStats;
pub use worker::{
    DEFAULT_PREEMPT_WAIT, PreemptionFence, StepStarted, TierRoutes, WorkerConfig, WorkerReset,
    WorkerSide,
};
