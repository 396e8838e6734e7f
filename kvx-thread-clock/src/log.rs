//! Samples of how long some threads were not scheduled, for a bound on when one of them acts.

use std::time::{Duration, Instant};

use crate::procfs;

/// Samples of the run-queue wait of the process's threads whose names start with a prefix,
/// and of each CPU's steal time.
#[derive(Debug)]
pub struct UnscheduledLog {
    prefix: String,
    samples: Vec<Sample>,
}

#[derive(Debug)]
struct Sample {
    at: Instant,
    threads: Vec<(u32, Duration)>,
    steal: Vec<Duration>,
}

impl UnscheduledLog {
    /// No samples yet; the first [`sample`](Self::sample) starts it.
    pub fn new(prefix: &str) -> Self {
        UnscheduledLog {
            prefix: prefix.to_owned(),
            samples: Vec::new(),
        }
    }

    /// Read the threads' run-queue waits and the steal time now.
    pub fn sample(&mut self) {
        let threads = procfs::threads_runq(&self.prefix);
        let steal = procfs::steal_per_cpu();
        self.samples.push(Sample {
            at: Instant::now(),
            threads,
            steal,
        });
    }

    /// How long the threads were not scheduled from the last sample at or before `from` to the
    /// first sample at or after `to`: their run-queue waits summed over the threads alive at
    /// both, plus the most steal any CPU had (zero where no two samples bracket the stretch).
    pub fn between(&self, from: Instant, to: Instant) -> Duration {
        let first = self.samples.iter().rev().find(|s| s.at <= from);
        let last = self.samples.iter().find(|s| s.at >= to);
        let (Some(first), Some(last)) = (first, last) else {
            return Duration::ZERO;
        };
        procfs::runq_growth(&first.threads, &last.threads)
            + procfs::most_steal(&first.steal, &last.steal)
    }
}
