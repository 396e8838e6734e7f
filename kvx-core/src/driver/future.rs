//! `TaskFuture`: a task's report as a future (feature `tokio`).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::error::CoreError;
use crate::ids::TaskId;
use crate::task::TaskReport;

/// Resolves to the task's report once it reaches a terminal state.
pub struct TaskFuture {
    id: TaskId,
    rx: oneshot::Receiver<TaskReport>,
}

impl TaskFuture {
    pub(crate) fn new(id: TaskId) -> (TaskFuture, super::Watcher) {
        let (tx, rx) = oneshot::channel();
        let watcher: super::Watcher = Box::new(move |r| {
            let _ = tx.send(r);
        });
        (TaskFuture { id, rx }, watcher)
    }

    /// The task's id.
    pub fn id(&self) -> TaskId {
        self.id
    }
}

impl Future for TaskFuture {
    type Output = Result<TaskReport, CoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.rx)
            .poll(cx)
            .map(|r| r.map_err(|_| CoreError::DriverStopped))
    }
}
