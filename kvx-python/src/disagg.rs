//! `Disaggregation`: kvx-connector's prefill/decode lifecycle ([`Disagg`]) for vLLM's scheduler
//! process, over a `SchedulerSide` and, on a consumer, kvx-rdma's lease keeper (it renews the
//! leases of the requests the engine will load from producers; no call waits on the network).
//! Python hands plain data in (request ids, `kv_transfer_params` as JSON, keys, block ids) and
//! gets plain data back.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvx_connector::{Allocated, Asking, Disagg, DisaggConfig, LeaseState, Leases, RemoteMatch};
use kvx_core::{RequestId, lock};
use kvx_offload::{RemoteSource, RemoteTierConfig};
use kvx_rdma::{KeeperConfig, KeptLease, TcpClientConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::Value;

use crate::scheduler::SchedulerSide;
use crate::{keys_from_bytes, kvx_err};

/// A consumer's lease keeper (kvx-rdma's); none on an engine that only produces.
struct Keeper(Option<kvx_rdma::LeaseKeeper>);

impl Keeper {
    fn new(remote: &RemoteTierConfig) -> PyResult<Keeper> {
        let k = kvx_rdma::LeaseKeeper::new(KeeperConfig {
            tcp: TcpClientConfig {
                token: remote.token.clone(),
                ..TcpClientConfig::default()
            },
            export_grace: Duration::from_millis(remote.export_grace_ms),
            ..KeeperConfig::default()
        })
        .map_err(kvx_err)?;
        Ok(Keeper(Some(k)))
    }
}

impl Leases for Keeper {
    fn keep(&mut self, id: u64, source: &RemoteSource) -> Result<(), String> {
        let Some(k) = &self.0 else {
            return Err("this engine loads nothing from a producer".into());
        };
        k.keep(id, source.descriptors()).map_err(|e| e.to_string())
    }

    fn state(&self, id: u64) -> Option<LeaseState> {
        self.0.as_ref()?.status(id).map(|s| match s {
            KeptLease::Pending => LeaseState::Pending,
            KeptLease::Live => LeaseState::Live,
            KeptLease::Lost(why) => LeaseState::Lost(why),
        })
    }

    fn release(&mut self, id: u64, done: bool) {
        if let Some(k) = &self.0 {
            k.release(id, done);
        }
    }

    fn kept(&self) -> usize {
        self.0.as_ref().map_or(0, kvx_rdma::LeaseKeeper::len)
    }
}

/// Parsed `kv_transfer_params` (JSON from Python); text that does not parse counts as none.
fn params(text: Option<&str>) -> Option<Value> {
    text.and_then(|t| serde_json::from_str(t).ok())
}

/// P's exports and D's remote requests of one scheduler side.
#[pyclass(module = "kvx._native")]
pub struct Disaggregation {
    core: Mutex<(Disagg, Keeper)>,
    side: Py<SchedulerSide>,
}

#[pymethods]
impl Disaggregation {
    /// Over `side` (its `remote` settings and worker count), in the engine namespace
    /// `namespace` (the id P names and D checks); `produce`: export finished prefills,
    /// `consume`: load remote ones; `export_seed` makes this start's export ids its own.
    #[new]
    fn new(
        side: Py<SchedulerSide>,
        namespace: String,
        produce: bool,
        consume: bool,
        export_seed: u64,
    ) -> PyResult<Disaggregation> {
        let (remote, world, block_tokens) = {
            let s = side.get();
            (s.remote.clone(), s.world, s.block_tokens)
        };
        let Some(remote) = remote else {
            return Err(PyValueError::new_err(
                "prefill/decode needs a `remote` section in kv_connector_extra_config",
            ));
        };
        let keeper = if consume {
            Keeper::new(&remote)?
        } else {
            Keeper(None)
        };
        let core = Disagg::new(DisaggConfig {
            namespace,
            remote,
            world,
            produce,
            consume,
            block_tokens: u64::from(block_tokens),
            export_seed,
        });
        Ok(Disaggregation {
            core: Mutex::new((core, keeper)),
            side,
        })
    }

    /// True for a request this engine loads from a producer, or still handles as one.
    #[pyo3(signature = (id, params=None))]
    fn wants(&self, id: &str, params: Option<&str>) -> bool {
        lock(&self.core).0.wants(id, self::params(params).as_ref())
    }

    /// A consumer's lookup of remote request `id` (number `number`, full-block `keys`,
    /// `num_computed` tokens of its own): `(None, None)` to ask again later; `(tokens, None)`
    /// with tokens > 0 to load asynchronously; `(0, why)` when it is served as any other
    /// request (`why`: the reason a remote load was refused or given up, else None).
    #[pyo3(signature = (id, number, params, keys, num_computed))]
    fn lookup(
        &self,
        id: &str,
        number: u64,
        params: Option<&str>,
        keys: &[u8],
        num_computed: u64,
    ) -> PyResult<(Option<u64>, Option<String>)> {
        let own = keys_from_bytes(keys)?;
        let p = self::params(params);
        let mut guard = lock(&self.core);
        let (core, keeper) = &mut *guard;
        Ok(
            match core.lookup(
                &Asking {
                    id,
                    number: RequestId(number),
                    params: p.as_ref(),
                    own: &own,
                    num_computed,
                },
                keeper,
                Instant::now(),
            ) {
                RemoteMatch::Later => (None, None),
                RemoteMatch::Load(tokens) => (Some(tokens), None),
                RemoteMatch::Local(why) => (Some(0), why),
            },
        )
    }

    /// The engine allocated `blocks` (the request's block ids) and `num_external` tokens:
    /// `(None, None)` for a request that is not a remote one waiting for blocks; `(True,
    /// None)` when its load was queued this step; `(False, why)` when its remote part ended
    /// without a load (`why`: set when one was refused).
    fn allocated(
        &self,
        id: &str,
        blocks: Vec<u32>,
        num_external: u64,
    ) -> (Option<bool>, Option<String>) {
        let mut guard = lock(&self.core);
        let (core, keeper) = &mut *guard;
        let mut side = lock(&self.side.get().inner);
        match core.allocated(id, &blocks, num_external, &mut side, keeper) {
            Allocated::NotRemote => (None, None),
            Allocated::Loading => (Some(true), None),
            Allocated::Ended(why) => (Some(false), why),
        }
    }

    /// The request's remote load was reported to vLLM (`finished_recving`).
    fn loaded(&self, id: &str) {
        let mut guard = lock(&self.core);
        let (core, keeper) = &mut *guard;
        core.loaded(id, keeper);
    }

    /// The request finished or was aborted: its lease, if any, is released and it is forgotten.
    fn finished(&self, id: &str) {
        let mut guard = lock(&self.core);
        let (core, keeper) = &mut *guard;
        core.finished(id, keeper);
    }

    /// P's finished request `number`: export the full blocks of its prompt (`keys`, the
    /// engine's `blocks`) when its params ask for a remote decode and it ended normally
    /// (`sendable`). `(params, None)`: the params D needs, as JSON; `(None, None)`: nothing to
    /// export; `(None, why)`: an export was refused (nothing changed).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (number, params, sendable, prompt_tokens, keys, blocks))]
    fn export(
        &self,
        number: u64,
        params: Option<&str>,
        sendable: bool,
        prompt_tokens: u64,
        keys: &[u8],
        blocks: Vec<u32>,
    ) -> PyResult<(Option<String>, Option<String>)> {
        let keys = keys_from_bytes(keys)?;
        let p = self::params(params);
        let mut guard = lock(&self.core);
        let mut side = lock(&self.side.get().inner);
        Ok(
            match guard.0.export(
                RequestId(number),
                p.as_ref(),
                sendable,
                prompt_tokens,
                &keys,
                &blocks,
                &mut side,
            ) {
                Ok(out) => (out, None),
                Err(why) => (None, Some(why)),
            },
        )
    }

    /// True while `id` was offered remote tokens (vLLM's hit source is then P2P).
    fn is_remote(&self, id: &str) -> bool {
        lock(&self.core).0.is_remote(id)
    }

    /// Remote requests tracked and leases kept (zero when idle).
    fn state_counts(&self) -> (usize, usize) {
        let guard = lock(&self.core);
        (guard.0.tracked(), guard.1.kept())
    }
}
