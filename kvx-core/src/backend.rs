//! The one trait every hardware backend implements.

use std::sync::Arc;
use std::time::Instant;

use crate::ids::OpId;
use crate::op::{Op, OpCompletion};

/// Wakes the driver when a backend has completions ready.
#[derive(Clone)]
pub struct Notifier(Arc<dyn Fn() + Send + Sync>);

impl Notifier {
    /// A notifier that calls `f`.
    pub fn new(f: impl Fn() + Send + Sync + 'static) -> Notifier {
        Notifier(Arc::new(f))
    }

    /// A notifier that does nothing (for backends polled in a loop, e.g. in tests).
    pub fn noop() -> Notifier {
        Notifier::new(|| {})
    }

    /// Wake whoever listens.
    pub fn notify(&self) {
        (self.0)()
    }
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Notifier")
    }
}

/// Why a backend refused an op without starting it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitErrorKind {
    /// The target is known to be unhealthy (breaker open) or shutting down.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// Too many ops (or zombie buffers) outstanding.
    #[error("busy: {0}")]
    Busy(String),
    /// The op cannot be executed by this backend.
    #[error("invalid op: {0}")]
    Invalid(String),
}

/// A refused op, handed back with its buffers.
#[derive(Debug)]
pub struct SubmitError {
    /// The op, untouched.
    pub op: Op,
    /// Why it was refused.
    pub kind: SubmitErrorKind,
}

/// What `Backend::wait` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOutcome {
    /// Every named op has completed (its completion is ready for `poll`, or already was polled).
    Completed,
    /// `until` passed first.
    TimedOut,
}

/// A device that executes ops: host memcpy, files, remote reads, GPU copies.
///
/// Contract, in short:
/// - `submit` takes ownership of an op (and its buffers) and returns at once, even when the
///   device behind it is stuck: no blocking syscall on the caller's thread. If it refuses, the op
///   comes back inside [`SubmitError`] so no buffer is lost.
/// - Every accepted op completes exactly once through `poll`, with its buffers, however late:
///   after a cancel, after its task timed out, after the device thaws. Until then the buffers
///   belong to the op (quarantine).
/// - `cancel` is a best-effort hint; the op still completes later.
/// - `wait` blocks the caller until the named ops completed or `until` passed (fences use it).
/// - After queueing completions a backend calls its [`Notifier`] so the driver wakes up.
/// - A backend that reads or writes engine memory says so in `touches_engine_memory`; such a
///   backend must only run bounded operations (memcpy, a device copy), never I/O that can hang.
pub trait Backend: Send {
    /// Short name for logs and errors (e.g. `host`, `posix:/mnt/kv`).
    fn name(&self) -> &str;
    /// True when ops read or write engine memory (then they must be bounded operations).
    fn touches_engine_memory(&self) -> bool;
    /// Install the notifier to call after completions are queued.
    fn set_notifier(&mut self, notifier: Notifier);
    /// Start an op. Must return promptly even if the device is stuck.
    fn submit(&mut self, op: Op) -> Result<(), SubmitError>;
    /// Move finished ops (with their buffers) into `out`. Never blocks.
    fn poll(&mut self, out: &mut Vec<OpCompletion>);
    /// Best effort: ask the device to abandon an op. It still completes later.
    fn cancel(&mut self, op: OpId);
    /// Block until the ops complete or `until` passes.
    fn wait(&mut self, ops: &[OpId], until: Instant) -> WaitOutcome;
}
