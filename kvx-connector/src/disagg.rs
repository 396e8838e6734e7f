//! [`Disagg`]: prefill/decode disaggregation on an engine's scheduler side, as vLLM drives its
//! NIXL connector (`kv_transfer_params`: `do_remote_decode` on P's request, `do_remote_prefill`
//! on D's). It takes `now` as an argument and does no I/O: the lease keeper is behind
//! [`Leases`], the blocks go through kvx-offload's scheduler side.
//!
//! P (producer): a finished request that asks for a remote decode is exported (its free is
//! delayed) and [`Disagg::export`] returns the params D needs: kvx's own under `"kvx"` (the
//! namespace, the export id, each P rank's server, the block keys, the lease). P's worker
//! reports the request in `finished_sending` once D said done, the lease expired, or it was
//! aborted.
//!
//! D (consumer): a request carrying those params waits ([`RemoteMatch::Later`]) until P
//! confirmed the lease, at most the remote load deadline, then is offered its remote full
//! blocks as an asynchronous load ([`RemoteMatch::Load`]). Params that do not parse, name
//! another namespace, another parallel layout or other blocks than D's own prompt are an error
//! of that request only: it is computed on D ([`RemoteMatch::Local`], with the reason). A
//! request D tracks holds its lease from its first lookup until its load ended, it was given
//! up, or it finished; the lease is released exactly once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_offload::{RemoteSource, RemoteTierConfig, SchedulerSide};
use rustc_hash::FxHashMap;
use serde_json::Value;

use crate::leases::{LeaseState, Leases};

/// A consumer's remote request, from its first lookup until it finished.
#[derive(Debug)]
struct Remote {
    number: RequestId,
    /// P's source; `None` for a request refused at its first lookup.
    source: Option<Arc<RemoteSource>>,
    /// Remote tokens were offered to the engine (its hits come from a producer).
    offered: bool,
    /// Blocks of the source that are this request's own prompt.
    blocks: usize,
    /// When it was first looked up (the lease's confirmation is awaited from then).
    seen: Instant,
    phase: Phase,
    /// The first block the load fills (the engine's own prefix).
    first: usize,
}

/// Where a consumer's remote request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The lease is not confirmed yet.
    Waiting,
    /// Tokens were offered; the engine's allocation comes next.
    Offered,
    /// The load is queued or in flight.
    Loading,
    /// The load ended or was given up (the lease is released): the request goes on as any
    /// other.
    Done,
}

/// What a consumer's lookup answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteMatch {
    /// Ask again later (the lease is not confirmed yet).
    Later,
    /// This many tokens load asynchronously from the producer.
    Load(u64),
    /// Nothing (more) comes from a producer: the request is served as any other; with the
    /// reason when a remote load was refused or given up.
    Local(Option<String>),
}

/// A request as a consumer's lookup sees it.
#[derive(Debug, Clone, Copy)]
pub struct Asking<'a> {
    /// The engine's request id.
    pub id: &'a str,
    /// kvx's number of the request (its lease and load are kept under it).
    pub number: RequestId,
    /// Its `kv_transfer_params`.
    pub params: Option<&'a Value>,
    /// The keys of its full blocks.
    pub own: &'a [BlockKey],
    /// Tokens of its own prefix the engine computed or holds.
    pub num_computed: u64,
}

/// What the engine's allocation for a remote request led to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allocated {
    /// Not a remote request waiting for its blocks.
    NotRemote,
    /// The load is queued in this step.
    Loading,
    /// The request's remote part ended without a load; with the reason when one was refused.
    Ended(Option<String>),
}

/// What a remote role is configured with.
#[derive(Debug, Clone)]
pub struct DisaggConfig {
    /// The engine's namespace id, which P names and D checks.
    pub namespace: String,
    /// The remote tier's settings (load deadline, lease, P's servers).
    pub remote: RemoteTierConfig,
    /// Workers behind the scheduler side (P names one server per rank).
    pub world: u32,
    /// This engine exports finished prefills.
    pub produce: bool,
    /// This engine loads remote prefills.
    pub consume: bool,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Seeds the export ids (distinct per engine start).
    pub export_seed: u64,
}

/// P's exports and D's remote loads of one scheduler side (see the module docs).
#[derive(Debug)]
pub struct Disagg {
    cfg: DisaggConfig,
    requests: FxHashMap<String, Remote>,
    /// Requests D computed itself instead of loading them remotely (bad params, lost lease),
    /// since the start.
    pub refused: u64,
    /// Requests P exported since the start.
    pub exports: u64,
}

/// Does a request's `kv_transfer_params` ask for this?
fn asks(params: Option<&Value>, flag: &str) -> bool {
    params
        .and_then(|p| p.get(flag))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// A 63-bit export id from a seed and a counter (splitmix64: distinct ids, spread).
fn export_id(seed: u64, n: u64) -> u64 {
    let mut z = seed.wrapping_add(n.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) >> 1
}

impl Disagg {
    /// P's and D's state for one scheduler side.
    pub fn new(cfg: DisaggConfig) -> Disagg {
        Disagg {
            cfg,
            requests: FxHashMap::default(),
            refused: 0,
            exports: 0,
        }
    }

    /// True for a request D loads from P, or still handles as one.
    pub fn wants(&self, id: &str, params: Option<&Value>) -> bool {
        if !self.cfg.consume {
            return false;
        }
        match self.requests.get(id) {
            Some(r) => r.phase != Phase::Done,
            None => asks(params, "do_remote_prefill"),
        }
    }

    /// True while D tracks `id` as a request offered remote tokens (its hits come from a
    /// producer).
    pub fn is_remote(&self, id: &str) -> bool {
        self.requests.get(id).is_some_and(|r| r.offered)
    }

    /// Check P's params against this engine and start keeping the lease.
    fn start(
        &self,
        number: RequestId,
        params: Option<&Value>,
        own: &[BlockKey],
        leases: &mut dyn Leases,
        now: Instant,
    ) -> Result<Remote, String> {
        let Some(kvx @ Value::Object(_)) = params.and_then(|p| p.get("kvx")) else {
            return Err("no kvx source in kv_transfer_params".into());
        };
        let source = RemoteSource::from_json(&kvx.to_string()).map_err(|e| e.to_string())?;
        if source.namespace != self.cfg.namespace {
            return Err(format!(
                "the blocks belong to namespace {}, this engine's is {}",
                source.namespace, self.cfg.namespace
            ));
        }
        if source.producers.len() != self.cfg.world as usize {
            return Err(format!(
                "{} producer ranks, this engine has {} workers",
                source.producers.len(),
                self.cfg.world
            ));
        }
        let n = source.keys.len().min(own.len());
        if n == 0 || source.keys[..n] != own[..n] {
            return Err("the source's blocks are not this request's prompt".into());
        }
        leases.keep(number.0, &source)?;
        Ok(Remote {
            number,
            source: Some(Arc::new(source)),
            offered: false,
            blocks: n,
            seen: now,
            phase: Phase::Waiting,
            first: 0,
        })
    }

    /// A consumer's lookup of a remote request.
    pub fn lookup(
        &mut self,
        asking: &Asking<'_>,
        leases: &mut dyn Leases,
        now: Instant,
    ) -> RemoteMatch {
        let &Asking {
            id,
            number,
            params,
            own,
            num_computed,
        } = asking;
        if !self.requests.contains_key(id) {
            match self.start(number, params, own, leases, now) {
                Ok(r) => {
                    self.requests.insert(id.to_string(), r);
                }
                Err(why) => {
                    self.refused += 1;
                    // Tracked as done, so that later lookups of it are local at once.
                    self.requests
                        .insert(id.to_string(), self.refused_entry(number, now));
                    return RemoteMatch::Local(Some(format!("kv_transfer_params: {why}")));
                }
            }
        }
        let deadline = Duration::from_millis(self.cfg.remote.load_ms);
        let block_tokens = self.cfg.block_tokens;
        let Some(r) = self.requests.get_mut(id) else {
            return RemoteMatch::Local(None);
        };
        if matches!(r.phase, Phase::Done | Phase::Loading) {
            return RemoteMatch::Local(None);
        }
        let lost = match leases.state(r.number.0) {
            Some(LeaseState::Live) => None,
            Some(LeaseState::Pending) if now.saturating_duration_since(r.seen) < deadline => {
                return RemoteMatch::Later;
            }
            Some(LeaseState::Pending) => Some(format!(
                "no answer from the producer within {} ms",
                self.cfg.remote.load_ms
            )),
            Some(LeaseState::Lost(why)) => Some(why),
            None => Some("not kept".into()),
        };
        if let Some(why) = lost {
            self.refused += 1;
            self.end(id, false, leases);
            return RemoteMatch::Local(Some(format!("the producer's lease: lost: {why}")));
        }
        let tokens = (r.blocks as u64 * block_tokens).saturating_sub(num_computed);
        if tokens == 0 {
            // A whole local hit: nothing to read, P may free the blocks now.
            self.end(id, true, leases);
            return RemoteMatch::Local(None);
        }
        r.phase = Phase::Offered;
        r.offered = true;
        r.first = (num_computed / block_tokens) as usize;
        RemoteMatch::Load(tokens)
    }

    /// A request refused at its first lookup: tracked as done (no lease kept).
    fn refused_entry(&self, number: RequestId, now: Instant) -> Remote {
        Remote {
            number,
            source: None,
            offered: false,
            blocks: 0,
            seen: now,
            phase: Phase::Done,
            first: 0,
        }
    }

    /// The engine allocated `blocks` (its block ids of the request, in order) and
    /// `num_external` tokens for an offered remote request: queue its load on `side`.
    pub fn allocated(
        &mut self,
        id: &str,
        blocks: &[u32],
        num_external: u64,
        side: &mut SchedulerSide,
        leases: &mut dyn Leases,
    ) -> Allocated {
        let Some((r, source)) = self
            .requests
            .get(id)
            .filter(|r| r.phase == Phase::Offered)
            .and_then(|r| Some((r, r.source.clone()?)))
        else {
            return Allocated::NotRemote;
        };
        let n = (num_external / self.cfg.block_tokens) as usize;
        if n == 0 {
            self.end(id, true, leases);
            return Allocated::Ended(None);
        }
        let end = r.first + n;
        let Some(ids) = blocks.get(r.first..end).filter(|_| end <= r.blocks) else {
            let why = format!(
                "the engine allocated blocks {}..{end} of {} (the producer holds {})",
                r.first,
                blocks.len(),
                r.blocks
            );
            self.end(id, false, leases);
            return Allocated::Ended(Some(why));
        };
        let pairs: Vec<(u32, EngineBlockId)> = ids
            .iter()
            .enumerate()
            .map(|(i, b)| ((r.first + i) as u32, EngineBlockId(*b)))
            .collect();
        side.remote_load(r.number, source, &pairs);
        if let Some(r) = self.requests.get_mut(id) {
            r.phase = Phase::Loading;
        }
        Allocated::Loading
    }

    /// The request's remote load was reported to the engine (`finished_recving`): P may free
    /// its blocks.
    pub fn loaded(&mut self, id: &str, leases: &mut dyn Leases) {
        if self
            .requests
            .get(id)
            .is_some_and(|r| r.phase == Phase::Loading)
        {
            self.end(id, true, leases);
        }
    }

    /// Release the request's lease once.
    fn end(&mut self, id: &str, done: bool, leases: &mut dyn Leases) {
        if let Some(r) = self.requests.get_mut(id) {
            if r.phase != Phase::Done {
                leases.release(r.number.0, done);
            }
            r.phase = Phase::Done;
        }
    }

    /// D's request finished or was aborted: stop renewing its lease, let P go, forget it.
    pub fn finished(&mut self, id: &str, leases: &mut dyn Leases) {
        self.end(id, true, leases);
        self.requests.remove(id);
    }

    /// P's request `number` finished: when it asks for a remote decode and ended normally
    /// (`sendable`), export the full blocks of its prompt (`keys` and the engine's `blocks`,
    /// in order; `prompt_tokens` long) on `side` and return the params D needs, as JSON.
    /// `Ok(None)`: nothing to export (the engine frees the request as usual); an error says
    /// why an export was refused (nothing changed).
    #[allow(clippy::too_many_arguments)]
    pub fn export(
        &mut self,
        number: RequestId,
        params: Option<&Value>,
        sendable: bool,
        prompt_tokens: u64,
        keys: &[BlockKey],
        blocks: &[u32],
        side: &mut SchedulerSide,
    ) -> Result<Option<String>, String> {
        if !(self.cfg.produce && sendable && asks(params, "do_remote_decode")) {
            return Ok(None);
        }
        let n = keys
            .len()
            .min(blocks.len())
            .min((prompt_tokens / self.cfg.block_tokens) as usize);
        if n == 0 {
            return Ok(None);
        }
        let producers =
            self.cfg.remote.producers(self.cfg.world).ok_or(
                "this engine exports nothing: set remote.listen (kv_connector_extra_config)",
            )?;
        let source = RemoteSource {
            namespace: self.cfg.namespace.clone(),
            export: export_id(self.cfg.export_seed, self.exports),
            producers,
            keys: keys[..n].to_vec(),
            ttl_ms: self.cfg.remote.lease_ttl_ms,
            heartbeat_ms: self.cfg.remote.heartbeat_ms,
        };
        source.validate().map_err(|e| e.to_string())?;
        let kvx: Value = serde_json::from_str(&source.to_json()).map_err(|e| e.to_string())?;
        let pairs: Vec<(BlockKey, EngineBlockId)> = keys[..n]
            .iter()
            .zip(blocks)
            .map(|(k, b)| (*k, EngineBlockId(*b)))
            .collect();
        side.export_finished(number, source.export, &pairs);
        self.exports += 1;
        let out =
            serde_json::json!({"do_remote_prefill": true, "do_remote_decode": false, "kvx": kvx});
        Ok(Some(out.to_string()))
    }

    /// Remote requests D tracks now (zero when idle).
    pub fn tracked(&self) -> usize {
        self.requests.len()
    }
}

#[cfg(test)]
mod tests;
