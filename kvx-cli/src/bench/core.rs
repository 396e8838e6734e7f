//! `kvx bench core [--json]`: the kvx-core tracker on its own, on one core, with no backend and
//! no I/O: tasks per second through submit → op handed out → completion → verdict (one block
//! per task, an engine block each, over 10 k requests as `cargo bench --bench core` does), the cost of expiring 1,000 tasks among 10 k and among 1 M
//! in flight, and the heap allocations each task costs.

use std::time::{Duration, Instant};

use clap::Args;
use kvx_core::{
    BackendCommand, BackendId, BlockKey, Buf, BufferPool, Direction, EngineBlockId, OpBlock,
    OpCompletion, RequestId, TaskSpec, Tracker, TrackerConfig,
};

use super::counting_alloc::allocations;

/// Options of `kvx bench core`.
#[derive(Args)]
pub struct CoreArgs {
    /// Tasks per throughput round.
    #[arg(long, default_value_t = 200_000)]
    tasks: u64,
    /// Throughput rounds (the median is reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Expiry rounds per size (the median is reported).
    #[arg(long, default_value_t = 100)]
    expiry_rounds: usize,
    /// Run only one part (for profilers); the other part's figures are left out.
    #[arg(long, value_enum)]
    only: Option<Part>,
    /// Print the results as JSON (one line).
    #[arg(long)]
    json: bool,
}

/// The two parts of the benchmark.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// Tasks per second and allocations per task.
    Throughput,
    /// The cost of expiring 1,000 tasks among 10 k and 1 M in flight.
    Expiry,
}

/// Engine blocks the throughput tasks cycle through.
const ENGINE_BLOCKS: u64 = 4096;
/// Requests the throughput tasks cycle through (as `cargo bench --bench core` does).
const REQUESTS: u64 = 10_000;
/// Tasks expired per expiry round.
const EXPIRED: usize = 1000;

/// A one-block load task of request `req`.
fn spec(
    pool: &BufferPool,
    req: u64,
    engine: Option<u32>,
    route: BackendId,
    at: Instant,
) -> TaskSpec {
    TaskSpec {
        request: RequestId(req),
        dir: Direction::Load,
        route: vec![route],
        blocks: vec![OpBlock {
            key: BlockKey(req as u128),
            engine: engine.map(EngineBlockId),
            buf: Buf::Owned(pool.take().expect("the bench pool holds a buffer per task")),
        }],
        deadline: at,
        deferred: false,
    }
}

/// Run the benchmark; returns the exit code.
pub fn run(args: CoreArgs) -> i32 {
    match measure(&args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvx bench core: {e}");
            1
        }
    }
}

/// A tracker with one backend and a pool for the throughput tasks.
struct Rig {
    tracker: Tracker,
    backend: BackendId,
    pool: BufferPool,
    now: Instant,
    deadline: Instant,
    ops: Vec<kvx_core::Op>,
}

impl Rig {
    fn new() -> Result<Rig, String> {
        let mut tracker = Tracker::new(TrackerConfig::default());
        let backend = tracker.add_backend(true);
        let now = Instant::now();
        Ok(Rig {
            tracker,
            backend,
            pool: BufferPool::new(64, 64, 64).map_err(|e| e.to_string())?,
            now,
            deadline: now + Duration::from_secs(3600),
            ops: Vec::with_capacity(4),
        })
    }

    fn spec(&self, i: u64) -> TaskSpec {
        let engine = Some((i % ENGINE_BLOCKS) as u32);
        spec(
            &self.pool,
            i % REQUESTS,
            engine,
            self.backend,
            self.deadline,
        )
    }

    /// One task through the tracker; returns false when its verdict was not Done.
    fn one_task(&mut self, s: TaskSpec) -> bool {
        let Rig {
            tracker, ops, now, ..
        } = self;
        tracker.submit(s, *now);
        while let Some(BackendCommand::Submit { op, .. }) = tracker.poll_backend_command() {
            ops.push(op);
        }
        for op in ops.drain(..) {
            tracker.handle_completion(OpCompletion::all(op, Ok(())), *now);
        }
        let mut ok = false;
        while let Some(ev) = tracker.poll_event() {
            if let kvx_core::Event::TaskFinished(r) = ev {
                ok = r.is_ok();
            }
        }
        ok
    }

    /// `n` tasks, one after the other; the time they took.
    #[inline(never)]
    fn throughput_round(&mut self, first: u64, n: u64) -> Result<Duration, String> {
        let start = Instant::now();
        for i in first..first + n {
            let s = self.spec(i);
            if !self.one_task(s) {
                return Err(format!("task {i} did not end Done"));
            }
        }
        Ok(start.elapsed())
    }

    /// Allocations per task inside the tracker's calls, and outside them (the spec's two
    /// vectors and the completion's result vector, which the caller and the backend build).
    fn allocations_per_task(&mut self, first: u64, n: u64) -> (f64, f64) {
        let (mut inside, mut outside) = (0u64, 0u64);
        for i in first..first + n {
            let a0 = allocations();
            let s = self.spec(i);
            let a1 = allocations();
            self.tracker.submit(s, self.now);
            while let Some(BackendCommand::Submit { op, .. }) = self.tracker.poll_backend_command()
            {
                self.ops.push(op);
            }
            let a2 = allocations();
            let completions: Vec<OpCompletion> = self
                .ops
                .drain(..)
                .map(|op| OpCompletion::all(op, Ok(())))
                .collect();
            let a3 = allocations();
            for c in completions {
                self.tracker.handle_completion(c, self.now);
            }
            while self.tracker.poll_event().is_some() {}
            let a4 = allocations();
            outside += (a1 - a0) + (a3 - a2);
            // The `completions` vector itself is bench scaffolding, not the backend's.
            outside -= 1;
            inside += (a2 - a1) + (a4 - a3);
        }
        (inside as f64 / n as f64, outside as f64 / n as f64)
    }
}

/// A tracker with `in_flight` tasks far from their deadline (each of its own request), and
/// rounds of 1,000 more tasks that expire together.
struct ExpiryRig {
    tracker: Tracker,
    pool: BufferPool,
    file: BackendId,
    in_flight: usize,
    now: Instant,
    next_request: u64,
    /// The ops of the tasks in flight, held as a backend would.
    _held: Vec<kvx_core::Op>,
    victims: Vec<kvx_core::Op>,
}

impl ExpiryRig {
    fn new(in_flight: usize) -> Result<ExpiryRig, String> {
        let pool = BufferPool::new(in_flight + EXPIRED, 8, 8).map_err(|e| e.to_string())?;
        let mut tracker = Tracker::new(TrackerConfig {
            zombie_budget_ops: usize::MAX,
            zombie_budget_bytes: u64::MAX,
        });
        let file = tracker.add_backend(false);
        let now = Instant::now();
        let far = now + Duration::from_secs(24 * 3600);
        for i in 0..in_flight as u64 {
            tracker.submit(spec(&pool, i, None, file, far), now);
        }
        let mut held = Vec::with_capacity(in_flight);
        while let Some(BackendCommand::Submit { op, .. }) = tracker.poll_backend_command() {
            held.push(op);
        }
        Ok(ExpiryRig {
            tracker,
            pool,
            file,
            in_flight,
            now,
            next_request: in_flight as u64,
            _held: held,
            victims: Vec::with_capacity(EXPIRED),
        })
    }

    /// One round: 1,000 tasks due in 1 ms, the clock moved on, `handle_timeout` timed; then
    /// the verdicts are checked and the zombies' late completions handed in (not timed).
    fn round(&mut self) -> Result<Duration, String> {
        let t = &mut self.tracker;
        let soon = self.now + Duration::from_millis(1);
        for _ in 0..EXPIRED {
            self.next_request += 1;
            t.submit(
                spec(&self.pool, self.next_request, None, self.file, soon),
                self.now,
            );
        }
        while let Some(BackendCommand::Submit { op, .. }) = t.poll_backend_command() {
            self.victims.push(op);
        }
        self.now = soon;
        let took = expire(t, self.now);
        let mut timed_out = 0;
        while let Some(ev) = t.poll_event() {
            if let kvx_core::Event::TaskFinished(r) = ev {
                timed_out += usize::from(r.state == kvx_core::TaskState::TimedOut);
            }
        }
        if timed_out != EXPIRED {
            return Err(format!("{timed_out} of {EXPIRED} tasks timed out"));
        }
        while t.poll_backend_command().is_some() {}
        for op in self.victims.drain(..) {
            t.handle_completion(OpCompletion::all(op, Ok(())), self.now);
        }
        let s = t.stats();
        if s.live_tasks != self.in_flight || s.zombie_ops != 0 {
            return Err(format!(
                "after a round: {} live tasks (want {}), {} zombies (want 0)",
                s.live_tasks, self.in_flight, s.zombie_ops
            ));
        }
        Ok(took)
    }
}

/// The median time, in milliseconds, `handle_timeout` takes to expire 1,000 tasks among 10 k
/// and among 1 M in flight; the rounds of the two alternate, so drift on a shared machine
/// hits both alike.
fn expiry_ms(rounds: usize) -> Result<(f64, f64), String> {
    let mut small = ExpiryRig::new(10_000)?;
    let mut large = ExpiryRig::new(1_000_000)?;
    for _ in 0..3 {
        small.round()?;
        large.round()?;
    }
    let (mut a, mut b) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for _ in 0..rounds {
        a.push(small.round()?);
        b.push(large.round()?);
    }
    let ms = |v: &mut Vec<Duration>| median(v).as_secs_f64() * 1e3;
    Ok((ms(&mut a), ms(&mut b)))
}

/// The timed part of an expiry round.
#[inline(never)]
fn expire(t: &mut Tracker, now: Instant) -> Duration {
    let start = Instant::now();
    t.handle_timeout(now);
    start.elapsed()
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Tasks per second (median round) and allocations per task, inside and outside the tracker.
struct Throughput {
    tasks_per_s: f64,
    allocs: f64,
    caller_allocs: f64,
}

fn throughput(args: &CoreArgs) -> Result<Throughput, String> {
    let mut rig = Rig::new()?;
    // Warm-up: the tracker's maps and queues reach their steady size.
    rig.throughput_round(0, args.tasks.min(20_000))?;
    let (allocs, caller_allocs) = rig.allocations_per_task(0, 10_000);
    let mut times = Vec::with_capacity(args.rounds);
    for _ in 0..args.rounds {
        times.push(rig.throughput_round(0, args.tasks)?);
    }
    if rig.tracker.stats().live_tasks != 0 {
        return Err("tasks left live after the throughput rounds".into());
    }
    Ok(Throughput {
        tasks_per_s: args.tasks as f64 / median(&mut times).as_secs_f64(),
        allocs,
        caller_allocs,
    })
}

fn measure(args: &CoreArgs) -> Result<(), String> {
    if args.tasks == 0 || args.rounds == 0 || args.expiry_rounds == 0 {
        return Err("--tasks, --rounds and --expiry-rounds must be positive".into());
    }
    // "On one core": stay on the CPU this thread starts on, as a migration between the
    // machine's cores would be timed as tracker work.
    let cpu = super::pin::pin_to_current_cpu();
    let tp = match args.only {
        Some(Part::Expiry) => None,
        _ => Some(throughput(args)?),
    };
    let expiry = match args.only {
        Some(Part::Throughput) => None,
        _ => Some(expiry_ms(args.expiry_rounds)?),
    };
    if args.json {
        let mut v = serde_json::json!({
            "bench": "core",
            "tasks": args.tasks,
            "rounds": args.rounds,
            "expiry_rounds": args.expiry_rounds,
            "pinned_cpu": cpu,
        });
        if let Some(tp) = &tp {
            v["tasks_per_s"] = tp.tasks_per_s.into();
            v["ns_per_task"] = (1e9 / tp.tasks_per_s).into();
            v["allocs_per_task"] = tp.allocs.into();
            v["caller_allocs_per_task"] = tp.caller_allocs.into();
        }
        if let Some((at_10k, at_1m)) = expiry {
            v["expire_1000_ms_at_10k"] = at_10k.into();
            v["expire_1000_ms_at_1m"] = at_1m.into();
            v["expire_ratio_1m_to_10k"] = (at_1m / at_10k).into();
        }
        println!("{v}");
        return Ok(());
    }
    match cpu {
        Some(c) => {
            println!("kvx bench core: the tracker alone on CPU {c} (pinned), one-block tasks")
        }
        None => println!(
            "kvx bench core: the tracker alone on one thread (not pinned), one-block tasks"
        ),
    }
    if let Some(tp) = &tp {
        println!(
            "  submit -> complete   {:10.0} tasks/s  ({:.0} ns per task; median of {} rounds of {})",
            tp.tasks_per_s,
            1e9 / tp.tasks_per_s,
            args.rounds,
            args.tasks
        );
        println!(
            "  allocations per task {:10.2} in the tracker, {:.2} by the caller and backend",
            tp.allocs, tp.caller_allocs
        );
    }
    if let Some((at_10k, at_1m)) = expiry {
        println!(
            "  expire 1000 tasks    {at_10k:10.3} ms among 10 k in flight, {at_1m:.3} ms among \
             1 M ({:.2}x); median of {} rounds",
            at_1m / at_10k,
            args.expiry_rounds
        );
    }
    Ok(())
}
