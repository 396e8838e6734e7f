//! `CompletionBoard`: the completion routing every backend needs, written once.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use crate::backend::{Notifier, WaitOutcome};
use crate::ids::OpId;
use crate::op::OpCompletion;
use crate::sync::{lock, wait_timeout};

struct Board<P, C> {
    pending: FxHashMap<OpId, P>,
    done: Vec<C>,
}

/// Pending ops, finished ops, and the wake-ups between a backend and its workers.
///
/// A backend marks an op pending when it accepts it, its worker (thread, ring reaper, CUDA
/// event waiter, network task) posts the op's completion when the device really returned the
/// buffers, `poll` drains what is done, `wait` blocks until named ops are done, and the driver's
/// notifier is called after each completion. Each pending op may carry backend state `P`
/// (a cancel flag, a cancel token).
///
/// What is posted is an [`OpCompletion`] by default; a backend that finishes an op from parts
/// (one job per block, say) posts the parts `C` instead with [`CompletionBoard::post`] and
/// takes them with [`CompletionBoard::drain`] or [`CompletionBoard::take_or_wait`].
pub struct CompletionBoard<P = (), C = OpCompletion> {
    board: Mutex<Board<P, C>>,
    cv: Condvar,
    notifier: Mutex<Notifier>,
}

impl<P, C> Default for CompletionBoard<P, C> {
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

impl<P, C> CompletionBoard<P, C> {
    /// Install the driver's notifier.
    pub fn set_notifier(&self, n: Notifier) {
        *lock(&self.notifier) = n;
    }

    /// An op was accepted: it is pending until `complete`.
    pub fn begin(&self, op: OpId, state: P) {
        lock(&self.board).pending.insert(op, state);
    }

    /// Accept `op` only while fewer than `limit` ops are pending; false if the limit is reached.
    pub fn begin_bounded(&self, op: OpId, state: P, limit: usize) -> bool {
        let mut b = lock(&self.board);
        if b.pending.len() >= limit {
            return false;
        }
        b.pending.insert(op, state);
        true
    }

    /// Forget a pending op that was never started (its submit was refused).
    pub fn abandon(&self, op: OpId) -> Option<P> {
        lock(&self.board).pending.remove(&op)
    }

    /// Run `f` on a pending op's state; `None` if it is not pending.
    pub fn with_pending<R>(&self, op: OpId, f: impl FnOnce(&mut P) -> R) -> Option<R> {
        lock(&self.board).pending.get_mut(&op).map(f)
    }

    /// Ops pending now.
    pub fn pending_len(&self) -> usize {
        lock(&self.board).pending.len()
    }

    /// Move what finished into `out` (the backend's `poll`). Never blocks for long.
    pub fn drain(&self, out: &mut Vec<C>) {
        out.append(&mut lock(&self.board).done);
    }

    /// Post finished parts that were never pending themselves; waiters and the driver are
    /// woken if there was any.
    pub fn post(&self, items: impl IntoIterator<Item = C>) {
        let any = {
            let mut b = lock(&self.board);
            let before = b.done.len();
            b.done.extend(items);
            b.done.len() > before
        };
        if any {
            self.wake();
        }
    }

    /// Take everything finished, waiting up to `timeout` for something when there is nothing.
    pub fn take_or_wait(&self, timeout: Duration) -> Vec<C> {
        let mut b = lock(&self.board);
        if b.done.is_empty() {
            b = wait_timeout(&self.cv, b, timeout);
        }
        std::mem::take(&mut b.done)
    }

    fn wake(&self) {
        self.cv.notify_all();
        lock(&self.notifier).notify();
    }
}

impl<P> CompletionBoard<P, OpCompletion> {
    /// Post a finished op (its buffers inside): it leaves the pending set, waiters and the
    /// driver are woken. Returns the op's state.
    pub fn complete(&self, c: OpCompletion) -> Option<P> {
        let state = {
            let mut b = lock(&self.board);
            let s = b.pending.remove(&c.op.id);
            b.done.push(c);
            s
        };
        self.wake();
        state
    }

    /// Block until none of `ops` is pending or `until` passes (the backend's `wait`).
    pub fn wait(&self, ops: &[OpId], until: Instant) -> WaitOutcome {
        let mut b = lock(&self.board);
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

    #[test]
    fn posted_parts_wake_a_waiter_and_the_notifier() {
        let board = Arc::new(CompletionBoard::<(), u32>::default());
        let woken = Arc::new(AtomicUsize::new(0));
        let w = woken.clone();
        board.set_notifier(Notifier::new(move || {
            w.fetch_add(1, Ordering::SeqCst);
        }));
        assert!(board.take_or_wait(Duration::from_millis(5)).is_empty());
        board.post(std::iter::empty());
        assert_eq!(
            woken.load(Ordering::SeqCst),
            0,
            "nothing posted, nobody woken"
        );
        let b = board.clone();
        let worker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            b.post([1, 2]);
        });
        let mut got = Vec::new();
        let end = Instant::now() + Duration::from_secs(5);
        while got.len() < 2 && Instant::now() < end {
            got.extend(board.take_or_wait(Duration::from_secs(1)));
        }
        worker.join().unwrap();
        assert_eq!(got, vec![1, 2]);
        assert_eq!(woken.load(Ordering::SeqCst), 1);
        board.post([3]);
        let mut out = Vec::new();
        board.drain(&mut out);
        assert_eq!(out, vec![3]);
    }
}
