//! `ConsumerSide`: a decode engine's remote requests (kvx-connector's [`Consumer`]) over
//! kvx-rdma's lease keeper, which renews each request's lease from its first lookup until its
//! load ended and tells the producers when they may free the blocks; no call waits on the
//! network.

use std::time::Duration;

use kvx_connector::disagg::{Consumer, Lease, Leases};
use kvx_core::RequestId;
use kvx_offload::{OffloadConfig, RemoteSource};
use kvx_rdma::{KeeperConfig, KeptLease, TcpClientConfig};

/// kvx-rdma's keeper as the consumer's [`Leases`].
pub(crate) struct Keeper(kvx_rdma::LeaseKeeper);

impl Leases for Keeper {
    fn keep(&mut self, number: RequestId, source: &RemoteSource) -> Result<(), String> {
        self.0
            .keep(number.0, source.descriptors())
            .map_err(|e| e.to_string())
    }

    fn status(&self, number: RequestId) -> Option<Lease> {
        self.0.status(number.0).map(|s| match s {
            KeptLease::Pending => Lease::Pending,
            KeptLease::Live => Lease::Live,
            KeptLease::Lost(why) => Lease::Lost(why),
        })
    }

    fn release(&mut self, number: RequestId, done: bool) {
        self.0.release(number.0, done);
    }
}

/// The consumer and its keeper.
pub(crate) struct ConsumerSide {
    pub(crate) core: Consumer,
    pub(crate) keeper: Keeper,
}

impl ConsumerSide {
    /// A consumer in key namespace `namespace` (the id producers name) for `world` workers,
    /// with `cfg`'s `remote` settings (token, export grace, load deadline; defaults without).
    pub(crate) fn new(
        cfg: &OffloadConfig,
        namespace: String,
        world: usize,
    ) -> Result<ConsumerSide, String> {
        let remote = cfg.remote.clone().unwrap_or_default();
        let keeper = kvx_rdma::LeaseKeeper::new(KeeperConfig {
            tcp: TcpClientConfig {
                token: remote.token.clone(),
                ..TcpClientConfig::default()
            },
            export_grace: Duration::from_millis(remote.export_grace_ms),
            ..KeeperConfig::default()
        })
        .map_err(|e| e.to_string())?;
        let core = Consumer::new(
            namespace,
            world,
            u64::from(cfg.block_tokens),
            Duration::from_millis(remote.load_ms),
        );
        Ok(ConsumerSide {
            core,
            keeper: Keeper(keeper),
        })
    }

    /// Leases kept now.
    pub(crate) fn kept(&self) -> usize {
        self.keeper.0.len()
    }
}
