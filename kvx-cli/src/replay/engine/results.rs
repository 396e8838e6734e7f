//! What a step's output does to the run: load results (checked byte for byte, counted as
//! hits, recomputes or failures by tier and phase), store results, and delayed frees.

use std::time::Instant;

use kvx_core::{BlockError, BlockKey};
use kvx_offload::{JobPart, JobResult, Tier, WorkerOutput};
use kvx_policy::LoadDecision;
use rustc_hash::FxHashSet;

use super::{Engine, St};
use crate::replay::error::ReplayError;
use crate::replay::payload;
use crate::replay::stats::Reason;

impl Engine<'_> {
    /// Act on a step's output: finished loads, store results, requests whose blocks may be
    /// freed.
    pub(super) fn absorb(&mut self, out: WorkerOutput) -> Result<(), ReplayError> {
        let now = Instant::now();
        let phase = self.schedule.phase(now);
        for j in &out.jobs {
            if j.part != JobPart::Load {
                for (_, e) in &j.failed {
                    self.stats.store_failure(Reason::of(e), 1, phase);
                }
            }
            match j.part {
                JobPart::Load => self.load_done(j, &out, now)?,
                JobPart::StoreHost => {
                    self.stats.stored_host += j.ok.len() as u64;
                    self.stats.store_failed_host += j.failed.len() as u64;
                }
                JobPart::StoreFile => {
                    self.stats.stored_file += j.ok.len() as u64;
                    self.stored_here.extend(j.ok.iter().copied());
                    self.stats.store_failed_file += j.failed.len() as u64;
                    self.stats.store_timeouts += j
                        .failed
                        .iter()
                        .filter(|f| matches!(f.1, BlockError::TimedOut))
                        .count() as u64;
                }
            }
        }
        for r in &out.finished_sending {
            self.stats.sending_reports += 1;
            let Some(q) = self.reqs.get_mut(r.0 as usize) else {
                return Err(ReplayError::Accounting(format!(
                    "{r} reported finished but was never replayed"
                )));
            };
            q.sending_reports += 1;
            if let Some(b) = self.pending_free.remove(r) {
                self.free.extend(b);
            }
        }
        Ok(())
    }

    fn load_done(
        &mut self,
        j: &JobResult,
        out: &WorkerOutput,
        now: Instant,
    ) -> Result<(), ReplayError> {
        let info = self.loads.remove(&j.job).ok_or_else(|| {
            ReplayError::Accounting(format!("load {:?} of {} was not started", j.job, j.request))
        })?;
        let id = info.req;
        if self.reqs[id].st != St::Loading {
            return Err(ReplayError::Accounting(format!(
                "{}: load result while not loading",
                j.request
            )));
        }
        let hit = self.reqs[id].hit_blocks;
        let started = self.reqs[id].load_start.unwrap_or(now);
        let wait = now - started;
        self.stats.load_waits.push(wait);
        self.note_wait(id, now);
        let decision = out
            .decisions
            .iter()
            .find(|d| d.0 == j.request)
            .map(|d| &d.1);
        let (valid, failed) = match decision {
            None | Some(LoadDecision::AllLoaded) => (hit, false),
            Some(LoadDecision::Recompute {
                first_invalid_index,
                ..
            }) => ((*first_invalid_index).min(hit), false),
            Some(LoadDecision::Fail { .. }) => (0, true),
        };
        if !j.failed.is_empty() && decision.is_none() {
            return Err(ReplayError::Accounting(format!(
                "{}: {} blocks failed to load but no decision came",
                j.request,
                j.failed.len()
            )));
        }
        // Every block a load reported done is checked byte for byte.
        let ok: FxHashSet<BlockKey> = j.ok.iter().copied().collect();
        let keys = self.keys[id].clone();
        for (i, k) in keys[..hit].iter().enumerate() {
            if !ok.contains(k) {
                continue;
            }
            let data = self
                .rig
                .arena
                .read_block(self.reqs[id].blocks[i])
                .map_err(|e| ReplayError::Setup(e.to_string()))?;
            if !payload::matches(*k, &data) {
                return Err(ReplayError::Mismatch {
                    request: id as u64,
                    index: i,
                    key: k.to_hex(),
                    tier: format!("{:?}", info.tiers.get(i)).to_lowercase(),
                });
            }
            self.stats.verified_blocks += 1;
            self.stats.verified_bytes += data.len() as u64;
        }
        if ok.len() + j.failed.len() != hit {
            return Err(ReplayError::Accounting(format!(
                "{}: load of {hit} blocks reported {} done and {} failed",
                j.request,
                ok.len(),
                j.failed.len()
            )));
        }
        let phase = self.schedule.phase(started);
        let pi = phase.index();
        for (i, k) in keys[..valid].iter().enumerate() {
            if !ok.contains(k) {
                return Err(ReplayError::Accounting(format!(
                    "{}: block {i} is in the valid prefix but did not load",
                    j.request
                )));
            }
            match info.tiers.get(i) {
                Some(Tier::File) => {
                    self.stats.hit_file += 1;
                    if self.s.nodes > 1 && !self.stored_here.contains(k) {
                        self.stats.cross_node_hits += 1;
                    }
                    self.stats.file_hits_by_phase[pi] += 1;
                }
                _ => {
                    self.stats.hit_host += 1;
                    self.stats.host_hits_by_phase[pi] += 1;
                }
            }
        }
        if j.failed.iter().any(|f| matches!(f.1, BlockError::TimedOut)) {
            self.stats.deadline_misses += 1;
        }
        for (_, e) in &j.failed {
            self.stats.load_failure(e, phase);
        }
        if failed {
            self.stats.failed_requests += 1;
            self.stats.failed_blocks += keys.len() as u64;
            // These blocks were counted as missed at admission.
            self.stats.missed -= (keys.len() - hit) as u64;
        } else {
            self.stats.recomputed += (hit - valid) as u64;
        }
        self.compute_and_end(id, valid, wait.as_secs_f64() * 1000.0, failed)
    }
}
