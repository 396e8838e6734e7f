//! Keep the calling thread on the CPU it runs on, so a single-threaded benchmark measures one
//! core rather than one core plus migrations between them.

/// Pin the calling thread to the CPU it is running on now; returns that CPU, or `None` where
/// the OS refuses (the benchmark then runs unpinned and says so).
#[cfg(target_os = "linux")]
pub(crate) fn pin_to_current_cpu() -> Option<usize> {
    // SAFETY: sched_getcpu reads no memory of ours.
    let cpu = unsafe { libc::sched_getcpu() };
    let cpu = usize::try_from(cpu).ok()?;
    // SAFETY: `set` is a local cpu_set_t owned by this frame, zeroed before CPU_SET writes one
    // bit inside it; sched_setaffinity only reads `size_of::<cpu_set_t>()` bytes of it.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    ok.then_some(cpu)
}

/// Pin the calling thread to the CPU it is running on now (not supported on this OS).
#[cfg(not(target_os = "linux"))]
pub(crate) fn pin_to_current_cpu() -> Option<usize> {
    None
}
