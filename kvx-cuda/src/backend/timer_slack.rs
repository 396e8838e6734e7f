//! A completer's polls as short as asked: Linux stretches a thread's timed sleeps by the thread's
//! timer slack (50 µs by default), more than the default poll interval.

/// Set the calling thread's timer slack to 1 µs (a failure only costs poll precision: logged).
pub(crate) fn tighten() {
    // SAFETY: PR_SET_TIMERSLACK takes a plain integer and changes only the calling thread's
    // timer slack; no memory is passed or kept.
    let r = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong) };
    if r != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "kvx-cuda: PR_SET_TIMERSLACK failed");
    }
}
