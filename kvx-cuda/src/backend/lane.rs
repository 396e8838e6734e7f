//! One direction's streams and its completer thread.
//!
//! Each lane is a FIFO of ops: `submit` queues an op's copies on up to `copy_streams` streams,
//! records one event per stream part, then pushes the op here; the completer pops the oldest op,
//! waits for every part's event (polling it every `completion_poll`, or sleeping in
//! `cuEventSynchronize`), and only then hands the op — and its buffers — back through the shared
//! completion list, waking `Backend::wait` callers and the driver's Notifier. Ops complete in
//! submission order even when a later one's copies ended first. An op's buffers therefore never
//! leave the backend before the DMA that reads or writes them finished, however late that is
//! after the task's deadline (the tracker keeps such an op as a zombie meanwhile).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use kvx_core::{BlockError, Op, OpCompletion};

use super::Ledger;
use crate::driver::Ctx;
use crate::error::CudaError;
use crate::stream::{Event, Stream};

/// What a completer waits on before it hands an op back: the moment the device is done with
/// the op's buffers.
pub(crate) trait Fence: Send + 'static {
    /// Block until the op's copies finished. `Err` only when their fate is unknown because the
    /// context itself broke (a sticky error aborts all of its work).
    fn wait(self, ledger: &Ledger) -> Result<(), CudaError>;
}

/// One stream's share of an op: the event recorded after its copies, or failing that the
/// stream itself.
pub(crate) struct FencePart {
    /// Recorded after the part's copies; `None` if recording failed.
    pub(crate) event: Option<Event>,
    /// The stream the part's copies were queued on.
    pub(crate) stream: Arc<Stream>,
}

/// The CUDA fence of an op: every part of it (one per stream its copies were spread over).
pub(crate) struct CudaFence {
    /// One per stream the op's copies went to, in stream order.
    pub(crate) parts: Vec<FencePart>,
    /// The context, rebound before a stream fallback.
    pub(crate) ctx: Arc<Ctx>,
    /// How events are waited for ([`crate::CudaBackendConfig::completion_poll`]).
    pub(crate) poll: Option<Duration>,
}

impl Fence for CudaFence {
    fn wait(self, ledger: &Ledger) -> Result<(), CudaError> {
        let mut result = Ok(());
        for part in self.parts {
            if let Some(ev) = part.event {
                match ev.wait(self.poll) {
                    Ok(()) => {
                        ledger.put_event(ev);
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "waiting for the op's event failed; synchronising the stream")
                    }
                }
            }
            let synced = self.ctx.bind().and_then(|()| part.stream.synchronize());
            if result.is_ok() {
                result = synced;
            }
        }
        result
    }
}

/// An op whose copies are queued on a lane's stream.
pub(crate) struct InFlight<F> {
    /// The op, holding its buffers.
    pub(crate) op: Op,
    /// Per-block results decided at submit (invalid blocks, enqueue failures).
    pub(crate) results: Vec<Result<(), BlockError>>,
    /// Holds once the device is done with the op's buffers.
    pub(crate) fence: F,
}

struct Queue<F> {
    items: VecDeque<InFlight<F>>,
    shutdown: bool,
}

/// The FIFO of ops queued on one stream.
pub(crate) struct Lane<F> {
    q: Mutex<Queue<F>>,
    cv: Condvar,
}

impl<F: Fence> Lane<F> {
    pub(crate) fn new() -> Lane<F> {
        Lane {
            q: Mutex::new(Queue {
                items: VecDeque::new(),
                shutdown: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// Queue an op whose fence is already set (its event recorded).
    pub(crate) fn push(&self, f: InFlight<F>) {
        kvx_core::lock(&self.q).items.push_back(f);
        self.cv.notify_one();
    }

    /// Ask the completer to exit once the queue is drained.
    pub(crate) fn shutdown(&self) {
        kvx_core::lock(&self.q).shutdown = true;
        self.cv.notify_all();
    }

    /// The oldest op, or `None` once shut down and drained. Blocks while the lane is idle.
    fn next(&self) -> Option<InFlight<F>> {
        let mut q = kvx_core::lock(&self.q);
        loop {
            if let Some(f) = q.items.pop_front() {
                return Some(f);
            }
            if q.shutdown {
                return None;
            }
            q = kvx_core::sync::wait(&self.cv, q);
        }
    }
}

/// Body of a completer thread: wait for each op's fence in order and complete the op.
pub(crate) fn run<F: Fence>(lane: Arc<Lane<F>>, ledger: Arc<Ledger>) {
    while let Some(f) = lane.next() {
        let InFlight {
            op,
            mut results,
            fence,
        } = f;
        if let Err(e) = fence.wait(&ledger) {
            // The copies' fate is unknown only if the context itself is broken (a sticky
            // error aborts all of its work), so the buffers are safe to hand back; the
            // blocks are reported failed. (An op whose queueing already failed was counted.)
            if results.iter().any(|r| r.is_ok()) {
                ledger.stats.failed_ops.fetch_add(1, Ordering::Relaxed);
            }
            let msg = format!("CUDA copy did not complete: {e}");
            for r in results.iter_mut().filter(|r| r.is_ok()) {
                *r = Err(BlockError::Io(msg.clone()));
            }
        }
        ledger.complete(OpCompletion { op, results });
    }
}
