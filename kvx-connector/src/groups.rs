//! Hybrid models: several KV cache groups (full attention, sliding window) over one engine block
//! pool, as vLLM's hybrid KV cache manager gives them.
//!
//! Each group has its own block table and key namespace; a block id belongs to one group at a
//! time, and the bytes of a block are what the layers of the group holding it wrote, so the
//! worker copies blocks as for one group and only the keys tell the groups apart.
//!
//! For a request whose local prefix ends at block `first`:
//!
//! - a hit of blocks `[first, end)` is one every group can serve: a full-attention group holds
//!   all of them, a sliding-window group the blocks the engine keeps for a prefix of `end`
//!   blocks ([`Group::skipped`]); [`Groups::plan`] finds the longest such `end`, and the load is
//!   one kvx job over the blocks of every group;
//! - a step stores, of the blocks it completes, every one of a full-attention group and those
//!   still in the window of a sliding-window group ([`Groups::stores`]);
//! - the engine frees sliding-window blocks while the request runs, possibly while a store of
//!   them is queued: [`Hybrid::fence`] names the blocks handed out again that a queued store may
//!   still read, to be fenced before the step's forward writes them.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::ops::Range;

use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_offload::{Lookup, SchedulerSide, Tier};

use crate::keys::Keyring;

/// One KV cache group as kvx treats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    /// `None`: full attention (every block of a prefix is read); else the window in tokens.
    window: Option<u64>,
    /// Tokens kept beyond the window's trailing edge (vLLM's `extra_retained_tokens`).
    extra_retained: u64,
}

impl Group {
    /// A full-attention group.
    pub const FULL: Group = Group {
        window: None,
        extra_retained: 0,
    };

    /// A sliding-window group of `window` tokens (at least 1) that keeps `extra_retained`
    /// tokens more.
    pub fn sliding(window: u64, extra_retained: u64) -> Group {
        Group {
            window: Some(window),
            extra_retained,
        }
    }

    /// True for a sliding-window group.
    pub fn is_sliding(&self) -> bool {
        self.window.is_some()
    }

    /// Tokens of a prefix of `tokens` the engine no longer keeps (vLLM's
    /// `get_num_skipped_tokens`): those before the window of the next token, less the extra
    /// retained ones.
    pub fn skipped(&self, tokens: u64) -> u64 {
        match self.window {
            None => 0,
            Some(window) => (tokens + 1).saturating_sub(window + self.extra_retained),
        }
    }
}

/// A group list kvx cannot serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupsError {
    /// No group at all.
    NoGroups,
    /// A block of zero tokens.
    ZeroBlockTokens,
    /// A sliding window of zero tokens.
    ZeroWindow { group: usize },
}

impl fmt::Display for GroupsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GroupsError::NoGroups => write!(f, "no KV cache group"),
            GroupsError::ZeroBlockTokens => write!(f, "a KV block of 0 tokens"),
            GroupsError::ZeroWindow { group } => {
                write!(f, "KV cache group {group}: a sliding window of 0 tokens")
            }
        }
    }
}

impl std::error::Error for GroupsError {}

/// The blocks of a hit, `[first, end)`, and each group's blocks to load (a suffix of the hit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub first: u64,
    pub end: u64,
    pub wanted: Vec<Range<u64>>,
}

impl Plan {
    /// Blocks of the hit (0 when there is none).
    pub fn blocks(&self) -> u64 {
        self.end.saturating_sub(self.first)
    }
}

/// An engine allocation that does not match the plan: a block the plan loads got the null
/// block, or one it does not load got a real block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocMismatch {
    pub group: usize,
    pub index: u64,
    /// 0: the null block.
    pub engine_block: u32,
    pub planned_load: bool,
}

impl fmt::Display for AllocMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let got = match self.engine_block {
            0 => "the null block".to_string(),
            b => format!("engine block {b}"),
        };
        let planned = if self.planned_load { "a load" } else { "none" };
        write!(
            f,
            "group {}: block {} is {got}, kvx planned {planned}",
            self.group, self.index
        )
    }
}

impl std::error::Error for AllocMismatch {}

/// The groups of one engine and its block size, and what follows from them alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Groups {
    groups: Vec<Group>,
    block_tokens: u64,
}

impl Groups {
    /// Checked: at least one group, blocks and windows of at least one token.
    pub fn new(groups: Vec<Group>, block_tokens: u64) -> Result<Groups, GroupsError> {
        if groups.is_empty() {
            return Err(GroupsError::NoGroups);
        }
        if block_tokens == 0 {
            return Err(GroupsError::ZeroBlockTokens);
        }
        if let Some(group) = groups.iter().position(|g| g.window == Some(0)) {
            return Err(GroupsError::ZeroWindow { group });
        }
        Ok(Groups {
            groups,
            block_tokens,
        })
    }

    /// How many groups.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// Never true ([`Groups::new`] refuses an empty list).
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The blocks of `[first, end)` group `g` reads for a prefix of `end` blocks.
    pub fn wanted(&self, g: usize, first: u64, end: u64) -> Range<u64> {
        let kept_from = self.groups[g].skipped(end * self.block_tokens) / self.block_tokens;
        first.max(kept_from).min(end)..end
    }

    /// The longest hit `[first, e)`, `e <= end`, every group can serve. `held(g, blocks)` says
    /// how many leading blocks of `blocks` the tiers hold in group `g`'s namespace, `None`:
    /// ask again later (then so is the answer). A hit of no block has `end <= first`.
    ///
    /// Why the longest: a block `m` a sliding-window group lacks lies in that group's window
    /// for every end from `m + 1` to the end being tried (windows only move forward as the end
    /// grows), so the next end that can be served is at most `m`.
    pub fn plan(
        &self,
        first: u64,
        end: u64,
        mut held: impl FnMut(usize, Range<u64>) -> Option<u64>,
    ) -> Option<Plan> {
        let mut end = end;
        for (g, group) in self.groups.iter().enumerate() {
            if !group.is_sliding() && end > first {
                end = first + held(g, first..end)?.min(end - first);
            }
        }
        'shrink: while end > first {
            for (g, group) in self.groups.iter().enumerate() {
                if !group.is_sliding() {
                    continue;
                }
                let want = self.wanted(g, first, end);
                if want.is_empty() {
                    continue;
                }
                let n = held(g, want.clone())?;
                if n < want.end - want.start {
                    end = want.start + n;
                    continue 'shrink;
                }
            }
            break;
        }
        let end = end.max(first);
        Some(Plan {
            first,
            end,
            wanted: (0..self.groups.len())
                .map(|g| self.wanted(g, first, end))
                .collect(),
        })
    }

    /// The engine blocks the plan loads, group by group, from the engine's block table of each
    /// group (`0`: the null block; a table too short reads as null blocks).
    pub fn engine_blocks(
        &self,
        plan: &Plan,
        tables: &[Vec<u32>],
    ) -> Result<Vec<EngineBlockId>, AllocMismatch> {
        let mut out = Vec::new();
        for (g, want) in plan.wanted.iter().enumerate() {
            let table = tables.get(g).map_or(&[][..], Vec::as_slice);
            for index in plan.first..plan.end {
                let engine_block = block_at(table, index);
                let planned_load = want.contains(&index);
                if planned_load != (engine_block != 0) {
                    return Err(AllocMismatch {
                        group: g,
                        index,
                        engine_block,
                        planned_load,
                    });
                }
                if planned_load {
                    out.push(EngineBlockId(engine_block));
                }
            }
        }
        Ok(out)
    }

    /// What a step that completes blocks `[first, upto)` of a request, `computed` tokens of it
    /// computed once the step ran, stores: `(group, block index, engine block)`, every block of
    /// a full-attention group and those a sliding-window group still keeps; null blocks never.
    pub fn stores(
        &self,
        first: u64,
        upto: u64,
        computed: u64,
        tables: &[Vec<u32>],
    ) -> Vec<(usize, u64, EngineBlockId)> {
        let mut out = Vec::new();
        for (g, group) in self.groups.iter().enumerate() {
            let table = tables.get(g).map_or(&[][..], Vec::as_slice);
            let from = first.max(group.skipped(computed) / self.block_tokens);
            for index in from..upto {
                let b = block_at(table, index);
                if b != 0 {
                    out.push((g, index, EngineBlockId(b)));
                }
            }
        }
        out
    }
}

fn block_at(table: &[u32], index: u64) -> u32 {
    usize::try_from(index)
        .ok()
        .and_then(|i| table.get(i).copied())
        .unwrap_or(0)
}

/// A hit the tiers hold for a request: tokens to load, and the blocks of them each tier holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hit {
    pub tokens: u64,
    pub host_blocks: usize,
    pub file_blocks: usize,
}

/// The hybrid-model state of a connector's scheduler side over kvx-offload's
/// [`SchedulerSide`] and the requests' keys per group (a [`Keyring`] with a namespace per
/// group): the hits waiting for the engine's allocation, and the sliding-window blocks a
/// queued store may still read.
#[derive(Debug)]
pub struct Hybrid {
    groups: Groups,
    plans: HashMap<RequestId, Plan>,
    sliding_sources: HashSet<EngineBlockId>,
    fenced: u64,
}

impl Hybrid {
    /// The state for `groups`.
    pub fn new(groups: Groups) -> Hybrid {
        Hybrid {
            groups,
            plans: HashMap::new(),
            sliding_sources: HashSet::new(),
            fenced: 0,
        }
    }

    /// The longest hit of blocks `[first, end)` every group can serve, registered with `side`
    /// as `req`'s pending lookup (one job over every group's blocks); `None`: ask again later.
    /// A hit of no tokens leaves no pending lookup.
    pub fn lookup(
        &mut self,
        side: &mut SchedulerSide,
        keys: &Keyring,
        req: RequestId,
        first: u64,
        end: u64,
    ) -> Option<Hit> {
        self.plans.remove(&req);
        let end = end.min(keys.blocks(req));
        let plan = self.groups.plan(first, end, |g, blocks| {
            match side.lookup(slice(keys.keys(req, g), blocks)) {
                Lookup::Retry => None,
                Lookup::Hit(tiers) => Some(tiers.len() as u64),
            }
        });
        let Some(plan) = plan else {
            drop_pending(side, req);
            return None;
        };
        if plan.blocks() == 0 {
            drop_pending(side, req);
            return Some(Hit::default());
        }
        let composite: Vec<BlockKey> = plan
            .wanted
            .iter()
            .enumerate()
            .flat_map(|(g, want)| slice(keys.keys(req, g), want.clone()).iter().copied())
            .collect();
        let bt = u64::from(side.block_tokens());
        let found = side.get_num_new_matched_tokens(req, &composite, 0)?;
        if found != composite.len() as u64 * bt {
            // A block went between the plan's lookups and this one.
            drop_pending(side, req);
            return Some(Hit::default());
        }
        let (host_blocks, file_blocks) = host_and_file(side.matched_tiers(req));
        let hit = Hit {
            tokens: plan.blocks() * bt,
            host_blocks,
            file_blocks,
        };
        self.plans.insert(req, plan);
        Some(hit)
    }

    /// The engine allocated `tables` (one block table per group) for `req`'s last hit: its
    /// load is queued with `side`. The engine blocks it loads, or `None` when no hit was
    /// waiting; an allocation that does not match the hit is an error and queues nothing.
    pub fn allocated(
        &mut self,
        side: &mut SchedulerSide,
        req: RequestId,
        tables: &[Vec<u32>],
    ) -> Result<Option<Vec<EngineBlockId>>, String> {
        let Some(plan) = self.plans.remove(&req) else {
            return Ok(None);
        };
        let blocks = self
            .groups
            .engine_blocks(&plan, tables)
            .map_err(|e| e.to_string())?;
        match side.update_state_after_alloc(req, &blocks) {
            Ok(Some(_)) => Ok(Some(blocks)),
            Ok(None) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Queue the store of what a step that completes blocks `[first, upto)` of `req` stores
    /// (`computed` tokens once it ran; see [`Groups::stores`]); true if a store was queued.
    #[allow(clippy::too_many_arguments)]
    pub fn save(
        &mut self,
        side: &mut SchedulerSide,
        keys: &Keyring,
        req: RequestId,
        first: u64,
        upto: u64,
        computed: u64,
        tables: &[Vec<u32>],
    ) -> bool {
        let upto = upto.min(keys.blocks(req));
        let stores = self.groups.stores(first, upto, computed, tables);
        if stores.is_empty() {
            return false;
        }
        let pairs: Vec<(BlockKey, EngineBlockId)> = stores
            .iter()
            .map(|&(g, index, b)| (keys.keys(req, g)[index as usize], b))
            .collect();
        if side.save_blocks(req, &pairs).is_none() {
            return false;
        }
        let sliding = stores
            .iter()
            .filter(|(g, ..)| self.groups.groups[*g].is_sliding());
        self.sliding_sources.extend(sliding.map(|&(.., b)| b));
        true
    }

    /// Of the engine blocks handed out this step, those a queued sliding-window store may still
    /// read, sorted: the worker fences them before the step's stores are queued (and so before
    /// the forward writes them). Each is named once.
    pub fn fence(
        &mut self,
        handed_out: impl IntoIterator<Item = EngineBlockId>,
    ) -> Vec<EngineBlockId> {
        let mut out: Vec<EngineBlockId> = handed_out
            .into_iter()
            .filter(|b| self.sliding_sources.remove(b))
            .collect();
        out.sort_unstable();
        out.dedup();
        self.fenced += out.len() as u64;
        out
    }

    /// The engine is done with `req`: any hit of it still waiting goes.
    pub fn forget(&mut self, req: RequestId) {
        self.plans.remove(&req);
    }

    /// Blocks fenced so far.
    pub fn fenced_blocks(&self) -> u64 {
        self.fenced
    }

    /// Requests with a hit waiting for the engine's allocation (0 when the engine is idle).
    pub fn request_count(&self) -> usize {
        self.plans.len()
    }
}

/// Drops `req`'s lookup still pending with `side` (from an earlier call).
fn drop_pending(side: &mut SchedulerSide, req: RequestId) {
    side.get_num_new_matched_tokens(req, &[], 0);
}

/// Blocks of a match in the host tier and in the file tier.
pub(crate) fn host_and_file(tiers: &[Tier]) -> (usize, usize) {
    let host = tiers.iter().filter(|t| **t == Tier::Host).count();
    (host, tiers.len() - host)
}

fn slice(keys: &[BlockKey], blocks: Range<u64>) -> &[BlockKey] {
    let end = (blocks.end as usize).min(keys.len());
    &keys[(blocks.start as usize).min(end)..end]
}

#[cfg(test)]
mod tests;
