//! What a replay counts, and the small statistics it prints.

use std::time::Duration;

use kvx_core::{BlockError, TrackerStats};
use kvx_posix::PosixStats;

use super::fault::Phase;

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
    /// File-tier hits by phase of the stall (before, during, after).
    pub file_hits_by_phase: [u64; 3],
    /// Host-tier hits by phase.
    pub host_hits_by_phase: [u64; 3],
    /// Failed load blocks by phase.
    pub load_failed_by_phase: [u64; 3],
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

/// Index of a phase in the per-phase arrays.
pub fn phase_index(p: Phase) -> usize {
    match p {
        Phase::Before => 0,
        Phase::During => 1,
        Phase::After => 2,
    }
}

impl RunStats {
    /// Count a failed load block.
    pub fn load_failure(&mut self, e: &BlockError) {
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
}
