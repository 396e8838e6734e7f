//! The two sides of the integration tests as separate processes: this test binary re-executed
//! with `KVX_RDMA_ROLE=producer` (a line-command producer) or `consumer` (one load, one report).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_policy::LeaseConfig;
use kvx_rdma::*;

/// Byte `j` of engine block `b` on the producer.
pub fn pattern(b: u32, j: usize) -> u8 {
    ((b as usize * 31 + j * 7 + 1) % 251) as u8
}

/// What the producer writes into blocks it got back (another request now owns them).
pub const REUSED: u8 = 0xDD;

/// Key of block index `i` of request `req`.
pub fn key(req: u64, i: u32) -> BlockKey {
    BlockKey::chain(Some(BlockKey(u128::from(req))), &i.to_le_bytes())
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// When a request's lease was started (`ready`) and aborted, if it was.
type LeaseMarks = (Option<Instant>, Option<Instant>);

/// The producer role: an arena of `KVX_BLOCKS` blocks of `KVX_BLOCK_BYTES`, a server on
/// `KVX_LISTEN`, commands on stdin, events on stdout.
pub fn producer() -> i32 {
    let blocks: u32 = env("KVX_BLOCKS", 64);
    let block_bytes: usize = env("KVX_BLOCK_BYTES", 65536);
    let mut arena = CpuArena::contiguous(block_bytes, blocks).expect("arena");
    for b in 0..blocks {
        let data: Vec<u8> = (0..block_bytes).map(|j| pattern(b, j)).collect();
        arena.write_block(EngineBlockId(b), &data).expect("fill");
    }
    let layout = arena.layout().clone();
    // SAFETY: the arena lives until this function returns, after the server is dropped; blocks
    // are overwritten only after the exporter reported their request released.
    let exporter = unsafe { Exporter::new(layout.clone()) }.expect("exporter");
    let cfg = ServerConfig {
        listen: env("KVX_LISTEN", SocketAddr::from(([127, 0, 0, 1], 0))),
        token: std::env::var("KVX_TOKEN").ok(),
        pace: Duration::from_millis(env("KVX_PACE_MS", 0)),
        handshake_timeout: Duration::from_millis(env("KVX_HANDSHAKE_MS", 5000)),
        write_timeout: Duration::from_millis(env("KVX_WRITE_MS", 5000)),
        idle_timeout: Duration::from_millis(env("KVX_IDLE_MS", 600_000)),
        ..ServerConfig::default()
    };
    let server = TcpServer::start(exporter.clone(), cfg).expect("server");
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let say = {
        let out = out.clone();
        move |line: String| {
            let mut o = kvx_core::lock(&out);
            let _ = writeln!(o, "{line}");
            let _ = o.flush();
        }
    };
    say(format!("listening {}", server.local_addr()));
    // Releases: overwrite the freed blocks (as the engine would reuse them), then report.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // When each request's lease started (`ready`) and when it was aborted, in this process's
    // clock: releases are timed against them without the pipes to the test in between.
    let marks: Arc<Mutex<HashMap<u64, LeaseMarks>>> = Arc::default();
    let poller = {
        let exporter = exporter.clone();
        let stop = stop.clone();
        let say = say.clone();
        let marks = marks.clone();
        let layout = layout.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // The release is timed at the poll that found it (the exporter's clock for
                // that poll), not after this loop overwrote its blocks: a 16 MiB block takes
                // the test milliseconds to overwrite on a cold machine.
                loop {
                    let polled = Instant::now();
                    let Some(r) = exporter.poll_released_at(polled) else {
                        break;
                    };
                    for b in &r.blocks {
                        for (addr, len) in layout.segments(*b).expect("segments") {
                            // SAFETY: the exporter released the request: no read of it is in
                            // progress and none will start; the arena is alive (joined below).
                            unsafe { std::ptr::write_bytes(addr as *mut u8, REUSED, len) };
                        }
                    }
                    say(format!("released {} {:?}", r.request.0, r.reason));
                    let mark = marks.lock().unwrap().remove(&r.request.0);
                    let since = |at: Option<Instant>| {
                        at.map_or("-".to_string(), |at| {
                            polled.duration_since(at).as_micros().to_string()
                        })
                    };
                    let (ready, abort) = mark.unwrap_or_default();
                    say(format!(
                        "release-timing {} ready_us={} abort_us={}",
                        r.request.0,
                        since(ready),
                        since(abort)
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| w.get(i).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        let reply = match w.first().copied() {
            // export <req> <first block> <count> <ttl ms> <readers>
            Some("export") => {
                let req = RequestId(num(1));
                let lease = LeaseConfig {
                    expected_readers: num(5) as u32,
                    ..LeaseConfig::with_ttl_ms(num(4))
                };
                let blocks: Vec<_> = (0..num(3) as u32)
                    .map(|i| (key(req.0, i), EngineBlockId(num(2) as u32 + i)))
                    .collect();
                match exporter.export(req, &blocks, &lease) {
                    Ok(()) => {
                        let d = server.descriptor(&exporter, req).expect("descriptor");
                        format!("desc {}", d.to_json())
                    }
                    Err(e) => format!("error {e}"),
                }
            }
            Some("ready") => match (Instant::now(), exporter.ready(RequestId(num(1)))) {
                (at, Ok(())) => {
                    marks.lock().unwrap().entry(num(1)).or_default().0 = Some(at);
                    "ok".into()
                }
                (_, Err(e)) => format!("error {e}"),
            },
            Some("abort") => match (Instant::now(), exporter.abort(RequestId(num(1)))) {
                (at, Ok(())) => {
                    marks.lock().unwrap().entry(num(1)).or_default().1 = Some(at);
                    "ok".into()
                }
                (_, Err(e)) => format!("error {e}"),
            },
            Some("status") => {
                let s = exporter.stats();
                let state = exporter.lease_state(RequestId(num(1)));
                let state = match state {
                    None => "gone".to_string(),
                    Some(kvx_policy::LeaseState::Pending) => "pending".into(),
                    Some(kvx_policy::LeaseState::Active { .. }) => "active".into(),
                    Some(kvx_policy::LeaseState::Released(r)) => format!("ended-{r:?}"),
                };
                format!(
                    "status {state} exported={} active={} draining={} pins={} read={} expired={} aborted={}",
                    s.exported,
                    s.active,
                    s.draining,
                    s.pins,
                    s.released_read,
                    s.released_expired,
                    s.released_aborted
                )
            }
            Some("quit") => break,
            _ => format!("error unknown command {line:?}"),
        };
        say(reply);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = poller.join();
    drop(server);
    drop(arena);
    0
}

/// The consumer role: load every block of `KVX_DESC` with a `KVX_DEADLINE_MS` deadline and
/// print one report line.
pub fn consumer() -> i32 {
    let Ok(desc) = RemoteDescriptor::from_json(&std::env::var("KVX_DESC").unwrap_or_default())
    else {
        println!("error bad KVX_DESC");
        return 2;
    };
    let deadline_ms: u64 = env("KVX_DEADLINE_MS", 2000);
    let mut c = Consumer::new(
        0,
        desc.block_bytes as usize,
        desc.blocks.len() as u32,
        None,
        true,
    );
    c.handle.register(desc.clone()).expect("register");
    println!("started");
    let t0 = Instant::now();
    let report = c.load(&desc.blocks, t0 + Duration::from_millis(deadline_ms));
    let ok = report.blocks.iter().filter(|b| b.result.is_ok()).count();
    let err = report
        .blocks
        .iter()
        .find_map(|b| b.result.as_ref().err().map(|e| e.to_string()))
        .unwrap_or_default();
    println!(
        "report state={:?} ok={ok} failed={} elapsed_ms={} err={err}",
        report.state,
        report.blocks.len() - ok,
        t0.elapsed().as_millis()
    );
    0
}

/// A consumer in this process: engine memory, a staging pool, a driver with `[rdma, host]`.
pub struct Consumer {
    // Fields drop in this order: the driver (and its backends) before the arena they copy into.
    pub driver: Driver,
    pub handle: ImporterHandle,
    route: Vec<BackendId>,
    pub pool: BufferPool,
    pub arena: CpuArena,
}

impl Consumer {
    pub fn new(
        reader: u32,
        block_bytes: usize,
        blocks: u32,
        token: Option<String>,
        heartbeats: bool,
    ) -> Consumer {
        let arena = CpuArena::contiguous(block_bytes, blocks).expect("arena");
        let importer = Importer::new(ImporterConfig {
            reader,
            token,
            heartbeats,
            ..ImporterConfig::default()
        })
        .expect("importer");
        let handle = importer.handle();
        let mut b = DriverBuilder::new(DriverConfig::default());
        let rdma = b.backend(Box::new(importer));
        // SAFETY: the arena is a field of the consumer declared after the driver, so it is
        // dropped after the driver has stopped its backends; the test reads it only after tasks
        // ended.
        let host = b.backend(Box::new(unsafe {
            CpuBackend::new(arena.layout().clone(), CpuBackendConfig::default()).expect("host")
        }));
        let driver = b.spawn().expect("driver");
        let pool = BufferPool::new(blocks as usize, block_bytes, DEFAULT_ALIGN).expect("pool");
        Consumer {
            driver,
            handle,
            route: vec![rdma, host],
            pool,
            arena,
        }
    }

    /// Load `keys` into engine blocks 0.. of the consumer's arena.
    pub fn load(&mut self, keys: &[BlockKey], deadline: Instant) -> TaskReport {
        let blocks = keys
            .iter()
            .enumerate()
            .map(|(i, k)| OpBlock {
                key: *k,
                engine: Some(EngineBlockId(i as u32)),
                buf: Buf::Owned(self.pool.take().expect("a free staging buffer")),
            })
            .collect();
        let task = self
            .driver
            .submit(TaskSpec {
                request: RequestId(1000),
                dir: Direction::Load,
                route: self.route.clone(),
                blocks,
                deadline,
                deferred: false,
            })
            .expect("submit");
        self.driver
            .wait_report(task, deadline + Duration::from_secs(5))
            .expect("the task must end within its deadline (+5 s slack)")
    }
}

/// A child process of this test binary with a line protocol on stdin/stdout.
pub struct Peer {
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    backlog: Vec<String>,
    pub stderr: std::path::PathBuf,
}

impl Peer {
    /// Start `role`, optionally under a prefix command (e.g. `ip netns exec NAME`).
    pub fn spawn(role: &str, envs: &[(&str, String)], prefix: &[String]) -> Peer {
        let exe = std::env::current_exe().expect("current exe");
        let mut cmd = match prefix.split_first() {
            Some((p, rest)) => {
                let mut c = Command::new(p);
                c.args(rest).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        let stderr = std::env::temp_dir().join(format!(
            "kvx-rdma-{role}-{}-{}.log",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        cmd.env("KVX_RDMA_ROLE", role)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"));
        let mut child = cmd.spawn().expect("spawn peer");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        Peer {
            child,
            stdin,
            lines,
            backlog: Vec::new(),
            stderr,
        }
    }

    /// A producer on loopback with extra settings.
    pub fn producer(envs: &[(&str, String)]) -> Peer {
        let mut p = Peer::spawn("producer", envs, &[]);
        p.wait_for("listening", Duration::from_secs(10));
        p
    }

    /// Send a command line.
    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}").expect("write to peer");
        stdin.flush().expect("flush to peer");
    }

    /// The next line starting with `prefix` (other lines are kept for later), or panic.
    pub fn wait_for(&mut self, prefix: &str, timeout: Duration) -> String {
        self.try_wait_for(prefix, timeout).unwrap_or_else(|| {
            panic!(
                "no line starting with {prefix:?} within {timeout:?}; backlog {:?}",
                self.backlog
            )
        })
    }

    /// Like `wait_for`, `None` on timeout.
    pub fn try_wait_for(&mut self, prefix: &str, timeout: Duration) -> Option<String> {
        if let Some(i) = self.backlog.iter().position(|l| l.starts_with(prefix)) {
            return Some(self.backlog.remove(i));
        }
        let until = Instant::now() + timeout;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return Some(l),
                Ok(l) => self.backlog.push(l),
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                    return None;
                }
            }
        }
    }

    /// Send a command and return its one-line answer (`desc`, `ok`, `status` or `error`).
    pub fn ask(&mut self, line: &str) -> String {
        self.send(line);
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let l = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no answer to {line:?}"));
            if ["desc ", "ok", "status ", "error "]
                .iter()
                .any(|p| l.starts_with(p))
            {
                return l;
            }
            self.backlog.push(l);
        }
    }

    /// Export blocks `first..first+count` as `req` and return its descriptor.
    pub fn export(
        &mut self,
        req: u64,
        first: u32,
        count: u32,
        ttl_ms: u64,
        readers: u32,
    ) -> RemoteDescriptor {
        let l = self.ask(&format!("export {req} {first} {count} {ttl_ms} {readers}"));
        let json = l
            .strip_prefix("desc ")
            .unwrap_or_else(|| panic!("export failed: {l}"));
        RemoteDescriptor::from_json(json).expect("descriptor")
    }

    /// `ready <req>`, asserting it worked.
    pub fn ready(&mut self, req: u64) {
        assert_eq!(self.ask(&format!("ready {req}")), "ok");
    }

    /// How long after `ready` and after `abort` (microseconds, in the producer's own clock)
    /// the producer's engine loop polled the release of `req`.
    pub fn release_timing(&mut self, req: u64) -> (Option<Duration>, Option<Duration>) {
        let line = self.wait_for(&format!("release-timing {req} "), Duration::from_secs(5));
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .and_then(|v| v.parse::<u64>().ok())
                .map(Duration::from_micros)
        };
        (field("ready_us="), field("abort_us="))
    }

    /// `status <req>`.
    pub fn status(&mut self, req: u64) -> String {
        self.ask(&format!("status {req}"))
    }

    /// The producer's stderr so far.
    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Send a signal to the process.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        let rc = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(rc, 0, "kill({sig}) failed");
    }
}

static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Drop for Peer {
    fn drop(&mut self) {
        self.stdin.take();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.stderr);
    }
}
