//! The engine model: requests arrive on the trace's clock, look up their prefix, load what the
//! tiers hold into engine memory, "compute" the rest (write each block's deterministic
//! payload), save every full block, and end. Each step hands the connector's metadata to the
//! worker and its output back, exactly as an engine's step loop does. Compute takes no wall
//! time; its cost is modelled from `--prefill-tokens-per-s` for time to first token.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_offload::{JobId, Tier, WorkerOutput};
use rustc_hash::{FxHashMap, FxHashSet};

use super::args::Settings;
use super::error::ReplayError;
use super::fault::StallSchedule;
use super::payload;
use super::rig::Rig;
use super::stats::{Reason, RunStats};
use super::trace::{TRACE_BLOCK_TOKENS, TraceRequest};

mod results;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    Waiting,
    Loading,
    Ended,
}

struct Req {
    st: St,
    blocks: Vec<EngineBlockId>,
    first_try: Option<Instant>,
    load_start: Option<Instant>,
    hit_blocks: usize,
    sending_reports: u32,
    /// `request_finished` said to delay freeing (then exactly one `finished_sending` comes).
    delayed: bool,
}

struct LoadInfo {
    req: usize,
    tiers: Vec<Tier>,
}

/// The engine model over one rig.
struct Engine<'a> {
    s: &'a Settings,
    trace: &'a [TraceRequest],
    keys: &'a [Vec<BlockKey>],
    rig: &'a mut Rig,
    pb: &'a ProgressBar,
    reqs: Vec<Req>,
    free: Vec<EngineBlockId>,
    pending_free: FxHashMap<RequestId, Vec<EngineBlockId>>,
    loads: FxHashMap<JobId, LoadInfo>,
    schedule: StallSchedule,
    stats: RunStats,
    scratch: Vec<u8>,
    poison: Vec<u8>,
    /// Keys this engine wrote to the file tier (a file hit on any other is a cross-node hit).
    stored_here: FxHashSet<BlockKey>,
}

/// Replay `trace` (with its block keys) on `rig`; the counters of the run.
pub fn replay(
    s: &Settings,
    trace: &[TraceRequest],
    keys: &[Vec<BlockKey>],
    rig: &mut Rig,
    pb: &ProgressBar,
) -> Result<RunStats, ReplayError> {
    if let Some(at) = s.start_unix_ms {
        // A node of a multi-node replay: start on the clock all nodes share.
        let at = std::time::UNIX_EPOCH + Duration::from_millis(at);
        if let Ok(wait) = at.duration_since(std::time::SystemTime::now()) {
            std::thread::sleep(wait);
        }
    }
    let start = Instant::now();
    let bytes = s.blocks.block_bytes as usize;
    let n_engine = rig.engine_blocks;
    let mut e = Engine {
        s,
        trace,
        keys,
        rig,
        pb,
        reqs: (0..trace.len())
            .map(|_| Req {
                st: St::Waiting,
                blocks: Vec::new(),
                first_try: None,
                load_start: None,
                hit_blocks: 0,
                sending_reports: 0,
                delayed: false,
            })
            .collect(),
        free: (0..n_engine).rev().map(EngineBlockId).collect(),
        pending_free: FxHashMap::default(),
        loads: FxHashMap::default(),
        schedule: StallSchedule::new(start, &s.stalls),
        stats: RunStats {
            requests: trace.len() as u64,
            blocks: keys.iter().map(|k| k.len() as u64).sum(),
            ..RunStats::default()
        },
        scratch: vec![0; bytes],
        poison: vec![0xA5; bytes],
        stored_here: FxHashSet::default(),
    };
    e.run(start)?;
    e.settle()?;
    e.check()?;
    Ok(e.stats)
}

impl Engine<'_> {
    fn run(&mut self, start: Instant) -> Result<(), ReplayError> {
        let mut waiting: VecDeque<usize> = VecDeque::new();
        let mut next = 0usize;
        let mut last = start;
        // Arrival times count from the first request (a trace may carry absolute times).
        let t0 = self
            .s
            .time_origin_ms
            .unwrap_or_else(|| self.trace.first().map_or(0.0, |r| r.timestamp_ms));
        let arrival = |r: &TraceRequest| (r.timestamp_ms - t0).max(0.0);
        // Nothing may hang: with work pending, some request must move within this long.
        let patience =
            Duration::from_millis(10 * (self.s.load_deadline_ms + self.s.store_deadline_ms))
                .max(Duration::from_secs(60));
        let mut moved = start;
        while self.stats.ended < self.stats.requests {
            let now = Instant::now();
            if !self.loads.is_empty() {
                self.stats.load_busy += now - last;
            }
            last = now;
            self.schedule.apply(now, self.rig.mount.as_ref());
            self.note_recovery(now);
            let trace_ms = (now - start).as_secs_f64() * 1000.0 * self.s.speedup;
            while next < self.trace.len() && arrival(&self.trace[next]) <= trace_ms {
                waiting.push_back(next);
                next += 1;
            }
            let admitted = self.admit(&mut waiting, now)?;
            let out = self.step()?;
            let busy = admitted || !out.is_empty();
            if admitted || !out.jobs.is_empty() || (waiting.is_empty() && self.loads.is_empty()) {
                moved = now;
            } else if now - moved > patience {
                return Err(ReplayError::Accounting(format!(
                    "no request moved for {patience:?}: {} waiting (first: req-{}), {} loading",
                    waiting.len(),
                    waiting.front().map_or(0, |i| *i),
                    self.loads.len()
                )));
            }
            self.absorb(out)?;
            if !busy {
                let idle = self.loads.is_empty() && self.rig.worker()?.in_flight() == 0;
                let pause = match self.trace.get(next) {
                    Some(r) if idle && waiting.is_empty() => {
                        let due = Duration::from_secs_f64(arrival(r) / self.s.speedup / 1000.0);
                        (start + due)
                            .saturating_duration_since(Instant::now())
                            .min(Duration::from_millis(1))
                    }
                    _ => Duration::from_micros(200),
                };
                std::thread::sleep(pause);
            }
        }
        self.stats.wall = start.elapsed();
        self.schedule.end(Instant::now(), self.rig.mount.as_ref());
        Ok(())
    }

    /// After the last stall, note when the file tier's breaker is closed again.
    fn note_recovery(&mut self, now: Instant) {
        if !self.schedule.awaiting_recovery(now) {
            return;
        }
        let closed = self.rig.files.as_ref().is_none_or(|f| {
            (0..f.capabilities().direct_per_root.len())
                .all(|root| f.breaker_state(root) == Some(kvx_policy::BreakerState::Closed))
        });
        if closed {
            self.schedule.recovered(now);
        }
    }

    /// Admit waiting requests in arrival order while engine memory lasts.
    fn admit(&mut self, waiting: &mut VecDeque<usize>, now: Instant) -> Result<bool, ReplayError> {
        let mut admitted = false;
        let mut i = 0;
        while i < waiting.len() {
            let id = waiting[i];
            let need = self.keys[id].len();
            if self.free.len() < need {
                break; // the oldest request waits for memory; later ones do not overtake it
            }
            let rid = RequestId(id as u64);
            self.reqs[id].first_try.get_or_insert(now);
            let Some(tokens) = self
                .rig
                .sched
                .get_num_new_matched_tokens(rid, &self.keys[id], 0)
            else {
                self.stats.retries += 1;
                i += 1;
                continue;
            };
            waiting.remove(i);
            admitted = true;
            let blocks = self.free.split_off(self.free.len() - need);
            let hit = (tokens / TRACE_BLOCK_TOKENS) as usize;
            let r = &mut self.reqs[id];
            r.blocks = blocks;
            r.hit_blocks = hit;
            if hit == 0 {
                self.note_wait(id, now);
                self.stats.missed += need as u64;
                self.compute_and_end(id, 0, 0.0, false)?;
                continue;
            }
            // Poison the load targets: a load that reports done without writing is caught.
            for b in &self.reqs[id].blocks[..hit] {
                self.rig
                    .arena
                    .write_block(*b, &self.poison)
                    .map_err(|e| ReplayError::Setup(e.to_string()))?;
            }
            let targets = self.reqs[id].blocks[..hit].to_vec();
            let job = self
                .rig
                .sched
                .update_state_after_alloc(rid, &targets)?
                .ok_or_else(|| ReplayError::Accounting(format!("{rid}: no load job")))?;
            self.loads.insert(
                job,
                LoadInfo {
                    req: id,
                    tiers: Vec::new(),
                },
            );
            let r = &mut self.reqs[id];
            r.st = St::Loading;
            r.load_start = Some(now);
            self.stats.load_jobs += 1;
            self.stats.missed += (need - hit) as u64;
        }
        Ok(admitted)
    }

    fn note_wait(&mut self, id: usize, now: Instant) {
        if let Some(t) = self.reqs[id].first_try {
            self.stats.max_request_wait = self.stats.max_request_wait.max(now - t);
        }
    }

    /// One connector step: metadata to the worker, its output back to the scheduler.
    fn step(&mut self) -> Result<WorkerOutput, ReplayError> {
        let meta = self.rig.sched.build_meta();
        for l in &meta.loads {
            if let Some(info) = self.loads.get_mut(&l.job) {
                info.tiers = l.blocks.iter().map(|b| b.tier).collect();
            }
        }
        let w = self.rig.worker()?;
        let started = w.start_step(meta)?;
        debug_assert!(started.fence().is_none(), "the replay preempts no request");
        let out = w.get_finished()?;
        self.rig.sched.update_from_worker(&out);
        Ok(out)
    }

    /// Compute blocks `valid..` of request `id`, save all its blocks, and end it. A failed
    /// request computes and saves nothing.
    fn compute_and_end(
        &mut self,
        id: usize,
        valid: usize,
        load_ms: f64,
        failed: bool,
    ) -> Result<(), ReplayError> {
        let rid = RequestId(id as u64);
        let keys = &self.keys[id];
        if !failed && !keys.is_empty() {
            let blocks = &self.reqs[id].blocks;
            for (k, b) in keys[valid..].iter().zip(&blocks[valid..]) {
                payload::fill(*k, &mut self.scratch);
                self.rig
                    .arena
                    .write_block(*b, &self.scratch)
                    .map_err(|e| ReplayError::Setup(e.to_string()))?;
            }
            let pairs: Vec<(BlockKey, EngineBlockId)> =
                keys.iter().copied().zip(blocks.iter().copied()).collect();
            self.rig.sched.save_blocks(rid, &pairs);
            let m = self.rig.sched.manager();
            let dropped = keys
                .iter()
                .filter(|k| !m.is_stored(Tier::Host, **k) && !m.is_storing(Tier::Host, **k))
                .count() as u64;
            self.stats.store_dropped += dropped;
            if dropped > 0 {
                let phase = self.schedule.phase(Instant::now());
                self.stats.store_failure(Reason::NoRoom, dropped, phase);
            }
        }
        if !failed {
            let input = self.trace[id].input_length as f64;
            let loaded = (valid as u64 * TRACE_BLOCK_TOKENS) as f64;
            let per_ms = self.s.prefill_tps / 1000.0;
            self.stats.ttft_recompute_ms.push(input / per_ms);
            self.stats
                .ttft_cache_ms
                .push(load_ms + (input - loaded).max(0.0) / per_ms);
        }
        let delay = self.rig.sched.request_finished(rid);
        let r = &mut self.reqs[id];
        r.delayed = delay;
        if delay {
            self.stats.delayed_frees += 1;
        }
        if r.st == St::Ended {
            return Err(ReplayError::Accounting(format!("{rid} ended twice")));
        }
        r.st = St::Ended;
        let blocks = std::mem::take(&mut r.blocks);
        if delay {
            self.pending_free.insert(rid, blocks);
        } else {
            self.free.extend(blocks);
        }
        self.stats.ended += 1;
        self.pb.inc(1);
        if self.stats.ended % 64 == 0 {
            let hits = self.stats.hits() as f64;
            let seen = (self.stats.hits() + self.stats.missed + self.stats.recomputed).max(1);
            self.pb
                .set_message(format!("hit rate {:.1}%", 100.0 * hits / seen as f64));
        }
        Ok(())
    }

    /// After the last request: step until every store is reported and the connector, the
    /// tracker and the file tier are idle.
    fn settle(&mut self) -> Result<(), ReplayError> {
        let t0 = Instant::now();
        let limit =
            Duration::from_millis(2 * self.s.store_deadline_ms + 2 * self.s.load_deadline_ms)
                + Duration::from_secs(10);
        loop {
            self.note_recovery(Instant::now());
            let out = self.step()?;
            self.absorb(out)?;
            let (tracker, empty) = self
                .rig
                .driver()?
                .stats()
                .map_err(|e| ReplayError::Setup(e.to_string()))?;
            let quiet = empty
                && self.rig.worker()?.in_flight() == 0
                && self.rig.sched.request_count() == 0
                && self.rig.sched.job_count() == 0
                && self.rig.sched.manager().is_quiet();
            if quiet {
                self.stats.tracker = tracker;
                break;
            }
            if t0.elapsed() > limit {
                return Err(ReplayError::Accounting(format!(
                    "the connector did not settle within {limit:?} after the last request: {tracker:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.stats.settle = t0.elapsed();
        self.stats.stall_log = self.schedule.log.clone();
        self.stats.posix = self.rig.files.as_ref().map(|f| f.stats());
        Ok(())
    }

    /// The accounting must add up.
    fn check(&mut self) -> Result<(), ReplayError> {
        let s = &self.stats;
        let fail = |m: String| Err(ReplayError::Accounting(m));
        if s.ended != s.requests || self.reqs.iter().any(|r| r.st != St::Ended) {
            return fail(format!("{} of {} requests ended", s.ended, s.requests));
        }
        if let Some((i, r)) = self
            .reqs
            .iter()
            .enumerate()
            .find(|(_, r)| r.sending_reports != u32::from(r.delayed))
        {
            return fail(format!(
                "req-{i} was reported finished {} times (delayed: {})",
                r.sending_reports, r.delayed
            ));
        }
        let accounted = s.hits() + s.missed + s.recomputed + s.failed_blocks;
        if accounted != s.blocks {
            return fail(format!(
                "hits {} + missed {} + recomputed {} + failed {} = {accounted}, not {} blocks",
                s.hits(),
                s.missed,
                s.recomputed,
                s.failed_blocks,
                s.blocks
            ));
        }
        if s.verified_bytes != s.verified_blocks * self.s.blocks.block_bytes {
            return fail("verified bytes do not match verified blocks".into());
        }
        if s.verified_blocks < s.hits() {
            return fail("a block was used without being verified".into());
        }
        if self.free.len() != self.rig.engine_blocks as usize || !self.pending_free.is_empty() {
            return fail(format!(
                "{} of {} engine blocks are free at the end",
                self.free.len(),
                self.rig.engine_blocks
            ));
        }
        let index: FxHashSet<BlockKey> = self
            .rig
            .sched
            .manager()
            .stored_keys(Tier::Host)
            .into_iter()
            .collect();
        let w = self.rig.worker()?;
        let held: FxHashSet<BlockKey> = w.host_keys().into_iter().collect();
        if held != index {
            return fail(format!(
                "host tier holds {} buffers but its index {} blocks",
                held.len(),
                index.len()
            ));
        }
        if w.pool().lent() != held.len() {
            return fail(format!(
                "{} pool buffers lent, {} held by the host tier",
                w.pool().lent(),
                held.len()
            ));
        }
        Ok(())
    }
}
