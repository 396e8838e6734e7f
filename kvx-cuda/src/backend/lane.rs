//! One direction's stream and its completer thread.
//!
//! Submission order on a stream is completion order, so each lane is a FIFO: `submit` queues
//! the copies, records the op's event, then pushes the op here; the completer pops the oldest
//! op, sleeps in `cuEventSynchronize` (the event has `CU_EVENT_BLOCKING_SYNC`, so no core
//! spins), and only then hands the op — and its buffers — back through the shared completion
//! list, waking `Backend::wait` callers and the driver's Notifier. An op's buffers therefore
//! never leave the backend before the DMA that reads or writes them finished, however late that
//! is after the task's deadline (the tracker keeps such an op as a zombie meanwhile).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};

use kvx_core::{BlockError, Op, OpCompletion};

use super::Shared;
use crate::driver::Ctx;
use crate::error::CudaError;
use crate::stream::{Event, Stream};

/// An op whose copies are queued on a lane's stream.
pub(crate) struct InFlight {
    /// The op, holding its buffers.
    pub(crate) op: Op,
    /// Per-block results decided at submit (invalid blocks, enqueue failures).
    pub(crate) results: Vec<Result<(), BlockError>>,
    /// Recorded after the op's copies; `None` if recording failed (then the whole stream is
    /// synchronised instead).
    pub(crate) event: Option<Event>,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<InFlight>,
    shutdown: bool,
}

/// A stream plus the FIFO of ops queued on it.
pub(crate) struct Lane {
    pub(crate) stream: Stream,
    q: Mutex<Queue>,
    cv: Condvar,
}

impl Lane {
    pub(crate) fn new(stream: Stream) -> Lane {
        Lane {
            stream,
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queue an op whose event is already recorded.
    pub(crate) fn push(&self, f: InFlight) {
        self.lock().items.push_back(f);
        self.cv.notify_one();
    }

    /// Ask the completer to exit once the queue is drained.
    pub(crate) fn shutdown(&self) {
        self.lock().shutdown = true;
        self.cv.notify_all();
    }

    /// The oldest op, or `None` once shut down and drained. Blocks while the lane is idle.
    fn next(&self) -> Option<InFlight> {
        let mut q = self.lock();
        loop {
            if let Some(f) = q.items.pop_front() {
                return Some(f);
            }
            if q.shutdown {
                return None;
            }
            q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Body of a completer thread: wait for each op's event in order and complete the op.
pub(crate) fn run(lane: Arc<Lane>, shared: Arc<Shared>, ctx: Arc<Ctx>) {
    if let Err(e) = ctx.bind() {
        tracing::error!(error = %e, "kvx-cuda completer cannot bind the CUDA context");
    }
    while let Some(f) = lane.next() {
        let InFlight {
            op,
            mut results,
            event,
        } = f;
        match wait_for(&lane, &ctx, event.as_ref()) {
            Ok(reusable) => {
                if let (true, Some(ev)) = (reusable, event) {
                    shared.put_event(ev);
                }
            }
            Err(e) => {
                // The copies' fate is unknown only if the context itself is broken (a sticky
                // error aborts all of its work), so the buffers are safe to hand back; the
                // blocks are reported failed.
                shared.stats.failed_ops.fetch_add(1, Ordering::Relaxed);
                let msg = format!("CUDA copy did not complete: {e}");
                for r in results.iter_mut().filter(|r| r.is_ok()) {
                    *r = Err(BlockError::Io(msg.clone()));
                }
            }
        }
        shared.complete(OpCompletion { op, results });
    }
}

/// Wait for the op's event; if that fails, rebind and fall back to the whole stream. `Ok(true)`
/// when the event itself completed (so it may be reused).
fn wait_for(lane: &Lane, ctx: &Ctx, event: Option<&Event>) -> Result<bool, CudaError> {
    if let Some(ev) = event {
        match ev.synchronize() {
            Ok(()) => return Ok(true),
            Err(e) => {
                tracing::warn!(error = %e, "cuEventSynchronize failed; synchronising the stream")
            }
        }
    }
    ctx.bind()?;
    lane.stream.synchronize().map(|()| false)
}
