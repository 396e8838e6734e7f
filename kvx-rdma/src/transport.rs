//! The consumer side of a transport: how blocks of a remote request get into local buffers.

use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

use kvx_core::{BlockError, PoolBuf};
use tokio::sync::watch;

use crate::descriptor::{RemoteDescriptor, TransportKind};
use crate::error::RdmaError;

/// A boxed, sendable future (the trait is object safe).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One block to read: its index in the descriptor and the kvx-owned buffer it lands in.
#[derive(Debug)]
pub struct ReadSlot<'b> {
    /// Index of the block in `RemoteDescriptor::blocks`.
    pub index: u32,
    /// Destination; its capacity is at least the descriptor's block size.
    pub buf: &'b mut PoolBuf,
}

/// Fires when an op is cancelled.
#[derive(Debug, Clone)]
pub struct CancelToken(watch::Receiver<bool>);

/// The other end of a [`CancelToken`].
#[derive(Debug)]
pub(crate) struct CancelSource(watch::Sender<bool>);

impl CancelToken {
    /// A token and the source that fires it.
    pub(crate) fn new() -> (CancelSource, CancelToken) {
        let (tx, rx) = watch::channel(false);
        (CancelSource(tx), CancelToken(rx))
    }

    /// True once fired.
    pub fn is_cancelled(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves when fired (never, if the source is dropped unfired).
    pub async fn cancelled(&self) {
        let mut rx = self.0.clone();
        if rx.wait_for(|v| *v).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl CancelSource {
    /// Fire the token.
    pub(crate) fn cancel(&self) {
        let _ = self.0.send(true);
    }
}

/// How a consumer reads from a producer. Implementations: [`crate::TcpTransport`] and, with
/// the `verbs` feature, `VerbsTransport`.
///
/// The ownership rule: `read` may write a slot's buffer only while its future runs; when the
/// future resolves, or is dropped, nothing may touch the buffers any more (a transport whose
/// device writes asynchronously, like an RDMA NIC, must flush its outstanding work first).
pub trait Transport: Send + Sync + 'static {
    /// Which descriptors this transport serves.
    fn kind(&self) -> TransportKind;

    /// Read the slots' blocks of `desc`; one result per slot, in order. Must resolve by
    /// `deadline` (unread blocks `TimedOut`) or soon after `cancel` fires (`Cancelled`).
    fn read<'a, 'b: 'a>(
        &'a self,
        desc: &'a RemoteDescriptor,
        slots: &'a mut [ReadSlot<'b>],
        deadline: Instant,
        cancel: &'a CancelToken,
    ) -> BoxFuture<'a, Vec<Result<(), BlockError>>>;

    /// Renew the lease of `desc`'s request.
    fn heartbeat<'a>(&'a self, desc: &'a RemoteDescriptor) -> BoxFuture<'a, Result<(), RdmaError>>;

    /// Tell the producer this reader is done with `desc`'s request.
    fn done<'a>(&'a self, desc: &'a RemoteDescriptor) -> BoxFuture<'a, Result<(), RdmaError>>;
}
