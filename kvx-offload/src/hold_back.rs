//! [`LoadHoldBack`]: ended loads kept from the engine until no copy can write their blocks.
//!
//! [`WorkerSide::get_finished`](crate::WorkerSide::get_finished) reports a load's verdict at
//! once, and lists the blocks a cut-short copy may still write in
//! [`WorkerOutput::blocks_in_use`] until [`WorkerOutput::blocks_released`]. An engine that frees
//! or reuses a request's blocks as soon as its load is reported (vLLM does, for a request in
//! `finished_recving`) must not hear of the load before then. `LoadHoldBack` is that wait, as
//! plain data: it learns each step's loads (local and remote alike) from the [`StepMeta`] and
//! turns each [`WorkerOutput`] into the loads the engine may hear of now. It does no I/O and
//! never waits.

use std::collections::{HashMap, HashSet};

use kvx_core::{EngineBlockId, RequestId};

use crate::meta::{JobPart, StepMeta, WorkerOutput};

/// Loads in flight and ended loads held back, by request.
#[derive(Debug, Default)]
pub struct LoadHoldBack {
    /// Engine blocks of each request's load in flight (local or remote).
    loading: HashMap<RequestId, Vec<EngineBlockId>>,
    /// Engine blocks a cut-short copy may still write.
    in_use: HashSet<EngineBlockId>,
    /// Ended loads not yet handed out, oldest first.
    parked: Vec<Parked>,
}

/// A load that ended, handed out once none of its blocks is in use.
#[derive(Debug)]
struct Parked {
    request: RequestId,
    blocks: Vec<EngineBlockId>,
    invalid: Vec<EngineBlockId>,
    /// In `finished_recving` (false: the request finished while loading; only its end is told).
    to_engine: bool,
}

/// The loads the engine may hear of now.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReleasedLoads {
    /// Requests to report as loaded (the engine's `finished_recving`).
    pub finished_recving: Vec<RequestId>,
    /// Their engine blocks that did not load, and invalid blocks of no known load.
    pub invalid_blocks: Vec<EngineBlockId>,
    /// Of `finished_recving`, the requests whose load failed in at least one block.
    pub failed_recving: Vec<RequestId>,
    /// Requests that finished while loading and whose load has now ended for good.
    pub ended: Vec<RequestId>,
}

impl ReleasedLoads {
    /// Add `o`'s loads after these.
    pub fn merge(&mut self, o: ReleasedLoads) {
        self.finished_recving.extend(o.finished_recving);
        self.invalid_blocks.extend(o.invalid_blocks);
        self.failed_recving.extend(o.failed_recving);
        self.ended.extend(o.ended);
    }
}

impl LoadHoldBack {
    /// Nothing tracked.
    pub fn new() -> LoadHoldBack {
        LoadHoldBack::default()
    }

    /// A step starts with `meta`: remember the engine blocks of each load it starts, local
    /// ([`StepMeta::loads`]) and remote ([`StepMeta::remote_loads`]).
    pub fn step_started(&mut self, meta: &StepMeta) {
        for l in &meta.loads {
            self.loading
                .insert(l.request, l.blocks.iter().map(|b| b.engine).collect());
        }
        for l in &meta.remote_loads {
            self.loading
                .insert(l.request, l.blocks.iter().map(|(_, b)| *b).collect());
        }
    }

    /// Take in a worker output and hand out the loads whose blocks no copy can write any more:
    /// this output's and those held back earlier whose blocks were released now.
    pub fn take(&mut self, out: &WorkerOutput) -> ReleasedLoads {
        self.in_use.extend(out.blocks_in_use.iter().copied());
        for b in &out.blocks_released {
            self.in_use.remove(b);
        }
        let reported: HashSet<RequestId> = out.finished_recving.iter().copied().collect();
        let mut unclaimed: HashSet<EngineBlockId> = out.invalid_blocks.iter().copied().collect();
        for j in out.jobs.iter().filter(|j| j.part == JobPart::Load) {
            let blocks = self.loading.remove(&j.request).unwrap_or_default();
            let invalid = blocks
                .iter()
                .copied()
                .filter(|b| unclaimed.remove(b))
                .collect();
            self.parked.push(Parked {
                request: j.request,
                blocks,
                invalid,
                to_engine: reported.contains(&j.request),
            });
        }
        let mut released = ReleasedLoads {
            invalid_blocks: unclaimed.into_iter().collect(),
            ..ReleasedLoads::default()
        };
        released.invalid_blocks.sort();
        let in_use = &self.in_use;
        self.parked.retain(|p| {
            if p.blocks.iter().any(|b| in_use.contains(b)) {
                return true;
            }
            if p.to_engine {
                released.finished_recving.push(p.request);
                if !p.invalid.is_empty() {
                    released.failed_recving.push(p.request);
                }
                released.invalid_blocks.extend_from_slice(&p.invalid);
            } else {
                released.ended.push(p.request);
            }
            false
        });
        released
    }

    /// True while `request`'s load is in flight or held back: the engine has not heard of
    /// its end yet.
    pub fn holds(&self, request: RequestId) -> bool {
        self.loading.contains_key(&request) || self.parked.iter().any(|p| p.request == request)
    }

    /// Loads in flight plus loads held back (0 when idle).
    pub fn len(&self) -> usize {
        self.loading.len() + self.parked.len()
    }

    /// True when no load is in flight or held back.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Loads held back now (ended, with a block still in use).
    pub fn held(&self) -> usize {
        self.parked.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvx_core::{BlockError, BlockKey};

    use super::*;
    use crate::meta::{JobId, JobResult, LoadBlock, LoadJob, RemoteLoadJob};
    use crate::remote::RemoteSource;
    use crate::tier::Tier;

    fn key(i: u32) -> BlockKey {
        BlockKey::chain(None, &i.to_be_bytes())
    }

    fn local(req: u64, blocks: &[u32]) -> StepMeta {
        StepMeta {
            loads: vec![LoadJob {
                job: JobId(req),
                request: RequestId(req),
                blocks: blocks
                    .iter()
                    .map(|&b| LoadBlock {
                        key: key(b),
                        engine: EngineBlockId(b),
                        tier: Tier::Host,
                        promote: false,
                    })
                    .collect(),
            }],
            ..StepMeta::default()
        }
    }

    fn remote(req: u64, blocks: &[u32]) -> StepMeta {
        let source = RemoteSource {
            namespace: "ns".into(),
            export: 1,
            producers: vec![([127, 0, 0, 1], 1).into()],
            keys: blocks.iter().map(|&b| key(b)).collect(),
            ttl_ms: 1000,
            heartbeat_ms: 100,
        };
        StepMeta {
            remote_loads: vec![RemoteLoadJob {
                job: JobId(req),
                request: RequestId(req),
                source: Arc::new(source),
                blocks: blocks
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| (i as u32, EngineBlockId(b)))
                    .collect(),
            }],
            ..StepMeta::default()
        }
    }

    /// The output of a load of `blocks` whose copy timed out and may still write them.
    fn cut_short(req: u64, blocks: &[u32]) -> WorkerOutput {
        let ids: Vec<EngineBlockId> = blocks.iter().map(|&b| EngineBlockId(b)).collect();
        WorkerOutput {
            finished_recving: vec![RequestId(req)],
            invalid_blocks: ids.clone(),
            jobs: vec![JobResult {
                job: JobId(req),
                request: RequestId(req),
                part: JobPart::Load,
                ok: Vec::new(),
                failed: blocks
                    .iter()
                    .map(|&b| (key(b), BlockError::TimedOut))
                    .collect(),
                promoted: Vec::new(),
            }],
            blocks_in_use: ids,
            ..WorkerOutput::default()
        }
    }

    fn released(blocks: &[u32]) -> WorkerOutput {
        WorkerOutput {
            blocks_released: blocks.iter().map(|&b| EngineBlockId(b)).collect(),
            ..WorkerOutput::default()
        }
    }

    fn ids(v: &[u32]) -> Vec<EngineBlockId> {
        v.iter().map(|&b| EngineBlockId(b)).collect()
    }

    #[test]
    fn a_cut_short_load_is_held_until_its_blocks_are_released() {
        for meta in [local(7, &[3, 4]), remote(7, &[3, 4])] {
            let mut h = LoadHoldBack::new();
            h.step_started(&meta);
            assert!(h.holds(RequestId(7)) && !h.holds(RequestId(8)));
            let now = h.take(&cut_short(7, &[3, 4]));
            assert!(
                h.holds(RequestId(7)),
                "held back: the engine has not heard of it"
            );
            assert_eq!(
                now,
                ReleasedLoads::default(),
                "reported while a copy may write"
            );
            assert_eq!(h.held(), 1);
            // One block released: still held.
            assert_eq!(h.take(&released(&[3])), ReleasedLoads::default());
            let now = h.take(&released(&[4]));
            assert!(!h.holds(RequestId(7)));
            assert_eq!(now.finished_recving, vec![RequestId(7)]);
            assert_eq!(now.invalid_blocks, ids(&[3, 4]));
            assert_eq!(now.failed_recving, vec![RequestId(7)], "its load failed");
            assert!(h.is_empty());
        }
    }

    #[test]
    fn a_clean_load_is_reported_at_once_and_an_abandoned_one_only_ends() {
        let mut h = LoadHoldBack::new();
        h.step_started(&remote(1, &[1, 2]));
        h.step_started(&local(2, &[5]));
        let mut out = cut_short(1, &[1, 2]);
        out.invalid_blocks.clear();
        out.blocks_in_use.clear();
        out.jobs.push(JobResult {
            job: JobId(2),
            request: RequestId(2),
            part: JobPart::Load,
            ok: vec![key(5)],
            failed: Vec::new(),
            promoted: Vec::new(),
        });
        let now = h.take(&out);
        assert_eq!(now.finished_recving, vec![RequestId(1)]);
        assert!(now.failed_recving.is_empty(), "no block of it failed");
        assert_eq!(
            now.ended,
            vec![RequestId(2)],
            "not in finished_recving: abandoned"
        );
        assert!(now.invalid_blocks.is_empty());
        assert!(h.is_empty());
    }

    #[test]
    fn invalid_blocks_of_no_known_load_go_out_at_once() {
        let mut h = LoadHoldBack::new();
        let out = WorkerOutput {
            invalid_blocks: ids(&[9, 8]),
            ..WorkerOutput::default()
        };
        assert_eq!(h.take(&out).invalid_blocks, ids(&[8, 9]));
    }
}
