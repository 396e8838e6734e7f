//! One engine node on a shared root: a store (shared-mount settings) in a driver, loads into
//! owned buffers, and the line protocol that the test process drives its child nodes with.
//!
//! A child node prints `ready` once its store is open, then answers one line per command read
//! from stdin (see [`serve`]).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kvx_core::*;
pub use kvx_posix::testing::key;
use kvx_posix::{IoEngine, PosixConfig, PosixHandle, PosixStore, ProbeAnswer, SharedMount};

/// Environment variable that turns the test binary into a child node on this root.
pub const NODE_ENV: &str = "KVX_SHARED_MOUNT_NODE";
/// Payload bytes of a block.
pub const BLOCK: usize = 16 << 10;
/// Probe deadline of every node.
pub const PROBE_DEADLINE: Duration = Duration::from_millis(200);
/// Load deadline under a freeze.
pub const LOAD_DEADLINE: Duration = Duration::from_millis(200);
/// One tick plus the stated 50 ms allowance for scheduling on these 2-core machines.
pub const MARGIN: Duration = TICK.saturating_add(Duration::from_millis(50));
/// Generous bound for "happens promptly" (never a performance assertion).
pub const SOON: Duration = Duration::from_secs(10);

/// The payload stored under `k` in `generation` (a re-store writes another generation).
pub fn payload(k: BlockKey, generation: u8) -> Vec<u8> {
    let seed = k.to_be_bytes();
    (0..BLOCK)
        .map(|i| seed[i % 16] ^ generation.wrapping_mul(31) ^ (i / 16) as u8)
        .collect()
}

/// The probe deadline of nodes in a test of what they see rather than of when: a probe that
/// answers past [`PROBE_DEADLINE`] is `Absent` by design (and a failure for the breaker), and
/// one did, by 1.6 ms, beside a compile and `dd` on a 2-core machine (2 runs in 16).
pub const PATIENT_PROBE: Duration = SOON;

/// The settings of every node: a shared root, psync or uring, a short breaker cool-down.
pub fn config(root: &Path, engine: IoEngine) -> PosixConfig {
    let mut c = PosixConfig::new(root);
    c.io_engine = engine;
    c.breaker.cool_down_ms = 200;
    c.shared = Some(SharedMount {
        probe_deadline: PROBE_DEADLINE,
        probe_ttl: Duration::from_millis(100),
        probe_entries: 4096,
        touch_on_load: true,
        ..SharedMount::default()
    });
    c
}

/// [`config`] with probes that time out after `probe_deadline`.
pub fn config_probing(root: &Path, engine: IoEngine, probe_deadline: Duration) -> PosixConfig {
    let mut c = config(root, engine);
    if let Some(shared) = c.shared.as_mut() {
        shared.probe_deadline = probe_deadline;
    }
    c
}

/// Block `k` in the owned buffer `buf`.
fn owned(k: BlockKey, buf: PoolBuf) -> OpBlock {
    OpBlock {
        key: k,
        engine: None,
        buf: Buf::Owned(buf),
    }
}

/// A node: its store in a driver, and a pool of staging buffers.
pub struct Node {
    pub driver: Driver,
    pub posix: BackendId,
    pub files: PosixHandle,
    pub pool: BufferPool,
}

/// What one load ended with.
#[derive(Debug, PartialEq, Eq)]
pub enum Loaded {
    /// Verified, and equal to the payload of `generation`.
    Exact(u8),
    /// Verified, but equal to no generation written (must never happen).
    Mixed,
    /// The block was reported invalid (missing, corrupt, timed out, breaker open...).
    Invalid(BlockError),
}

impl Node {
    /// Open a node on `root`.
    pub fn open(root: &Path, engine: IoEngine) -> Node {
        Node::open_probing(root, engine, PROBE_DEADLINE)
    }

    /// Open a node on `root` whose probes time out after `probe_deadline`.
    pub fn open_probing(root: &Path, engine: IoEngine, probe_deadline: Duration) -> Node {
        let store =
            PosixStore::open(config_probing(root, engine, probe_deadline)).expect("open store");
        let files = store.handle();
        let mut b = DriverBuilder::new(DriverConfig::default());
        let posix = b.backend(Box::new(store));
        let driver = b.spawn().expect("driver");
        let pool = BufferPool::new(256, BLOCK, DEFAULT_ALIGN).expect("pool");
        Node {
            driver,
            posix,
            files,
            pool,
        }
    }

    /// Store `keys` (generation `generation`); every block must succeed.
    pub fn store(&self, keys: &[BlockKey], generation: u8) {
        assert_eq!(self.store_unless_removing(keys, generation), 0);
    }

    /// Store `keys` (generation `generation`); every block must succeed but those refused
    /// because a remove of theirs (a collector's) is still in flight: how many were.
    pub fn store_unless_removing(&self, keys: &[BlockKey], generation: u8) -> usize {
        let blocks = keys
            .iter()
            .map(|&k| self.filled(k, generation).expect("a staging buffer"))
            .collect();
        let r = self.run(Direction::Store, blocks, Instant::now() + SOON);
        let mut refused = 0;
        for b in &r.blocks {
            match &b.result {
                Ok(()) => {}
                Err(BlockError::Unavailable(m)) if m.contains("remove of this block") => {
                    assert!(
                        !self.files.contains(b.key),
                        "{}: refused, yet indexed",
                        b.key
                    );
                    refused += 1;
                }
                Err(e) => panic!("store of {} failed: {e}", b.key),
            }
        }
        refused
    }

    /// Block `k` in a staging buffer holding its payload of `generation` (none when the pool
    /// is empty).
    fn filled(&self, k: BlockKey, generation: u8) -> Option<OpBlock> {
        let mut buf = self.pool.take()?;
        buf.set_len(BLOCK);
        buf.as_mut_slice().copy_from_slice(&payload(k, generation));
        Some(owned(k, buf))
    }

    /// Run one task of `blocks` in direction `dir` with `deadline`, and wait for its report.
    fn run(&self, dir: Direction, blocks: Vec<OpBlock>, deadline: Instant) -> TaskReport {
        let t = self
            .driver
            .submit(TaskSpec {
                request: RequestId(1),
                dir,
                route: vec![self.posix],
                blocks,
                deadline,
                deferred: false,
            })
            .expect("submit a task");
        self.driver
            .wait_report(t, deadline + SOON)
            .expect("a task's report")
    }

    /// Store `k` (generation `generation`) with `deadline`: whether the store reported
    /// success, and when kvx decided it (the report's `finished_at`, not when this thread woke
    /// up to read it: the bound is kvx's).
    pub fn store_by(&self, k: BlockKey, generation: u8, deadline: Instant) -> (bool, Instant) {
        let Some(block) = self.filled(k, generation) else {
            // Buffers of stores still stuck in a frozen mount are quarantined.
            return (false, Instant::now());
        };
        let r = self.run(Direction::Store, vec![block], deadline);
        (r.is_ok(), r.finished_at)
    }

    /// Load `k` with `deadline`; returns the verdict and when kvx decided it (the report's
    /// `finished_at`).
    pub fn load(&self, k: BlockKey, deadline: Instant) -> (Loaded, Instant) {
        let Some(buf) = self.pool.take() else {
            // Buffers of loads still stuck in a frozen mount are quarantined.
            return (
                Loaded::Invalid(BlockError::Unavailable("no staging buffer".into())),
                Instant::now(),
            );
        };
        let r = self.run(Direction::Load, vec![owned(k, buf)], deadline);
        let at = r.finished_at;
        let b = &r.blocks[0];
        let verdict = match (&b.result, &b.buf) {
            (Ok(()), Some(buf)) => {
                let got = buf.as_slice();
                (0..=255u8)
                    .find(|g| got == payload(k, *g).as_slice())
                    .map_or(Loaded::Mixed, Loaded::Exact)
            }
            (Ok(()), None) => Loaded::Mixed,
            (Err(e), _) => Loaded::Invalid(e.clone()),
        };
        (verdict, at)
    }

    /// Probe `k` until the answer is not `Pending` (or `SOON` passes): the answer, whether
    /// the first call already gave it, and how long it took.
    pub fn find(&self, k: BlockKey) -> (ProbeAnswer, bool, Duration) {
        let t0 = Instant::now();
        let mut first = true;
        loop {
            let a = self.files.probe(k);
            if a != ProbeAnswer::Pending || t0.elapsed() > SOON {
                return (a, first, t0.elapsed());
            }
            first = false;
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Serve commands on stdin as a child node on `root` (the value of [`NODE_ENV`]:
/// `<engine> <probe deadline in ms> <root>`). Commands and answers, one line each:
///
/// - `find A B` → `found P` (keys A..B whose probe said present);
/// - `load A B G` → `load EXACT OTHER MIXED INVALID` (exact: generation G; other: another
///   generation; mixed: no generation at all);
/// - `stores A B G MS` → `stores OK LATE_US` (store keys A..B in generation G, each with a
///   deadline of MS: how many succeeded, and the latest verdict past its deadline);
/// - `churn A B MS` → `churn EXACT MIXED INVALID NOTFOUND` (load A..B round after round for MS);
/// - `collect QUOTA MS` → `collect PASSES REMOVED` (collector passes with a quota of QUOTA
///   bytes, one after another for MS; any failed pass panics the node);
/// - `frozen A B C D O` → `frozen ANSWER_US FIRST_ABSENT LOAD_LATE_US LOAD_OK BREAKER_OPEN`
///   (probe new keys A..B and load stored keys C..D under a freeze; the loads first when O
///   is 1, so that they, not the probes, meet the mount before the breaker opens);
/// - `quit`.
pub fn serve(spec: &str) {
    let mut words = spec.splitn(3, ' ');
    let mut word = || words.next().expect("node spec: <engine> <probe ms> <root>");
    let engine: IoEngine = word().parse().expect("engine");
    let probe = Duration::from_millis(word().parse().expect("probe deadline"));
    let node = Node::open_probing(Path::new(word()), engine, probe);
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").expect("stdout");
    out.flush().expect("stdout");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let w: Vec<&str> = line.split_whitespace().collect();
        let n = |i: usize| -> u64 { w[i].parse().expect("number") };
        let answer = match w.first().copied() {
            Some("find") => {
                let found = (n(1)..n(2))
                    .filter(|&i| node.find(key(i)).0 == ProbeAnswer::Present)
                    .count();
                format!("found {found}")
            }
            Some("load") => {
                let (mut exact, mut other, mut mixed, mut invalid) = (0, 0, 0, 0);
                for i in n(1)..n(2) {
                    match node.load(key(i), Instant::now() + SOON).0 {
                        Loaded::Exact(g) if u64::from(g) == n(3) => exact += 1,
                        Loaded::Exact(_) => other += 1,
                        Loaded::Mixed => mixed += 1,
                        Loaded::Invalid(_) => invalid += 1,
                    }
                }
                format!("load {exact} {other} {mixed} {invalid}")
            }
            Some("stores") => {
                let (mut ok, mut late) = (0, Duration::ZERO);
                for i in n(1)..n(2) {
                    let deadline = Instant::now() + Duration::from_millis(n(4));
                    let (stored, at) = node.store_by(key(i), n(3) as u8, deadline);
                    ok += u64::from(stored);
                    late = late.max(at.saturating_duration_since(deadline));
                }
                format!("stores {ok} {}", late.as_micros())
            }
            Some("churn") => churn(&node, n(1)..n(2), Duration::from_millis(n(3))),
            Some("collect") => {
                let cfg = kvx_posix::CollectorConfig::new(n(1));
                let stop = std::sync::atomic::AtomicBool::new(false);
                let end = Instant::now() + Duration::from_millis(n(2));
                let (mut passes, mut removed) = (0, 0);
                while Instant::now() < end {
                    let r = node.files.collect(&cfg, &stop).expect("a collector pass");
                    passes += 1;
                    removed += r.removed.len();
                }
                format!("collect {passes} {removed}")
            }
            Some("frozen") => frozen(&node, n(1)..n(2), n(3)..n(4), n(5) == 1),
            Some("quit") | None => break,
            Some(other) => panic!("unknown command {other:?}"),
        };
        writeln!(out, "{answer}").expect("stdout");
        out.flush().expect("stdout");
    }
}

fn churn(node: &Node, keys: std::ops::Range<u64>, span: Duration) -> String {
    let end = Instant::now() + span;
    let (mut exact, mut mixed, mut invalid, mut not_found) = (0, 0, 0, 0);
    while Instant::now() < end {
        for i in keys.clone() {
            match node.load(key(i), Instant::now() + SOON).0 {
                Loaded::Exact(_) => exact += 1,
                Loaded::Mixed => mixed += 1,
                Loaded::Invalid(BlockError::NotFound) => not_found += 1,
                Loaded::Invalid(e) => {
                    eprintln!("churn: load of block {i} refused: {e:?}");
                    invalid += 1
                }
            }
        }
    }
    format!("churn {exact} {mixed} {invalid} {not_found}")
}

fn frozen(
    node: &Node,
    fresh: std::ops::Range<u64>,
    stored: std::ops::Range<u64>,
    loads_first: bool,
) -> String {
    // Loads of blocks this node holds end by their deadline (plus a tick and the allowance).
    let mut late = Duration::ZERO;
    let mut ok = 0;
    let mut loads = || {
        for i in stored.clone() {
            let deadline = Instant::now() + LOAD_DEADLINE;
            let (v, at) = node.load(key(i), deadline);
            late = late.max(at.saturating_duration_since(deadline));
            if matches!(v, Loaded::Exact(_)) {
                ok += 1;
            }
        }
    };
    if loads_first {
        loads();
    }
    // Probes of keys no index holds: each answers Absent within the probe deadline.
    let mut slowest = Duration::ZERO;
    let mut all_absent = true;
    for i in fresh.clone() {
        let (a, _, took) = node.find(key(i));
        all_absent &= a == ProbeAnswer::Absent;
        slowest = slowest.max(took);
    }
    // The timeouts opened the breaker: a new key is a miss on the first call.
    let (a, first, _) = node.find(key(fresh.end + 1_000_000));
    let first_absent = a == ProbeAnswer::Absent && first && all_absent;
    if !loads_first {
        loads();
    }
    let open = matches!(
        node.files.breaker_state(0),
        Some(kvx_policy::BreakerState::Open { .. })
    );
    format!(
        "frozen {} {} {} {ok} {}",
        slowest.as_micros(),
        u8::from(first_absent),
        late.as_micros(),
        u8::from(open)
    )
}

/// The command that runs `program` under `prefix` (a program that execs the rest of its
/// command line, as `nsenter` does), or `program` itself when `prefix` is empty.
pub fn command_under(prefix: &[String], program: impl AsRef<std::ffi::OsStr>) -> Command {
    match prefix.split_first() {
        Some((first, args)) => {
            let mut c = Command::new(first);
            c.args(args).arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// A child node process, driven over its stdin and stdout.
pub struct ChildNode {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl ChildNode {
    /// Start this test binary as a node on `root` and wait for its `ready`.
    pub fn spawn(root: &Path, engine: IoEngine) -> ChildNode {
        ChildNode::spawn_under(&[], root, engine)
    }

    /// Start this test binary as a node on `root` under the command `prefix` (which must exec
    /// it, as `nsenter --net=...` does) and wait for its `ready`.
    pub fn spawn_under(prefix: &[String], root: &Path, engine: IoEngine) -> ChildNode {
        ChildNode::spawn_probing(prefix, root, engine, PROBE_DEADLINE)
    }

    /// [`ChildNode::spawn_under`], the node's probes timing out after `probe_deadline`.
    pub fn spawn_probing(
        prefix: &[String],
        root: &Path,
        engine: IoEngine,
        probe_deadline: Duration,
    ) -> ChildNode {
        let exe: PathBuf = std::env::current_exe().expect("test binary");
        let spec = format!("{engine} {} {}", probe_deadline.as_millis(), root.display());
        let mut child = command_under(prefix, exe)
            .env(NODE_ENV, spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn a node");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut n = ChildNode {
            child,
            stdin,
            stdout,
        };
        assert_eq!(n.read(), "ready");
        n
    }

    fn read(&mut self) -> String {
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .expect("read a node's answer");
        assert!(!line.is_empty(), "the node exited");
        line.trim().to_string()
    }

    /// Send a command without waiting for the answer.
    pub fn send(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").expect("write a command");
        self.stdin.flush().expect("flush");
    }

    /// The answer to the last command, as numbers after its first word `word`.
    pub fn answer(&mut self, word: &str) -> Vec<u64> {
        let line = self.read();
        let mut w = line.split_whitespace();
        assert_eq!(w.next(), Some(word), "answer {line:?}");
        w.map(|x| x.parse().expect("number")).collect()
    }

    /// Send `cmd` and wait for its answer.
    pub fn ask(&mut self, cmd: &str, word: &str) -> Vec<u64> {
        self.send(cmd);
        self.answer(word)
    }

    /// Tell the node to quit and check that it exited cleanly.
    pub fn quit(mut self) {
        self.send("quit");
        let status = self.child.wait().expect("wait for a node");
        assert!(status.success(), "node exited with {status}");
    }
}

impl Drop for ChildNode {
    fn drop(&mut self) {
        // A node that is still running after a failed assertion: end it (by its own id).
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
