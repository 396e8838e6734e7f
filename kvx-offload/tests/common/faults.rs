//! Fault-injecting wrappers around a real backend, for exact interleavings: a gate that holds
//! every op it is given (the op neither completes nor can be cancelled) until it is opened,
//! and a fuse that panics on its Nth op.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::{Backend, Notifier, Op, OpCompletion, OpId, SubmitError, WaitOutcome};

#[derive(Default)]
struct GateState {
    open: AtomicBool,
    submitted: AtomicUsize,
    returned: AtomicUsize,
    notifier: Mutex<Option<Notifier>>,
}

/// The test's side of a [`Gate`].
#[derive(Clone)]
pub struct GateCtl(Arc<GateState>);

impl GateCtl {
    /// Let held and new ops through to the real backend.
    pub fn open(&self) {
        self.0.open.store(true, Ordering::Release);
        if let Some(n) = self.0.notifier.lock().unwrap().as_ref() {
            n.notify();
        }
    }

    /// Hold every new op.
    pub fn close(&self) {
        self.0.open.store(false, Ordering::Release);
    }

    /// Ops the driver submitted through the gate.
    pub fn submitted(&self) -> usize {
        self.0.submitted.load(Ordering::Acquire)
    }

    /// Ops whose completion the gate handed back to the driver.
    pub fn returned(&self) -> usize {
        self.0.returned.load(Ordering::Acquire)
    }
}

/// Holds ops while closed: they never complete and `cancel` does nothing to them.
pub struct Gate {
    inner: Box<dyn Backend>,
    state: Arc<GateState>,
    held: Vec<Op>,
}

impl Gate {
    /// A closed or open gate in front of `inner`.
    pub fn new(inner: Box<dyn Backend>, open: bool) -> (Gate, GateCtl) {
        let state = Arc::new(GateState::default());
        state.open.store(open, Ordering::Release);
        let ctl = GateCtl(state.clone());
        (
            Gate {
                inner,
                state,
                held: Vec::new(),
            },
            ctl,
        )
    }

    fn is_open(&self) -> bool {
        self.state.open.load(Ordering::Acquire)
    }

    fn release_held(&mut self) {
        for op in std::mem::take(&mut self.held) {
            if let Err(e) = self.inner.submit(op) {
                panic!("the real backend refused a held op: {:?}", e.kind);
            }
        }
    }
}

impl Backend for Gate {
    fn name(&self) -> &str {
        "gate"
    }

    fn touches_engine_memory(&self) -> bool {
        self.inner.touches_engine_memory()
    }

    fn set_notifier(&mut self, notifier: Notifier) {
        *self.state.notifier.lock().unwrap() = Some(notifier.clone());
        self.inner.set_notifier(notifier);
    }

    fn submit(&mut self, op: Op) -> Result<(), SubmitError> {
        self.state.submitted.fetch_add(1, Ordering::AcqRel);
        if self.is_open() {
            self.release_held();
            self.inner.submit(op)
        } else {
            self.held.push(op);
            Ok(())
        }
    }

    fn poll(&mut self, out: &mut Vec<OpCompletion>) {
        if self.is_open() {
            self.release_held();
        }
        let before = out.len();
        self.inner.poll(out);
        self.state
            .returned
            .fetch_add(out.len() - before, Ordering::AcqRel);
    }

    fn cancel(&mut self, op: OpId) {
        if !self.held.iter().any(|h| h.id == op) {
            self.inner.cancel(op);
        }
    }

    fn wait(&mut self, ops: &[OpId], until: Instant) -> WaitOutcome {
        while !self.is_open() {
            if Instant::now() >= until {
                return WaitOutcome::TimedOut;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.release_held();
        self.inner.wait(ops, until)
    }
}

/// Panics on its `n`th submitted op (1-based); a real backend otherwise.
pub struct Fuse {
    inner: Box<dyn Backend>,
    n: usize,
    seen: usize,
}

impl Fuse {
    /// A fuse that blows on op `n`.
    pub fn new(inner: Box<dyn Backend>, n: usize) -> Fuse {
        Fuse { inner, n, seen: 0 }
    }
}

impl Backend for Fuse {
    fn name(&self) -> &str {
        "fuse"
    }

    fn touches_engine_memory(&self) -> bool {
        self.inner.touches_engine_memory()
    }

    fn set_notifier(&mut self, notifier: Notifier) {
        self.inner.set_notifier(notifier);
    }

    fn submit(&mut self, op: Op) -> Result<(), SubmitError> {
        self.seen += 1;
        if self.seen == self.n {
            panic!("test fuse: op {} blew the backend", self.n);
        }
        self.inner.submit(op)
    }

    fn poll(&mut self, out: &mut Vec<OpCompletion>) {
        self.inner.poll(out);
    }

    fn cancel(&mut self, op: OpId) {
        self.inner.cancel(op);
    }

    fn wait(&mut self, ops: &[OpId], until: Instant) -> WaitOutcome {
        self.inner.wait(ops, until)
    }
}

/// A rig whose engine backend sits behind an open [`Gate`], and the gate's control.
pub fn gated_rig(dir: &std::path::Path, mut opts: super::Opts) -> (super::Rig, GateCtl) {
    let (ctl_tx, ctl_rx) = std::sync::mpsc::channel();
    opts.wrap_engine = Some(Box::new(move |inner| {
        let (gate, ctl) = Gate::new(inner, true);
        ctl_tx.send(ctl).unwrap();
        Box::new(gate)
    }));
    let r = super::rig(dir, opts);
    (r, ctl_rx.recv().unwrap())
}
