//! `CompletionBoard`: the completion routing every backend needs, written once.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use rustc_hash::FxHashMap;

use crate::backend::{Notifier, WaitOutcome};
use crate::ids::OpId;
use crate::op::OpCompletion;
use crate::sync::{lock, wait_timeout};

struct Board<P> {
    pending: FxHashMap<OpId, P>,
    done: Vec<OpCompletion>,
}

/// Pending ops, finished ops, and the wake-ups between a backend and its workers.
///
/// A backend marks an op pending when it accepts it, its worker (thread, ring reaper, CUDA
/// event waiter, network task) posts the op's completion when the device really returned the
/// buffers, `poll` drains what is done, `wait` blocks until named ops are done, and the driver's
/// notifier is called after each completion. Each pending op may carry backend state `P`
/// (a cancel flag, a cancel token).
pub struct CompletionBoard<P = ()> {
    board: Mutex<Board<P>>,
    cv: Condvar,
    notifier: Mutex<Notifier>,
}

impl<P> Default for CompletionBoard<P> {
    fn default() -> Self {
        CompletionBoard {
            board: Mutex::new(Board {
                pending: FxHashMap::default(),
                done: Vec::new(),
            }),
            cv: Condvar::new(),
            notifier: Mutex::new(Notifier::noop()),
        }
    }
}

impl<P> CompletionBoard<P> {
    fn lock(&self) -> MutexGuard<'_, Board<P>> {
        lock(&self.board)
    }

    /// Install the driver's notifier.
    pub fn set_notifier(&self, n: Notifier) {
        *lock(&self.notifier) = n;
    }

    /// An op was accepted: it is pending until `complete`.
    pub fn begin(&self, op: OpId, state: P) {
        self.lock().pending.insert(op, state);
    }

    /// Accept `op` only while fewer than `limit` ops are pending; false if the limit is reached.
    pub fn begin_bounded(&self, op: OpId, state: P, limit: usize) -> bool {
        let mut b = self.lock();
        if b.pending.len() >= limit {
            return false;
        }
        b.pending.insert(op, state);
        true
    }

    /// Forget a pending op that was never started (its submit was refused).
    pub fn abandon(&self, op: OpId) -> Option<P> {
        self.lock().pending.remove(&op)
    }

    /// Run `f` on a pending op's state; `None` if it is not pending.
    pub fn with_pending<R>(&self, op: OpId, f: impl FnOnce(&mut P) -> R) -> Option<R> {
        self.lock().pending.get_mut(&op).map(f)
    }

    /// Ops pending now.
    pub fn pending_len(&self) -> usize {
        self.lock().pending.len()
    }

    /// Post a finished op (its buffers inside): it leaves the pending set, waiters and the
    /// driver are woken. Returns the op's state.
    pub fn complete(&self, c: OpCompletion) -> Option<P> {
        let state = {
            let mut b = self.lock();
            let s = b.pending.remove(&c.op.id);
            b.done.push(c);
            s
        };
        self.cv.notify_all();
        lock(&self.notifier).notify();
        state
    }

    /// Move finished ops into `out` (the backend's `poll`). Never blocks for long.
    pub fn drain(&self, out: &mut Vec<OpCompletion>) {
        out.append(&mut self.lock().done);
    }

    /// Block until none of `ops` is pending or `until` passes (the backend's `wait`).
    pub fn wait(&self, ops: &[OpId], until: Instant) -> WaitOutcome {
        let mut b = self.lock();
        loop {
            if ops.iter().all(|o| !b.pending.contains_key(o)) {
                return WaitOutcome::Completed;
            }
            let now = Instant::now();
            if now >= until {
                return WaitOutcome::TimedOut;
            }
            b = wait_timeout(&self.cv, b, until - now);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::ids::{Direction, RequestId, TaskId};
    use crate::op::Op;

    fn op(id: u64) -> Op {
        Op {
            id: OpId(id),
            task: TaskId(1),
            request: RequestId(1),
            dir: Direction::Load,
            deadline: Instant::now(),
            blocks: vec![],
        }
    }

    #[test]
    fn wait_returns_when_a_worker_completes_and_the_notifier_fires() {
        let board = Arc::new(CompletionBoard::<bool>::default());
        let woken = Arc::new(AtomicUsize::new(0));
        let w = woken.clone();
        board.set_notifier(Notifier::new(move || {
            w.fetch_add(1, Ordering::SeqCst);
        }));
        board.begin(OpId(1), false);
        assert!(!board.begin_bounded(OpId(2), false, 1), "limit reached");
        assert_eq!(
            board.with_pending(OpId(1), |c| std::mem::replace(c, true)),
            Some(false)
        );
        let b = board.clone();
        let worker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            b.complete(OpCompletion::all(op(1), Ok(())))
        });
        let until = Instant::now() + Duration::from_secs(5);
        assert_eq!(board.wait(&[OpId(1)], until), WaitOutcome::Completed);
        assert_eq!(
            worker.join().unwrap(),
            Some(true),
            "the op's state comes back"
        );
        assert_eq!(woken.load(Ordering::SeqCst), 1);
        let mut out = Vec::new();
        board.drain(&mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(board.pending_len(), 0);
        board.begin(OpId(3), false);
        let soon = Instant::now() + Duration::from_millis(10);
        assert_eq!(board.wait(&[OpId(3)], soon), WaitOutcome::TimedOut);
        assert_eq!(board.abandon(OpId(3)), Some(false));
    }
}
