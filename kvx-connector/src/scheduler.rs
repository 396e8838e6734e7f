//! [`Scheduler`]: the scheduler side of a connector, as an engine adapter drives it: requests
//! named by the engine's id, the request table ([`Requests`]), each request's keys
//! ([`Keyring`]), hybrid KV cache groups ([`Hybrid`]) when the engine has several, over
//! kvx-offload's [`SchedulerSide`] (the tier index, the jobs, the step message).

use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_offload::SchedulerSide;

use crate::groups::{Groups, Hybrid, host_and_file};
use crate::keys::Keyring;
use crate::requests::{Ending, Matched, Requests};
use crate::step::StepMsg;

/// What a lookup offers the engine: tokens beyond those it computed, and whether it loads
/// them asynchronously (else before the forward of the step that schedules the request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    pub tokens: u64,
    pub asynchronous: bool,
}

/// What the scheduler side counted since it was built (the connector's counters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Lookups of requests, local and remote.
    pub lookups: u64,
    /// Loads queued (local and remote), their tokens, and their blocks from the host and the
    /// file tier.
    pub loads: u64,
    pub hit_tokens: u64,
    pub host_hit_blocks: u64,
    pub file_hit_blocks: u64,
    /// Store jobs queued.
    pub store_jobs: u64,
    /// Live requests the engine preempted.
    pub preemptions: u64,
    /// Loads that did not fully succeed on every rank.
    pub failed_loads: u64,
}

impl Counters {
    /// Each counter by name.
    pub fn named(&self) -> [(&'static str, u64); 8] {
        [
            ("lookups", self.lookups),
            ("hit_tokens", self.hit_tokens),
            ("host_hit_blocks", self.host_hit_blocks),
            ("file_hit_blocks", self.file_hit_blocks),
            ("loads", self.loads),
            ("store_jobs", self.store_jobs),
            ("preemptions", self.preemptions),
            ("failed_loads", self.failed_loads),
        ]
    }
}

/// The scheduler side's core (see the module docs).
pub struct Scheduler {
    side: SchedulerSide,
    requests: Requests,
    keys: Keyring,
    hybrid: Option<Hybrid>,
    host_loads_in_step: bool,
    /// Steps built so far.
    steps: u64,
    /// Engine blocks the next step's message fences first.
    fence: Vec<EngineBlockId>,
    counters: Counters,
}

impl Scheduler {
    /// A core over `side`, keying requests with `keys` (one namespace per group of `groups`;
    /// `groups` `None`: one full-attention group). `host_loads_in_step`: a hit wholly in the
    /// host tier is loaded before the forward of the step that schedules its request.
    pub fn new(
        side: SchedulerSide,
        keys: Keyring,
        groups: Option<Groups>,
        host_loads_in_step: bool,
    ) -> Result<Scheduler, String> {
        let expected = groups.as_ref().map_or(1, Groups::len);
        if keys.groups() != expected {
            return Err(format!(
                "{} key namespaces for {expected} KV cache groups",
                keys.groups()
            ));
        }
        Ok(Scheduler {
            side,
            requests: Requests::new(),
            keys,
            hybrid: groups.map(Hybrid::new),
            host_loads_in_step,
            steps: 0,
            fence: Vec::new(),
            counters: Counters::default(),
        })
    }

    /// kvx-offload's scheduler side (the tier index, exports, remote loads).
    pub fn side(&mut self) -> &mut SchedulerSide {
        &mut self.side
    }

    /// The request table.
    pub fn requests(&self) -> &Requests {
        &self.requests
    }

    /// The hybrid groups' state, when there are several groups.
    pub fn hybrid(&self) -> Option<&Hybrid> {
        self.hybrid.as_ref()
    }

    /// kvx's number of live request `name` (numbered at its first call).
    pub fn admit(&mut self, name: &str) -> RequestId {
        self.requests.admit(name)
    }

    /// How many of live request `name`'s engine hashes its keys cover (none for a request
    /// not yet admitted).
    pub fn hashes_seen(&self, name: &str) -> usize {
        self.requests
            .live(name)
            .map_or(0, |req| self.keys.hashes_seen(req))
    }

    /// Extend live request `name`'s keys with its engine hashes from
    /// [`Scheduler::hashes_seen`] on; its full blocks with keys.
    pub fn extend_keys<'a>(&mut self, name: &str, new: impl IntoIterator<Item = &'a [u8]>) -> u64 {
        let req = self.requests.admit(name);
        self.keys.extend(req, new);
        self.keys.blocks(req)
    }

    /// Live request `name`'s keys in the first group's namespace.
    pub fn keys(&self, name: &str) -> &[BlockKey] {
        self.requests
            .live(name)
            .map_or(&[], |req| self.keys.keys(req, 0))
    }

    /// The tokens the tiers hold for live request `name` (`num_tokens` long, `num_computed`
    /// of them computed by the engine) beyond those computed; `None`: ask again later. Never
    /// from a block whose load failed before on. With one group, a hit wholly in the host tier
    /// that leaves a token to compute loads in the step when `host_loads_in_step`; with
    /// several, the longest hit every group can serve (its last token is always computed by
    /// the engine), always asynchronously.
    pub fn lookup(&mut self, name: &str, num_computed: u64, num_tokens: u64) -> Option<Offer> {
        self.counters.lookups += 1;
        let req = self.requests.admit(name);
        let cap = self.requests.cap(req);
        let bt = u64::from(self.side.block_tokens());
        if let Some(hybrid) = &mut self.hybrid {
            let end = cap
                .map_or(u64::MAX, |c| c)
                .min(num_tokens.saturating_sub(1) / bt);
            let hit = hybrid.lookup(&mut self.side, &self.keys, req, num_computed / bt, end)?;
            if hit.tokens > 0 {
                let matched = Matched {
                    local_tokens: num_computed,
                    host_blocks: hit.host_blocks,
                    file_blocks: hit.file_blocks,
                    in_step: false,
                };
                self.requests.set_matched(req, matched);
            }
            return Some(Offer {
                tokens: hit.tokens,
                asynchronous: hit.tokens > 0,
            });
        }
        let keys = self.keys.keys(req, 0);
        let keys = &keys[..keys.len().min(cap.map_or(usize::MAX, |c| c as usize))];
        let tokens = self
            .side
            .get_num_new_matched_tokens(req, keys, num_computed)?;
        let (host_blocks, file_blocks) = host_and_file(self.side.matched_tiers(req));
        // The engine computes at least one token in the step that schedules a request: a hit
        // of the whole prompt loads asynchronously (the engine then recomputes its last token).
        let in_step = tokens > 0
            && file_blocks == 0
            && self.host_loads_in_step
            && num_computed + tokens < num_tokens;
        let matched = Matched {
            local_tokens: num_computed,
            host_blocks,
            file_blocks,
            in_step,
        };
        self.requests.set_matched(req, matched);
        Some(Offer {
            tokens,
            asynchronous: tokens > 0 && !in_step,
        })
    }

    /// The last match of live request `name`.
    pub fn matched(&self, name: &str) -> Matched {
        self.requests
            .live(name)
            .map(|r| self.requests.matched(r))
            .unwrap_or_default()
    }

    /// The engine allocated `tables` (one block table per group) for live request `name`,
    /// `num_external_tokens` of it for its last match: the load is queued. The engine blocks
    /// it loads, or `None` when no load was queued; an allocation that does not fit the match
    /// is an error and queues nothing.
    pub fn allocated(
        &mut self,
        name: &str,
        tables: &[Vec<u32>],
        num_external_tokens: u64,
    ) -> Result<Option<Vec<EngineBlockId>>, String> {
        let Some(req) = self.requests.live(name) else {
            return Ok(None);
        };
        if num_external_tokens == 0 {
            return Ok(None);
        }
        let blocks = if let Some(hybrid) = &mut self.hybrid {
            hybrid.allocated(&mut self.side, req, tables)?
        } else {
            let bt = u64::from(self.side.block_tokens());
            let first = (self.requests.matched(req).local_tokens / bt) as usize;
            let n = (num_external_tokens / bt) as usize;
            let table = tables.first().map_or(&[][..], Vec::as_slice);
            let Some(blocks) = table.get(first..first.saturating_add(n)) else {
                return Err(format!(
                    "{name}: a table of {} blocks has no blocks {first}..+{n}",
                    table.len()
                ));
            };
            let blocks: Vec<EngineBlockId> = blocks.iter().copied().map(EngineBlockId).collect();
            self.side
                .update_state_after_alloc(req, &blocks)
                .map_err(|e| e.to_string())?
                .map(|_| blocks)
        };
        if blocks.is_some() {
            self.requests.load_started(req);
            let m = self.requests.matched(req);
            self.count_load(num_external_tokens, m.host_blocks, m.file_blocks);
        }
        Ok(blocks)
    }

    /// The load of `tokens` of live request `name` was queued with kvx-offload directly (a
    /// remote load): it is loading until reported in `finished_recving`.
    pub fn load_started(&mut self, name: &str, tokens: u64) {
        if let Some(req) = self.requests.live(name) {
            self.requests.load_started(req);
            self.count_load(tokens, 0, 0);
        }
    }

    fn count_load(&mut self, tokens: u64, host_blocks: usize, file_blocks: usize) {
        let c = &mut self.counters;
        c.loads += 1;
        c.hit_tokens += tokens;
        c.host_hit_blocks += host_blocks as u64;
        c.file_hit_blocks += file_blocks as u64;
    }

    /// A lookup answered outside [`Scheduler::lookup`] (a decode engine's remote request).
    pub fn count_lookup(&mut self) {
        self.counters.lookups += 1;
    }

    /// What this side counted so far.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Save the computed full blocks of live request `name` from `first` on (one group):
    /// `blocks` are their engine blocks, those past its keyed blocks left out. True if a store
    /// was queued.
    pub fn save_blocks(&mut self, name: &str, first: u64, blocks: &[u32]) -> bool {
        let Some(req) = self.requests.live(name) else {
            return false;
        };
        let keys = self.keys.keys(req, 0);
        let pairs: Vec<(BlockKey, EngineBlockId)> = keys
            .get(first as usize..)
            .unwrap_or(&[])
            .iter()
            .copied()
            .zip(blocks.iter().copied().map(EngineBlockId))
            .collect();
        let queued = !pairs.is_empty() && self.side.save_blocks(req, &pairs).is_some();
        self.counters.store_jobs += u64::from(queued);
        queued
    }

    /// Save what a step that completes blocks `[first, upto)` of live request `name` stores
    /// in every group (`computed` tokens once it ran, `tables` one block table per group);
    /// true if a store was queued.
    pub fn save_groups(
        &mut self,
        name: &str,
        first: u64,
        upto: u64,
        computed: u64,
        tables: &[Vec<u32>],
    ) -> bool {
        let (Some(req), Some(hybrid)) = (self.requests.live(name), &mut self.hybrid) else {
            return false;
        };
        let queued = hybrid.save(
            &mut self.side,
            &self.keys,
            req,
            first,
            upto,
            computed,
            tables,
        );
        self.counters.store_jobs += u64::from(queued);
        queued
    }

    /// The engine preempted live request `name`; false if it is unknown.
    pub fn preempted(&mut self, name: &str) -> bool {
        let Some(req) = self.requests.live(name) else {
            return false;
        };
        self.side.request_preempted(req);
        self.counters.preemptions += 1;
        true
    }

    /// The engine is done with live request `name`: true when its blocks must stay until it is
    /// reported in `finished_sending` (a request whose load is in flight is not delayed: the
    /// engine keeps its blocks until the load is reported in `finished_recving`).
    pub fn finished(&mut self, name: &str) -> bool {
        let Some(req) = self.requests.live(name) else {
            return false;
        };
        self.forget(req);
        let delayed = self.side.request_finished(req);
        matches!(
            self.requests.finish(name, delayed),
            Some((_, Ending::Delayed))
        )
    }

    /// The engine is done with live request `name`, whose blocks kvx-offload exports: its
    /// freeing waits until it is reported in `finished_sending`.
    pub fn exported(&mut self, name: &str) {
        if let Some((req, _)) = self.requests.finish(name, true) {
            self.forget(req);
        }
    }

    fn forget(&mut self, req: RequestId) {
        self.keys.forget(req);
        if let Some(h) = &mut self.hybrid {
            h.forget(req);
        }
    }

    /// The workers reported these requests in `finished_recving` and `finished_sending`.
    pub fn reported<'a>(
        &mut self,
        recving: impl IntoIterator<Item = &'a str>,
        sending: impl IntoIterator<Item = &'a str>,
    ) {
        for name in recving {
            self.requests.recv_reported(name);
        }
        for name in sending {
            self.requests.send_reported(name);
        }
    }

    /// Take in job outcomes of `rank`: a load that did not fully succeed on every rank stops
    /// its request being offered the blocks from its first failed one (in any group) on.
    /// Returns how many such loads there were.
    pub fn update_from_rank(&mut self, rank: u32, out: &kvx_offload::WorkerOutput) -> usize {
        let applied = self.side.update_from_rank(rank, out);
        let mut failed_loads = 0;
        for j in &applied {
            if j.part != kvx_offload::JobPart::Load || j.failed.is_empty() {
                continue;
            }
            failed_loads += 1;
            let failed: Vec<BlockKey> = j.failed.iter().map(|(k, _)| *k).collect();
            if let Some(index) = self.keys.first_failed(j.request, &failed) {
                self.requests.lower_cap(j.request, index);
            }
        }
        self.counters.failed_loads += failed_loads as u64;
        failed_loads
    }

    /// Of the engine blocks handed out this step (to requests: new, grown, resumed, copied
    /// into), before the step's stores are planned: those the workers fence before they queue
    /// the step's stores (sliding-window store sources; none with one group), named in the
    /// step's message. Returns how many.
    pub fn fence(&mut self, handed_out: impl IntoIterator<Item = EngineBlockId>) -> usize {
        let Some(h) = &mut self.hybrid else {
            return 0;
        };
        let fenced = h.fence(handed_out);
        self.fence.extend_from_slice(&fenced);
        fenced.len()
    }

    /// This step's message: kvx-offload's instructions, the requests it names and the blocks
    /// to fence first.
    pub fn build_step(&mut self) -> StepMsg {
        let fence = std::mem::take(&mut self.fence);
        let abandoned = self.requests.take_abandoned();
        let in_step = self.requests.take_in_step();
        let mut meta = self.side.build_meta();
        // The engine itself keeps an abandoned request's blocks until its load is reported.
        meta.delayed_free.retain(|r| !abandoned.contains(r));
        // Only requests the engine named: the workers report them by that name.
        let t = &self.requests;
        let loads: Vec<RequestId> = meta
            .loads
            .iter()
            .map(|l| l.request)
            .chain(meta.remote_loads.iter().map(|l| l.request))
            .filter(|r| !in_step.contains(r) && t.name(*r).is_some())
            .collect();
        let delayed: Vec<RequestId> = meta
            .delayed_free
            .iter()
            .copied()
            .filter(|r| t.name(*r).is_some())
            .collect();
        let mut names: Vec<(RequestId, String)> = loads
            .iter()
            .chain(&delayed)
            .filter_map(|r| t.name(*r).map(|n| (*r, n.to_string())))
            .collect();
        names.sort_unstable_by_key(|(r, _)| *r);
        names.dedup_by_key(|(r, _)| *r);
        self.steps += 1;
        StepMsg {
            step: self.steps,
            meta,
            names,
            loads,
            delayed,
            abandoned,
            in_step,
            fence,
        }
    }

    /// `(live, finished and still reported, loading, numbers in use, keyed, waiting hybrid
    /// hits)`: all zero when the engine is idle.
    pub fn counts(&self) -> [usize; 6] {
        let (live, finished, loading) = self.requests.counts();
        let hybrid = self.hybrid.as_ref().map_or(0, Hybrid::request_count);
        [
            live,
            finished,
            loading,
            self.requests.numbers(),
            self.keys.len(),
            hybrid,
        ]
    }
}

#[cfg(test)]
mod tests;
