//! The calling thread's clocks, for tests that bound a call's time on a shared machine.
//!
//! A call that waits on a lock, a condition variable, a stuck device or the disk sleeps; a call
//! that the OS took the CPU away from was not scheduled. A "never blocks" bound excuses only the
//! second: [`Interval::unexcused`] is the wall time less the time the thread was not scheduled:
//!
//! - its run-queue wait (runnable but not running): the second field of
//!   `/proc/thread-self/schedstat`, in nanoseconds. Where the kernel has no schedstat it is
//!   estimated from the thread's involuntary context switches (`getrusage(RUSAGE_THREAD)`),
//!   [`SWITCH_ALLOWANCE`] each;
//! - steal time (the hypervisor ran something else on the virtual CPU; the thread's own clocks
//!   count it as neither running nor waiting): the most any CPU had over the interval, from
//!   `/proc/stat`, in whole clock ticks (10 ms), so up to a tick of steal goes unexcused.
//!
//! A call that waits for another thread of the process by design (a lock it holds briefly, a
//! fence it signals) also sleeps while *that* thread waits on a run queue. A clock made with
//! [`ThreadClock::also_excusing`] also excuses the run-queue wait of the process's threads
//! whose names start with a prefix, summed over the interval (an over-estimate when several of
//! them wait at once, never time any of them slept).
//!
//! A bound on *another* thread's timing (a verdict the driver thread hands out by a deadline)
//! excuses that thread's unscheduled time over the stretch: [`UnscheduledLog`] samples it.

use std::fs::File;
use std::time::{Duration, Instant};

mod log;
mod procfs;
mod rusage;

pub use log::UnscheduledLog;

/// The fallback's excuse per involuntary context switch: a few scheduler slices of a loaded
/// 2-core machine.
pub const SWITCH_ALLOWANCE: Duration = Duration::from_millis(20);

/// Reads the calling thread's clocks. Open it on the thread whose calls it times.
#[derive(Debug)]
pub struct ThreadClock {
    schedstat: Option<File>,
    others: Option<String>,
}

/// The thread's clocks at one moment.
#[derive(Clone, Debug)]
pub struct Reading {
    at: Instant,
    cpu: Duration,
    runq: Duration,
    major_faults: i64,
    /// Each CPU's steal time so far.
    steal: Vec<Duration>,
    /// (thread id, its run-queue wait) of each excused other thread.
    others: Vec<(u32, Duration)>,
}

/// What one timed stretch of a thread was made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interval {
    /// Wall-clock time.
    pub wall: Duration,
    /// Runnable but not running (waiting on a run queue, or the fallback's estimate).
    pub runq: Duration,
    /// The most steal time any CPU had meanwhile.
    pub steal: Duration,
    /// The excused other threads' run-queue wait, summed (zero without schedstat).
    pub others_runq: Duration,
    /// Running on a CPU.
    pub cpu: Duration,
    /// Major page faults taken (each a wait for the disk).
    pub major_faults: i64,
}

impl ThreadClock {
    /// A clock of the calling thread.
    pub fn new() -> Self {
        ThreadClock {
            schedstat: procfs::own_schedstat(),
            others: None,
        }
    }

    /// A clock of the calling thread that also excuses the run-queue wait of the process's
    /// threads whose names start with `prefix` (those alive at both ends of an interval).
    pub fn also_excusing(prefix: &str) -> Self {
        ThreadClock {
            others: Some(prefix.to_owned()),
            ..Self::new()
        }
    }

    /// Where the run-queue wait comes from, for a test's report.
    pub fn source(&self) -> &'static str {
        if self.schedstat.is_some() {
            "run-queue wait from /proc/thread-self/schedstat, steal from /proc/stat"
        } else {
            "involuntary context switches (getrusage RUSAGE_THREAD) x 20 ms, steal from /proc/stat"
        }
    }

    /// The calling thread's clocks now.
    pub fn now(&self) -> Reading {
        let others = match (&self.others, &self.schedstat) {
            (Some(prefix), Some(_)) => procfs::threads_runq(prefix),
            _ => Vec::new(),
        };
        let steal = procfs::steal_per_cpu();
        let usage = rusage::this_thread();
        let (cpu, runq) = match self.schedstat.as_ref().and_then(procfs::read_schedstat) {
            Some(both) => both,
            None => (
                usage.cpu,
                SWITCH_ALLOWANCE * u32::try_from(usage.involuntary_switches).unwrap_or(u32::MAX),
            ),
        };
        Reading {
            at: Instant::now(),
            cpu,
            runq,
            major_faults: usage.major_faults,
            steal,
            others,
        }
    }

    /// Time `f`: its result and what its time was made of.
    pub fn time<R>(&self, f: impl FnOnce() -> R) -> (R, Interval) {
        let before = self.now();
        let r = f();
        let end = Instant::now();
        let mut after = self.now();
        after.at = end;
        (r, after.since(&before))
    }
}

impl Default for ThreadClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Reading {
    /// The interval from `earlier` to this reading.
    pub fn since(&self, earlier: &Reading) -> Interval {
        Interval {
            wall: self.at.saturating_duration_since(earlier.at),
            runq: self.runq.saturating_sub(earlier.runq),
            steal: procfs::most_steal(&earlier.steal, &self.steal),
            others_runq: procfs::runq_growth(&earlier.others, &self.others),
            cpu: self.cpu.saturating_sub(earlier.cpu),
            major_faults: self.major_faults - earlier.major_faults,
        }
    }
}

impl Interval {
    /// Wall time less the time this thread (and the excused others) were not scheduled: what
    /// a "never blocks" bound is held to.
    pub fn unexcused(&self) -> Duration {
        self.wall
            .saturating_sub(self.runq)
            .saturating_sub(self.steal)
            .saturating_sub(self.others_runq)
    }

    /// Neither running, nor runnable, nor stolen: on a lock, a condition, the disk.
    pub fn slept(&self) -> Duration {
        self.wall
            .saturating_sub(self.runq)
            .saturating_sub(self.steal)
            .saturating_sub(self.cpu)
    }
}

impl std::fmt::Display for Interval {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?}: {:?} on a run queue, {:?} stolen, {:?} on a CPU, {:?} asleep, {} major page \
             faults; the excused other threads {:?} on their run queues",
            self.wall,
            self.runq,
            self.steal,
            self.cpu,
            self.slept(),
            self.major_faults,
            self.others_runq
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sleep_is_not_excused_and_spinning_is_cpu() {
        let clock = ThreadClock::new();
        let ((), slept) = clock.time(|| std::thread::sleep(Duration::from_millis(30)));
        assert!(slept.wall >= Duration::from_millis(30), "{slept}");
        // Asleep all along: nothing of it is a run-queue wait (stolen time may be excused).
        assert!(
            slept.wall - slept.runq >= Duration::from_millis(29),
            "{slept}"
        );
        assert!(slept.unexcused() >= slept.slept(), "{slept}");
        assert!(slept.cpu < Duration::from_millis(20), "{slept}");
        let ((), spun) = clock.time(|| {
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_millis(30) {
                std::hint::spin_loop();
            }
        });
        assert!(
            spun.cpu + spun.runq + spun.steal >= Duration::from_millis(25),
            "{spun}"
        );
        assert!(spun.slept() < Duration::from_millis(10), "{spun}");
    }

    #[test]
    fn another_threads_clock_is_not_this_ones() {
        let clock = ThreadClock::new();
        let before = clock.now();
        std::thread::spawn(|| {
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_millis(30) {
                std::hint::spin_loop();
            }
        })
        .join()
        .unwrap();
        let i = clock.now().since(&before);
        assert!(i.cpu < Duration::from_millis(20), "{i}");
        assert_eq!(i.others_runq, Duration::ZERO, "{i}");
    }

    #[test]
    fn the_excused_threads_run_queue_wait_is_counted() {
        let clock = ThreadClock::also_excusing("clk-spin");
        let mut history = UnscheduledLog::new("clk-spin");
        if clock.schedstat.is_none() {
            println!("skip: no /proc/thread-self/schedstat here");
            return;
        }
        // More spinning threads than this machine has cores: some of them wait on a run
        // queue while this thread sleeps on their joins.
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let start = std::sync::Barrier::new(cores + 2);
        let (((), i), during) = std::thread::scope(|s| {
            let spinners: Vec<_> = (0..cores + 1)
                .map(|n| {
                    std::thread::Builder::new()
                        .name(format!("clk-spin-{n}"))
                        .spawn_scoped(s, || {
                            start.wait();
                            let t0 = Instant::now();
                            while t0.elapsed() < Duration::from_millis(300) {
                                std::hint::spin_loop();
                            }
                            // Alive at both readings: the end is read before the joins.
                            std::thread::sleep(Duration::from_millis(200));
                        })
                        .unwrap()
                })
                .collect();
            start.wait();
            std::thread::sleep(Duration::from_millis(20));
            history.sample();
            let during = Instant::now();
            let out = clock.time(|| std::thread::sleep(Duration::from_millis(300)));
            history.sample();
            for t in spinners {
                t.join().unwrap();
            }
            (out, during)
        });
        let ended = Instant::now();
        assert!(i.others_runq > Duration::from_millis(10), "{i}");
        assert!(
            history.between(during, during) >= i.others_runq,
            "its samples bracket the timed interval: {:?} {i}",
            history.between(during, during)
        );
        assert_eq!(
            history.between(ended, ended),
            Duration::ZERO,
            "no sample after"
        );
        assert!(i.unexcused() < i.wall, "{i}");
    }
}
