//! Streams and events: each stream is a thread that runs its commands later, in order.
//!
//! `submit` only queues; the stream's thread waits while its device is stalled, sleeps the
//! per-copy delay, and runs copies and event records one after another. An event completes
//! when the thread reaches its record; waiting for an event or a stream sleeps until then.
//! Once the context has a sticky error the thread runs no more copies, but still reaches every
//! record, so waiters wake and see the error.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};

use cudarc::driver::sys::CUresult;
use kvx_core::lock;
use kvx_core::sync::wait;

use crate::knobs::CopyVerdict;
use crate::memory::{Place, copy};
use crate::registry::Context;

/// One copy a stream runs.
pub(crate) struct Copy {
    pub(crate) dst: Place,
    pub(crate) src: Place,
    pub(crate) len: usize,
}

enum Command {
    Copy(Copy),
    Record(Arc<EventState>, u64),
}

/// Commands queued and finished, for `cuStreamSynchronize`.
#[derive(Default)]
struct Progress {
    queued: u64,
    done: u64,
}

/// A stream: its context, its queue and its progress.
pub(crate) struct StreamShared {
    pub(crate) ctx: Arc<Context>,
    tx: Mutex<Option<Sender<Command>>>,
    progress: Mutex<Progress>,
    advanced: Condvar,
}

impl StreamShared {
    /// Create a stream of `ctx` and start its thread.
    pub(crate) fn spawn(ctx: Arc<Context>) -> Result<Arc<StreamShared>, CUresult> {
        let (tx, rx) = channel();
        let s = Arc::new(StreamShared {
            ctx,
            tx: Mutex::new(Some(tx)),
            progress: Mutex::new(Progress::default()),
            advanced: Condvar::new(),
        });
        let runner = s.clone();
        std::thread::Builder::new()
            .name("cuda-standin-stream".into())
            .spawn(move || runner.run(rx))
            .map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
        s.ctx.add_stream(&s);
        Ok(s)
    }

    fn push(&self, c: Command) -> Result<(), CUresult> {
        let tx = lock(&self.tx);
        let tx = tx.as_ref().ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        lock(&self.progress).queued += 1;
        tx.send(c).map_err(|_| CUresult::CUDA_ERROR_INVALID_HANDLE)
    }

    /// Queue copies (one command each, so the delay and the fault count apply per copy).
    pub(crate) fn copy(&self, copies: Vec<Copy>) -> Result<(), CUresult> {
        copies
            .into_iter()
            .try_for_each(|c| self.push(Command::Copy(c)))
    }

    /// Queue the record of `ev`: it completes when the stream gets there.
    pub(crate) fn record(&self, ev: &Arc<EventState>) -> Result<(), CUresult> {
        let generation = {
            let mut st = lock(&ev.state);
            st.recorded += 1;
            st.recorded
        };
        self.push(Command::Record(ev.clone(), generation))
    }

    /// Wait until everything queued so far ran; the context's sticky error, if any.
    pub(crate) fn synchronize(&self) -> Result<(), CUresult> {
        let mut p = lock(&self.progress);
        let target = p.queued;
        while p.done < target {
            p = wait(&self.advanced, p);
        }
        drop(p);
        self.ctx.check()
    }

    /// `cuStreamDestroy`: no new work; what is queued still runs, then the thread ends.
    pub(crate) fn close(&self) {
        lock(&self.tx).take();
    }

    fn run(self: Arc<Self>, rx: Receiver<Command>) {
        let knobs = &self.ctx.device.knobs;
        for c in rx {
            knobs.wait_running();
            match c {
                Command::Copy(c) => {
                    if self.ctx.check().is_ok()
                        && (knobs.before_copy() == CopyVerdict::Fault
                            || !copy(&c.dst, &c.src, c.len))
                    {
                        self.ctx.poison();
                    }
                }
                Command::Record(ev, generation) => ev.reached(generation),
            }
            lock(&self.progress).done += 1;
            self.advanced.notify_all();
        }
    }
}

/// Records made and reached.
#[derive(Default)]
struct Marks {
    recorded: u64,
    reached: u64,
}

/// An event: complete when its stream reached its latest record (or never recorded).
pub(crate) struct EventState {
    pub(crate) ctx: Arc<Context>,
    state: Mutex<Marks>,
    done: Condvar,
}

impl EventState {
    pub(crate) fn new(ctx: Arc<Context>) -> Arc<EventState> {
        Arc::new(EventState {
            ctx,
            state: Mutex::new(Marks::default()),
            done: Condvar::new(),
        })
    }

    fn reached(&self, generation: u64) {
        let mut st = lock(&self.state);
        st.reached = st.reached.max(generation);
        drop(st);
        self.done.notify_all();
    }

    /// `cuEventSynchronize`: wait for the latest record; then the context's sticky error.
    pub(crate) fn synchronize(&self) -> Result<(), CUresult> {
        let mut st = lock(&self.state);
        let target = st.recorded;
        while st.reached < target {
            st = wait(&self.done, st);
        }
        drop(st);
        self.ctx.check()
    }

    /// `cuEventQuery`'s answer: has the stream reached the latest record?
    pub(crate) fn is_complete(&self) -> bool {
        let st = lock(&self.state);
        st.reached >= st.recorded
    }
}
