//! The freeze/thaw gate every filesystem request passes through.
//!
//! While the gate is open a request is served on the FUSE session thread that received it.
//! While it is frozen the request is parked on a thread of its own that waits on a condvar, so
//! the session threads keep reading requests and every one of them is counted as blocked (a
//! test can wait until N are stuck). Thaw wakes them all and they are served; close wakes them
//! all and they fail with `ENOTCONN`, as on an aborted connection. Neither thaw nor close ever
//! waits for a parked request, so a frozen request cannot deadlock them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use fuser::Errno;
use kvx_core::sync::{lock, wait, wait_timeout};

/// A FUSE reply that can be answered with an error (implemented for the reply types we use).
pub(crate) trait Fail: Send + 'static {
    /// Answer the request with `err`.
    fn fail(self, err: Errno);
}

/// Where the gate stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Requests are served at once.
    Open,
    /// Requests wait until thaw or close.
    Frozen,
    /// The mount is being torn down: requests fail at once.
    Closed,
}

#[derive(Debug)]
struct State {
    mode: Mode,
    blocked: usize,
}

/// Freeze/thaw state shared by the filesystem and its [`StallMount`](crate::StallMount).
#[derive(Debug)]
pub(crate) struct Gate {
    state: Mutex<State>,
    changed: Condvar,
    served: AtomicU64,
}

impl Gate {
    /// An open gate.
    pub(crate) fn new() -> Self {
        Gate {
            state: Mutex::new(State {
                mode: Mode::Open,
                blocked: 0,
            }),
            changed: Condvar::new(),
            served: AtomicU64::new(0),
        }
    }

    fn set_mode(&self, from: &[Mode], to: Mode) {
        let mut st = lock(&self.state);
        if from.contains(&st.mode) {
            st.mode = to;
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Make every following request block until [`thaw`](Self::thaw).
    pub(crate) fn freeze(&self) {
        self.set_mode(&[Mode::Open], Mode::Frozen);
    }

    /// Serve the parked requests and every following one.
    pub(crate) fn thaw(&self) {
        self.set_mode(&[Mode::Frozen], Mode::Open);
    }

    /// Fail the parked requests and every following one with `ENOTCONN`, for good.
    pub(crate) fn close(&self) {
        self.set_mode(&[Mode::Open, Mode::Frozen], Mode::Closed);
    }

    /// Whether requests currently block.
    pub(crate) fn is_frozen(&self) -> bool {
        lock(&self.state).mode == Mode::Frozen
    }

    /// Requests parked right now.
    pub(crate) fn blocked(&self) -> usize {
        lock(&self.state).blocked
    }

    /// Requests let through to the backing store so far.
    pub(crate) fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// Wait until at least `n` requests are parked; false if `timeout` passed first.
    pub(crate) fn wait_blocked(&self, n: usize, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut st = lock(&self.state);
        while st.blocked < n {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = wait_timeout(&self.changed, st, left);
        }
        true
    }

    /// Run `serve(reply)` now if open, on a parked thread once thawed if frozen, or fail the
    /// reply if closed.
    pub(crate) fn admit<R: Fail>(
        self: &Arc<Self>,
        reply: R,
        serve: impl FnOnce(R) + Send + 'static,
    ) {
        let mut st = lock(&self.state);
        match st.mode {
            Mode::Open => {
                // Counted under the lock: a freeze that follows sees every request let through.
                self.served.fetch_add(1, Ordering::Relaxed);
                drop(st);
                serve(reply);
            }
            Mode::Closed => {
                drop(st);
                reply.fail(Errno::ENOTCONN);
            }
            Mode::Frozen => {
                st.blocked += 1;
                drop(st);
                self.changed.notify_all();
                let gate = Arc::clone(self);
                let parked = thread::Builder::new()
                    .name("stallfs-parked".into())
                    .spawn(move || gate.park(reply, serve));
                if let Err(e) = parked {
                    // The closure (and with it the reply) is gone: fuser answers a dropped
                    // reply with EIO. Undo the count so waiters do not see a phantom request.
                    tracing::warn!("stallfs: cannot park a frozen request: {e}");
                    lock(&self.state).blocked -= 1;
                    self.changed.notify_all();
                }
            }
        }
    }

    /// Body of a parked request: wait while frozen, then serve or fail.
    fn park<R: Fail>(&self, reply: R, serve: impl FnOnce(R)) {
        let mut st = lock(&self.state);
        while st.mode == Mode::Frozen {
            st = wait(&self.changed, st);
        }
        st.blocked -= 1;
        let mode = st.mode;
        if mode == Mode::Open {
            self.served.fetch_add(1, Ordering::Relaxed);
        }
        drop(st);
        self.changed.notify_all();
        if mode == Mode::Closed {
            reply.fail(Errno::ENOTCONN);
        } else {
            serve(reply);
        }
    }
}
