//! Metrics through the `metrics` facade: every name kvx records, and the recording written once.
//!
//! Nothing is recorded anywhere until the application installs a recorder (for example the
//! Prometheus exporter of the `kvx` facade, feature `prometheus`); without one each call is a
//! few loads and a branch.
//!
//! Labels: `dir` is `load` or `store`; `outcome` is `done`, `failed`, `timed_out` or
//! `cancelled` for tasks, and `ok` or the [`BlockError`] kind for blocks; `tier` is the
//! offload tier (`host`, `file`); `target` is a file-tier root or a remote peer.

use std::time::Duration;

use crate::ids::Direction;
use crate::op::BlockError;
use crate::task::{TaskReport, TaskState};
use crate::tracker::TrackerStats;

/// Tasks that ended, by `dir` and `outcome` (counter).
pub const TASKS: &str = "kvx_tasks_total";
/// Blocks of ended tasks, by `dir` and `outcome` (counter).
pub const BLOCKS: &str = "kvx_blocks_total";
/// Bytes of blocks that arrived, by `dir` (counter).
pub const BYTES: &str = "kvx_bytes_total";
/// Tasks that ended because their deadline passed, by `dir` (counter).
pub const TIMEOUTS: &str = "kvx_timeouts_total";
/// Completions that came back after their task had ended (gauge: the tracker's running count).
pub const LATE_COMPLETIONS: &str = "kvx_late_completions";
/// Ops whose task ended while the backend still holds them (gauge).
pub const ZOMBIE_OPS: &str = "kvx_zombie_ops";
/// Buffer bytes quarantined in zombie ops (gauge).
pub const ZOMBIE_BYTES: &str = "kvx_zombie_bytes";
/// Tasks not yet ended (gauge).
pub const LIVE_TASKS: &str = "kvx_live_tasks";
/// Fences handed out (preemption, block reuse, reset), by `kind` (counter).
pub const FENCES: &str = "kvx_fences_total";
/// Seconds a caller waited on a fence, by `held` (`true`, `false`) (histogram).
pub const FENCE_WAIT_SECONDS: &str = "kvx_fence_wait_seconds";
/// Blocks moved by the offload connector, by `tier`, `dir` and `outcome` (counter).
pub const TIER_BLOCKS: &str = "kvx_tier_blocks_total";
/// Bytes moved by the offload connector, by `tier` and `dir` (counter).
pub const TIER_BYTES: &str = "kvx_tier_bytes_total";
/// Seconds from a job's submission to its verdict, by `tier` and `dir` (histogram).
pub const TIER_SECONDS: &str = "kvx_tier_job_seconds";
/// Blocks a store put in no tier, by `reason`: `no_room` (every tier full of blocks pinned by
/// loads or being stored) or the [`failure_reason`] of the block's last store (counter).
pub const STORE_SKIPPED: &str = "kvx_store_skipped_blocks_total";
/// Circuit breaker state of a target: 0 closed, 1 half-open, 2 open (gauge, by `target`).
pub const BREAKER_STATE: &str = "kvx_breaker_state";
/// Times a target's breaker opened, by `target` (counter).
pub const BREAKER_OPENS: &str = "kvx_breaker_opens_total";

/// The label value of a direction.
pub fn dir_label(dir: Direction) -> &'static str {
    match dir {
        Direction::Load => "load",
        Direction::Store => "store",
    }
}

/// The label value of a task's terminal state (`live` if it has none yet).
pub fn outcome_label(state: &TaskState) -> &'static str {
    match state {
        TaskState::Done => "done",
        TaskState::Failed(_) => "failed",
        TaskState::TimedOut => "timed_out",
        TaskState::Cancelled => "cancelled",
        TaskState::Queued | TaskState::InFlight => "live",
    }
}

/// The label value of a block's verdict.
pub fn block_outcome_label(result: &Result<(), BlockError>) -> &'static str {
    result.as_ref().err().map_or("ok", block_error_label)
}

/// Why a block failed, finer than [`block_error_label`]: a refusal (`Unavailable`) is told
/// apart by the refusing part's message (kvx-posix says "breaker open on ...", "busy: ...",
/// "... stuck in the kernel" and "a remove of this block is still in flight"; kvx-offload "host
/// pool exhausted" and "no `<tier>`-tier buffer for ..."): `breaker_open`, `busy`,
/// `pool_exhausted`, `no_room` or `other`; any other error is its kind's label.
pub fn failure_reason(error: &BlockError) -> &'static str {
    let BlockError::Unavailable(m) = error else {
        return block_error_label(error);
    };
    if m.contains("breaker open") {
        "breaker_open"
    } else if m.starts_with("busy")
        || m.contains("stuck in the kernel")
        || m.contains("remove of this block")
    {
        "busy"
    } else if m.contains("pool exhausted") || m.contains("-tier buffer") {
        "pool_exhausted"
    } else if m.contains("no room") {
        "no_room"
    } else {
        "other"
    }
}

/// The label value of a block error's kind.
pub fn block_error_label(error: &BlockError) -> &'static str {
    match error {
        BlockError::NotFound => "not_found",
        BlockError::Corrupt(_) => "corrupt",
        BlockError::Io(_) => "io",
        BlockError::TimedOut => "timed_out",
        BlockError::Cancelled => "cancelled",
        BlockError::Unavailable(_) => "unavailable",
        BlockError::Invalid(_) => "invalid",
        BlockError::Remote(_) => "remote",
    }
}

/// Register the task and timeout counters of both directions at zero, so a scrape shows them
/// before the first task ends (the driver calls this when it starts).
pub fn register_counters() {
    for dir in [Direction::Load, Direction::Store] {
        let d = dir_label(dir);
        metrics::counter!(TIMEOUTS, "dir" => d).increment(0);
        metrics::counter!(TASKS, "dir" => d, "outcome" => "done").increment(0);
    }
}

/// Record a task's verdict: tasks, blocks and bytes by direction and outcome, and timeouts.
pub fn record_report(report: &TaskReport) {
    let dir = dir_label(report.dir);
    let outcome = outcome_label(&report.state);
    metrics::counter!(TASKS, "dir" => dir, "outcome" => outcome).increment(1);
    if report.state == TaskState::TimedOut {
        metrics::counter!(TIMEOUTS, "dir" => dir).increment(1);
    }
    let mut bytes = 0u64;
    for b in &report.blocks {
        let outcome = block_outcome_label(&b.result);
        metrics::counter!(BLOCKS, "dir" => dir, "outcome" => outcome).increment(1);
        if b.result.is_ok() {
            bytes += b.buf.as_ref().map_or(0, |buf| buf.len() as u64);
        }
    }
    if bytes > 0 {
        metrics::counter!(BYTES, "dir" => dir).increment(bytes);
    }
}

/// Publish the tracker's gauges: live tasks, zombies and late completions.
pub fn record_stats(stats: &TrackerStats) {
    metrics::gauge!(LIVE_TASKS).set(stats.live_tasks as f64);
    metrics::gauge!(ZOMBIE_OPS).set(stats.zombie_ops as f64);
    metrics::gauge!(ZOMBIE_BYTES).set(stats.zombie_bytes as f64);
    metrics::gauge!(LATE_COMPLETIONS).set(stats.late_completions as f64);
}

/// Count a fence handed out; `kind` is `preempt`, `blocks` or `reset`.
pub fn record_fence(kind: &'static str) {
    metrics::counter!(FENCES, "kind" => kind).increment(1);
}

/// Record how long a caller waited on a fence and whether it held.
pub fn record_fence_wait(waited: Duration, held: bool) {
    let held = if held { "true" } else { "false" };
    metrics::histogram!(FENCE_WAIT_SECONDS, "held" => held).record(waited.as_secs_f64());
}

/// Record one offload job's verdict on a tier: blocks by outcome, bytes moved, and (when known)
/// its latency from submission to verdict.
pub fn record_tier_job(
    tier: &'static str,
    dir: Direction,
    ok_blocks: u64,
    failed_blocks: u64,
    bytes: u64,
    took: Option<Duration>,
) {
    let d = dir_label(dir);
    if ok_blocks > 0 {
        metrics::counter!(TIER_BLOCKS, "tier" => tier, "dir" => d, "outcome" => "ok")
            .increment(ok_blocks);
    }
    if failed_blocks > 0 {
        metrics::counter!(TIER_BLOCKS, "tier" => tier, "dir" => d, "outcome" => "failed")
            .increment(failed_blocks);
    }
    if bytes > 0 {
        metrics::counter!(TIER_BYTES, "tier" => tier, "dir" => d).increment(bytes);
    }
    if let Some(took) = took {
        metrics::histogram!(TIER_SECONDS, "tier" => tier, "dir" => d).record(took.as_secs_f64());
    }
}

/// Record `blocks` blocks a store put in no tier, for `reason` (see [`STORE_SKIPPED`]).
pub fn record_store_skipped(reason: &'static str, blocks: u64) {
    metrics::counter!(STORE_SKIPPED, "reason" => reason).increment(blocks);
}

/// The gauge value of a breaker state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerGauge {
    /// Ops flow.
    Closed,
    /// One probe op is allowed through.
    HalfOpen,
    /// Ops fail at once.
    Open,
}

/// Publish a target's breaker state (a file-tier root, a remote peer); counts openings.
pub fn record_breaker(target: &str, state: BreakerGauge) {
    let value = match state {
        BreakerGauge::Closed => 0.0,
        BreakerGauge::HalfOpen => 1.0,
        BreakerGauge::Open => 2.0,
    };
    metrics::gauge!(BREAKER_STATE, "target" => target.to_string()).set(value);
    if state == BreakerGauge::Open {
        metrics::counter!(BREAKER_OPENS, "target" => target.to_string()).increment(1);
    }
}
