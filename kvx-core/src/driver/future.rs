//! `TaskFuture`: a task's report as a future (feature `tokio`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::error::CoreError;
use crate::ids::TaskId;
use crate::task::TaskReport;

use super::mailbox::{Mailbox, Watcher};

/// Resolves to the task's report once it reaches a terminal state; to
/// [`CoreError::DriverStopped`] if the driver stopped first, or [`CoreError::DroppedByReset`].
#[must_use = "a future does nothing unless awaited; the task runs either way, its report goes to the future"]
pub struct TaskFuture {
    id: TaskId,
    rx: oneshot::Receiver<TaskReport>,
    mailbox: Arc<Mailbox>,
}

impl TaskFuture {
    pub(super) fn new(id: TaskId, mailbox: Arc<Mailbox>) -> (TaskFuture, Watcher) {
        let (tx, rx) = oneshot::channel();
        let watcher: Watcher = Box::new(move |r| {
            let _ = tx.send(r);
        });
        (TaskFuture { id, rx, mailbox }, watcher)
    }

    /// The task's id.
    pub fn id(&self) -> TaskId {
        self.id
    }
}

impl Future for TaskFuture {
    type Output = Result<TaskReport, CoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let id = self.id;
        let mailbox = self.mailbox.clone();
        // The driver drops a watcher without calling it only on a reset or a stop; the stop
        // is recorded before the watchers are dropped.
        Pin::new(&mut self.rx).poll(cx).map(|r| {
            r.map_err(|_| match mailbox.stopped.get() {
                Some(s) => CoreError::DriverStopped {
                    reason: s.reason.clone(),
                },
                None if mailbox
                    .stop_requested
                    .load(std::sync::atomic::Ordering::Acquire) =>
                {
                    CoreError::DriverStopped {
                        reason: "stopped".into(),
                    }
                }
                None => CoreError::DroppedByReset(id),
            })
        })
    }
}
