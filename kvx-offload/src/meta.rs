//! What the scheduler half tells the worker half each step, and what comes back.

use kvx_core::{BlockError, BlockKey, EngineBlockId, RequestId};
use kvx_policy::LoadDecision;

use crate::remote::RemoteSource;
use crate::tier::Tier;

/// A transfer job, numbered by the scheduler half.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub u64);

/// One block of a load job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadBlock {
    /// Content key.
    pub key: BlockKey,
    /// Engine block to fill.
    pub engine: EngineBlockId,
    /// Tier to read it from.
    pub tier: Tier,
    /// File blocks only: a host-tier place is reserved; keep the block there after loading.
    pub promote: bool,
}

/// Load a request's leading blocks from the tiers into engine blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadJob {
    /// Job id.
    pub job: JobId,
    /// Request.
    pub request: RequestId,
    /// Blocks in prefix order.
    pub blocks: Vec<LoadBlock>,
}

/// Store engine blocks into the host tier, and write the new ones through to the file tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreJob {
    /// Job id.
    pub job: JobId,
    /// Request.
    pub request: RequestId,
    /// Blocks to copy out of engine memory.
    pub blocks: Vec<(BlockKey, EngineBlockId)>,
    /// Keys (among `blocks`) to write to the file tier.
    pub write_file: Vec<BlockKey>,
    /// Keys (among `write_file`) the host tier had no room for: copied into a staging buffer
    /// for the file write only, never kept in the host tier.
    pub file_only: Vec<BlockKey>,
}

/// Write host-tier blocks into the file tier before the host tier drops them (write-back on a
/// shared mount).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteBackJob {
    /// Job id (its result comes back as a [`JobPart::StoreFile`]).
    pub job: JobId,
    /// Host-tier keys to write.
    pub keys: Vec<BlockKey>,
}

/// Export a finished request's engine blocks to remote readers (producer): the blocks stay the
/// engine's until the lease ends, and the request is reported in `finished_sending` then; a
/// GPU engine's are copied into staging buffers the lease holds instead, and the request is
/// reported once that copy is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportJob {
    /// The engine's request (in `finished` and `delayed_free` of the same step).
    pub request: RequestId,
    /// The export id readers name it by.
    pub export: u64,
    /// Keys and engine blocks, in the order readers name them.
    pub blocks: Vec<(BlockKey, EngineBlockId)>,
}

/// Load blocks of a remote producer's exported request into engine blocks (consumer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteLoadJob {
    /// Job id (its result comes back as a [`JobPart::Load`]).
    pub job: JobId,
    /// The engine's request.
    pub request: RequestId,
    /// Where the blocks are.
    pub source: std::sync::Arc<RemoteSource>,
    /// Index of each block in the source's keys, and the engine block it fills.
    pub blocks: Vec<(u32, EngineBlockId)>,
}

/// The request a write-back's task and [`JobResult`] name: a write-back serves no request
/// (the scheduler half matches every result by its job).
pub const NO_REQUEST: RequestId = RequestId(u64::MAX);

/// Per-step instructions from the scheduler half to the worker half.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepMeta {
    /// Loads to start now.
    pub loads: Vec<LoadJob>,
    /// Stores to queue (submitted at the start of the next step).
    pub stores: Vec<StoreJob>,
    /// Requests preempted this step.
    pub preempted: Vec<RequestId>,
    /// Requests that finished this step.
    pub finished: Vec<RequestId>,
    /// Of those, the ones whose freeing the engine delays (`request_finished` returned true):
    /// exactly these come back once in `finished_sending`.
    pub delayed_free: Vec<RequestId>,
    /// Host-tier blocks to write into the file tier before `evict_host` drops them.
    pub write_back: Vec<WriteBackJob>,
    /// Host-tier blocks to drop.
    pub evict_host: Vec<BlockKey>,
    /// File-tier blocks evicted from the index (removed; on a shared mount only forgotten).
    pub evict_file: Vec<BlockKey>,
    /// File-tier blocks that failed verification: remove their files.
    pub remove_file: Vec<BlockKey>,
    /// After a reset: the only host-tier keys to keep.
    pub retain_host: Option<Vec<BlockKey>>,
    /// Finished requests whose blocks are exported to remote readers.
    pub exports: Vec<ExportJob>,
    /// Loads from remote producers.
    pub remote_loads: Vec<RemoteLoadJob>,
    /// No request is left to start another step: submit the queued stores in this step.
    pub submit_stores_now: bool,
}

/// Which part of a job a [`JobResult`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobPart {
    /// A load into engine memory.
    Load,
    /// The host-tier part of a store.
    StoreHost,
    /// The file-tier part of a store (write-through).
    StoreFile,
}

/// The outcome of one job (or one part of a store job).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobResult {
    /// Job id.
    pub job: JobId,
    /// Request the job served ([`NO_REQUEST`] for a write-back).
    pub request: RequestId,
    /// Which part of the job.
    pub part: JobPart,
    /// Keys that made it.
    pub ok: Vec<BlockKey>,
    /// Keys that did not, and why.
    pub failed: Vec<(BlockKey, BlockError)>,
    /// Loads only: keys read from files now held in host memory (to enter the host tier).
    pub promoted: Vec<BlockKey>,
}

/// What the worker half reports after a step (`get_finished`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerOutput {
    /// Finished requests whose delayed freeing may happen now (each reported once; requests
    /// `request_finished` did not delay are never reported).
    pub finished_sending: Vec<RequestId>,
    /// Requests whose load ended (see `decisions` for those that did not fully load).
    pub finished_recving: Vec<RequestId>,
    /// Engine blocks whose contents are not valid after a load.
    pub invalid_blocks: Vec<EngineBlockId>,
    /// The failure-policy decision for each request whose load was incomplete.
    pub decisions: Vec<(RequestId, LoadDecision)>,
    /// Job outcomes, for the scheduler half.
    pub jobs: Vec<JobResult>,
    /// Engine blocks of loads reported here whose cut-short copy may still write them (the
    /// device did not answer): keep them out of use — do not free, reuse or compute into
    /// them — until they come back in `blocks_released`.
    pub blocks_in_use: Vec<EngineBlockId>,
    /// Blocks of an earlier `blocks_in_use` that no copy can write any more.
    pub blocks_released: Vec<EngineBlockId>,
}

impl WorkerOutput {
    /// True when nothing happened.
    pub fn is_empty(&self) -> bool {
        self.finished_sending.is_empty()
            && self.finished_recving.is_empty()
            && self.invalid_blocks.is_empty()
            && self.decisions.is_empty()
            && self.jobs.is_empty()
            && self.blocks_in_use.is_empty()
            && self.blocks_released.is_empty()
    }

    /// Append another output.
    pub fn merge(&mut self, o: WorkerOutput) {
        self.finished_sending.extend(o.finished_sending);
        self.finished_recving.extend(o.finished_recving);
        self.invalid_blocks.extend(o.invalid_blocks);
        self.decisions.extend(o.decisions);
        self.jobs.extend(o.jobs);
        self.blocks_in_use.extend(o.blocks_in_use);
        self.blocks_released.extend(o.blocks_released);
    }
}
