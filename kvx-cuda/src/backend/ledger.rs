//! The backend's ledger, shared with its completer threads: the ops between submit and
//! completion, the CUDA events kept for reuse, and the counters behind [`CudaStats`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvx_core::{CompletionBoard, OpCompletion, OpId};

use crate::plan;
use crate::stream::{self, Event};

/// Counters of one backend (monotonic, except `in_flight`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CudaStats {
    /// Ops accepted.
    pub ops: u64,
    /// Blocks in accepted ops.
    pub blocks: u64,
    /// Blocks refused as invalid (no engine block, unpinned or short buffer, duplicate).
    pub invalid_blocks: u64,
    /// Bytes queued for copying.
    pub bytes: u64,
    /// Copy runs after coalescing.
    pub runs: u64,
    /// Driver copy calls (a batch counts one).
    pub api_calls: u64,
    /// Batched copy calls.
    pub batch_calls: u64,
    /// Batched calls that failed and were redone run by run.
    pub batch_fallbacks: u64,
    /// Ops completed (handed to `poll`).
    pub completed_ops: u64,
    /// Ops whose copies failed in the driver.
    pub failed_ops: u64,
    /// Ops accepted and not yet completed.
    pub in_flight: usize,
    /// Ops the driver cancelled (their task ended first); each still completes later.
    pub abandoned_ops: u64,
    /// Abandoned ops whose copies finished afterwards (their buffers went back then).
    pub late_completions: u64,
    /// Abandoned ops still holding their buffers (zombies): `abandoned_ops - late_completions`.
    pub zombies: u64,
    /// The last error of a batched copy call (after which batching was switched off).
    pub last_batch_error: Option<String>,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) ops: AtomicU64,
    pub(super) blocks: AtomicU64,
    pub(super) invalid_blocks: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) runs: AtomicU64,
    pub(super) api_calls: AtomicU64,
    pub(super) batch_calls: AtomicU64,
    pub(super) batch_fallbacks: AtomicU64,
    pub(super) completed_ops: AtomicU64,
    pub(super) failed_ops: AtomicU64,
    pub(super) abandoned_ops: AtomicU64,
    pub(super) late_completions: AtomicU64,
    pub(super) last_batch_error: Mutex<Option<String>>,
}

impl Counters {
    /// Count the runs of one part of an op queued with `calls`.
    pub(super) fn count(&self, runs: &[plan::Run], calls: &stream::Calls) {
        self.runs.fetch_add(runs.len() as u64, Ordering::Relaxed);
        let bytes = runs.iter().map(|r| r.len as u64).sum::<u64>();
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.api_calls.fetch_add(calls.api_calls, Ordering::Relaxed);
        self.batch_calls
            .fetch_add(calls.batch_calls, Ordering::Relaxed);
        self.batch_fallbacks
            .fetch_add(calls.batch_fallbacks, Ordering::Relaxed);
        if let Some(e) = &calls.batch_error {
            *kvx_core::lock(&self.last_batch_error) = Some(e.to_string());
        }
    }
}

/// What the backend knows of an op between submit and completion.
#[derive(Debug, Default)]
pub(crate) struct OpState {
    /// When the driver cancelled it (its task ended first).
    pub(super) abandoned_at: Option<Instant>,
}

/// The backend's ledger, shared with its completer threads: its ops (pending and finished, on
/// the completion board), the CUDA events kept for reuse, and its counters.
pub(crate) struct Ledger {
    pub(super) board: CompletionBoard<OpState>,
    pub(super) events: Mutex<Vec<Event>>,
    pub(super) stats: Counters,
}

impl Ledger {
    pub(super) fn new() -> Ledger {
        Ledger {
            board: CompletionBoard::default(),
            events: Mutex::new(Vec::new()),
            stats: Counters::default(),
        }
    }

    /// Queue a completion, wake waiters and the driver.
    pub(crate) fn complete(&self, c: OpCompletion) {
        let op = c.op.id;
        // Counted before it is posted: whoever sees the completion sees it counted. An
        // abandoned op's completion is counted late only once posted, so `zombies` never
        // drops before the buffers are on their way back.
        self.stats.completed_ops.fetch_add(1, Ordering::Relaxed);
        let state = self.board.complete(c);
        if let Some(at) = state.and_then(|s| s.abandoned_at) {
            self.stats.late_completions.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%op, late = ?at.elapsed(), "kvx-cuda: abandoned op completed; its buffers go back now");
        }
    }

    /// The driver gave up on `op`: mark it abandoned (once). Its copies still run to the end
    /// and it keeps its buffers until then.
    pub(crate) fn abandon(&self, op: OpId) {
        let now = Instant::now();
        let first = self
            .board
            .with_pending(op, |s| s.abandoned_at.replace(now).is_none())
            .unwrap_or(false);
        if first {
            self.stats.abandoned_ops.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%op, "kvx-cuda: op abandoned; a queued CUDA copy cannot be withdrawn, its buffers stay held until its event completes");
        }
    }

    /// Return a completed event to the pool.
    pub(crate) fn put_event(&self, ev: Event) {
        kvx_core::lock(&self.events).push(ev);
    }

    pub(super) fn snapshot(&self) -> CudaStats {
        let c = &self.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CudaStats {
            ops: get(&c.ops),
            blocks: get(&c.blocks),
            invalid_blocks: get(&c.invalid_blocks),
            bytes: get(&c.bytes),
            runs: get(&c.runs),
            api_calls: get(&c.api_calls),
            batch_calls: get(&c.batch_calls),
            batch_fallbacks: get(&c.batch_fallbacks),
            completed_ops: get(&c.completed_ops),
            failed_ops: get(&c.failed_ops),
            in_flight: self.board.pending_len(),
            abandoned_ops: get(&c.abandoned_ops),
            late_completions: get(&c.late_completions),
            zombies: get(&c.abandoned_ops).saturating_sub(get(&c.late_completions)),
            last_batch_error: kvx_core::lock(&c.last_batch_error).clone(),
        }
    }
}

/// Reads a backend's counters after the backend moved into a driver.
#[derive(Clone)]
pub struct CudaStatsHandle {
    pub(super) ledger: Arc<Ledger>,
}

impl CudaStatsHandle {
    /// The counters now.
    pub fn snapshot(&self) -> CudaStats {
        self.ledger.snapshot()
    }
}

impl std::fmt::Debug for CudaStatsHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.snapshot().fmt(f)
    }
}
