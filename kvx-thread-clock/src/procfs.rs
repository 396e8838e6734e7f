//! What the clocks read from `/proc`: schedstat files and the CPUs' steal time.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use crate::rusage;

/// The calling thread's schedstat, open, where the kernel has one.
pub(crate) fn own_schedstat() -> Option<File> {
    File::open("/proc/thread-self/schedstat")
        .ok()
        .filter(|f| read_schedstat(f).is_some())
}

/// (time on a CPU, time on a run queue) from an open schedstat file.
pub(crate) fn read_schedstat(f: &File) -> Option<(Duration, Duration)> {
    let mut buf = [0u8; 128];
    let n = f.read_at(&mut buf, 0).ok()?;
    let text = std::str::from_utf8(&buf[..n]).ok()?;
    let mut fields = text.split_ascii_whitespace().map(|s| s.parse::<u64>().ok());
    let cpu = fields.next()??;
    let runq = fields.next()??;
    Some((Duration::from_nanos(cpu), Duration::from_nanos(runq)))
}

/// (thread id, run-queue wait) of each other thread of this process whose name starts with
/// `prefix`.
pub(crate) fn threads_runq(prefix: &str) -> Vec<(u32, Duration)> {
    let me = std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse::<u32>().ok());
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<u32>().ok())
        else {
            continue;
        };
        if Some(tid) == me {
            continue;
        }
        let named = std::fs::read_to_string(task.path().join("comm"))
            .is_ok_and(|comm| comm.starts_with(prefix));
        let runq = File::open(task.path().join("schedstat"))
            .ok()
            .and_then(|f| read_schedstat(&f));
        if let (true, Some((_, runq))) = (named, runq) {
            out.push((tid, runq));
        }
    }
    out
}

/// How much the run-queue wait of the threads in both readings grew, summed.
pub(crate) fn runq_growth(earlier: &[(u32, Duration)], later: &[(u32, Duration)]) -> Duration {
    later
        .iter()
        .filter_map(|(tid, runq)| {
            let (_, before) = earlier.iter().find(|(t, _)| t == tid)?;
            Some(runq.saturating_sub(*before))
        })
        .sum()
}

/// Each CPU's steal time so far (the 8th value of its `cpuN` line in `/proc/stat`, in clock
/// ticks); empty where the kernel does not say.
pub(crate) fn steal_per_cpu() -> Vec<Duration> {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return Vec::new();
    };
    let tick = rusage::clock_tick();
    stat.lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .filter_map(|l| l.split_ascii_whitespace().nth(8)?.parse::<u32>().ok())
        .map(|ticks| tick * ticks)
        .collect()
}

/// The most any one CPU's steal time grew between two readings.
pub(crate) fn most_steal(earlier: &[Duration], later: &[Duration]) -> Duration {
    earlier
        .iter()
        .zip(later)
        .map(|(a, b)| b.saturating_sub(*a))
        .max()
        .unwrap_or_default()
}
