//! What a replay counts, and the small statistics it prints.

use std::time::Duration;

use kvx_core::metrics::failure_reason;
use kvx_core::{BlockError, TrackerStats};
use kvx_posix::PosixStats;
use serde_json::{Value, json};

use super::fault::Phase;

/// Why a block's store or load failed, as the replay breaks failures down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The deadline passed first.
    TimedOut,
    /// The file tier's breaker was open: refused at once.
    BreakerOpen,
    /// The file tier refused: too many I/Os stuck, or its job queue full.
    Busy,
    /// No tier had room (computed blocks nothing could take).
    NoRoom,
    /// No staging or host buffer was free.
    PoolExhausted,
    /// The block failed verification.
    Corrupt,
    /// The block was not there (or not readable by this version).
    NotFound,
    /// Anything else (I/O errors, cancels).
    Other,
}

impl Reason {
    /// Every reason, in report order.
    pub const ALL: [Reason; 8] = [
        Reason::TimedOut,
        Reason::BreakerOpen,
        Reason::Busy,
        Reason::NoRoom,
        Reason::PoolExhausted,
        Reason::Corrupt,
        Reason::NotFound,
        Reason::Other,
    ];

    /// Its name in the report and the JSON output.
    pub fn key(self) -> &'static str {
        match self {
            Reason::TimedOut => "timed_out",
            Reason::BreakerOpen => "breaker_open",
            Reason::Busy => "busy",
            Reason::NoRoom => "no_room",
            Reason::PoolExhausted => "pool_exhausted",
            Reason::Corrupt => "corrupt",
            Reason::NotFound => "not_found",
            Reason::Other => "other",
        }
    }

    /// The reason of a block error (kvx-core's [`failure_reason`]; I/O errors, cancels and
    /// invalid or remote blocks are `Other`).
    pub fn of(e: &BlockError) -> Reason {
        Reason::ALL
            .into_iter()
            .find(|r| r.key() == failure_reason(e))
            .unwrap_or(Reason::Other)
    }

    fn index(self) -> usize {
        Reason::ALL.iter().position(|r| *r == self).unwrap_or(7)
    }
}

/// Failed blocks counted by [`Reason`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ByReason([u64; 8]);

impl ByReason {
    /// Count `n` blocks failed for `r`.
    pub fn add(&mut self, r: Reason, n: u64) {
        self.0[r.index()] += n;
    }

    /// Blocks failed for `r`.
    pub fn get(&self, r: Reason) -> u64 {
        self.0[r.index()]
    }

    /// All failed blocks.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// `{"timed_out": n, ...}` with every reason.
    pub fn to_json(&self) -> Value {
        Value::Object(
            Reason::ALL
                .iter()
                .map(|r| (r.key().to_string(), json!(self.get(*r))))
                .collect(),
        )
    }

    /// `timed_out 3, busy 1` (the reasons that occurred), or `none`.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = Reason::ALL
            .iter()
            .filter(|r| self.get(**r) > 0)
            .map(|r| format!("{} {}", r.key(), self.get(*r)))
            .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    }
}

/// Counters of one replay run.
#[derive(Debug, Default, Clone)]
pub struct RunStats {
    /// Requests replayed.
    pub requests: u64,
    /// Requests ended (each exactly once).
    pub ended: u64,
    /// Requests whose load failed and whose policy failed them.
    pub failed_requests: u64,
    /// Full blocks referenced by all requests.
    pub blocks: u64,
    /// Blocks served from the host tier (loaded, verified, used).
    pub hit_host: u64,
    /// Blocks served from the file tier (loaded, verified, used).
    pub hit_file: u64,
    /// Blocks in no tier when looked up (computed).
    pub missed: u64,
    /// Blocks a lookup found but whose load did not deliver them (recomputed).
    pub recomputed: u64,
    /// Blocks of failed requests (neither used nor computed).
    pub failed_blocks: u64,
    /// Load jobs started.
    pub load_jobs: u64,
    /// Load jobs that ran into their deadline.
    pub deadline_misses: u64,
    /// Blocks of those.
    pub deadline_missed_blocks: u64,
    /// Load blocks turned away at once (open breaker, no staging buffer).
    pub load_rejected_blocks: u64,
    /// Load blocks the index placed in the host tier but whose buffer was dropped before the
    /// load started (see the report: a promotion of the same load evicted them).
    pub load_host_buffer_gone: u64,
    /// Load blocks that failed verification in the file tier or were gone.
    pub load_corrupt_blocks: u64,
    /// Load blocks that failed otherwise.
    pub load_other_failed_blocks: u64,
    /// Blocks verified byte-exact after a load reported them done.
    pub verified_blocks: u64,
    /// Bytes of those.
    pub verified_bytes: u64,
    /// Blocks stored in the host tier.
    pub stored_host: u64,
    /// Blocks written through to the file tier.
    pub stored_file: u64,
    /// Host-tier stores that failed.
    pub store_failed_host: u64,
    /// File-tier writes that failed (timeouts included).
    pub store_failed_file: u64,
    /// File-tier writes that ran into their deadline.
    pub store_timeouts: u64,
    /// Computed blocks that no tier took (the host tier had no room).
    pub store_dropped: u64,
    /// Lookups answered "ask again later".
    pub retries: u64,
    /// Load waits (submission to result), one per load job.
    pub load_waits: Vec<Duration>,
    /// Longest time a request waited on kvx (first lookup to ready to compute).
    pub max_request_wait: Duration,
    /// Time during which at least one load was in flight.
    pub load_busy: Duration,
    /// Modelled time to first token with the cache, ms, per request that ran.
    pub ttft_cache_ms: Vec<f64>,
    /// Modelled time to first token recomputing everything, ms, per request that ran.
    pub ttft_recompute_ms: Vec<f64>,
    /// File-tier hits by phase of the stall ([`Phase::ALL`] order).
    pub file_hits_by_phase: [u64; 4],
    /// File-tier hits on blocks another node stored (a multi-node replay).
    pub cross_node_hits: u64,
    /// Host-tier hits by phase.
    pub host_hits_by_phase: [u64; 4],
    /// Failed load blocks by phase.
    pub load_failed_by_phase: [u64; 4],
    /// Failed store blocks (host and file tier, and computed blocks no tier took) by reason.
    pub store_failures: ByReason,
    /// Failed load blocks by reason.
    pub load_failures: ByReason,
    /// Failed store blocks by phase (when reported) and reason.
    pub store_failures_by_phase: [ByReason; 4],
    /// Failed load blocks by phase (when the load started) and reason.
    pub load_failures_by_phase: [ByReason; 4],
    /// Reports in `finished_sending`.
    pub sending_reports: u64,
    /// Requests whose freeing `request_finished` delayed.
    pub delayed_frees: u64,
    /// Wall time of the replay (arrivals to the last request's end).
    pub wall: Duration,
    /// Wall time to settle afterwards (stores in flight, stuck I/O released).
    pub settle: Duration,
    /// Freeze/thaw times.
    pub stall_log: Vec<(Duration, &'static str)>,
    /// The tracker at the end.
    pub tracker: TrackerStats,
    /// The file tier's counters at the end.
    pub posix: Option<PosixStats>,
}

impl RunStats {
    /// Count a failed load block of a load started in phase `p`.
    pub fn load_failure(&mut self, e: &BlockError, p: Phase) {
        let r = Reason::of(e);
        self.load_failures.add(r, 1);
        self.load_failures_by_phase[p.index()].add(r, 1);
        self.load_failed_by_phase[p.index()] += 1;
        match e {
            BlockError::TimedOut => self.deadline_missed_blocks += 1,
            BlockError::Unavailable(m) if m.starts_with("no Host-tier buffer") => {
                self.load_host_buffer_gone += 1
            }
            BlockError::Unavailable(_) => self.load_rejected_blocks += 1,
            BlockError::Corrupt(_) | BlockError::NotFound => self.load_corrupt_blocks += 1,
            _ => self.load_other_failed_blocks += 1,
        }
    }

    /// Count `n` store blocks failed for `r`, reported in phase `p`.
    pub fn store_failure(&mut self, r: Reason, n: u64, p: Phase) {
        self.store_failures.add(r, n);
        self.store_failures_by_phase[p.index()].add(r, n);
    }

    /// Blocks served from the tiers.
    pub fn hits(&self) -> u64 {
        self.hit_host + self.hit_file
    }
}

/// Nearest-rank percentile of `v` (sorted ascending); 0 when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// Mean of `v`; 0 when empty.
pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// `v` sorted ascending.
pub fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[], 99.0), 0.0);
        assert_eq!(percentile(&[7.0], 1.0), 7.0);
        assert_eq!(mean(&[1.0, 3.0]), 2.0);
    }

    #[test]
    fn reasons_of_block_errors() {
        let un = |m: &str| BlockError::Unavailable(m.into());
        let cases = [
            (BlockError::TimedOut, Reason::TimedOut),
            (un("breaker open on /mnt/kv"), Reason::BreakerOpen),
            (
                un("busy: posix:/kv (uring engine): job queue full"),
                Reason::Busy,
            ),
            (un("posix:/kv: 300 I/Os stuck in the kernel"), Reason::Busy),
            (
                un("a remove of this block is still in flight"),
                Reason::Busy,
            ),
            (un("host pool exhausted"), Reason::PoolExhausted),
            (un("no File-tier buffer for 0abc"), Reason::PoolExhausted),
            (un("Host tier has no room: 3 blocks needed"), Reason::NoRoom),
            (BlockError::Corrupt("x".into()), Reason::Corrupt),
            (BlockError::NotFound, Reason::NotFound),
            (BlockError::Io("EIO".into()), Reason::Other),
            (BlockError::Cancelled, Reason::Other),
        ];
        for (e, want) in cases {
            assert_eq!(Reason::of(&e), want, "{e}");
        }
        let mut s = RunStats::default();
        s.load_failure(&BlockError::TimedOut, Phase::During);
        s.load_failure(&un("breaker open on r"), Phase::Recovering);
        s.store_failure(Reason::Busy, 2, Phase::Before);
        assert_eq!(s.load_failures.get(Reason::TimedOut), 1);
        assert_eq!(s.load_failures_by_phase[2].get(Reason::BreakerOpen), 1);
        assert_eq!(s.load_failed_by_phase, [0, 1, 1, 0]);
        assert_eq!(s.store_failures.total(), 2);
        assert_eq!(s.store_failures.describe(), "busy 2");
        assert_eq!(s.store_failures.to_json()["busy"], 2);
    }
}
