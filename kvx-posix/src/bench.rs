//! A closed-loop driver of a [`PosixStore`] for benchmarks (`kvx bench posix`, criterion): the
//! store runs `queue_depth` single-block ops at a time (its [`PosixConfig::queue_depth`]), and
//! the driver keeps `backlog` more submitted and waiting in the store, as an engine that hands
//! over a step's blocks at once does, so that when an op ends the next one starts in the store
//! without waiting for this loop to see the completion and submit it (0: the loop refills only
//! after it sees a completion). It stores or loads a set of keys and measures throughput and
//! per-op latency (submit to verdict, so with a backlog it includes the wait in the store).
//!
//! Every op has a deadline. An op past it is cancelled, counted as timed out and never waited
//! for again (its buffer comes back whenever the filesystem answers). Once an op of a phase
//! timed out (by this loop's clock or by the store's verdict) the phase starts no new op: the
//! mount is stuck or too slow for the deadline, a new op would only wait out a deadline of its
//! own (a breaker that lets a probe through, say), and a run with a timeout measures nothing.
//! The keys it did not start are reported as not started. When no buffer is left for the next
//! op and none comes back within [`STARVED`], the phase ends the same way. So a phase on a
//! frozen mount ends within its deadline (plus [`STARVED`]) of the freeze.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvx_core::{
    Backend, BlockError, BlockKey, Buf, BufferPool, DEFAULT_ALIGN, Direction, Notifier, Op,
    OpBlock, OpCompletion, OpId, RequestId, TaskId,
};
use rustc_hash::{FxHashMap, FxHashSet};

use crate::config::PosixConfig;
use crate::error::PosixError;
use crate::store::PosixStore;
use crate::store::handle::PosixHandle;

/// How long a phase waits for a buffer to come back from a timed-out op before it gives up
/// on the keys it has not started.
pub const STARVED: Duration = Duration::from_millis(200);

/// The result of one phase (all stores, or all loads).
#[derive(Debug, Clone, Default)]
pub struct Phase {
    /// Payload bytes moved by the ops that succeeded.
    pub bytes: u64,
    /// Wall time from the first submit to the end of the phase.
    pub elapsed: Duration,
    /// Per-op latency (submit to completion seen) of the ops that succeeded, sorted.
    pub latencies: Vec<Duration>,
    /// Keys whose op succeeded.
    pub ok: Vec<BlockKey>,
    /// Ops cancelled at their deadline.
    pub timed_out: usize,
    /// Ops that completed with an error.
    pub failed: usize,
    /// Ops the store refused at submit (busy, breaker open).
    pub refused: usize,
    /// Keys never started: an op of the phase timed out, or no staging buffer came back from
    /// timed-out ops.
    pub not_started: usize,
    /// The first error seen, for the report.
    pub first_error: Option<String>,
    /// An op timed out, and the phase started no new op after it.
    pub gave_up: bool,
}

impl Phase {
    /// Throughput in GiB/s.
    pub fn gib_s(&self) -> f64 {
        self.bytes as f64 / (1u64 << 30) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Latency percentile `p` (0..=100) in microseconds.
    pub fn percentile_us(&self, p: f64) -> f64 {
        if self.latencies.is_empty() {
            return 0.0;
        }
        let i = ((p / 100.0) * (self.latencies.len() - 1) as f64).round() as usize;
        self.latencies[i.min(self.latencies.len() - 1)].as_secs_f64() * 1e6
    }

    /// True when every key's op succeeded.
    pub fn is_clean(&self) -> bool {
        self.timed_out + self.failed + self.refused + self.not_started == 0
    }
}

/// A store with a staging pool of `queue_depth + backlog` buffers, driven in a closed loop.
pub struct BenchRig {
    store: PosixStore,
    pool: BufferPool,
    block_size: usize,
    /// Ops submitted and not yet seen complete: the store's queue depth plus the backlog.
    window: usize,
    wake: Arc<(Mutex<bool>, Condvar)>,
    next_op: u64,
    /// Ops given up on at their deadline, still holding a buffer.
    abandoned: FxHashSet<OpId>,
}

impl BenchRig {
    /// Open a store with `cfg` and a pool of `cfg.queue_depth + backlog` buffers of
    /// `block_size`; `backlog` ops wait in the store beyond the `cfg.queue_depth` it runs.
    pub fn new(
        cfg: PosixConfig,
        block_size: usize,
        backlog: usize,
    ) -> Result<BenchRig, PosixError> {
        let window = cfg.queue_depth + backlog;
        let mut store = PosixStore::open(cfg)?;
        let pool = BufferPool::new(window, block_size, DEFAULT_ALIGN)
            .map_err(|e| PosixError::Bench(format!("staging pool: {e}")))?;
        // Give every buffer a payload once; stores send it as is.
        let mut all = Vec::new();
        while let Some(mut b) = pool.take() {
            for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
                *x = (i as u8).wrapping_mul(31).wrapping_add(7);
            }
            all.push(b);
        }
        drop(all);
        let wake = Arc::new((Mutex::new(false), Condvar::new()));
        let w = wake.clone();
        store.set_notifier(Notifier::new(move || {
            let (m, cv) = &*w;
            *kvx_core::lock(m) = true;
            cv.notify_one();
        }));
        Ok(BenchRig {
            store,
            pool,
            block_size,
            window,
            wake,
            next_op: 1,
            abandoned: FxHashSet::default(),
        })
    }

    /// The store's handle (capabilities, counters, lookups).
    pub fn handle(&self) -> PosixHandle {
        self.store.handle()
    }

    fn park(&self, at_most: Duration) {
        let (m, cv) = &*self.wake;
        let mut woken = kvx_core::lock(m);
        if !*woken {
            woken = kvx_core::wait_timeout(cv, woken, at_most.min(Duration::from_millis(20)));
        }
        *woken = false;
    }

    /// Store (or load) every key once, `queue_depth` single-block ops in flight in the store and
    /// the backlog waiting there, each with `deadline`; see the module docs for what a phase
    /// does with ops that do not finish.
    pub fn run(&mut self, dir: Direction, keys: &[BlockKey], deadline: Duration) -> Phase {
        let mut inflight: FxHashMap<OpId, (Instant, BlockKey)> = FxHashMap::default();
        let mut phase = Phase::default();
        let mut out: Vec<OpCompletion> = Vec::new();
        let mut next = 0;
        let mut starved_since: Option<Instant> = None;
        // An op timed out: start no more (see the module docs).
        let mut timed_out = false;
        let t0 = Instant::now();
        loop {
            while !timed_out && inflight.len() < self.window && next < keys.len() {
                let Some(mut buf) = self.pool.take() else {
                    break;
                };
                buf.set_len(self.block_size);
                let id = OpId(self.next_op);
                self.next_op += 1;
                let now = Instant::now();
                let op = Op {
                    id,
                    task: TaskId(id.0),
                    request: RequestId(0),
                    dir,
                    deadline: now + deadline,
                    blocks: vec![OpBlock {
                        key: keys[next],
                        engine: None,
                        buf: Buf::Owned(buf),
                    }],
                };
                match self.store.submit(op) {
                    Ok(()) => {
                        inflight.insert(id, (now, keys[next]));
                    }
                    Err(e) => {
                        phase.refused += 1;
                        phase.first_error.get_or_insert_with(|| e.kind.to_string());
                    }
                }
                next += 1;
            }
            self.store.poll(&mut out);
            // Completions free buffers: start their successors before sleeping again (their
            // wake-up may have been taken by the last park already).
            let progressed = !out.is_empty();
            let now = Instant::now();
            for c in out.drain(..) {
                if self.abandoned.remove(&c.op.id) {
                    continue; // a late completion of a timed-out op: its buffer is back
                }
                let Some((start, key)) = inflight.remove(&c.op.id) else {
                    continue;
                };
                match c.results.iter().find_map(|r| r.as_ref().err()) {
                    None => {
                        phase.latencies.push(now - start);
                        phase.ok.push(key);
                    }
                    Some(e) => {
                        timed_out |= *e == BlockError::TimedOut;
                        phase.failed += 1;
                        phase
                            .first_error
                            .get_or_insert_with(|| format!("{dir} of {key} failed: {e}"));
                    }
                }
            }
            let overdue: Vec<OpId> = inflight
                .iter()
                .filter(|(_, (start, _))| now >= *start + deadline)
                .map(|(id, _)| *id)
                .collect();
            for id in overdue {
                inflight.remove(&id);
                self.store.cancel(id);
                self.abandoned.insert(id);
                phase.timed_out += 1;
                timed_out = true;
            }
            if (next >= keys.len() || timed_out) && inflight.is_empty() {
                phase.not_started = keys.len() - next;
                phase.gave_up = timed_out;
                break;
            }
            if inflight.is_empty() && self.pool.available() == 0 {
                // Every buffer is held by an op given up on: wait a little for one to return.
                let since = *starved_since.get_or_insert(now);
                if now >= since + STARVED {
                    phase.not_started = keys.len() - next;
                    break;
                }
            } else {
                starved_since = None;
            }
            let until_due = inflight
                .values()
                .map(|(start, _)| (*start + deadline).saturating_duration_since(now))
                .min()
                .unwrap_or(STARVED);
            if !progressed {
                self.park(until_due);
            }
        }
        phase.elapsed = t0.elapsed();
        phase.latencies.sort_unstable();
        phase.bytes = (phase.ok.len() * self.block_size) as u64;
        phase
    }

    /// Remove `keys` from the store (as a full tier evicts them), then poll the store until
    /// its maintenance lane is empty, so that their files are recycled as spare files before
    /// the next phase; false if that took longer than `within`.
    pub fn evict(&mut self, keys: &[BlockKey], within: Duration) -> bool {
        let handle = self.store.handle();
        for k in keys {
            handle.remove(*k);
        }
        let until = Instant::now() + within;
        let mut out = Vec::new();
        loop {
            // Read before the poll: a remove that ends in between is absorbed by this poll.
            let idle = handle.stats().maintenance == 0;
            self.store.poll(&mut out);
            // Late completions of ops given up on: their buffers are back in the pool.
            for c in out.drain(..) {
                self.abandoned.remove(&c.op.id);
            }
            if idle {
                return true;
            }
            let now = Instant::now();
            if now >= until {
                return false;
            }
            self.park(until - now);
        }
    }
}

/// `n` distinct keys for a benchmark run `seed`.
pub fn bench_keys(seed: u64, n: usize) -> Vec<BlockKey> {
    (0..n as u64)
        .map(|i| BlockKey::chain(None, &[seed.to_le_bytes(), i.to_le_bytes()].concat()))
        .collect()
}
