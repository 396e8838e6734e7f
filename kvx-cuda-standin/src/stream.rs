//! Streams and events: each stream is a thread that runs its commands later, in order.
//!
//! `submit` only queues; the stream's thread waits while its device is stalled, sleeps the
//! per-copy delay, and runs copies, host functions, waits and event marks one after another.
//! An event's record is a mark in its stream's queue: the event is complete once the stream's
//! thread passed that mark. A wait (`cuStreamWaitEvent`) captures the event's latest mark at
//! the call, as on a GPU: the waiting stream's thread runs nothing after the wait until the
//! marked stream passed the mark, whatever the event is recorded on later. Once the context has
//! a sticky error the thread runs no more copies or host functions, but still passes every
//! mark and wait, so waiters wake and see the error.

use std::ffi::c_void;
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

/// A host function and its argument (`cuLaunchHostFunc`), run on the stream's thread.
pub(crate) struct HostCall {
    pub(crate) f: unsafe extern "C" fn(*mut c_void),
    /// The caller's `userData`, passed back untouched.
    pub(crate) data: usize,
}

enum Command {
    Copy(Copy),
    Host(HostCall),
    /// Passed when everything queued before it ran: an event's record.
    Mark,
    /// Wait until `0` passed its first `1` commands.
    Wait(Arc<StreamShared>, u64),
}

/// Commands queued and finished, for `cuStreamSynchronize`, marks and waits.
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

    /// Queue `c`; its position in the stream (1 for the first command ever queued).
    fn push(&self, c: Command) -> Result<u64, CUresult> {
        let tx = lock(&self.tx);
        let tx = tx.as_ref().ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        let position = {
            let mut p = lock(&self.progress);
            p.queued += 1;
            p.queued
        };
        tx.send(c)
            .map_err(|_| CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        Ok(position)
    }

    /// Queue copies (one command each, so the delay and the fault count apply per copy).
    pub(crate) fn copy(&self, copies: Vec<Copy>) -> Result<(), CUresult> {
        copies
            .into_iter()
            .try_for_each(|c| self.push(Command::Copy(c)).map(drop))
    }

    /// Queue a host function (`cuLaunchHostFunc`): it runs when the stream gets there, and the
    /// stream runs nothing else until it returns.
    pub(crate) fn host(&self, call: HostCall) -> Result<(), CUresult> {
        self.push(Command::Host(call)).map(drop)
    }

    /// Queue the record of `ev`: it completes when the stream gets there.
    pub(crate) fn record(self: &Arc<Self>, ev: &EventState) -> Result<(), CUresult> {
        let position = self.push(Command::Mark)?;
        *lock(&ev.latest) = Some((self.clone(), position));
        Ok(())
    }

    /// Queue a wait for `ev`'s latest record as it is now (none: nothing to wait for).
    pub(crate) fn wait_event(&self, ev: &EventState) -> Result<(), CUresult> {
        let Some((marked, position)) = lock(&ev.latest).clone() else {
            return Ok(());
        };
        self.push(Command::Wait(marked, position)).map(drop)
    }

    /// Whether the stream's thread ran its first `position` commands.
    fn passed(&self, position: u64) -> bool {
        lock(&self.progress).done >= position
    }

    /// Sleep until the stream's thread ran its first `position` commands.
    fn wait_passed(&self, position: u64) {
        let mut p = lock(&self.progress);
        while p.done < position {
            p = wait(&self.advanced, p);
        }
    }

    /// Wait until everything queued so far ran; the context's sticky error, if any.
    pub(crate) fn synchronize(&self) -> Result<(), CUresult> {
        let target = lock(&self.progress).queued;
        self.wait_passed(target);
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
                Command::Host(call) => {
                    if self.ctx.check().is_ok() {
                        // SAFETY: the function and its argument are what the caller of
                        // cuLaunchHostFunc passed, to be called once on a thread of the driver
                        // with that argument (libcuda's contract).
                        unsafe { (call.f)(call.data as *mut c_void) };
                    }
                }
                Command::Mark => {}
                Command::Wait(marked, position) => marked.wait_passed(position),
            }
            lock(&self.progress).done += 1;
            self.advanced.notify_all();
        }
    }
}

/// An event: complete when the stream of its latest record passed it (or never recorded).
pub(crate) struct EventState {
    pub(crate) ctx: Arc<Context>,
    /// The stream of the latest record and the record's position in it.
    latest: Mutex<Option<(Arc<StreamShared>, u64)>>,
}

impl EventState {
    pub(crate) fn new(ctx: Arc<Context>) -> Arc<EventState> {
        Arc::new(EventState {
            ctx,
            latest: Mutex::new(None),
        })
    }

    /// `cuEventSynchronize`: wait for the latest record; then the context's sticky error.
    pub(crate) fn synchronize(&self) -> Result<(), CUresult> {
        if let Some((stream, position)) = lock(&self.latest).clone() {
            stream.wait_passed(position);
        }
        self.ctx.check()
    }

    /// `cuEventQuery`'s answer: has the stream reached the latest record?
    pub(crate) fn is_complete(&self) -> bool {
        lock(&self.latest)
            .as_ref()
            .is_none_or(|(stream, position)| stream.passed(*position))
    }
}
