//! [`PosixStore`]: the file block store as a kvx [`Backend`].

pub(crate) mod handle;
pub(crate) mod health;
pub(crate) mod index;
pub(crate) mod root_check;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvx_core::{
    Backend, BlockError, BlockKey, Buf, Direction, EngineBlockId, Notifier, Op, OpCompletion, OpId,
    SubmitError, SubmitErrorKind, WaitOutcome,
};
use kvx_policy::Admission;
use rustc_hash::{FxHashMap, FxHashSet};

use crate::config::{Capabilities, IoEngine, PosixConfig};
use crate::error::PosixError;
use crate::io::fault::Faults;
use crate::job::{BlockJob, FileOp, JobParams};
use crate::paths::Layout;
use crate::store::handle::{Counters, PosixHandle, StoreState};
use crate::store::health::Health;
use crate::store::index::{Index, scan};
use crate::store::root_check::probe_root;

struct BlockSlot {
    key: BlockKey,
    engine_block: Option<EngineBlockId>,
    root: usize,
    buf: Option<Buf>,
    result: Option<Result<(), BlockError>>,
}

struct OpState {
    op: Op,
    slots: Vec<BlockSlot>,
    pending: usize,
    cancel: Arc<AtomicBool>,
    submitted: Instant,
    /// Roots whose breaker admitted this op.
    roots: Vec<usize>,
    health_recorded: bool,
}

/// A file block store: one verified file per block under one or more roots. Implements
/// [`Backend`]: loads fill the op's owned buffers, stores persist the buffers' bytes; it never
/// touches engine memory.
pub struct PosixStore {
    name: String,
    cfg: PosixConfig,
    state: Arc<StoreState>,
    direct: Vec<bool>,
    /// Inline I/O per root (see [`PosixConfig::inline_io`]).
    inline: Vec<bool>,
    dirs: FxHashSet<(usize, u16)>,
    ops: FxHashMap<OpId, OpState>,
    ready: Vec<OpCompletion>,
    notifier: Notifier,
    /// Loads in flight per key, when removed block files are recycled as spares.
    recycling: Option<crate::spare::recycle::Recycling>,
}

impl PosixStore {
    /// Open (or create) a store: probe each root for O_DIRECT, scan it to rebuild the index and
    /// remove stale temporary files, and start the engine. Blocks while it scans: open a store
    /// before its mount is in the engine's critical path.
    pub fn open(cfg: PosixConfig) -> Result<PosixStore, PosixError> {
        PosixStore::open_with(cfg, None)
    }

    /// [`PosixStore::open`] with faults injected around the engine (tests).
    pub(crate) fn open_with(
        cfg: PosixConfig,
        faults: Option<Arc<Faults>>,
    ) -> Result<PosixStore, PosixError> {
        cfg.validate()?;
        for r in &cfg.roots {
            if r.as_os_str().as_encoded_bytes().contains(&0) {
                return Err(PosixError::BadConfig(format!(
                    "root {r:?} contains a NUL byte"
                )));
            }
        }
        let direct = cfg
            .roots
            .iter()
            .map(|r| probe_root(r, cfg.direct))
            .collect::<Result<Vec<bool>, _>>()?;
        let inline: Vec<bool> = cfg
            .roots
            .iter()
            .map(|r| cfg.inline_io && crate::store::root_check::is_local_fs(r))
            .collect();
        let layout = Layout::new(cfg.roots.clone());
        let found = scan(&layout, cfg.stale_temp_age)?;
        let with_spares: Vec<bool> = inline.iter().map(|i| *i && cfg.shared.is_none()).collect();
        let spares = crate::spare::Spares::open(
            &cfg.roots,
            &with_spares,
            cfg.spare_files,
            cfg.spare_file_len(),
            cfg.spare_refill,
            format!("{}-{}", layout.host(), std::process::id()),
        )?;
        let recycling = spares
            .as_ref()
            .is_some_and(crate::spare::Spares::recycles)
            .then(crate::spare::recycle::Recycling::default);
        let mut dirs: FxHashSet<(usize, u16)> = found.dirs.into_iter().collect();
        if spares.is_some() {
            dirs.extend(crate::spare::make_fan_out_dirs(&cfg.roots, &with_spares)?);
        }
        let (sink, io_engine) = crate::io::start(&cfg, faults)?;
        let caps = Capabilities {
            engine: cfg.engine,
            direct: direct.iter().all(|d| *d),
            direct_per_root: direct.clone(),
            inline_per_root: inline.clone(),
            scanned_blocks: found.keys.len(),
            removed_temps: found.removed_temps,
        };
        let touch = match &cfg.shared {
            Some(m) if m.touch_on_load => {
                Some(crate::shared_mount::touch::TouchLane::start().map_err(|e| {
                    PosixError::Engine {
                        engine: "touch",
                        msg: format!("cannot start the touch thread: {e}"),
                    }
                })?)
            }
            _ => None,
        };
        let index = Index::default();
        index.extend(found.keys);
        let health = Health::new(&cfg.roots, cfg.breaker)?;
        let name = format!(
            "posix:{}",
            cfg.roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        tracing::info!(store = %name, engine = %cfg.engine, direct = caps.direct,
            blocks = caps.scanned_blocks, removed_temps = caps.removed_temps, "posix store opened");
        Ok(PosixStore {
            name,
            state: Arc::new(StoreState {
                index,
                health,
                layout,
                io_engine,
                sink,
                caps,
                counters: Counters::default(),
                probes: cfg
                    .shared
                    .clone()
                    .map(crate::shared_mount::probe_cache::ProbeTable::new),
                touch,
                spares,
                listing: std::sync::Mutex::new(None),
            }),
            direct,
            inline,
            dirs,
            ops: FxHashMap::default(),
            ready: Vec::new(),
            notifier: Notifier::noop(),
            recycling,
            cfg,
        })
    }

    /// A thread-safe handle for lookups, removal, health and counters.
    pub fn handle(&self) -> PosixHandle {
        PosixHandle {
            state: self.state.clone(),
        }
    }

    /// What the store found out when it opened.
    pub fn capabilities(&self) -> &Capabilities {
        &self.state.caps
    }

    /// How many of `keys`, from the first, the store holds.
    pub fn lookup(&self, keys: &[BlockKey]) -> usize {
        self.state.index.lookup(keys)
    }

    /// Forget `key` and unlink its file in the background; true if the store held it.
    pub fn remove(&self, key: BlockKey) -> bool {
        self.handle().remove(key)
    }

    fn prefix(key: BlockKey) -> u16 {
        u16::from(crate::paths::fan_out(key))
    }

    /// Fold finished jobs into their ops; finished ops go to `ready`.
    fn absorb(&mut self, jobs: Vec<Box<BlockJob>>) {
        let now = Instant::now();
        for mut job in jobs {
            if job.action == FileOp::Probe {
                if let Some(t) = &self.state.probes {
                    t.answered(job.key, &job.result, now, &self.state.health);
                }
                continue;
            }
            self.state.give_back_spare(&mut job);
            if let (Some(r), Some(spares)) = (&mut self.recycling, &self.state.spares) {
                r.job_returned(&mut job, spares, &self.state.counters.recycled);
            }
            if job.action == FileOp::Remove {
                if let Err(e) = &job.result {
                    tracing::warn!(key = %job.key, error = %e, "posix: remove failed");
                }
                continue;
            }
            let Some(st) = self.ops.get_mut(&job.op) else {
                tracing::error!(op = %job.op, "posix: completion of an unknown op");
                continue;
            };
            if job.made_dirs {
                self.dirs.insert((job.root, Self::prefix(job.key)));
            }
            let mut result = std::mem::replace(&mut job.result, Ok(()));
            if job.action == FileOp::Load && result.is_ok() {
                result = job.check_payload();
            }
            let c = &self.state.counters;
            match (job.action, &result) {
                (FileOp::Store, Ok(())) => {
                    let cancelled = st.cancel.load(Ordering::Acquire);
                    if cancelled || now + self.cfg.visibility_margin >= st.op.deadline {
                        // The tracker may already have ended the task: never leave it visible.
                        result = Err(if cancelled {
                            BlockError::Cancelled
                        } else {
                            BlockError::TimedOut
                        });
                        c.undone.fetch_add(1, Ordering::Relaxed);
                        self.state.unlink(job.key, job.nonce());
                    } else {
                        c.stored.fetch_add(1, Ordering::Relaxed);
                        self.state.index.insert(job.key);
                    }
                }
                (FileOp::Load, Ok(())) => {
                    self.state.index.insert(job.key);
                    if let Some(t) = &self.state.touch {
                        t.touch(&job.block_path(), crate::shared_mount::touch::Stamp::Now);
                    }
                    if st.cancel.load(Ordering::Acquire) {
                        result = Err(BlockError::Cancelled);
                    } else if now >= st.op.deadline {
                        // The read finished, but after the deadline: not in time.
                        result = Err(BlockError::TimedOut);
                    } else {
                        c.loaded.fetch_add(1, Ordering::Relaxed);
                    }
                }
                (FileOp::Load, Err(BlockError::NotFound)) => {
                    self.state.index.remove(job.key);
                    if let Some(t) = &self.state.probes {
                        t.forget(job.key);
                    }
                }
                (FileOp::Load, Err(BlockError::Corrupt(m))) => {
                    tracing::warn!(key = %job.key, error = %m, "posix: corrupt block");
                    c.corrupt.fetch_add(1, Ordering::Relaxed);
                    self.state.index.remove(job.key);
                    if let Some(t) = &self.state.probes {
                        t.forget(job.key);
                    }
                }
                (FileOp::Store, Err(BlockError::TimedOut | BlockError::Cancelled))
                    if job.undone =>
                {
                    c.undone.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
            let Some(slot) = st.slots.get_mut(job.index) else {
                continue;
            };
            slot.buf = job.buf.take();
            slot.result = Some(result);
            st.pending -= 1;
            if st.pending == 0 {
                let id = job.op;
                self.finish(id, now);
            }
        }
    }

    /// Report an op's health to its roots' breakers (once), then queue its completion.
    fn finish(&mut self, id: OpId, now: Instant) {
        let Some(mut st) = self.ops.remove(&id) else {
            return;
        };
        if !st.health_recorded {
            let late = now >= st.op.deadline;
            for &root in &st.roots {
                let mut failed = late;
                let mut only_cancelled = true;
                for s in st.slots.iter().filter(|s| s.root == root) {
                    match &s.result {
                        Some(Err(BlockError::Io(_) | BlockError::TimedOut)) => failed = true,
                        Some(Err(BlockError::Cancelled)) => {}
                        _ => only_cancelled = false,
                    }
                }
                if failed {
                    self.state.health.failure(root, now);
                } else if !only_cancelled {
                    self.state.health.success(
                        root,
                        now,
                        now.saturating_duration_since(st.submitted),
                    );
                }
            }
        }
        let mut results = Vec::with_capacity(st.slots.len());
        let mut blocks = Vec::with_capacity(st.slots.len());
        for s in st.slots.drain(..) {
            let Some(buf) = s.buf else {
                // Unreachable by construction: every slot gets its buffer back before pending
                // reaches zero. Dropping the block would lose a buffer, so keep going loudly.
                tracing::error!(op = %id, key = %s.key, "posix: block finished without its buffer");
                continue;
            };
            results.push(s.result.unwrap_or(Err(BlockError::Io("no result".into()))));
            blocks.push(kvx_core::OpBlock {
                key: s.key,
                engine: s.engine_block,
                buf,
            });
        }
        st.op.blocks = blocks;
        self.ready.push(OpCompletion { op: st.op, results });
    }

    fn params(
        &self,
        root: usize,
        key: BlockKey,
        dir: Direction,
        deadline: Instant,
        cancel: &Arc<AtomicBool>,
    ) -> JobParams {
        JobParams {
            direct: self.direct.get(root).copied().unwrap_or(false),
            inline: self.inline.get(root).copied().unwrap_or(false),
            crc_off_ring: self.cfg.engine == IoEngine::Uring,
            fdatasync: self.cfg.fdatasync,
            make_dirs: dir == Direction::Store && !self.dirs.contains(&(root, Self::prefix(key))),
            deadline,
            cancel: cancel.clone(),
            margin: self.cfg.visibility_margin,
            nonce: (dir == Direction::Store).then(|| self.state.layout.nonce()),
        }
    }
}

impl Backend for PosixStore {
    fn name(&self) -> &str {
        &self.name
    }

    fn touches_engine_memory(&self) -> bool {
        false
    }

    fn set_notifier(&mut self, notifier: Notifier) {
        self.notifier = notifier.clone();
        self.state.sink.set_notifier(notifier);
    }

    fn submit(&mut self, mut op: Op) -> Result<(), SubmitError> {
        let io_engine = &self.state.io_engine;
        let stuck = io_engine.snapshot().written_off;
        if stuck >= self.cfg.max_stuck {
            return Err(SubmitError {
                op,
                kind: SubmitErrorKind::Busy(format!(
                    "busy: {} ({} engine): {stuck} I/Os stuck in the kernel (limit {})",
                    self.name,
                    io_engine.name(),
                    self.cfg.max_stuck
                )),
            });
        }
        let room = io_engine.room();
        if op.blocks.len() > room {
            return Err(SubmitError {
                kind: SubmitErrorKind::Busy(format!(
                    "busy: {} ({} engine): job queue full ({} blocks, room for {room}, max_queued {})",
                    self.name,
                    io_engine.name(),
                    op.blocks.len(),
                    self.cfg.max_queued
                )),
                op,
            });
        }
        let now = Instant::now();
        let layout = &self.state.layout;
        let mut admission: FxHashMap<usize, Admission> = FxHashMap::default();
        for b in &op.blocks {
            let root = layout.root_of(b.key);
            admission
                .entry(root)
                .or_insert_with(|| self.state.health.admit(root, now));
        }
        if !op.blocks.is_empty() && admission.values().all(|a| *a == Admission::Rejected) {
            self.state
                .counters
                .rejected
                .fetch_add(op.blocks.len() as u64, Ordering::Relaxed);
            let roots: Vec<String> = admission
                .keys()
                .map(|r| layout.roots()[*r].display().to_string())
                .collect();
            return Err(SubmitError {
                op,
                kind: SubmitErrorKind::Unavailable(format!("breaker open on {}", roots.join(", "))),
            });
        }
        let cancel = Arc::new(AtomicBool::new(false));
        let blocks = std::mem::take(&mut op.blocks);
        let mut slots = Vec::with_capacity(blocks.len());
        let mut jobs = Vec::new();
        for (i, b) in blocks.into_iter().enumerate() {
            let root = layout.root_of(b.key);
            let mut slot = BlockSlot {
                key: b.key,
                engine_block: b.engine,
                root,
                buf: None,
                result: None,
            };
            let refuse = if admission.get(&root) == Some(&Admission::Rejected) {
                self.state.counters.rejected.fetch_add(1, Ordering::Relaxed);
                Some(BlockError::Unavailable(format!(
                    "breaker open on {}",
                    layout.roots()[root].display()
                )))
            } else if op.dir == Direction::Load && matches!(b.buf, Buf::Shared(_)) {
                Some(BlockError::Invalid(
                    "a load needs an owned destination buffer".into(),
                ))
            } else {
                None
            };
            if let Some(e) = refuse {
                slot.buf = Some(b.buf);
                slot.result = Some(Err(e));
                slots.push(slot);
                continue;
            }
            let action = match op.dir {
                Direction::Load => FileOp::Load,
                Direction::Store => FileOp::Store,
            };
            let params = self.params(root, b.key, op.dir, op.deadline, &cancel);
            let paths = layout.paths(b.key, action == FileOp::Store);
            let mut job = Box::new(BlockJob::new(
                op.id,
                i,
                action,
                b.key,
                Some(b.buf),
                paths,
                params,
            ));
            if let (Some(len), Some(spares)) = (job.store_file_len(), &self.state.spares)
                && let Some(spare) = spares.take(root, len)
            {
                job.use_spare(spare);
            }
            job.compute_payload_crc();
            jobs.push(job);
            slots.push(slot);
        }
        let mut roots: Vec<usize> = admission
            .iter()
            .filter(|(_, a)| **a != Admission::Rejected)
            .map(|(r, _)| *r)
            .collect();
        roots.sort_unstable();
        let id = op.id;
        let mut st = OpState {
            op,
            slots,
            pending: 0,
            cancel,
            submitted: now,
            roots,
            health_recorded: false,
        };
        for job in jobs {
            let index = job.index;
            let key = job.key;
            match self.state.io_engine.submit(job) {
                Ok(()) => {
                    st.pending += 1;
                    if let (Some(r), Direction::Load) = (&mut self.recycling, st.op.dir) {
                        r.load_started(key);
                    }
                }
                Err(r) => {
                    let mut job = r.job;
                    self.state.give_back_spare(&mut job);
                    st.slots[index].buf = job.buf.take();
                    st.slots[index].result = Some(Err(BlockError::Unavailable(r.reason)));
                }
            }
        }
        let immediate = st.pending == 0;
        self.ops.insert(id, st);
        if immediate {
            self.finish(id, now);
            self.notifier.notify();
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<OpCompletion>) {
        let jobs = self.state.sink.take();
        if !jobs.is_empty() {
            self.absorb(jobs);
        }
        out.append(&mut self.ready);
    }

    fn cancel(&mut self, op: OpId) {
        let now = Instant::now();
        let Some(st) = self.ops.get_mut(&op) else {
            return;
        };
        st.cancel.store(true, Ordering::Release);
        if now >= st.op.deadline && !st.health_recorded {
            // A timeout: count it now, while the I/O may still be stuck.
            st.health_recorded = true;
            for &root in &st.roots {
                self.state.health.failure(root, now);
            }
        }
        self.state.io_engine.write_off_overdue();
    }

    fn wait(&mut self, ops: &[OpId], until: Instant) -> WaitOutcome {
        loop {
            let jobs = self.state.sink.take();
            if !jobs.is_empty() {
                self.absorb(jobs);
            }
            if ops.iter().all(|o| !self.ops.contains_key(o)) {
                return WaitOutcome::Completed;
            }
            let now = Instant::now();
            if now >= until {
                return WaitOutcome::TimedOut;
            }
            let jobs = self.state.sink.take_or_wait(until - now);
            self.absorb(jobs);
        }
    }
}
