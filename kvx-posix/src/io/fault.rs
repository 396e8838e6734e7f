//! Fault injection around the real engines, for tests that must run without FUSE: a *stall*
//! holds every syscall's completion (as a frozen mount holds the syscall) until a thaw, and a
//! *late* completion holds the completions of the next data reads (or renames) for a while. The syscall itself
//! really runs; only its return to the job is held, so the engine sees exactly what a stuck
//! kernel call looks like: a psync thread that does not come back, a ring slot with no CQE.

use kvx_core::sync::lock;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

pub use crate::job::Late;

#[derive(Debug, Default)]
struct State {
    frozen: bool,
    held: usize,
    late: Option<Late>,
    late_left: usize,
    late_by: Duration,
    /// psync's replacements for written-off workers wait before their threads start.
    replacements_held: bool,
}

/// The faults a store's engine applies (shared with the test that drives them).
#[derive(Debug, Default)]
pub struct Faults {
    st: Mutex<State>,
    cv: Condvar,
}

/// When a held completion is handed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// At once (no fault).
    No,
    /// At the next thaw.
    UntilThaw,
    /// At this instant.
    Until(Instant),
}

impl Faults {
    /// Hold every completion from now until [`Faults::thaw`].
    pub fn freeze(&self) {
        lock(&self.st).frozen = true;
    }

    /// Hand back what a freeze held.
    pub fn thaw(&self) {
        lock(&self.st).frozen = false;
        self.cv.notify_all();
    }

    /// Hold (or let go) the start of psync's replacement workers, after the pool has counted
    /// them: the window in which a written-off worker may come back.
    pub fn hold_replacements(&self, on: bool) {
        lock(&self.st).replacements_held = on;
        self.cv.notify_all();
    }

    /// Block the calling thread (psync, about to start replacement workers) while
    /// [`Faults::hold_replacements`] is on.
    pub(crate) fn replacements_may_start(&self) {
        let mut s = lock(&self.st);
        while s.replacements_held {
            s = kvx_core::sync::wait(&self.cv, s);
        }
    }

    /// Completions held right now.
    pub fn held(&self) -> usize {
        lock(&self.st).held
    }

    /// Hold the completions of the next `count` syscalls of kind `what` for `by`.
    pub fn late(&self, what: Late, count: usize, by: Duration) {
        let mut s = lock(&self.st);
        s.late = Some(what);
        s.late_left = count;
        s.late_by = by;
    }

    /// Decide how long the completion of a syscall (of kind `kind`, if it is one a late fault
    /// can target) is held; a held completion counts in [`Faults::held`] until
    /// [`Faults::release`].
    pub(crate) fn hold(&self, kind: Option<Late>) -> Hold {
        let mut s = lock(&self.st);
        let h = if s.frozen {
            Hold::UntilThaw
        } else if kind.is_some() && kind == s.late && s.late_left > 0 {
            s.late_left -= 1;
            Hold::Until(Instant::now() + s.late_by)
        } else {
            Hold::No
        };
        if h != Hold::No {
            s.held += 1;
        }
        h
    }

    /// True once a held completion may be handed back.
    pub(crate) fn is_due(&self, h: Hold, now: Instant) -> bool {
        match h {
            Hold::No => true,
            Hold::UntilThaw => !lock(&self.st).frozen,
            Hold::Until(t) => now >= t,
        }
    }

    /// A held completion was handed back.
    pub(crate) fn release(&self) {
        let mut s = lock(&self.st);
        s.held = s.held.saturating_sub(1);
    }

    /// Block the calling thread (a psync worker, just back from a syscall) for as long as the
    /// fault holds this completion.
    pub(crate) fn gate(&self, kind: Option<Late>) {
        match self.hold(kind) {
            Hold::No => return,
            Hold::UntilThaw => {
                let mut s = lock(&self.st);
                while s.frozen {
                    s = kvx_core::sync::wait(&self.cv, s);
                }
            }
            Hold::Until(t) => std::thread::sleep(t.saturating_duration_since(Instant::now())),
        }
        self.release();
    }
}
