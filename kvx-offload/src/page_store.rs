//! A blocking page store over the tiers, for an engine whose own host cache calls its storage
//! from I/O threads and waits for each call (SGLang's HiCache storage backends).
//!
//! Each call is one short request of the two connector halves: [`PageStore::store`] saves
//! pages and finishes at once, [`PageStore::load`] looks the keys up, loads the leading run of
//! hits and finishes, [`PageStore::exists`] only looks up. The engine memory is the engine's
//! host cache; a page is an engine block. Each call returns a verdict per page once no kvx copy
//! touches the pages any more, and never later than its deadline (the config's load or store
//! timeout) plus [`PageStore::MARGIN`]: the halves' own deadlines end a stuck transfer, so a
//! frozen mount costs one deadline and a `false` for each page it held, never a hung thread.
//! The file write of a store is written through after the call returned (its bytes are in kvx
//! buffers by then), so a slow disk never holds the engine's pages.
//!
//! Calls may come from several threads at once: the halves sit behind one lock that no call
//! holds while it waits, and whichever call polls the worker half files every result under
//! its request, so each caller finds its own.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvx_core::{BlockKey, DriverHandle, EngineBlockId, RequestId, lock};
use rustc_hash::{FxHashMap, FxHashSet};
use tracing::error;

use crate::{
    EngineMemory, JobPart, Lookup, Offload, OffloadBuilder, OffloadConfig, OffloadError,
    OffloadRuntime, SchedulerSide, Tier, TransferStats, WorkerSide,
};

/// What came back for one call's request so far.
#[derive(Default)]
struct Outcome {
    /// The load ended (`finished_recving`).
    loaded: bool,
    /// The request's pages were let go after its stores (`finished_sending`).
    released: bool,
    /// Keys the request's jobs moved into engine memory or the host tier.
    ok: FxHashSet<BlockKey>,
    /// A store's file part (its write-through) ended.
    file_ended: bool,
    /// Keys the file part wrote.
    in_file: FxHashSet<BlockKey>,
}

struct Halves {
    sched: SchedulerSide,
    worker: WorkerSide,
    next_request: u64,
    /// Requests of calls still waiting, with what came back for each.
    waiting: FxHashMap<RequestId, Outcome>,
    /// Pages a cut-short copy may still write.
    in_use: FxHashSet<EngineBlockId>,
}

impl Halves {
    fn request(&mut self) -> RequestId {
        self.next_request += 1;
        let req = RequestId(self.next_request);
        self.waiting.insert(req, Outcome::default());
        req
    }

    /// One step of the halves: queued work goes out, finished work comes back and is filed
    /// under its request.
    fn poll(&mut self) -> Result<(), OffloadError> {
        let meta = self.sched.build_meta();
        // No call preempts a request, so no preemption fence can be outstanding.
        let _clear = self.worker.start_step(meta)?;
        let out = self.worker.get_finished()?;
        self.sched.update_from_worker(&out);
        for job in &out.jobs {
            let Some(o) = self.waiting.get_mut(&job.request) else {
                continue;
            };
            match job.part {
                JobPart::Load | JobPart::StoreHost => o.ok.extend(job.ok.iter().copied()),
                JobPart::StoreFile => {
                    o.file_ended = true;
                    o.in_file.extend(job.ok.iter().copied());
                }
            }
        }
        for req in &out.finished_recving {
            if let Some(o) = self.waiting.get_mut(req) {
                o.loaded = true;
            }
        }
        for req in &out.finished_sending {
            if let Some(o) = self.waiting.get_mut(req) {
                o.released = true;
            }
        }
        self.in_use.extend(out.blocks_in_use);
        for b in &out.blocks_released {
            self.in_use.remove(b);
        }
        Ok(())
    }
}

/// Pages in and out of the tiers, one blocking call at a time per thread.
pub struct PageStore {
    halves: Mutex<Halves>,
    driver: DriverHandle,
    runtime: Mutex<Option<OffloadRuntime>>,
    load_timeout: Duration,
    store_timeout: Duration,
}

impl PageStore {
    /// How long past its deadline a call may take: the driver's tick, the verdict's fold and
    /// scheduling on a busy machine.
    pub const MARGIN: Duration = Duration::from_millis(500);

    /// A store over `memory` (the engine's host cache, one block per page of
    /// `cfg.block_tokens` tokens) with the tiers of `cfg`; with `shard`, the file tier is the
    /// shard's own directory under each root ([`OffloadBuilder::shard`]).
    pub fn new(
        cfg: OffloadConfig,
        memory: EngineMemory,
        shard: Option<kvx_posix::Shard>,
    ) -> Result<PageStore, OffloadError> {
        let load_timeout = Duration::from_millis(cfg.timeouts.load_ms);
        let store_timeout = Duration::from_millis(cfg.timeouts.store_ms);
        let Offload {
            scheduler,
            worker,
            runtime,
        } = match shard {
            Some(s) => OffloadBuilder::new(cfg, memory).shard(s).build()?,
            None => OffloadBuilder::new(cfg, memory).build()?,
        };
        let driver = runtime.driver().cloned().ok_or(OffloadError::Core(
            kvx_core::CoreError::DriverStopped {
                reason: "the runtime has no driver".into(),
            },
        ))?;
        Ok(PageStore {
            halves: Mutex::new(Halves {
                sched: scheduler,
                worker,
                next_request: 0,
                waiting: FxHashMap::default(),
                in_use: FxHashSet::default(),
            }),
            driver,
            runtime: Mutex::new(Some(runtime)),
            load_timeout,
            store_timeout,
        })
    }

    /// How many of `keys`, from the first, the tiers hold now. A block being stored or a
    /// shared mount being probed is waited for, up to the load timeout.
    pub fn exists(&self, keys: &[BlockKey]) -> Result<usize, OffloadError> {
        self.check_open()?;
        let until = Instant::now() + self.load_timeout;
        self.lookup(keys, until)
    }

    /// Load `keys` into `pages` (one page per key): the leading run of keys the tiers hold is
    /// loaded, and each page's verdict comes back in order (`false` for a page not loaded: a
    /// miss, a failed or corrupt block, a deadline). Returns once no kvx copy writes the
    /// pages any more, by the load timeout plus [`PageStore::MARGIN`].
    pub fn load(
        &self,
        keys: &[BlockKey],
        pages: &[EngineBlockId],
    ) -> Result<Vec<bool>, OffloadError> {
        let (until, mut h) = self.begin(keys, pages, self.load_timeout)?;
        let req = h.request();
        let tokens = loop {
            match h.sched.get_num_new_matched_tokens(req, keys, 0) {
                Some(t) => break t,
                None if Instant::now() >= until => break 0,
                None => h = self.pause(h, until)?,
            }
        };
        let n = (tokens / h.sched.block_tokens() as u64) as usize;
        if n == 0 {
            h.sched.request_finished(req);
            h.waiting.remove(&req);
            return Ok(vec![false; keys.len()]);
        }
        if let Err(e) = h.sched.update_state_after_alloc(req, &pages[..n]) {
            h.sched.request_finished(req);
            h.waiting.remove(&req);
            return Err(e);
        }
        h.poll()?;
        let mut h = self.wait_for(h, req, |o| o.loaded, until + Self::MARGIN)?;
        if h.sched.request_finished(req) {
            h = self.wait_for(h, req, |o| o.released, until + Self::MARGIN)?;
        }
        // A copy cut short at the deadline may still write a page: wait until none can.
        while pages[..n].iter().any(|p| h.in_use.contains(p))
            && Instant::now() < until + Self::MARGIN
        {
            h = self.pause(h, until + Self::MARGIN)?;
        }
        let held: Vec<EngineBlockId> = pages[..n]
            .iter()
            .copied()
            .filter(|p| h.in_use.contains(p))
            .collect();
        if !held.is_empty() {
            error!(pages = ?held, "a cut-short copy may still write these pages");
        }
        let outcome = h.waiting.remove(&req).unwrap_or_default();
        Ok(keys
            .iter()
            .zip(pages)
            .enumerate()
            .map(|(i, (k, p))| i < n && outcome.ok.contains(k) && !held.contains(p))
            .collect())
    }

    /// Store `pages` under `keys` (one key per page). A page's verdict is `true` once its key
    /// is in a tier: in the host tier as soon as its bytes are copied there (the file tier is
    /// written through afterwards), in the file tier once its file is written when the host
    /// tier had no room, or already held. `false`: no tier had room, or the copy or the write
    /// failed. Returns by the store timeout plus [`PageStore::MARGIN`]; no kvx copy reads the
    /// pages once it returned.
    pub fn store(
        &self,
        keys: &[BlockKey],
        pages: &[EngineBlockId],
    ) -> Result<Vec<bool>, OffloadError> {
        let (until, mut h) = self.begin(keys, pages, self.store_timeout)?;
        let until = until + Self::MARGIN;
        let in_tier = |h: &Halves, tier: Tier, k: &BlockKey| {
            let m = h.sched.manager();
            m.is_stored(tier, *k) || m.is_storing(tier, *k)
        };
        let held: Vec<bool> = keys
            .iter()
            .map(|k| in_tier(&h, Tier::Host, k) || in_tier(&h, Tier::File, k))
            .collect();
        let req = h.request();
        let blocks: Vec<(BlockKey, EngineBlockId)> =
            keys.iter().copied().zip(pages.iter().copied()).collect();
        h.sched.save_blocks(req, &blocks);
        // Blocks only the file tier took have their verdict when their file is written.
        let file_only = keys
            .iter()
            .zip(&held)
            .any(|(k, held)| !held && in_tier(&h, Tier::File, k) && !in_tier(&h, Tier::Host, k));
        if h.sched.request_finished(req) {
            h.poll()?;
            h = self.wait_for(h, req, |o| o.released, until)?;
        }
        if file_only {
            h = self.wait_for(h, req, |o| o.file_ended, until)?;
        }
        let outcome = h.waiting.remove(&req).unwrap_or_default();
        Ok(keys
            .iter()
            .zip(held)
            .map(|(k, held)| held || outcome.ok.contains(k) || outcome.in_file.contains(k))
            .collect())
    }

    /// Forget every block the tiers hold (their files are removed): no call finds one again.
    pub fn clear(&self) -> Result<(), OffloadError> {
        self.check_open()?;
        let mut h = lock(&self.halves);
        h.sched.reset_cache();
        h.poll()
    }

    /// What both halves counted since the last call.
    pub fn take_stats(&self) -> TransferStats {
        let mut h = lock(&self.halves);
        let mut s = h.worker.take_stats();
        let skips = h.sched.take_stats();
        s.merge(skips);
        s
    }

    /// Finish what was accepted (the file writes of earlier stores), waiting at most the
    /// store timeout, then stop the driver: no kvx thread touches the engine's memory once
    /// this returns; later calls fail.
    pub fn close(&self) {
        let Some(rt) = lock(&self.runtime).take() else {
            return;
        };
        {
            let mut h = lock(&self.halves);
            match h.worker.drain(self.store_timeout) {
                Ok(out) => h.sched.update_from_worker(&out),
                Err(e) => error!(error = %e, "closing the page store: its driver had stopped"),
            }
            let left = h.worker.in_flight();
            if left > 0 {
                error!(
                    left,
                    "closing the page store: transfers still out at the store timeout are abandoned"
                );
            }
        }
        rt.shutdown();
    }

    /// A load's or store's start: the store is open, one page per key; its deadline and the
    /// halves.
    fn begin(
        &self,
        keys: &[BlockKey],
        pages: &[EngineBlockId],
        timeout: Duration,
    ) -> Result<(Instant, std::sync::MutexGuard<'_, Halves>), OffloadError> {
        self.check_open()?;
        check_lengths(keys, pages)?;
        Ok((Instant::now() + timeout, lock(&self.halves)))
    }

    fn check_open(&self) -> Result<(), OffloadError> {
        match lock(&self.runtime).is_some() {
            true => Ok(()),
            false => Err(stopped("the page store is closed")),
        }
    }

    fn lookup(&self, keys: &[BlockKey], until: Instant) -> Result<usize, OffloadError> {
        let mut h = lock(&self.halves);
        loop {
            match h.sched.lookup(keys) {
                Lookup::Hit(tiers) => return Ok(tiers.len()),
                Lookup::Retry if Instant::now() >= until => return Ok(0),
                Lookup::Retry => h = self.pause(h, until)?,
            }
        }
    }

    /// Poll until what came back for `req` satisfies `done`, or `until` passed.
    fn wait_for<'a>(
        &'a self,
        mut h: std::sync::MutexGuard<'a, Halves>,
        req: RequestId,
        done: impl Fn(&Outcome) -> bool,
        until: Instant,
    ) -> Result<std::sync::MutexGuard<'a, Halves>, OffloadError> {
        while !h.waiting.get(&req).is_some_and(&done) && Instant::now() < until {
            h = self.pause(h, until)?;
        }
        Ok(h)
    }

    /// Let go of the halves until the driver has something to hand out (at most one tick, so
    /// that a result another call took is seen too), then poll.
    fn pause<'a>(
        &'a self,
        h: std::sync::MutexGuard<'a, Halves>,
        until: Instant,
    ) -> Result<std::sync::MutexGuard<'a, Halves>, OffloadError> {
        drop(h);
        let tick = Instant::now() + kvx_core::TICK;
        self.driver.wait_finished(tick.min(until));
        let mut h = lock(&self.halves);
        h.poll()?;
        Ok(h)
    }
}

impl Drop for PageStore {
    fn drop(&mut self) {
        self.close();
    }
}

fn stopped(reason: &str) -> OffloadError {
    OffloadError::Core(kvx_core::CoreError::DriverStopped {
        reason: reason.into(),
    })
}

fn check_lengths(keys: &[BlockKey], pages: &[EngineBlockId]) -> Result<(), OffloadError> {
    if keys.len() == pages.len() {
        Ok(())
    } else {
        Err(OffloadError::config(
            "pages",
            format!("{} keys but {} pages", keys.len(), pages.len()),
        ))
    }
}
