//! The noop engine: every job completes at once, without touching a file (as foyer's noop
//! engine does). A store reports success and its block enters the index; a load or a probe
//! finds nothing (`NotFound`), so the block leaves the index again; a remove succeeds. It
//! measures what the store's own machinery costs, with no device underneath.

use std::sync::Arc;

use super::{Engine, EngineCounters, Outbox, Refused};
use crate::job::BlockJob;

/// The engine that runs no syscall.
pub(crate) struct NoopEngine {
    outbox: Arc<Outbox>,
    counters: EngineCounters,
    target: usize,
    room: usize,
}

impl NoopEngine {
    /// A noop engine reporting `queue_depth` workers and room for `max_queued` jobs.
    pub(crate) fn new(queue_depth: usize, max_queued: usize, outbox: Arc<Outbox>) -> NoopEngine {
        let counters = EngineCounters::default();
        counters
            .workers
            .store(queue_depth, std::sync::atomic::Ordering::Release);
        NoopEngine {
            outbox,
            counters,
            target: queue_depth,
            room: max_queued.max(1),
        }
    }
}

impl Engine for NoopEngine {
    fn name(&self) -> &'static str {
        "noop"
    }

    fn submit(&self, mut job: Box<BlockJob>) -> Result<(), Refused> {
        job.complete_without_io();
        self.outbox.push([job]);
        Ok(())
    }

    fn room(&self) -> usize {
        self.room
    }

    fn write_off_overdue(&self) {}

    fn counters(&self) -> &EngineCounters {
        &self.counters
    }

    fn target(&self) -> usize {
        self.target
    }

    fn queued(&self) -> usize {
        0
    }
}
