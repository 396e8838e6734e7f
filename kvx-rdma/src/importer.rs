//! The consumer: a kvx-core [`Backend`] that loads remote blocks into the ops' own buffers.
//!
//! Ops are `Load`s whose blocks name keys of a registered [`RemoteDescriptor`]; the importer
//! fills each block's `Owned` buffer (it never touches engine memory, so a route is
//! `[rdma, host]`). The op's deadline bounds every read: at the deadline the transport drops
//! the connection (or flushes the queue pair) and the op completes with the unread blocks
//! `TimedOut`, its buffers handed back — so a late reply can only ever land in the op's own
//! buffer while the op is still with the importer. Deadlines of the task and zombie
//! quarantine are kvx-core's Tracker's business; the importer only never loses an op.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::lock;
use kvx_core::{
    Backend, BlockError, BlockKey, Buf, CompletionBoard, Direction, Notifier, Op, OpCompletion,
    OpId, PoolBuf, RequestId, SubmitError, SubmitErrorKind, WaitOutcome,
};
use tokio::sync::watch;

use crate::descriptor::{RemoteDescriptor, TransportKind};
use crate::error::RdmaError;
use crate::keeper::{Renewal, renew};
use crate::shards::{ShardThreads, Shards};
use crate::tcp::{TcpClientConfig, TcpTransport};
use crate::transport::{CancelSource, CancelToken, ReadSlot, Transport};

/// Settings of an [`Importer`].
#[derive(Debug, Clone)]
pub struct ImporterConfig {
    /// This reader's id (e.g. its tensor-parallel rank); the producer counts distinct ids.
    pub reader: u32,
    /// Shared token to present to producers (default none).
    pub token: Option<String>,
    /// Reading threads (default: one per core, at most 8); each op is read by the least busy
    /// one.
    pub threads: usize,
    /// Renew the leases of registered requests every descriptor heartbeat interval (default on).
    pub heartbeats: bool,
    /// Ops in flight at once; more are refused as busy (default 4096).
    pub max_ops: usize,
    /// Connect + handshake timeout (default 2 s).
    pub connect_timeout: Duration,
    /// Heartbeat / done round-trip timeout (default 2 s).
    pub control_timeout: Duration,
}

impl Default for ImporterConfig {
    fn default() -> Self {
        ImporterConfig {
            reader: 0,
            token: None,
            threads: crate::shards::default_count(),
            heartbeats: true,
            max_ops: 4096,
            connect_timeout: Duration::from_secs(2),
            control_timeout: Duration::from_secs(2),
        }
    }
}

impl ImporterConfig {
    /// The TCP transport settings implied by this config.
    pub fn tcp(&self) -> TcpClientConfig {
        TcpClientConfig {
            reader: self.reader,
            token: self.token.clone(),
            connect_timeout: self.connect_timeout,
            control_timeout: self.control_timeout,
            ..TcpClientConfig::default()
        }
    }
}

struct Registered {
    desc: Arc<RemoteDescriptor>,
    stop: watch::Sender<bool>,
    lost: Arc<Mutex<Option<String>>>,
}

#[derive(Default)]
struct Registry {
    descs: HashMap<RequestId, Registered>,
    keys: HashMap<BlockKey, Vec<(RequestId, u32)>>,
    /// The remote request each local request reads (`ImporterHandle::register_for`).
    readers: HashMap<RequestId, RequestId>,
}

impl Registry {
    /// Where `key` is read from for an op of local request `reader`: the remote request
    /// registered for `reader` if it exports the key, else any registered one that does.
    fn lookup(&self, reader: RequestId, key: BlockKey) -> Option<(Arc<RemoteDescriptor>, u32)> {
        let found = self.keys.get(&key)?;
        let own = self.readers.get(&reader);
        found
            .iter()
            .filter(|(r, _)| own.is_none_or(|o| o == r))
            .chain(found.iter())
            .find_map(|(r, i)| self.descs.get(r).map(|reg| (reg.desc.clone(), *i)))
    }

    fn remove(&mut self, request: RequestId) -> Option<Registered> {
        self.readers.retain(|_, r| *r != request);
        let reg = self.descs.remove(&request)?;
        for key in &reg.desc.blocks {
            if let Some(v) = self.keys.get_mut(key) {
                v.retain(|(r, _)| *r != request);
                if v.is_empty() {
                    self.keys.remove(key);
                }
            }
        }
        Some(reg)
    }
}

/// What the importer shares with its op tasks: settings, ops, registered descriptors,
/// transports and the threads they run on.
struct ImporterState {
    cfg: ImporterConfig,
    /// Ops in flight (each with its cancel source) and finished ops.
    ops: CompletionBoard<CancelSource>,
    registry: Mutex<Registry>,
    transports: Vec<Arc<dyn Transport>>,
    shards: Shards,
}

impl ImporterState {
    fn transport(&self, kind: TransportKind) -> Option<Arc<dyn Transport>> {
        self.transports.iter().find(|t| t.kind() == kind).cloned()
    }
}

/// The consumer-side backend. Register descriptors through an [`ImporterHandle`].
pub struct Importer {
    name: String,
    state: Arc<ImporterState>,
    /// Held for its drop, which stops the threads.
    _threads: ShardThreads,
}

/// A cloneable handle to register remote requests with an [`Importer`] (which the driver owns)
/// and to say when this reader is done with them.
#[derive(Clone)]
pub struct ImporterHandle {
    state: Arc<ImporterState>,
}

impl Importer {
    /// An importer reading over TCP.
    pub fn new(cfg: ImporterConfig) -> Result<Importer, RdmaError> {
        let tcp = Arc::new(TcpTransport::new(cfg.tcp()));
        Importer::with_transports(cfg, vec![tcp])
    }

    /// An importer with the given transports (one per [`TransportKind`]).
    pub fn with_transports(
        cfg: ImporterConfig,
        transports: Vec<Arc<dyn Transport>>,
    ) -> Result<Importer, RdmaError> {
        let (shards, threads) = Shards::start("kvx-rdma-importer", cfg.threads)
            .map_err(|e| RdmaError::Runtime(format!("cannot start the importer threads: {e}")))?;
        let state = Arc::new(ImporterState {
            cfg,
            ops: CompletionBoard::default(),
            registry: Mutex::new(Registry::default()),
            transports,
            shards,
        });
        Ok(Importer {
            name: "rdma".into(),
            state,
            _threads: threads,
        })
    }

    /// A handle for registering descriptors (keep it when the importer moves into a driver).
    pub fn handle(&self) -> ImporterHandle {
        ImporterHandle {
            state: self.state.clone(),
        }
    }
}

impl ImporterHandle {
    /// Make `desc`'s blocks loadable by key, and start renewing its lease.
    pub fn register(&self, desc: RemoteDescriptor) -> Result<(), RdmaError> {
        desc.validate()?;
        let transport = self
            .state
            .transport(desc.transport)
            .ok_or_else(|| RdmaError::TransportUnavailable(desc.transport.to_string()))?;
        let request = desc.request;
        let desc = Arc::new(desc);
        let mut reg = lock(&self.state.registry);
        if reg.descs.contains_key(&request) {
            return Err(RdmaError::BadDescriptor {
                request,
                what: "already registered with this importer".into(),
            });
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(k) = desc.blocks.iter().find(|k| !seen.insert(**k)) {
            return Err(RdmaError::BadBlock {
                request,
                key: *k,
                what: "appears twice in the descriptor".into(),
            });
        }
        let (stop, stop_rx) = watch::channel(false);
        let lost = Arc::new(Mutex::new(None));
        for (i, key) in desc.blocks.iter().enumerate() {
            reg.keys.entry(*key).or_default().push((request, i as u32));
        }
        reg.descs.insert(
            request,
            Registered {
                desc: desc.clone(),
                stop,
                lost: lost.clone(),
            },
        );
        drop(reg);
        if self.state.cfg.heartbeats {
            // A refusal ends the renewals at once (no grace: the producer exported it already).
            let on_renewal = move |r: Renewal| {
                if let Renewal::Refused(why) = r {
                    *lock(&lost) = Some(why);
                }
            };
            self.state.shards.spawn(renew(
                transport,
                desc,
                stop_rx,
                Duration::ZERO,
                Duration::ZERO,
                on_renewal,
            ));
        }
        Ok(())
    }

    /// [`ImporterHandle::register`], and read `desc`'s blocks for the ops of local request
    /// `reader` from it first: two remote requests that export the same key (a shared prefix)
    /// are not interchangeable, since one's lease may end while the other's reader still needs
    /// the block.
    pub fn register_for(&self, reader: RequestId, desc: RemoteDescriptor) -> Result<(), RdmaError> {
        let request = desc.request;
        self.register(desc)?;
        lock(&self.state.registry).readers.insert(reader, request);
        Ok(())
    }

    /// Why the producer refused a heartbeat for `request` (its lease ended), if it did.
    pub fn lease_lost(&self, request: RequestId) -> Option<String> {
        let reg = lock(&self.state.registry);
        reg.descs.get(&request).and_then(|r| lock(&r.lost).clone())
    }

    /// Requests registered now.
    pub fn registered(&self) -> usize {
        lock(&self.state.registry).descs.len()
    }

    /// Stop renewing `request`'s lease and unregister it, without telling the producer.
    pub fn forget(&self, request: RequestId) -> Result<(), RdmaError> {
        let reg = lock(&self.state.registry)
            .remove(request)
            .ok_or(RdmaError::NotRegistered(request))?;
        let _ = reg.stop.send(true);
        Ok(())
    }

    /// This reader is done with `request`: stop heartbeats, unregister, and tell the producer
    /// (waits at most the control timeout).
    pub fn done(&self, request: RequestId) -> Result<(), RdmaError> {
        let reg = lock(&self.state.registry)
            .remove(request)
            .ok_or(RdmaError::NotRegistered(request))?;
        let _ = reg.stop.send(true);
        let transport = self
            .state
            .transport(reg.desc.transport)
            .ok_or_else(|| RdmaError::TransportUnavailable(reg.desc.transport.to_string()))?;
        let (tx, rx) = std::sync::mpsc::channel();
        let desc = reg.desc.clone();
        self.state.shards.spawn(async move {
            let _ = tx.send(transport.done(&desc).await);
        });
        let wait = self.state.cfg.control_timeout + Duration::from_millis(500);
        rx.recv_timeout(wait).map_err(|_| RdmaError::TimedOut {
            what: "done",
            addr: reg.desc.addr,
        })?
    }
}

async fn run_op(state: Arc<ImporterState>, mut op: Op, cancel: CancelToken) {
    let n = op.blocks.len();
    let mut results: Vec<Option<Result<(), BlockError>>> = vec![None; n];
    // Resolve keys and group blocks by remote request.
    // Per remote request: (position in the op, block index in the descriptor).
    type Group = (Arc<RemoteDescriptor>, Vec<(usize, u32)>);
    let mut groups: Vec<Group> = Vec::new();
    {
        let reg = lock(&state.registry);
        for (pos, b) in op.blocks.iter().enumerate() {
            let Some((desc, index)) = reg.lookup(op.request, b.key) else {
                results[pos] = Some(Err(BlockError::NotFound));
                continue;
            };
            let problem = match &b.buf {
                Buf::Shared(_) => Some("a remote load needs an owned destination buffer".into()),
                Buf::Owned(p) if (p.capacity() as u64) < desc.block_bytes => Some(format!(
                    "buffer of {} bytes is smaller than the {}-byte remote block",
                    p.capacity(),
                    desc.block_bytes
                )),
                Buf::Owned(_) => None,
            };
            if let Some(msg) = problem {
                results[pos] = Some(Err(BlockError::Invalid(msg)));
                continue;
            }
            match groups.iter_mut().find(|(d, _)| Arc::ptr_eq(d, &desc)) {
                Some((_, v)) => v.push((pos, index)),
                None => groups.push((desc, vec![(pos, index)])),
            }
        }
    }
    {
        let mut bufs: Vec<Option<&mut PoolBuf>> =
            op.blocks.iter_mut().map(|b| b.buf.as_owned_mut()).collect();
        for (desc, members) in groups {
            let Some(transport) = state.transport(desc.transport) else {
                for (pos, _) in members {
                    results[pos] = Some(Err(BlockError::Unavailable(format!(
                        "no {} transport",
                        desc.transport
                    ))));
                }
                continue;
            };
            let mut slots: Vec<ReadSlot<'_>> = Vec::with_capacity(members.len());
            let mut positions = Vec::with_capacity(members.len());
            for (pos, index) in members {
                if let Some(buf) = bufs[pos].take() {
                    slots.push(ReadSlot { index, buf });
                    positions.push(pos);
                }
            }
            let out = transport
                .read(&desc, &mut slots, op.deadline, &cancel)
                .await;
            for (pos, r) in positions.into_iter().zip(out) {
                results[pos] = Some(r);
            }
        }
    }
    let results = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(BlockError::Io("block was not read".into()))))
        .collect();
    state.ops.complete(OpCompletion { op, results });
}

impl Backend for Importer {
    fn name(&self) -> &str {
        &self.name
    }

    fn touches_engine_memory(&self) -> bool {
        false
    }

    fn set_notifier(&mut self, notifier: Notifier) {
        self.state.ops.set_notifier(notifier);
    }

    fn submit(&mut self, op: Op) -> Result<(), SubmitError> {
        if op.dir != Direction::Load {
            return Err(SubmitError {
                op,
                kind: SubmitErrorKind::Invalid("the rdma importer only loads".into()),
            });
        }
        let (source, token) = CancelToken::new();
        if !self
            .state
            .ops
            .begin_bounded(op.id, source, self.state.cfg.max_ops)
        {
            let msg = format!("{} remote ops in flight", self.state.ops.pending_len());
            return Err(SubmitError {
                op,
                kind: SubmitErrorKind::Busy(msg),
            });
        }
        let state = self.state.clone();
        self.state.shards.spawn(run_op(state, op, token));
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<OpCompletion>) {
        self.state.ops.drain(out);
    }

    fn cancel(&mut self, op: OpId) {
        self.state.ops.with_pending(op, |s| s.cancel());
    }

    fn wait(&mut self, ops: &[OpId], until: Instant) -> WaitOutcome {
        self.state.ops.wait(ops, until)
    }
}

impl Drop for Importer {
    fn drop(&mut self) {
        for r in lock(&self.state.registry).descs.values() {
            let _ = r.stop.send(true);
        }
        // `_threads` drops next: it waits (at most 1 s) until no op task is left.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Exporter, ServerConfig, TcpServer};
    use kvx_core::{
        BufferPool, CpuArena, DEFAULT_ALIGN, DriverBuilder, DriverConfig, EngineBlockId, OpBlock,
        TaskSpec,
    };
    use kvx_policy::LeaseConfig;

    /// Two remote requests export the same key (a shared prefix); the first one's lease ended.
    /// A reader registered for the second reads the key from it, not from the first.
    #[test]
    fn a_reader_reads_a_shared_key_from_its_own_remote_request() {
        let mut arena = CpuArena::contiguous(4096, 4).unwrap();
        arena.write_block(EngineBlockId(1), &[5u8; 4096]).unwrap();
        // SAFETY: the arena outlives the exporter and the server (dropped first, below); no
        // exported block is written while exported.
        let exporter = unsafe { Exporter::new(arena.layout().clone()) }.unwrap();
        let server = TcpServer::start(exporter.clone(), ServerConfig::default()).unwrap();
        let key = BlockKey::chain(None, b"shared prefix");
        let lease = LeaseConfig {
            ttl_ms: 30_000,
            heartbeat_interval_ms: 1_000,
            expected_readers: 1,
        };
        for r in [RequestId(1), RequestId(2)] {
            exporter
                .export(r, &[(key, EngineBlockId(1))], &lease)
                .unwrap();
            exporter.ready(r).unwrap();
        }
        exporter.abort(RequestId(1)).unwrap();
        while exporter.poll_released().is_none() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let importer = Importer::new(ImporterConfig {
            heartbeats: false,
            ..ImporterConfig::default()
        })
        .unwrap();
        let handle = importer.handle();
        // Registered first: the released request (its descriptor as the consumer got it).
        let mut first = server.descriptor(&exporter, RequestId(2)).unwrap();
        first.request = RequestId(1);
        handle.register(first).unwrap();
        let reader = RequestId(40);
        handle
            .register_for(reader, server.descriptor(&exporter, RequestId(2)).unwrap())
            .unwrap();
        let mut b = DriverBuilder::new(DriverConfig::default());
        let rdma = b.backend(Box::new(importer));
        let driver = b.spawn().unwrap();
        let pool = BufferPool::new(2, 4096, DEFAULT_ALIGN).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let task = driver
            .submit(TaskSpec {
                request: reader,
                dir: Direction::Load,
                route: vec![rdma],
                blocks: vec![OpBlock {
                    key,
                    engine: None,
                    buf: Buf::Owned(pool.take().unwrap()),
                }],
                deadline,
                deferred: false,
            })
            .unwrap();
        let report = driver.wait_report(task, deadline).unwrap();
        assert!(report.is_ok(), "{:?}", report.blocks[0].result);
        assert_eq!(
            report.blocks[0].buf.as_ref().unwrap().as_slice(),
            &[5u8; 4096][..]
        );
        handle.forget(RequestId(2)).unwrap();
        assert!(lock(&handle.state.registry).readers.is_empty());
        drop(driver);
        drop(server);
    }
}
