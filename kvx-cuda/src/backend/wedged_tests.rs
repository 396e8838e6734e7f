//! A stream that never completes, without a GPU: the backend's completion path (lanes,
//! completer thread, completion board, `cancel`) with the op's CUDA event replaced by a latch
//! the test opens. The real-GPU counterpart is `deadline_quarantine_on_long_copy` in
//! `tests/gpu`, which holds a stream with a long copy.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvx_core::{
    Backend, BlockKey, Buf, BufferPool, DEFAULT_ALIGN, Direction, DriverBuilder, DriverConfig,
    EngineBlockId, Notifier, Op, OpBlock, OpCompletion, OpId, RequestId, SubmitError, TaskSpec,
    TaskState, WaitOutcome,
};

use super::lane::{self, Fence, InFlight, Lane};
use super::{Ledger, OpState};
use crate::error::CudaError;

/// The driver's timer granularity (kvx-core's tick) and the allowance these 2-core machines
/// add on top: the bound on when a verdict may come after a deadline.
const TICK: Duration = kvx_core::TICK;
const ALLOWANCE: Duration = Duration::from_millis(50);

/// Stands in for an op's CUDA event on a wedged stream: holds until opened.
#[derive(Clone, Default)]
struct Latch(Arc<(Mutex<bool>, Condvar)>);

impl Latch {
    fn open(&self) {
        *self.0.0.lock().unwrap() = true;
        self.0.1.notify_all();
    }
}

impl Fence for Latch {
    fn wait(self, _: &Ledger) -> Result<(), CudaError> {
        let mut open = self.0.0.lock().unwrap();
        while !*open {
            open = self.0.1.wait(open).unwrap();
        }
        Ok(())
    }
}

/// `CudaBackend`'s completion side over a latch: submit queues the op on a lane, a completer
/// thread waits for the latch, and poll, cancel and wait are the backend's own.
struct Wedged {
    ledger: Arc<Ledger>,
    lane: Arc<Lane<Latch>>,
    latch: Latch,
    submitted: Arc<Mutex<Vec<OpId>>>,
    completer: Option<JoinHandle<()>>,
}

impl Wedged {
    fn new(latch: Latch) -> Wedged {
        let ledger = Arc::new(Ledger::new());
        let lane = Arc::new(Lane::new());
        let completer = {
            let (lane, ledger) = (lane.clone(), ledger.clone());
            std::thread::spawn(move || lane::run(lane, ledger))
        };
        Wedged {
            ledger,
            lane,
            latch,
            submitted: Arc::default(),
            completer: Some(completer),
        }
    }
}

impl Backend for Wedged {
    fn name(&self) -> &str {
        "wedged-cuda"
    }

    fn touches_engine_memory(&self) -> bool {
        true
    }

    fn set_notifier(&mut self, notifier: Notifier) {
        self.ledger.board.set_notifier(notifier);
    }

    fn submit(&mut self, op: Op) -> Result<(), SubmitError> {
        self.ledger.board.begin(op.id, OpState::default());
        self.submitted.lock().unwrap().push(op.id);
        let results = vec![Ok(()); op.blocks.len()];
        let fence = self.latch.clone();
        self.lane.push(InFlight { op, results, fence });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<OpCompletion>) {
        self.ledger.board.drain(out);
    }

    fn cancel(&mut self, op: OpId) {
        self.ledger.abandon(op);
    }

    fn wait(&mut self, ops: &[OpId], until: Instant) -> WaitOutcome {
        self.ledger.board.wait(ops, until)
    }
}

impl Drop for Wedged {
    fn drop(&mut self) {
        self.lane.shutdown();
        if let Some(h) = self.completer.take() {
            let _ = h.join();
        }
    }
}

/// Wait up to `limit` for `f`; true if it held.
fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    f()
}

#[test]
fn a_wedged_copy_gets_its_verdict_at_the_deadline_and_stays_a_zombie() {
    let latch = Latch::default();
    let backend = Wedged::new(latch.clone());
    let ledger = backend.ledger.clone();
    let submitted = backend.submitted.clone();
    let mut b = DriverBuilder::new(DriverConfig::default());
    let id = b.backend(Box::new(backend));
    let driver = b.spawn().unwrap();
    let pool = BufferPool::new(2, 4096, DEFAULT_ALIGN).unwrap();
    let deadline = Instant::now() + Duration::from_millis(100);
    let task = driver
        .submit(TaskSpec {
            request: RequestId(1),
            dir: Direction::Load,
            route: vec![id],
            blocks: vec![OpBlock {
                key: BlockKey::chain(None, b"wedged"),
                engine: Some(EngineBlockId(0)),
                buf: Buf::Owned(pool.take().unwrap()),
            }],
            deadline,
            deferred: false,
        })
        .unwrap();
    // The delivery check below holds only if this thread waits before the deadline passes.
    let ahead = deadline.saturating_duration_since(Instant::now());
    println!("wedged copy: the caller waits for the verdict {ahead:?} before the deadline");
    assert!(
        !ahead.is_zero(),
        "submitting took past the deadline: the caller was not waiting"
    );

    // The verdict comes from the tracker at the deadline, though the copy never returns.
    let report = driver
        .wait_report(task, deadline + Duration::from_secs(5))
        .expect("a verdict for the wedged task");
    let reported = Instant::now();
    println!(
        "wedged copy: the verdict reached the caller {:?} after the deadline (bound {:?})",
        reported.saturating_duration_since(deadline),
        TICK + ALLOWANCE
    );
    assert_eq!(report.state, TaskState::TimedOut);
    assert!(
        reported <= deadline + TICK + ALLOWANCE,
        "verdict {:?} after the deadline",
        reported - deadline
    );
    assert!(
        report.blocks[0].buf.is_none(),
        "the zombie op keeps its buffer"
    );

    // The driver cancelled the op: it is marked abandoned, and still holds its buffer.
    assert!(eventually(Duration::from_secs(1), || ledger
        .snapshot()
        .abandoned_ops
        == 1));
    let s = ledger.snapshot();
    assert_eq!((s.zombies, s.in_flight, s.late_completions), (1, 1, 0));
    assert_eq!(pool.lent(), 1, "the pinned buffer stays with the op");
    let op = submitted.lock().unwrap()[0];
    // A fence over the op does not hold while the copy runs, cancelled or not.
    assert_eq!(
        ledger
            .board
            .wait(&[op], Instant::now() + Duration::from_millis(20)),
        WaitOutcome::TimedOut
    );

    // The copy finally completes: the buffer goes back, the late completion is counted.
    latch.open();
    assert_eq!(
        ledger
            .board
            .wait(&[op], Instant::now() + Duration::from_secs(2)),
        WaitOutcome::Completed
    );
    assert!(
        eventually(Duration::from_secs(2), || {
            drop(driver.get_finished());
            pool.is_whole()
        }),
        "{} buffers still out after the copy completed",
        pool.lent()
    );
    let s = ledger.snapshot();
    assert_eq!(
        (s.abandoned_ops, s.late_completions, s.zombies, s.in_flight),
        (1, 1, 0, 0)
    );
    drop(driver);
}

#[test]
fn abandon_marks_once_and_ignores_unknown_ops() {
    let ledger = Ledger::new();
    ledger.board.begin(OpId(7), OpState::default());
    ledger.abandon(OpId(7));
    ledger.abandon(OpId(7));
    ledger.abandon(OpId(8));
    let s = ledger.snapshot();
    assert_eq!((s.abandoned_ops, s.zombies, s.in_flight), (1, 1, 1));
}
