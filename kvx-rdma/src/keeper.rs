//! The consumer's lease keeper: renews the leases of a remote request while the engine waits to
//! read it, and tells its producers when the reader is done — no call waits on the network.
//!
//! An engine's scheduler learns of a remote request before any of its workers reads it, and
//! may keep it waiting (no free blocks) for longer than the producer's TTL. The keeper renews
//! the request's lease at every producer (one per producer rank) from the moment the scheduler
//! [`LeaseKeeper::keep`]s it, and says whether the lease is known to be held
//! ([`KeptLease::Live`]), not confirmed yet ([`KeptLease::Pending`]) or gone
//! ([`KeptLease::Lost`]). A producer that does not know the request yet (its engine exports it
//! at its next step) is asked again for [`KeeperConfig::export_grace`] before the lease counts
//! as lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::lock;
use tokio::runtime::{Handle, Runtime};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::descriptor::RemoteDescriptor;
use crate::error::RdmaError;
use crate::tcp::{TcpClientConfig, TcpTransport};
use crate::transport::Transport;
use crate::wire::ErrorCode;

/// Settings of a [`LeaseKeeper`].
#[derive(Debug, Clone)]
pub struct KeeperConfig {
    /// The TCP settings of heartbeats and done notifications (reader id, token, timeouts).
    pub tcp: TcpClientConfig,
    /// How long a producer may answer "not exported" before the lease counts as lost: the
    /// producer exports a finished request at its engine's next step (default 2 s).
    pub export_grace: Duration,
    /// Pause between two asks while the producer does not know the request yet (default 5 ms).
    pub retry: Duration,
}

impl Default for KeeperConfig {
    fn default() -> Self {
        KeeperConfig {
            tcp: TcpClientConfig::default(),
            export_grace: Duration::from_secs(2),
            retry: Duration::from_millis(5),
        }
    }
}

/// Where a kept request's leases stand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeptLease {
    /// Not every producer confirmed the lease yet.
    Pending,
    /// Every producer renewed the lease at least once, and none refused since.
    Live,
    /// A producer refused the lease (ended, or never exported): the reason.
    Lost(String),
}

/// One producer's lease, as its heartbeat task last saw it.
#[derive(Debug, Clone)]
pub(crate) enum Renewal {
    /// No heartbeat of it succeeded yet.
    Unconfirmed,
    /// A heartbeat succeeded.
    Renewed,
    /// The producer refused it: why.
    Refused(String),
}

struct Kept {
    descs: Vec<Arc<RemoteDescriptor>>,
    stop: watch::Sender<bool>,
    renewals: Arc<Mutex<Vec<Renewal>>>,
}

/// Renews the leases of remote requests and reports readers done; see the module docs.
pub struct LeaseKeeper {
    cfg: KeeperConfig,
    transport: Arc<TcpTransport>,
    kept: Mutex<HashMap<u64, Kept>>,
    rt: Option<Runtime>,
    handle: Handle,
}

impl LeaseKeeper {
    /// A keeper with its own small runtime (one thread).
    pub fn new(cfg: KeeperConfig) -> Result<LeaseKeeper, RdmaError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvx-rdma-keeper")
            .enable_all()
            .build()
            .map_err(|e| RdmaError::Runtime(format!("cannot start the keeper runtime: {e}")))?;
        Ok(LeaseKeeper {
            transport: Arc::new(TcpTransport::new(cfg.tcp.clone())),
            cfg,
            kept: Mutex::new(HashMap::new()),
            handle: rt.handle().clone(),
            rt: Some(rt),
        })
    }

    /// Start renewing the leases `descs` describe (one per producer rank) under the caller's
    /// id `id`. Returns at once; a descriptor that does not validate is refused, as is an id
    /// kept already.
    pub fn keep(&self, id: u64, descs: Vec<RemoteDescriptor>) -> Result<(), RdmaError> {
        let Some(first) = descs.first() else {
            return Err(RdmaError::BadDescriptor {
                request: kvx_core::RequestId(id),
                what: "no producer to keep a lease with".into(),
            });
        };
        let request = first.request;
        for d in &descs {
            d.validate()?;
        }
        let mut kept = lock(&self.kept);
        if kept.contains_key(&id) {
            return Err(RdmaError::BadDescriptor {
                request,
                what: format!("lease {id} is kept already"),
            });
        }
        let (stop, stop_rx) = watch::channel(false);
        let renewals = Arc::new(Mutex::new(vec![Renewal::Unconfirmed; descs.len()]));
        let descs: Vec<Arc<RemoteDescriptor>> = descs.into_iter().map(Arc::new).collect();
        for (i, d) in descs.iter().enumerate() {
            let transport: Arc<dyn Transport> = self.transport.clone();
            let renewals = renewals.clone();
            let on_renewal = move |r: Renewal| lock(&renewals)[i] = r;
            self.handle.spawn(renew(
                transport,
                d.clone(),
                stop_rx.clone(),
                self.cfg.export_grace,
                self.cfg.retry,
                on_renewal,
            ));
        }
        kept.insert(
            id,
            Kept {
                descs,
                stop,
                renewals,
            },
        );
        Ok(())
    }

    /// Where the leases kept under `id` stand; `None` if `id` is not kept.
    pub fn status(&self, id: u64) -> Option<KeptLease> {
        let kept = lock(&self.kept);
        let k = kept.get(&id)?;
        let renewals = lock(&k.renewals);
        let mut all_renewed = true;
        for r in renewals.iter() {
            match r {
                Renewal::Refused(why) => return Some(KeptLease::Lost(why.clone())),
                Renewal::Unconfirmed => all_renewed = false,
                Renewal::Renewed => {}
            }
        }
        Some(if all_renewed {
            KeptLease::Live
        } else {
            KeptLease::Pending
        })
    }

    /// Stop renewing `id`'s leases; with `done`, tell every producer this reader is done (sent
    /// in the background, never waited for: a producer that does not hear it releases at its
    /// TTL). Returns false if `id` was not kept.
    pub fn release(&self, id: u64, done: bool) -> bool {
        let Some(k) = lock(&self.kept).remove(&id) else {
            return false;
        };
        let _ = k.stop.send(true);
        if done {
            for d in k.descs {
                let transport = self.transport.clone();
                self.handle.spawn(async move {
                    if let Err(e) = transport.done(&d).await {
                        debug!(request = %d.request, addr = %d.addr, error = %e,
                            "kvx-rdma: done not delivered; the producer releases at its TTL");
                    }
                });
            }
        }
        true
    }

    /// Requests kept now.
    pub fn len(&self) -> usize {
        lock(&self.kept).len()
    }

    /// True when no request is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        for k in lock(&self.kept).values() {
            let _ = k.stop.send(true);
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Renew `desc`'s lease every heartbeat interval until `stop`, reporting each outcome to
/// `on_renewal`. A producer that does not know the request is asked again every `retry` until
/// it renewed once or `export_grace` passed; a refusal after that ends the renewals.
pub(crate) async fn renew(
    transport: Arc<dyn Transport>,
    desc: Arc<RemoteDescriptor>,
    mut stop: watch::Receiver<bool>,
    export_grace: Duration,
    retry: Duration,
    on_renewal: impl Fn(Renewal) + Send + 'static,
) {
    let started = Instant::now();
    let mut renewed_once = false;
    loop {
        let mut pause = desc.heartbeat_interval();
        tokio::select! {
            r = transport.heartbeat(&desc) => match r {
                Ok(()) => {
                    renewed_once = true;
                    on_renewal(Renewal::Renewed);
                }
                Err(RdmaError::Remote { code: ErrorCode::UnknownRequest | ErrorCode::NotReady, .. })
                    if !renewed_once && started.elapsed() < export_grace =>
                {
                    pause = retry;
                }
                Err(RdmaError::Remote { code: ErrorCode::LeaseEnded | ErrorCode::UnknownRequest, message, .. }) => {
                    warn!(request = %desc.request, addr = %desc.addr, %message, "kvx-rdma: lease lost");
                    on_renewal(Renewal::Refused(message));
                    return;
                }
                Err(e) => debug!(request = %desc.request, error = %e, "kvx-rdma: heartbeat failed; retrying"),
            },
            _ = stop.wait_for(|v| *v) => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.wait_for(|v| *v) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Exporter, ServerConfig, TcpServer, TransportKind};
    use kvx_core::{BlockKey, CpuArena, EngineBlockId, RequestId};
    use kvx_policy::{LeaseConfig, ReleaseReason};

    fn wait_for(keeper: &LeaseKeeper, id: u64, want: &KeptLease, within: Duration) -> bool {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if keeper.status(id).as_ref() == Some(want) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    #[test]
    fn a_lease_exported_after_keep_goes_live_and_done_releases_it() {
        let arena = CpuArena::contiguous(4096, 4).unwrap();
        // SAFETY: the arena outlives the exporter and the server (dropped first, below), and no
        // block is written while exported.
        let exporter = unsafe { Exporter::new(arena.layout().clone()) }.unwrap();
        let server = TcpServer::start(exporter.clone(), ServerConfig::default()).unwrap();
        let key = BlockKey::chain(None, b"k");
        let desc = RemoteDescriptor {
            request: RequestId(7),
            addr: server.local_addr(),
            transport: TransportKind::Tcp,
            block_bytes: 4096,
            blocks: vec![key],
            heartbeat_interval_ms: 50,
            ttl_ms: 400,
            expected_readers: 1,
        };
        let keeper = LeaseKeeper::new(KeeperConfig::default()).unwrap();
        keeper.keep(1, vec![desc.clone()]).unwrap();
        assert!(keeper.keep(1, vec![desc]).is_err(), "an id is kept once");
        // Not exported yet: pending (the producer's next step exports it).
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(keeper.status(1), Some(KeptLease::Pending));
        let lease = LeaseConfig {
            ttl_ms: 400,
            heartbeat_interval_ms: 50,
            expected_readers: 1,
        };
        exporter
            .export(RequestId(7), &[(key, EngineBlockId(1))], &lease)
            .unwrap();
        exporter.ready(RequestId(7)).unwrap();
        assert!(wait_for(
            &keeper,
            1,
            &KeptLease::Live,
            Duration::from_secs(1)
        ));
        // Heartbeats every 50 ms keep a 400 ms lease past its TTL.
        std::thread::sleep(Duration::from_millis(600));
        assert!(exporter.poll_released().is_none(), "released while kept");
        assert!(keeper.release(1, true));
        assert!(!keeper.release(1, true));
        let end = Instant::now() + Duration::from_secs(2);
        let released = loop {
            if let Some(r) = exporter.poll_released() {
                break r;
            }
            assert!(Instant::now() < end, "done never arrived");
            std::thread::sleep(Duration::from_millis(2));
        };
        assert_eq!(released.reason, ReleaseReason::Read);
        assert!(keeper.is_empty());
        drop(server);
    }

    #[test]
    fn a_request_the_producer_never_exports_is_lost_after_the_grace() {
        let arena = CpuArena::contiguous(4096, 2).unwrap();
        // SAFETY: the arena outlives the exporter and its server; nothing is exported.
        let exporter = unsafe { Exporter::new(arena.layout().clone()) }.unwrap();
        let server = TcpServer::start(exporter, ServerConfig::default()).unwrap();
        let desc = RemoteDescriptor {
            request: RequestId(9),
            addr: server.local_addr(),
            transport: TransportKind::Tcp,
            block_bytes: 4096,
            blocks: vec![BlockKey::chain(None, b"x")],
            heartbeat_interval_ms: 50,
            ttl_ms: 400,
            expected_readers: 1,
        };
        let cfg = KeeperConfig {
            export_grace: Duration::from_millis(100),
            ..KeeperConfig::default()
        };
        let keeper = LeaseKeeper::new(cfg).unwrap();
        let t0 = Instant::now();
        keeper.keep(3, vec![desc]).unwrap();
        let end = t0 + Duration::from_secs(2);
        let lost_at = loop {
            if let Some(KeptLease::Lost(why)) = keeper.status(3) {
                assert!(why.contains("not exported"), "{why}");
                break t0.elapsed();
            }
            assert!(Instant::now() < end, "never lost");
            std::thread::sleep(Duration::from_millis(1));
        };
        // Lost once the 100 ms grace passed: one retry (5 ms) + a round trip + a tick later.
        assert!(lost_at >= Duration::from_millis(100), "{lost_at:?}");
        assert!(
            lost_at <= Duration::from_millis(100 + 5 + 1 + 50),
            "{lost_at:?}"
        );
        assert!(keeper.release(3, false));
        drop(server);
    }
}
