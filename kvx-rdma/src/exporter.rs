//! The producer: exports requests' engine blocks under leases and reports releases.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvx_core::lock;
use kvx_core::{BlockKey, EngineBlockId, KvLayout, Notifier, RequestId};
use kvx_policy::{LeaseConfig, LeaseState};
use tokio::sync::watch;

use crate::descriptor::{RemoteDescriptor, TransportKind};
use crate::error::RdmaError;
use crate::exports::{ExportStats, ExportTable, Refusal, Released};
use crate::memory::{EngineMemory, PinnedRead};
use crate::wire::ErrorCode;

struct Inner {
    table: Mutex<ExportTable>,
    /// The table's epoch, published to replies in progress and the server's reaper.
    lease_events: watch::Sender<u64>,
    mem: EngineMemory,
    notifier: Mutex<Notifier>,
    hooks: Mutex<Vec<Arc<dyn ReleaseHook>>>,
}

/// Something that must let go of a request's memory before the engine hears it was released
/// (the verbs transport deregisters the request's memory regions here).
pub(crate) trait ReleaseHook: Send + Sync {
    /// The request's lease ended and no read holds it; called before it becomes visible.
    fn released(&self, request: RequestId);
}

/// The producer side: which requests are readable, under which lease, and which are released.
///
/// Cheap to clone (one shared state); the servers of every transport hold a clone.
///
/// Lifecycle of a request: [`Exporter::export`] (lease pending: not readable, no expiry) →
/// [`Exporter::ready`] (the lease starts; reader heartbeats renew it) → released when every
/// expected reader said done, at expiry, or on [`Exporter::abort`]. The engine learns of it
/// from [`Exporter::poll_released`] and only then frees the blocks.
#[derive(Clone)]
pub struct Exporter {
    inner: Arc<Inner>,
}

impl Exporter {
    /// An exporter over the engine's KV pool described by `layout` (host memory).
    ///
    /// # Safety
    /// Every region of `layout` must be host memory valid for reads for as long as this
    /// exporter or a server holding it lives, and the engine must not write or free an exported
    /// block until [`Exporter::poll_released`] has returned its request.
    pub unsafe fn new(layout: KvLayout) -> Result<Exporter, RdmaError> {
        let mem = EngineMemory::new(layout)?;
        let table = ExportTable::new(mem.layout().num_blocks(), mem.layout().block_bytes() as u64);
        Ok(Exporter {
            inner: Arc::new(Inner {
                table: Mutex::new(table),
                lease_events: watch::Sender::new(0),
                mem,
                notifier: Mutex::new(Notifier::noop()),
                hooks: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The engine's layout.
    pub fn layout(&self) -> &KvLayout {
        self.inner.mem.layout()
    }

    /// Call `notifier` whenever a release is queued (so the engine polls promptly).
    pub fn set_notifier(&self, notifier: Notifier) {
        *lock(&self.inner.notifier) = notifier;
    }

    /// Export `blocks` (key and engine block, in the order readers name them) of `request` for
    /// `lease.expected_readers` readers. The lease is pending until [`Exporter::ready`].
    pub fn export(
        &self,
        request: RequestId,
        blocks: &[(BlockKey, EngineBlockId)],
        lease: &LeaseConfig,
    ) -> Result<(), RdmaError> {
        self.table().export(request, blocks, lease)
    }

    /// The request can be read from now on: its lease starts.
    pub fn ready(&self, request: RequestId) -> Result<(), RdmaError> {
        self.ready_at(request, Instant::now())
    }

    /// [`Exporter::ready`] with the caller's clock.
    pub fn ready_at(&self, request: RequestId, now: Instant) -> Result<(), RdmaError> {
        let r = self.table().ready(request, now);
        self.after_change();
        r
    }

    /// End the request's lease now (the engine aborted it); it is released once no read holds it.
    pub fn abort(&self, request: RequestId) -> Result<(), RdmaError> {
        let r = self.table().abort(request);
        self.after_change();
        r
    }

    /// `request` will not be exported here (the engine refused it): its readers hear that its
    /// lease ended (aborted) at once instead of waiting for it. No effect on a request exported
    /// now.
    pub fn refuse(&self, request: RequestId) {
        self.table().refuse(request);
    }

    /// The next released request (lease read, expired or aborted). Never blocks.
    pub fn poll_released(&self) -> Option<Released> {
        self.poll_released_at(Instant::now())
    }

    /// [`Exporter::poll_released`] with the caller's clock.
    pub fn poll_released_at(&self, now: Instant) -> Option<Released> {
        self.tick(now);
        self.table().pop_released()
    }

    /// When the next lease expires (poll again then).
    pub fn next_expiry(&self) -> Option<Instant> {
        self.table().next_timeout()
    }

    /// Where `request`'s lease stands; `None` once released (or never exported).
    pub fn lease_state(&self, request: RequestId) -> Option<LeaseState> {
        self.table().lease_state(request)
    }

    /// Counters.
    pub fn stats(&self) -> ExportStats {
        self.table().stats()
    }

    /// The descriptor consumers need, for a server listening on `addr`.
    pub fn descriptor(
        &self,
        request: RequestId,
        addr: SocketAddr,
        transport: TransportKind,
    ) -> Result<RemoteDescriptor, RdmaError> {
        let t = self.table();
        let blocks = t
            .blocks(request)
            .ok_or(RdmaError::UnknownRequest(request))?;
        let lease = t
            .lease_config(request)
            .ok_or(RdmaError::UnknownRequest(request))?;
        Ok(RemoteDescriptor {
            request,
            addr,
            transport,
            block_bytes: t.block_bytes(),
            blocks: blocks.iter().map(|(k, _)| *k).collect(),
            heartbeat_interval_ms: lease.heartbeat_interval_ms,
            ttl_ms: lease.ttl_ms,
            expected_readers: lease.expected_readers,
        })
    }

    /// Expire what is due at `now`, let go of released memory and wake the engine.
    pub fn tick(&self, now: Instant) {
        self.table().tick(now);
        self.after_change();
    }

    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn add_release_hook(&self, hook: Arc<dyn ReleaseHook>) {
        lock(&self.inner.hooks).push(hook);
    }

    /// Admit a read of `len` bytes at `offset` of block index `block` of `request`.
    pub(crate) fn begin_read(
        &self,
        request: RequestId,
        block: u32,
        offset: u64,
        len: u64,
    ) -> Result<PinnedRead, Refusal> {
        let engine = self
            .table()
            .begin_read(request, block, offset, len, Instant::now())?;
        let ranges = self.inner.mem.ranges(engine, offset, len);
        let me = self.clone();
        Ok(PinnedRead::new(
            ranges,
            Box::new(move || {
                me.table().end_read(request);
                // A reply cut at the lease's expiry releases the request now, not at the
                // reaper's next round.
                me.tick(Instant::now());
            }),
        ))
    }

    /// By when a reply from `request`'s blocks must be fully written (its lease's expiry);
    /// `None` once the lease ended: the reply is cut.
    pub(crate) fn read_deadline(&self, request: RequestId) -> Option<Instant> {
        self.table().read_deadline(request)
    }

    /// Changes whenever a lease starts or ends (re-read [`Exporter::read_deadline`] and
    /// [`Exporter::next_expiry`] then).
    pub(crate) fn lease_events(&self) -> watch::Receiver<u64> {
        self.inner.lease_events.subscribe()
    }

    /// The `(address, length)` segments of every block of `request` (for memory registration).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn segments_of(&self, request: RequestId) -> Option<Vec<Vec<(usize, usize)>>> {
        let t = self.table();
        let blocks = t.blocks(request)?;
        let bytes = t.block_bytes();
        Some(
            blocks
                .iter()
                .map(|(_, b)| self.inner.mem.ranges(*b, 0, bytes))
                .collect(),
        )
    }

    /// Check that `request` is readable now (lease active), without pinning anything.
    pub(crate) fn check_readable(&self, request: RequestId) -> Result<(), Refusal> {
        // No `after_change` here: callers may hold locks a release hook takes; releases this
        // tick settles are published by the next change or the server's reaper.
        self.table().check_readable(request, Instant::now())
    }

    /// A reader's heartbeat.
    pub(crate) fn heartbeat(&self, request: RequestId) -> Result<(), Refusal> {
        let r = self.table().heartbeat(request, Instant::now());
        self.after_change();
        r
    }

    /// A reader is done.
    pub(crate) fn reader_done(&self, request: RequestId, reader: u32) -> Result<(), Refusal> {
        let r = self.table().reader_done(request, reader, Instant::now());
        self.after_change();
        r
    }

    fn table(&self) -> MutexGuard<'_, ExportTable> {
        lock(&self.inner.table)
    }

    /// Run the release hooks for releases queued since the last call, then wake the engine.
    fn after_change(&self) {
        let (fresh, epoch) = {
            let mut t = self.table();
            (t.take_fresh(), t.epoch())
        };
        self.inner.lease_events.send_if_modified(|seen| {
            let changed = *seen != epoch;
            *seen = epoch;
            changed
        });
        if fresh.is_empty() {
            return;
        }
        let hooks = lock(&self.inner.hooks).clone();
        for h in &hooks {
            for r in &fresh {
                h.released(r.request);
            }
        }
        self.table().publish(fresh);
        lock(&self.inner.notifier).notify();
    }
}

impl std::fmt::Debug for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exporter")
            .field("stats", &self.stats())
            .finish()
    }
}

/// Turn a refusal into an error for callers outside the wire protocol.
#[allow(dead_code)]
pub(crate) fn refusal_error(addr: SocketAddr, (code, message): Refusal) -> RdmaError {
    RdmaError::Remote {
        addr,
        code,
        message,
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Exporter>();
    let _ = ErrorCode::Internal;
}
