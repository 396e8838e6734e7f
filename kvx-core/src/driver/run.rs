//! The driver thread: one loop that applies commands, polls backends, fires timers, hands ops
//! to backends and publishes results, with every pass (and so every backend call) run under
//! `catch_unwind` so that a panic stops the driver cleanly instead of hanging its callers.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use crate::backend::{Backend, Notifier};
use crate::ids::TaskId;
use crate::metrics;
use crate::op::OpCompletion;
use crate::sync::lock;
use crate::task::TaskReport;
use crate::tracker::{BackendCommand, Event, Fence, Tracker};

use super::fence::FenceSlot;
use super::mailbox::{Cmd, Mailbox, Watcher};
use super::{DriverConfig, Stopped, TICK};

/// Records a stop even if the thread unwinds past every other handler, so no caller can wait
/// on a driver that is gone.
struct StopGuard(Arc<Mailbox>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        self.0.stop(Stopped {
            reason: "the driver thread exited".into(),
            blocks_at_risk: None,
        });
    }
}

/// Body of the driver thread.
pub(super) fn run(mailbox: Arc<Mailbox>, cfg: DriverConfig, backends: Vec<Box<dyn Backend>>) {
    let _guard = StopGuard(mailbox.clone());
    let mut l = Loop {
        mailbox: mailbox.clone(),
        tracker: Tracker::new(cfg.tracker.clone()),
        backends,
        batch: VecDeque::new(),
        fences: Vec::new(),
        fence_check: None,
        watchers: FxHashMap::default(),
        completions: Vec::new(),
        reports: Vec::new(),
        applied: 0,
        gauges_at: None,
    };
    let result = catch_unwind(AssertUnwindSafe(|| {
        l.install();
        l.run(cfg.max_park)
    }));
    let reason = match result {
        Ok(()) => "stopped".to_string(),
        Err(payload) => {
            let msg = panic_message(payload.as_ref());
            tracing::error!(panic = %msg, "kvx driver thread panicked: the driver stops");
            format!("the driver thread panicked: {msg}")
        }
    };
    let blocks_at_risk = catch_unwind(AssertUnwindSafe(|| l.tracker.engine_blocks_out())).ok();
    // Record first: futures woken by the dropped watchers below read the reason.
    mailbox.stop(Stopped {
        reason,
        blocks_at_risk,
    });
    // Backends are dropped here, on the driver thread (a backend's drop may wait for its
    // workers); a second panic in a drop is contained.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(l)));
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

struct Loop {
    mailbox: Arc<Mailbox>,
    tracker: Tracker,
    backends: Vec<Box<dyn Backend>>,
    /// Commands taken from the queue and not yet applied (kept here, not on the stack, so a
    /// panic does not drop their watchers before the stop is recorded).
    batch: VecDeque<Cmd>,
    fences: Vec<(Fence, Arc<FenceSlot>)>,
    /// The next moment a pending fence's copies become overdue (their due time plus a tick):
    /// the thread makes a pass then, so a waiter learns it without waiting for `max_park`.
    fence_check: Option<Instant>,
    watchers: FxHashMap<TaskId, Watcher>,
    completions: Vec<OpCompletion>,
    /// Reports for the outbox, collected during a pass.
    reports: Vec<TaskReport>,
    applied: u64,
    /// When the tracker's gauges were last published to the metrics recorder.
    gauges_at: Option<Instant>,
}

/// How often at most the driver publishes the tracker's gauges (a scrape interval is seconds;
/// a busy driver makes thousands of passes a second).
const GAUGE_INTERVAL: Duration = Duration::from_millis(100);

impl Loop {
    /// Register the backends with the tracker and give them a way to wake this thread.
    fn install(&mut self) {
        let me = std::thread::current();
        for b in self.backends.iter_mut() {
            let t = me.clone();
            b.set_notifier(Notifier::new(move || t.unpark()));
            self.tracker.add_backend(b.touches_engine_memory());
        }
        self.publish(Vec::new(), false);
    }

    fn run(&mut self, max_park: Duration) {
        while !self.mailbox.stop_requested.load(Ordering::Acquire) {
            if !self.turn() {
                let wake = match (self.tracker.poll_timeout(), self.fence_check) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let park = match wake {
                    Some(at) => at.saturating_duration_since(Instant::now()).min(max_park),
                    None => max_park,
                };
                if !park.is_zero() {
                    std::thread::park_timeout(park);
                }
            }
        }
    }

    /// One pass: commands, completions, timers, backend commands, events, fences, then the
    /// outbox. True if anything happened.
    fn turn(&mut self) -> bool {
        let mut busy = false;
        self.batch
            .extend(std::mem::take(&mut *lock(&self.mailbox.cmds)));
        let now = Instant::now();
        while let Some(cmd) = self.batch.pop_front() {
            busy = true;
            self.applied += 1;
            self.apply(cmd, now);
        }
        for b in self.backends.iter_mut() {
            b.poll(&mut self.completions);
        }
        let now = Instant::now();
        for c in std::mem::take(&mut self.completions) {
            busy = true;
            self.tracker.handle_completion(c, now);
        }
        self.tracker.handle_timeout(Instant::now());
        while let Some(t) = self.tracker.poll_backend_command() {
            busy = true;
            match t {
                BackendCommand::Submit { backend, op } => {
                    if let Err(e) = self.backends[backend.0 as usize].submit(op) {
                        self.tracker.handle_submit_error(e, Instant::now());
                    }
                }
                BackendCommand::Cancel { backend, op } => {
                    self.backends[backend.0 as usize].cancel(op)
                }
            }
        }
        let mut released = Vec::new();
        while let Some(ev) = self.tracker.poll_event() {
            busy = true;
            match ev {
                Event::TaskFinished(r) => {
                    metrics::record_report(&r);
                    match self.watchers.remove(&r.task) {
                        Some(w) => w(r),
                        None => self.reports.push(r),
                    }
                }
                Event::RequestReleased(req) => released.push(req),
            }
        }
        let tracker = &self.tracker;
        let mut fence_held = false;
        let mut fence_check: Option<Instant> = None;
        self.fences.retain(|(f, slot)| {
            let holds = tracker.fence_holds(f);
            if holds {
                slot.set();
                fence_held = true;
            } else if let Some(due) = tracker.fence_due(f) {
                slot.note_due(due, now);
                let overdue_at = due + TICK;
                if overdue_at > now {
                    fence_check = Some(fence_check.map_or(overdue_at, |c| c.min(overdue_at)));
                }
            }
            !holds
        });
        self.fence_check = fence_check;
        self.publish(released, fence_held);
        busy
    }

    /// Put results and a stats snapshot in the outbox; wake waiters if there is news.
    fn publish(&mut self, released: Vec<crate::ids::RequestId>, fence_held: bool) {
        let news = fence_held || !released.is_empty() || !self.reports.is_empty();
        let stats = self.tracker.stats();
        let now = Instant::now();
        if self
            .gauges_at
            .is_none_or(|t| now.duration_since(t) >= GAUGE_INTERVAL)
        {
            metrics::record_stats(&stats);
            self.gauges_at = Some(now);
        }
        let empty = self.tracker.is_empty();
        {
            let mut out = lock(&self.mailbox.out);
            out.finished.reports.append(&mut self.reports);
            out.finished.released.extend(released);
            out.stats = stats;
            out.empty = empty;
            out.applied = self.applied;
        }
        if news {
            self.mailbox.cv.notify_all();
        }
    }

    fn apply(&mut self, cmd: Cmd, now: Instant) {
        match cmd {
            Cmd::Submit(id, spec, bond, watcher) => {
                if let Some(w) = watcher {
                    self.watchers.insert(id, w);
                }
                if let Err(e) = self.tracker.submit_as(id, spec, bond, now) {
                    tracing::error!(%id, error = %e, "driver: task id reused");
                    self.watchers.remove(&id);
                }
            }
            Cmd::StartStep => self.tracker.start_step(),
            Cmd::Cancel(t) => self.tracker.cancel(t, now),
            Cmd::Preempt(req, slot) => {
                let f = self.tracker.preempt(req, now);
                metrics::record_fence("preempt");
                self.fences.push((f, slot));
            }
            Cmd::FenceBlocks(blocks, slot) => {
                let f = self.tracker.fence_blocks(&blocks);
                metrics::record_fence("blocks");
                self.fences.push((f, slot));
            }
            Cmd::Finish(req) => {
                self.tracker.finish(req, now);
            }
            Cmd::Reset(slot) => {
                let f = self.tracker.reset(now);
                metrics::record_fence("reset");
                self.fences.push((f, slot));
                // Dropped watchers resolve their futures with `DroppedByReset`.
                self.watchers.clear();
            }
        }
    }
}
