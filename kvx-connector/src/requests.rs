//! The request table of a connector's scheduler side: the engine's request ids and kvx's
//! numbers for them, and where each request stands between the engine and kvx.
//!
//! A request is *live* from its first lookup until the engine finishes it. Its load, once
//! queued, is either read by the forward of the step that schedules it (*in step*) or
//! *loading* until a worker reports it in `finished_recving`. A finished request stays in the
//! table while the engine still hears of it: until `finished_sending` when kvx delayed its
//! freeing (stores of its blocks, or an export, still out), or until `finished_recving` when
//! its load was still in flight (it is then *abandoned*: handed to the workers so that they
//! report it once the load ended). After the last report its number is gone.

use std::collections::{HashMap, HashSet};

use kvx_core::RequestId;

/// What the last lookup of a request found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Matched {
    /// Tokens the engine had computed locally at the lookup.
    pub local_tokens: u64,
    /// Blocks of the hit in the host tier and in the file tier.
    pub host_blocks: usize,
    pub file_blocks: usize,
    /// The load is read by the forward of the step that schedules the request.
    pub in_step: bool,
}

/// How the engine's finishing of a request ends for kvx.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Nothing of it is out: its number is gone.
    Freed,
    /// Its freeing waits until it is reported in `finished_sending`.
    Delayed,
    /// Its load is in flight: the engine keeps its blocks until it is reported in
    /// `finished_recving` (kvx does not delay it further).
    Abandoned,
}

#[derive(Debug)]
struct Entry {
    name: String,
    live: bool,
    matched: Matched,
    /// Blocks from this index on are never offered again (a load of one of them failed).
    cap: Option<u64>,
}

/// The request table (see the module docs).
#[derive(Debug, Default)]
pub struct Requests {
    next: u64,
    live: HashMap<String, RequestId>,
    /// Finished requests the engine still reports, by the engine's id.
    finished: HashMap<String, RequestId>,
    entries: HashMap<RequestId, Entry>,
    loading: HashSet<RequestId>,
    in_step: Vec<RequestId>,
    abandoned: Vec<RequestId>,
}

impl Requests {
    /// An empty table; numbers start at 1.
    pub fn new() -> Requests {
        Requests {
            next: 1,
            ..Requests::default()
        }
    }

    /// The number of the live request `name`, numbered now if it is new.
    pub fn admit(&mut self, name: &str) -> RequestId {
        if let Some(id) = self.live.get(name) {
            return *id;
        }
        let id = RequestId(self.next);
        self.next += 1;
        self.live.insert(name.to_string(), id);
        self.entries.insert(
            id,
            Entry {
                name: name.to_string(),
                live: true,
                matched: Matched::default(),
                cap: None,
            },
        );
        id
    }

    /// The number of the live request `name`.
    pub fn live(&self, name: &str) -> Option<RequestId> {
        self.live.get(name).copied()
    }

    /// The engine's id of request `id`, live or finished and still reported.
    pub fn name(&self, id: RequestId) -> Option<&str> {
        self.entries.get(&id).map(|e| e.name.as_str())
    }

    /// Record what the last lookup of `id` found.
    pub fn set_matched(&mut self, id: RequestId, matched: Matched) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.matched = matched;
        }
    }

    /// What the last lookup of `id` found.
    pub fn matched(&self, id: RequestId) -> Matched {
        self.entries.get(&id).map(|e| e.matched).unwrap_or_default()
    }

    /// The index from which blocks of `id` are no longer offered.
    pub fn cap(&self, id: RequestId) -> Option<u64> {
        self.entries.get(&id).and_then(|e| e.cap)
    }

    /// A load of block `index` of live request `id` failed: blocks from there on are never
    /// offered again (the engine recomputes them; offering them again would retry the same
    /// failure forever).
    pub fn lower_cap(&mut self, id: RequestId, index: u64) {
        if let Some(e) = self.entries.get_mut(&id).filter(|e| e.live) {
            e.cap = Some(e.cap.map_or(index, |c| c.min(index)));
        }
    }

    /// The load of `id`'s last match is queued: true when the forward of this step reads it
    /// (then it is never reported in `finished_recving`), else it is loading until reported.
    pub fn load_started(&mut self, id: RequestId) -> bool {
        let in_step = self.matched(id).in_step;
        if in_step {
            self.in_step.push(id);
        } else {
            self.loading.insert(id);
        }
        in_step
    }

    /// True while `name`'s load is queued and not yet reported in `finished_recving`.
    pub fn is_loading(&self, name: &str) -> bool {
        self.number(name)
            .is_some_and(|id| self.loading.contains(&id))
    }

    /// The requests whose load this step's forward reads (each handed out once).
    pub fn take_in_step(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.in_step)
    }

    /// The requests that finished while loading, for this step's message (each handed out once).
    pub fn take_abandoned(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.abandoned)
    }

    /// The engine finished live request `name`; `delayed`: kvx-offload delays its freeing
    /// (stores of its blocks, or an export, still out). `None` for a request never admitted.
    pub fn finish(&mut self, name: &str, delayed: bool) -> Option<(RequestId, Ending)> {
        let id = self.live.remove(name)?;
        let ending = if self.loading.contains(&id) {
            self.abandoned.push(id);
            Ending::Abandoned
        } else if delayed {
            Ending::Delayed
        } else {
            Ending::Freed
        };
        match ending {
            Ending::Freed => {
                self.entries.remove(&id);
            }
            Ending::Delayed | Ending::Abandoned => {
                if let Some(e) = self.entries.get_mut(&id) {
                    e.live = false;
                }
                self.finished.insert(name.to_string(), id);
            }
        }
        Some((id, ending))
    }

    /// A worker reported `name` in `finished_recving`: its load ended.
    pub fn recv_reported(&mut self, name: &str) {
        if let Some(id) = self.number(name) {
            self.loading.remove(&id);
        }
        self.release(name);
    }

    /// A worker reported `name` in `finished_sending`: its delayed freeing happened.
    pub fn send_reported(&mut self, name: &str) {
        self.release(name);
    }

    /// A finished request was reported for the last time: its number goes, unless its load
    /// is still to be reported.
    fn release(&mut self, name: &str) {
        let Some(&id) = self.finished.get(name) else {
            return;
        };
        if self.loading.contains(&id) {
            return;
        }
        self.finished.remove(name);
        self.entries.remove(&id);
    }

    /// kvx's number of request `name`, live or finished and still reported.
    pub fn number(&self, name: &str) -> Option<RequestId> {
        self.live
            .get(name)
            .or_else(|| self.finished.get(name))
            .copied()
    }

    /// `(live, finished and still reported, loading)` counts: all zero when the engine is idle
    /// and every report arrived.
    pub fn counts(&self) -> (usize, usize, usize) {
        (self.live.len(), self.finished.len(), self.loading.len())
    }

    /// Numbers in use (live or still reported).
    pub fn numbers(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests;
