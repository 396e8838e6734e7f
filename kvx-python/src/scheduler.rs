//! `SchedulerSide`: kvx-connector's scheduler core ([`kvx_connector::scheduler::Scheduler`])
//! for Python (vLLM's scheduler process): requests named by vLLM's id, their keys, lifecycle and
//! hybrid KV cache groups, over kvx-offload's scheduler side.

use std::sync::{Arc, Mutex, MutexGuard};

use kvx_connector::Namespace;
use kvx_connector::codec;
use kvx_connector::groups::{Group, Groups};
use kvx_connector::keys::{Keyring, key_bytes};
use kvx_connector::scheduler::Scheduler;
use kvx_core::{BlockKey, EngineBlockId, RequestId, lock};
use kvx_offload::{RemoteSource, RemoteTierConfig, Tier};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PySequence};

use crate::config::connector_config;
use crate::consumer::ConsumerSide;
use crate::{KvxError, keys_from_bytes};
use kvx_connector::disagg::{Allocated, Lookup};

/// The scheduler side: decides per step what to load and store, keeps the tier index and the
/// request table (vLLM's request ids, kvx's numbers for them, each request's keys, match, load
/// and finishing). Requests are named by the engine's id; `admit` gives kvx's number of one.
#[pyclass(module = "kvx._native")]
pub struct SchedulerSide {
    core: Mutex<Scheduler>,
    /// The remote tier's settings (what a producer's sources name).
    remote: Option<RemoteTierConfig>,
    /// Workers behind this side (a producer names one server per rank).
    world: u32,
    /// `host_loads_in_step` of the config.
    host_loads_in_step: bool,
    /// A decode engine's remote requests (prefill/decode), when this engine is a consumer.
    /// Locked before `core` when both are.
    consumer: Option<Mutex<ConsumerSide>>,
}

impl SchedulerSide {
    fn core(&self) -> MutexGuard<'_, Scheduler> {
        lock(&self.core)
    }

    /// The engine hashes of `block_hashes` that request `name`'s keys do not cover yet.
    fn new_hashes(
        &self,
        name: &str,
        block_hashes: &Bound<'_, PySequence>,
    ) -> PyResult<Vec<Vec<u8>>> {
        let seen = self.core().hashes_seen(name);
        let n = block_hashes.len()?;
        (seen..n)
            .map(|i| block_hashes.get_item(i)?.extract())
            .collect()
    }

    /// Request `name`'s keys brought up to `block_hashes`.
    fn extend(&self, name: &str, block_hashes: &Bound<'_, PySequence>) -> PyResult<u64> {
        let new = self.new_hashes(name, block_hashes)?;
        Ok(self.core().extend_keys(name, new.iter().map(Vec::as_slice)))
    }
}

#[pymethods]
impl SchedulerSide {
    /// A scheduler side with the connector's settings `config` (vLLM's extra config, as JSON)
    /// and vLLM's `block_tokens`, for `tp_size × pp_size` workers. Requests' blocks are keyed
    /// in `namespaces`, one per KV cache group, from `hashes_per_block` engine block hashes per
    /// block; `groups`, for several groups, gives each as `(window, extra_retained)` (`window`
    /// `None`: full attention). A file tier's existing blocks are adopted into the index (with
    /// several workers, those every worker's shard holds). The GIL is free while the tier is
    /// read (a stuck mount holds only this call). A `ValueError` names what is wrong.
    #[new]
    #[pyo3(signature = (config, block_tokens, namespaces, tp_size=1, pp_size=1, hashes_per_block=1, groups=None, consumer=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        config: &str,
        block_tokens: u32,
        namespaces: Vec<Vec<u8>>,
        tp_size: u32,
        pp_size: u32,
        hashes_per_block: usize,
        groups: Option<Vec<(Option<u64>, u64)>>,
        consumer: Option<String>,
    ) -> PyResult<SchedulerSide> {
        let value_error = |e: String| PyValueError::new_err(e);
        let namespaces = namespaces.iter().map(|n| Namespace::new(n)).collect();
        let keys = Keyring::new(namespaces, hashes_per_block).map_err(value_error)?;
        let groups = groups
            .map(|g| {
                let g = g
                    .into_iter()
                    .map(|(window, extra)| window.map_or(Group::FULL, |w| Group::sliding(w, extra)))
                    .collect();
                Groups::new(g, u64::from(block_tokens)).map_err(|e| e.to_string())
            })
            .transpose()
            .map_err(value_error)?;
        let (cfg, side) = py.detach(|| {
            let cfg = connector_config(config, block_tokens)?;
            let side = kvx_offload::scheduler_side_sharded(&cfg, tp_size, pp_size)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            Ok::<_, PyErr>((cfg, side))
        })?;
        let world = tp_size * pp_size;
        let consumer = consumer
            .map(|ns| ConsumerSide::new(&cfg, ns, world as usize).map(Mutex::new))
            .transpose()
            .map_err(value_error)?;
        let core =
            Scheduler::new(side, keys, groups, cfg.host_loads_in_step).map_err(value_error)?;
        Ok(SchedulerSide {
            core: Mutex::new(core),
            remote: cfg.remote,
            world,
            host_loads_in_step: cfg.host_loads_in_step,
            consumer,
        })
    }

    /// The config's `host_loads_in_step`: a hit wholly in the host tier is loaded before the
    /// forward of the step that schedules its request.
    #[getter]
    fn host_loads_in_step(&self) -> bool {
        self.host_loads_in_step
    }

    /// kvx's number of the live request `name` (numbered at its first call).
    fn admit(&self, name: &str) -> u64 {
        self.core().admit(name).0
    }

    /// Take in request `name`'s engine block hashes (its whole list: only those not yet seen
    /// are read); returns its full blocks with keys.
    fn extend_keys(&self, name: &str, block_hashes: &Bound<'_, PySequence>) -> PyResult<u64> {
        self.extend(name, block_hashes)
    }

    /// Request `name`'s block keys (16 bytes each) in the first group's namespace.
    fn keys<'py>(&self, py: Python<'py>, name: &str) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &key_bytes(self.core().keys(name)))
    }

    /// Tokens beyond `num_computed` that the tiers hold for request `name` (`num_tokens` long,
    /// `block_hashes` its engine block hashes; never from a block whose load failed before),
    /// and whether the engine loads them asynchronously (see kvx-connector's
    /// `Scheduler::lookup`). `None`: ask again later. The GIL is free during the lookup.
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        name: &str,
        block_hashes: &Bound<'_, PySequence>,
        num_computed: u64,
        num_tokens: u64,
    ) -> PyResult<Option<(u64, bool)>> {
        let new = self.new_hashes(name, block_hashes)?;
        Ok(py.detach(|| {
            let mut core = self.core();
            core.extend_keys(name, new.iter().map(Vec::as_slice));
            core.lookup(name, num_computed, num_tokens)
                .map(|o| (o.tokens, o.asynchronous))
        }))
    }

    /// The last match of request `name`, as `(host blocks, file blocks)`.
    fn hit(&self, name: &str) -> (usize, usize) {
        let m = self.core().matched(name);
        (m.host_blocks, m.file_blocks)
    }

    /// The engine allocated `tables` (one block table per KV cache group) for request `name`,
    /// `num_external_tokens` of it for its last match: the load is queued. The engine blocks
    /// it loads, or `None` when no load was queued; a `KvxError` (nothing queued) for an
    /// allocation that does not fit the match.
    fn update_state_after_alloc(
        &self,
        name: &str,
        tables: Vec<Vec<u32>>,
        num_external_tokens: u64,
    ) -> PyResult<Option<Vec<u32>>> {
        let blocks = self
            .core()
            .allocated(name, &tables, num_external_tokens)
            .map_err(|e| KvxError::new_err(format!("update_state_after_alloc: {name}: {e}")))?;
        Ok(blocks.map(|b| b.into_iter().map(|b| b.0).collect()))
    }

    /// The load of `tokens` of request `name` was queued directly (`remote_load`): it is
    /// loading until reported in `finished_recving`.
    fn load_started(&self, name: &str, tokens: u64) {
        self.core().load_started(name, tokens);
    }

    /// What this side counted so far: lookups, loads queued with their tokens and their blocks
    /// per tier, store jobs, preemptions, loads that failed in a block; as (name, count).
    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.core().counters().named().to_vec()
    }

    /// True while request `name`'s load is queued and not yet reported in `finished_recving`.
    fn is_loading(&self, name: &str) -> bool {
        self.core().requests().is_loading(name)
    }

    /// Save the computed full blocks `first..` of request `name` (`block_hashes` its engine
    /// block hashes), whose engine blocks are `blocks` (those past its keyed blocks are left
    /// out); true if a store was queued.
    fn save_blocks(
        &self,
        name: &str,
        block_hashes: &Bound<'_, PySequence>,
        first: u64,
        blocks: Vec<u32>,
    ) -> PyResult<bool> {
        self.extend(name, block_hashes)?;
        Ok(self.core().save_blocks(name, first, &blocks))
    }

    /// Several KV cache groups: queue the store of what a step that completes blocks
    /// `[first, upto)` of request `name` stores in each group (`computed` tokens of it once the
    /// step ran, `tables` one block table per group); true if a store was queued.
    #[allow(clippy::too_many_arguments)]
    fn save_groups(
        &self,
        name: &str,
        block_hashes: &Bound<'_, PySequence>,
        first: u64,
        upto: u64,
        computed: u64,
        tables: Vec<Vec<u32>>,
    ) -> PyResult<bool> {
        self.extend(name, block_hashes)?;
        Ok(self
            .core()
            .save_groups(name, first, upto, computed, &tables))
    }

    /// Blocks fenced so far.
    #[getter]
    fn fenced_blocks(&self) -> u64 {
        self.core().hybrid().map_or(0, |h| h.fenced_blocks())
    }

    /// Forget every block the tiers hold (vLLM's `reset_prefix_cache(reset_connector=True)`):
    /// no lookup offers one again; the next step's metadata drops them from the workers' host
    /// tiers and removes their files, and blocks a load or store in flight still touches follow
    /// once it ended. Requests in flight go on.
    fn reset_cache(&self) {
        self.core().side().reset_cache();
    }

    /// Blocks a store put in no tier because no tier had room (every block pinned by a load or
    /// being stored), as `[("store_skipped_no_room", n)]` (empty while none).
    fn store_skips(&self) -> Vec<(String, u64)> {
        crate::worker::skipped(self.core().side().store_skips()).collect()
    }

    /// What this side counted since the last call (blocks no tier had room for), as a dict
    /// for vLLM's stats (see `kvx.vllm.stats`).
    fn take_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.core().side().take_stats();
        crate::stats::to_dict(py, &stats)
    }

    /// The engine preempted request `name`; false if it is unknown.
    fn request_preempted(&self, name: &str) -> bool {
        self.core().preempted(name)
    }

    /// The engine is done with request `name`; true when its blocks must stay until it is
    /// reported in `finished_sending` (a request whose load is in flight is not delayed: the
    /// engine keeps its blocks until the load is reported in `finished_recving`).
    fn request_finished(&self, name: &str) -> bool {
        self.core().finished(name)
    }

    /// The engine is done with request `name`, whose blocks `export_finished` exported: its
    /// freeing waits until it is reported in `finished_sending`.
    fn request_exported(&self, name: &str) {
        self.core().exported(name);
    }

    /// The workers reported these requests in `finished_recving` and `finished_sending`.
    fn reported(&self, recving: Vec<String>, sending: Vec<String>) {
        let recving = recving.iter().map(String::as_str);
        self.core()
            .reported(recving, sending.iter().map(String::as_str));
    }

    /// `[live, finished and still reported, loading, numbers in use, keyed, waiting hybrid
    /// hits]` requests: all zero when the engine is idle.
    fn table_counts(&self) -> [usize; 6] {
        self.core().counts()
    }

    /// The engine is done with a request whose `blocks` (keyed `keys`, 16 bytes each) a remote
    /// reader will load: export them under `export` this step (the freeing waits until the
    /// request is reported in `finished_sending`). Returns the source the reader needs, as
    /// JSON, naming `namespace`. A `ValueError` if this engine is not a producer (no
    /// `remote.listen`) or keys and blocks do not pair up; then nothing changed.
    fn export_finished(
        &self,
        req: u64,
        export: u64,
        namespace: String,
        keys: &[u8],
        blocks: Vec<u32>,
    ) -> PyResult<String> {
        let keys = keys_from_bytes(keys)?;
        if keys.is_empty() || keys.len() != blocks.len() {
            return Err(PyValueError::new_err(format!(
                "export_finished: {} keys but {} blocks",
                keys.len(),
                blocks.len()
            )));
        }
        let Some(remote) = &self.remote else {
            return Err(PyValueError::new_err(
                "this engine exports nothing: kv_connector_extra_config has no `remote`",
            ));
        };
        let Some(producers) = remote.producers(self.world) else {
            return Err(PyValueError::new_err(
                "this engine exports nothing: set remote.listen (kv_connector_extra_config)",
            ));
        };
        let source = RemoteSource {
            namespace,
            export,
            producers,
            keys: keys.clone(),
            ttl_ms: remote.lease_ttl_ms,
            heartbeat_ms: remote.heartbeat_ms,
        };
        source
            .validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let pairs: Vec<(BlockKey, EngineBlockId)> = keys
            .into_iter()
            .zip(blocks.into_iter().map(EngineBlockId))
            .collect();
        self.core()
            .side()
            .export_finished(RequestId(req), export, &pairs);
        Ok(source.to_json())
    }

    /// Queue a load of a remote source's blocks `first..first + len(blocks)` into `blocks`
    /// this step. A `ValueError` (nothing queued) for a source that does not parse or names
    /// fewer blocks.
    fn remote_load(&self, req: u64, source: &str, first: u32, blocks: Vec<u32>) -> PyResult<()> {
        let source =
            RemoteSource::from_json(source).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let n = source.keys.len() as u64;
        if blocks.is_empty() || u64::from(first) + blocks.len() as u64 > n {
            return Err(PyValueError::new_err(format!(
                "remote_load: blocks {first}..+{} of a source of {n}",
                blocks.len()
            )));
        }
        let pairs: Vec<(u32, EngineBlockId)> = blocks
            .into_iter()
            .enumerate()
            .map(|(i, b)| (first + i as u32, EngineBlockId(b)))
            .collect();
        self.core()
            .side()
            .remote_load(RequestId(req), Arc::new(source), &pairs);
        Ok(())
    }

    /// A decode engine's lookup of request `name` (its `block_hashes`, `num_computed` tokens
    /// computed here). `source`: the producer's source it came with (JSON), `None` when it
    /// asks for no remote prefill. `None` back: look it up locally (not a remote request, or no
    /// longer one); else `(tokens, asynchronous, why)` as vLLM's lookup answers, `tokens`
    /// `None` while the producer has not confirmed the lease (at most the remote load
    /// deadline), and `why` set when the request computes its prompt here against the plan (a
    /// source that does not fit this engine, a lost lease).
    #[allow(clippy::type_complexity)]
    fn remote_lookup(
        &self,
        name: &str,
        block_hashes: &Bound<'_, PySequence>,
        source: Option<&str>,
        num_computed: u64,
    ) -> PyResult<Option<(Option<u64>, bool, Option<String>)>> {
        let Some(c) = &self.consumer else {
            return Ok(None);
        };
        let mut c = lock(c);
        if source.is_none() && !c.core.is_remote(name) {
            return Ok(None);
        }
        let number = {
            let mut sched = self.core();
            sched.count_lookup();
            sched.admit(name)
        };
        self.extend(name, block_hashes)?;
        let keys = self.core().keys(name).to_vec();
        let ConsumerSide { core, keeper } = &mut *c;
        let now = std::time::Instant::now();
        Ok(
            match core.lookup(keeper, name, number, source, &keys, num_computed, now) {
                Lookup::Local => None,
                Lookup::Wait => Some((None, false, None)),
                Lookup::Offer(tokens) => Some((Some(tokens), true, None)),
                Lookup::Compute { why } => Some((Some(0), false, why)),
            },
        )
    }

    /// True once request `name` came to this decode engine as a remote one (until it
    /// finished).
    fn remote_known(&self, name: &str) -> bool {
        self.consumer
            .as_ref()
            .is_some_and(|c| lock(c).core.knows(name))
    }

    /// The engine allocated `blocks` (the request's block table) for the `num_external_tokens`
    /// offered to remote request `name`: `None` when it is not one offered blocks; else
    /// `(queued, why)`: true when its load from the producer was queued, false when its remote
    /// part ended without one (`why` set when that was not the plan).
    fn remote_alloc(
        &self,
        name: &str,
        blocks: Vec<u32>,
        num_external_tokens: u64,
    ) -> Option<(bool, Option<String>)> {
        let mut c = lock(self.consumer.as_ref()?);
        let ConsumerSide { core, keeper } = &mut *c;
        match core.allocated(keeper, name, &blocks, num_external_tokens) {
            Allocated::Local => None,
            Allocated::Ended { why } => Some((false, why)),
            Allocated::Load {
                number,
                source,
                blocks,
            } => {
                let mut sched = self.core();
                sched.side().remote_load(number, source, &blocks);
                sched.load_started(name, num_external_tokens);
                Some((true, None))
            }
        }
    }

    /// The workers reported these requests in `finished_recving`: the producers of the remote
    /// ones may free their blocks.
    fn remote_loaded(&self, names: Vec<String>) {
        if let Some(c) = &self.consumer {
            let mut c = lock(c);
            let ConsumerSide { core, keeper } = &mut *c;
            for n in &names {
                core.loaded(keeper, n);
            }
        }
    }

    /// Request `name` finished or was aborted: a remote one's lease is let go.
    fn remote_finished(&self, name: &str) {
        if let Some(c) = &self.consumer {
            let mut c = lock(c);
            let ConsumerSide { core, keeper } = &mut *c;
            core.finished(keeper, name);
        }
    }

    /// `(remote requests tracked, leases kept, sources refused)`: the first two zero when idle.
    fn remote_counts(&self) -> (usize, usize, u64) {
        self.consumer.as_ref().map_or((0, 0, 0), |c| {
            let c = lock(c);
            let (n, refused) = c.core.counts();
            (n, c.kept(), refused)
        })
    }

    /// This step's message for every worker (`WorkerSide.start_step`), encoded: kvx-offload's
    /// instructions, the requests they name, the blocks `fence` chose.
    fn build_meta<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let msg = self.core().build_step();
        PyBytes::new(py, &codec::encode_step(&msg))
    }

    /// Of `handed_out` (engine blocks this step's scheduler output gives to requests), before
    /// the step's stores are planned: those a queued sliding-window store may still read, which
    /// the workers fence before they queue this step's stores (named in the step's message).
    /// Returns how many.
    fn fence(&self, handed_out: Vec<u32>) -> usize {
        self.core().fence(handed_out.into_iter().map(EngineBlockId))
    }

    /// Take in the job outcomes a worker reported (the message names its rank). With several
    /// workers a job counts once every rank reported it (kvx-offload merges them). A load that
    /// did not fully succeed on every rank stops its request being offered the blocks from its
    /// first failed one on. Returns how many such loads there were.
    fn update_from_worker(&self, jobs: &[u8]) -> PyResult<usize> {
        let (rank, jobs) =
            codec::decode_jobs(jobs).map_err(|e| KvxError::new_err(e.to_string()))?;
        let out = kvx_offload::WorkerOutput {
            jobs,
            ..Default::default()
        };
        Ok(self.core().update_from_rank(rank, &out))
    }

    /// Requests with state here.
    fn request_count(&self) -> usize {
        self.core().side().request_count()
    }

    /// Jobs not yet fully reported.
    fn job_count(&self) -> usize {
        self.core().side().job_count()
    }

    /// Job parts some workers reported and others not yet (0 with one worker).
    fn partial_count(&self) -> usize {
        self.core().side().partial_count()
    }

    /// Workers behind this scheduler side (tensor × pipeline parallel size).
    fn world(&self) -> u32 {
        self.core().side().world()
    }

    /// True when nothing is pinned, stored or promoted in the index.
    fn is_quiet(&self) -> bool {
        self.core().side().manager().is_quiet()
    }

    /// Blocks held by the host tier and by the file tier.
    fn tier_sizes(&self) -> (usize, usize) {
        let mut core = self.core();
        let m = core.side().manager();
        (m.blocks(Tier::Host), m.blocks(Tier::File))
    }
}
