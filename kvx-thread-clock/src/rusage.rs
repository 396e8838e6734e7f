//! The libc calls of this crate (its only unsafe code): `getrusage(RUSAGE_THREAD)` and the
//! clock tick.

use std::time::Duration;

/// The parts of the calling thread's resource usage the clock reads.
pub(crate) struct Usage {
    /// User plus system CPU time.
    pub cpu: Duration,
    pub involuntary_switches: i64,
    pub major_faults: i64,
}

pub(crate) fn this_thread() -> Usage {
    // SAFETY: `rusage` is plain old data; all zeros is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to an owned, writable `rusage`; RUSAGE_THREAD is the caller.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    if rc != 0 {
        return Usage {
            cpu: Duration::ZERO,
            involuntary_switches: 0,
            major_faults: 0,
        };
    }
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    Usage {
        cpu: tv(u.ru_utime) + tv(u.ru_stime),
        involuntary_switches: u.ru_nivcsw,
        major_faults: u.ru_majflt,
    }
}

/// The length of one clock tick (`sysconf(_SC_CLK_TCK)`), the unit of `/proc/stat`.
pub(crate) fn clock_tick() -> std::time::Duration {
    // SAFETY: `sysconf` reads a constant of the system; it takes no pointer.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    std::time::Duration::from_nanos(1_000_000_000 / hz)
}
