//! A child process storing blocks in a loop is killed with SIGKILL; reopening the store finds
//! only complete, verified blocks and no temporary file.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_posix::{IoEngine, PosixConfig, PosixStore};

use crate::rig::*;

/// Environment variable that turns the test binary into the storing child.
pub const CHILD_ENV: &str = "KVX_POSIX_TORN_CHILD";

/// Blocks per task in the child, and tasks in flight at once.
const PER_TASK: u64 = 4;
const IN_FLIGHT: u64 = 4;
const CHILD_BLOCK: usize = 1 << 20;

/// The child: store blocks forever, printing how many are known to be stored.
pub fn child(spec: &str) {
    let mut parts = spec.splitn(3, ':');
    let (Some(engine), Some(first), Some(dir)) = (parts.next(), parts.next(), parts.next()) else {
        eprintln!("bad {CHILD_ENV}: {spec}");
        std::process::exit(2);
    };
    let first: u64 = first.parse().expect("first key number");
    let mut cfg = PosixConfig::new(dir);
    cfg.io_engine = engine.parse().expect("engine name");
    // fdatasync before each rename keeps stores in flight long enough for the kill to land.
    cfg.fdatasync = true;
    let store = PosixStore::open(cfg).expect("open store");
    let mut b = DriverBuilder::new(DriverConfig::default());
    let posix = b.backend(Box::new(store));
    let driver = b.spawn().expect("driver");
    let pool =
        BufferPool::new((PER_TASK * IN_FLIGHT) as usize, CHILD_BLOCK, DEFAULT_ALIGN).expect("pool");
    let mut next = first;
    let mut stored = 0u64;
    let mut out = std::io::stdout();
    loop {
        let tasks: Vec<TaskId> = (0..IN_FLIGHT)
            .map(|_| {
                let blocks = (0..PER_TASK)
                    .map(|_| {
                        let k = key(next);
                        next += 1;
                        let mut buf = pool.take().expect("buffer");
                        buf.set_len(CHILD_BLOCK);
                        buf.as_mut_slice().copy_from_slice(&payload(k));
                        OpBlock {
                            key: k,
                            engine: None,
                            buf: Buf::Owned(buf),
                        }
                    })
                    .collect();
                driver
                    .submit(TaskSpec {
                        request: RequestId(1),
                        dir: Direction::Store,
                        route: vec![posix],
                        blocks,
                        deadline: Instant::now() + Duration::from_secs(30),
                        deferred: false,
                    })
                    .expect("submit")
            })
            .collect();
        for t in tasks {
            let rep = driver
                .wait_report(t, Instant::now() + Duration::from_secs(60))
                .expect("report");
            assert!(rep.is_ok(), "child store failed: {:?}", first_error(&rep));
            stored += PER_TASK;
        }
        let _ = writeln!(out, "stored {stored}");
        let _ = out.flush();
    }
}

/// What the child stores under `k` (cheap to make: the key repeated).
fn payload(k: BlockKey) -> Vec<u8> {
    k.to_be_bytes().repeat(CHILD_BLOCK / 16)
}

fn temp_files(dir: &Path) -> usize {
    files_with_suffix(dir, ".kvb.tmp").len()
}

/// Start a child storing keys from `first` on, wait until it reports `at_least` blocks stored,
/// then kill it with SIGKILL while its next batch is being written. Returns what it reported.
fn kill_child_mid_write(
    engine: IoEngine,
    root: &Path,
    first: u64,
    at_least: u64,
    fraction: f64,
) -> u64 {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(CHILD_ENV, format!("{engine}:{first}:{}", root.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut stored = 0u64;
    let mut seen = Vec::new();
    let end = Instant::now() + Duration::from_secs(60);
    while (stored < at_least || seen.len() < 2) && Instant::now() < end {
        let Some(Ok(line)) = lines.next() else {
            break;
        };
        if let Some(n) = line.strip_prefix("stored ") {
            stored = n.parse().unwrap();
            seen.push(Instant::now());
        }
    }
    // A batch (fill the buffers, then write them) takes about as long as the last one did:
    // kill the child `fraction` of the way into the next, where its writes are in flight.
    let period = match seen.as_slice() {
        [.., a, b] => *b - *a,
        _ => Duration::from_millis(10),
    };
    std::thread::sleep(period.mul_f64(fraction));
    // SAFETY: sending a signal to our own child process by its pid.
    let rc = unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    assert_eq!(rc, 0);
    let status = child.wait().unwrap();
    assert!(!status.success());
    assert!(stored >= at_least, "the child stored only {stored} blocks");
    stored
}

/// Reopen the store at `root`: no temporary file may remain, and every block it finds must
/// load, verify and hold the payload the child wrote. Returns the blocks found.
fn reopen_and_verify(engine: IoEngine, root: &Path, temps_before: usize) -> usize {
    let r = {
        let mut cfg = PosixConfig::new(root);
        cfg.io_engine = engine;
        PosixStore::open(cfg).unwrap()
    };
    let caps = r.capabilities().clone();
    assert_eq!(
        caps.removed_temps, temps_before,
        "the scan removes the dead child's temps"
    );
    assert_eq!(temp_files(root), 0, "no temporary file is left");
    let files = r.handle();
    let keys = files.keys();
    let pool = BufferPool::new(16, CHILD_BLOCK, DEFAULT_ALIGN).unwrap();
    let mut b = DriverBuilder::new(DriverConfig::default());
    let posix = b.backend(Box::new(r));
    let driver = b.spawn().unwrap();
    for chunk in keys.chunks(16) {
        let blocks = chunk
            .iter()
            .map(|&k| OpBlock {
                key: k,
                engine: None,
                buf: Buf::Owned(pool.take().unwrap()),
            })
            .collect();
        let t = driver
            .submit(TaskSpec {
                request: RequestId(1),
                dir: Direction::Load,
                route: vec![posix],
                blocks,
                deadline: Instant::now() + SOON,
                deferred: false,
            })
            .unwrap();
        let rep = driver.wait_report(t, Instant::now() + SOON).unwrap();
        assert!(rep.is_ok(), "{:?}", first_error(&rep));
        for (b, k) in rep.blocks.iter().zip(chunk) {
            assert!(
                b.buf.as_ref().unwrap().as_slice() == &payload(*k)[..],
                "block {k} holds another payload"
            );
        }
    }
    keys.len()
}

pub fn torn_write(engine: IoEngine) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let root = dir.path().join("kv");
    // Kill children until one dies with temporary files on disk (a torn store), up to 10 tries;
    // every try must reopen clean.
    let mut total = 0u64;
    let mut torn = 0;
    let fractions = [0.85, 0.7, 0.95, 0.6, 0.9, 0.5, 0.8, 0.4, 0.75, 0.3];
    for (attempt, fraction) in fractions.into_iter().enumerate() {
        let first = attempt as u64 * 1_000_000;
        total += kill_child_mid_write(engine, &root, first, 16, fraction);
        let temps_before = temp_files(&root);
        let found = reopen_and_verify(engine, &root, temps_before);
        assert!(
            found as u64 >= total,
            "{found} blocks found, {total} reported stored"
        );
        println!(
            "torn_write {engine}: try {attempt}: {found} blocks verified, {temps_before} temps removed"
        );
        if temps_before > 0 {
            torn += 1;
            break;
        }
    }
    assert!(
        torn > 0,
        "no kill landed inside a store: the test did not exercise a torn write"
    );
}
