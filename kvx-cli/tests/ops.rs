//! `kvx verify` and `kvx gc` through the built binary on real block stores: blocks written by a
//! real `PosixStore`, then damaged by hand; two gc processes at once; a frozen FUSE mount
//! (kvx-fusefs StallFs), where the run must end with a clear error within its deadline. A test
//! that cannot run here prints one `skip:` line and is counted as ignored.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime};

use kvx_core::{
    BlockKey, Buf, BufferPool, DEFAULT_ALIGN, Direction, DriverBuilder, DriverConfig, OpBlock,
    RequestId, TaskSpec,
};
use kvx_posix::format::HEADER_LEN;
use kvx_posix::{PosixConfig, PosixStore};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::Value;

const BLOCK: usize = 8192;

fn kvx(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvx"))
        .args(args)
        .output()
        .expect("run kvx")
}

fn check(cond: bool, what: &str) -> Result<(), Failed> {
    if cond { Ok(()) } else { Err(what.into()) }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn last_json(out: &Output) -> Result<Value, Failed> {
    let s = text(&out.stdout);
    let line = s.lines().last().ok_or("no output")?;
    serde_json::from_str(line).map_err(|e| format!("last line is not JSON ({e}): {line}").into())
}

fn num(j: &Value, k: &str) -> Result<u64, Failed> {
    j[k].as_u64()
        .ok_or_else(|| format!("JSON lacks {k}: {j}").into())
}

/// Store `n` blocks (block `i` filled with byte `i`) through a real `PosixStore` at `root`;
/// returns their keys and paths.
fn store_blocks(root: &Path, n: usize) -> Result<Vec<(BlockKey, PathBuf)>, Failed> {
    let store = PosixStore::open(PosixConfig::new(root)).map_err(|e| e.to_string())?;
    let pool = BufferPool::new(n, BLOCK, DEFAULT_ALIGN).map_err(|e| e.to_string())?;
    let mut b = DriverBuilder::new(DriverConfig::default());
    let posix = b.backend(Box::new(store));
    let driver = b.spawn().map_err(|e| e.to_string())?;
    let soon = Instant::now() + Duration::from_secs(10);
    let mut blocks = Vec::new();
    let mut keys = Vec::new();
    for i in 0..n {
        let key = BlockKey::chain(None, format!("block {i}").as_bytes());
        let mut buf = pool.take().ok_or("pool empty")?;
        buf.as_mut_slice().fill(i as u8);
        blocks.push(OpBlock {
            key,
            engine: None,
            buf: Buf::Owned(buf),
        });
        keys.push(key);
    }
    let t = driver
        .submit(TaskSpec {
            request: RequestId(1),
            dir: Direction::Store,
            route: vec![posix],
            blocks,
            deadline: soon,
            deferred: false,
        })
        .map_err(|e| e.to_string())?;
    let report = driver
        .wait_report(t, soon)
        .ok_or("the store did not report in time")?;
    check(report.is_ok(), "the store succeeded")?;
    Ok(keys
        .into_iter()
        .map(|k| {
            let hex = k.to_hex();
            let path = root.join(&hex[0..2]).join(format!("{hex}.kvb"));
            (k, path)
        })
        .collect())
}

fn set_age(path: &Path, age: Duration) -> Result<(), Failed> {
    let f = std::fs::File::options().write(true).open(path)?;
    f.set_modified(SystemTime::now() - age)?;
    Ok(())
}

/// Damage four files the four ways acceptance 3 names, add a newer-format block; returns the
/// damaged paths (flipped, truncated, foreign, stale temporary) and the newer one.
fn damage(blocks: &[(BlockKey, PathBuf)]) -> Result<([PathBuf; 4], PathBuf), Failed> {
    let flipped = blocks[0].1.clone();
    let mut b = std::fs::read(&flipped)?;
    b[HEADER_LEN + 100] ^= 0x01;
    std::fs::write(&flipped, b)?;
    let truncated = blocks[1].1.clone();
    std::fs::File::options()
        .write(true)
        .open(&truncated)?
        .set_len((HEADER_LEN + BLOCK / 2) as u64)?;
    let foreign = blocks[2].1.clone();
    std::fs::write(&foreign, vec![b'#'; HEADER_LEN + BLOCK])?;
    let stale = blocks[3]
        .1
        .with_file_name(format!("{}.deadhost-4242-7.kvb.tmp", blocks[3].0.to_hex()));
    std::fs::write(&stale, vec![0u8; HEADER_LEN])?;
    set_age(&stale, Duration::from_secs(3600))?;
    let newer = blocks[4].1.clone();
    let mut b = std::fs::read(&newer)?;
    b[8] = 2;
    std::fs::write(&newer, b)?;
    Ok(([flipped, truncated, foreign, stale], newer))
}

/// verify names a flipped payload byte, a truncated file, a foreign file and a stale temporary
/// file and exits 1; a newer-format block is a note, left alone; `--repair` removes the four
/// and a second run exits 0.
fn verify_finds_and_repairs() -> Result<(), Failed> {
    let d = tempfile::tempdir()?;
    let blocks = store_blocks(d.path(), 8)?;
    let (bad, newer) = damage(&blocks)?;
    let dir = d.path().to_str().ok_or("path")?;

    let out = kvx(&["verify", dir, "--json"]);
    let stdout = text(&out.stdout);
    check(
        out.status.code() == Some(1),
        &format!(
            "exit {:?}: {stdout}{}",
            out.status.code(),
            text(&out.stderr)
        ),
    )?;
    let words = [
        "checksum mismatch",
        "truncated",
        "foreign file",
        "stale temporary file",
    ];
    for (path, word) in bad.iter().zip(words) {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&path.display().to_string()))
            .ok_or_else(|| format!("{} not named: {stdout}", path.display()))?;
        check(
            line.contains(word),
            &format!("{line:?} should say {word:?}"),
        )?;
    }
    let line = stdout
        .lines()
        .find(|l| l.starts_with(&newer.display().to_string()))
        .ok_or("the newer-format block is reported")?;
    check(
        line.contains("format version 2") && line.contains("left alone"),
        line,
    )?;
    let j = last_json(&out)?;
    check(num(&j, "problems")? == 4, &format!("4 problems: {j}"))?;
    check(num(&j, "blocks_ok")? == 4, &format!("4 good blocks: {j}"))?;
    let kinds: Vec<&str> = j["findings"]
        .as_array()
        .ok_or("findings")?
        .iter()
        .filter_map(|f| f["kind"].as_str())
        .collect();
    for k in [
        "checksum_mismatch",
        "truncated",
        "foreign",
        "stale_temp",
        "newer_format",
    ] {
        check(kinds.contains(&k), &format!("{k} in {kinds:?}"))?;
    }
    check(
        bad.iter().all(|p| p.exists()),
        "without --repair nothing goes",
    )?;

    let out = kvx(&["verify", dir, "--repair", "--json"]);
    check(
        out.status.code() == Some(1),
        "the repair run found problems",
    )?;
    let j = last_json(&out)?;
    check(
        num(&j, "removed")? == 4 && num(&j, "unresolved")? == 0,
        &format!("{j}"),
    )?;
    check(bad.iter().all(|p| !p.exists()), "--repair removed the four")?;
    check(newer.exists(), "the newer-format block is left alone")?;

    let out = kvx(&["verify", dir, "--json"]);
    check(
        out.status.code() == Some(0),
        &format!("second run exits 0: {}", text(&out.stdout)),
    )?;
    let j = last_json(&out)?;
    check(
        num(&j, "problems")? == 0 && num(&j, "blocks_ok")? == 4,
        &format!("{j}"),
    )
}

/// Blocks aged 1..=n minutes, block 0 the newest.
fn aged_store(root: &Path, n: usize) -> Result<Vec<PathBuf>, Failed> {
    let blocks = store_blocks(root, n)?;
    let mut paths = Vec::new();
    for (i, (_, p)) in blocks.into_iter().enumerate() {
        set_age(&p, Duration::from_secs(60 * (i as u64 + 1)))?;
        paths.push(p);
    }
    Ok(paths)
}

const FILE: u64 = (HEADER_LEN + BLOCK) as u64;

/// gc removes the oldest blocks first until the block bytes are under the quota.
fn gc_oldest_first() -> Result<(), Failed> {
    let d = tempfile::tempdir()?;
    let paths = aged_store(d.path(), 12)?;
    let stale = paths[0].with_file_name("x.host-1-1.kvb.tmp");
    std::fs::write(&stale, b"leftover")?;
    set_age(&stale, Duration::from_secs(7200))?;
    let dir = d.path().to_str().ok_or("path")?;
    let quota = (5 * FILE + 100).to_string();

    let out = kvx(&["gc", dir, "--max-bytes", &quota, "--dry-run", "--json"]);
    check(out.status.success(), &text(&out.stderr))?;
    check(
        num(&last_json(&out)?, "removed_blocks")? == 7,
        "dry run plans 7",
    )?;
    check(
        paths.iter().all(|p| p.exists()),
        "a dry run removes nothing",
    )?;

    let out = kvx(&["gc", dir, "--max-bytes", &quota, "--json"]);
    check(
        out.status.success(),
        &format!("{}{}", text(&out.stdout), text(&out.stderr)),
    )?;
    let j = last_json(&out)?;
    check(
        num(&j, "bytes_before")? == 12 * FILE && num(&j, "bytes_after")? == 5 * FILE,
        &format!("{j}"),
    )?;
    let removed: Vec<String> = j["removed"]
        .as_array()
        .ok_or("removed")?
        .iter()
        .filter_map(|r| r["path"].as_str().map(String::from))
        .collect();
    let oldest: Vec<String> = paths[5..]
        .iter()
        .rev()
        .map(|p| p.display().to_string())
        .collect();
    check(removed == oldest, &format!("oldest first: {removed:?}"))?;
    check(
        j["temps_removed"].as_array().map(Vec::len) == Some(1) && !stale.exists(),
        "the stale temporary file is gone",
    )?;
    for (i, p) in paths.iter().enumerate() {
        check(p.exists() == (i < 5), &format!("block {i}"))?;
    }
    Ok(())
}

/// Two gc processes at once on one store: both succeed and the newest blocks that fit stay.
fn gc_concurrent() -> Result<(), Failed> {
    let d = tempfile::tempdir()?;
    let paths = aged_store(d.path(), 64)?;
    let dir = d.path().to_str().ok_or("path")?;
    let quota = (20 * FILE).to_string();
    let runs: Vec<_> = (0..2)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_kvx"))
                .args(["gc", dir, "--max-bytes", &quota, "--json"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    for r in runs {
        let out = r.wait_with_output()?;
        check(
            out.status.success(),
            &format!("{}{}", text(&out.stdout), text(&out.stderr)),
        )?;
        let j = last_json(&out)?;
        check(num(&j, "bytes_after")? <= 20 * FILE, &format!("{j}"))?;
        check(
            j["failed"].as_array().is_some_and(Vec::is_empty),
            "no failures",
        )?;
    }
    for (i, p) in paths.iter().enumerate() {
        check(
            p.exists() == (i < 20),
            &format!("block {i}: the 20 newest stay"),
        )?;
    }
    Ok(())
}

/// `kvx <cmd>` on a frozen FUSE mount prints a clear error and exits 3, while the mount is
/// still frozen, within its deadline plus one tick plus 50 ms of the moment its first file
/// operation got stuck in the mount.
fn frozen(cmd: &[&str]) -> Result<(), Failed> {
    let d = tempfile::tempdir()?;
    let mount = kvx_fusefs::StallFs::mount(d.path(), kvx_fusefs::Backing::Memory)
        .map_err(|e| e.to_string())?;
    let leaf = mount.path().join("ab");
    std::fs::create_dir_all(&leaf)?;
    std::fs::write(
        leaf.join("abcd0000000000000000000000000001.kvb"),
        vec![0u8; 5000],
    )?;
    let deadline_ms = 300;
    mount.freeze();
    let t0 = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvx"))
        .args(cmd)
        .arg(mount.path())
        .args(["--deadline-ms", &deadline_ms.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // The first stderr line, read on a thread (the worker process stuck on the mount keeps
    // stderr open).
    let err = child.stderr.take().ok_or("stderr")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let got = BufReader::new(err).read_line(&mut line).map(|_| line);
        let _ = tx.send(got);
    });
    let give_up = Duration::from_millis(deadline_ms + 5000);
    let stuck = mount.wait_blocked(1, give_up);
    let t1 = Instant::now();
    let exited = loop {
        if let Some(status) = child.try_wait()? {
            break Some((status, t1.elapsed()));
        }
        if t0.elapsed() > give_up {
            break None;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let line = rx.recv_timeout(Duration::from_secs(1));
    mount.thaw();
    let Some((status, took)) = exited else {
        let _ = child.kill();
        let _ = child.wait();
        return Err("kvx did not exit within the deadline + 5 s while the mount was frozen".into());
    };
    let line = line.map_err(|_| "no error line")??;
    check(stuck, "an operation got stuck in the frozen mount")?;
    check(
        line.contains(&format!(
            "did not answer within {deadline_ms} ms: the mount may be frozen"
        )),
        &format!("clear error: {line:?}"),
    )?;
    check(
        took <= Duration::from_millis(deadline_ms + 1 + 50),
        &format!("kvx exited {took:?} after its operation got stuck, deadline {deadline_ms} ms"),
    )?;
    check(status.code() == Some(3), &format!("exit {status}"))?;
    println!(
        "{}: exit 3 {took:?} after its operation got stuck (deadline {deadline_ms} ms): {}",
        cmd[0],
        line.trim()
    );
    if cmd.contains(&"--json") {
        let mut out = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().ok_or("stdout")?, &mut out)?;
        let j: Value = serde_json::from_str(out.lines().last().ok_or("no JSON")?)?;
        check(
            j["frozen"] == Value::Bool(true) && num(&j, "exit_code")? == 3,
            &format!("JSON says frozen: {j}"),
        )?;
    }
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    let fuse = kvx_fusefs::fuse_available();
    if let Err(why) = &fuse {
        println!("skip: frozen mount tests ({why})");
    }
    let trials = vec![
        Trial::test("verify_finds_and_repairs", verify_finds_and_repairs),
        Trial::test("gc_oldest_first", gc_oldest_first),
        Trial::test("gc_concurrent", gc_concurrent),
        Trial::test("verify_frozen_mount", || frozen(&["verify", "--json"]))
            .with_ignored_flag(fuse.is_err()),
        Trial::test("gc_frozen_mount", || frozen(&["gc", "--max-bytes", "1M"]))
            .with_ignored_flag(fuse.is_err()),
    ];
    libtest_mimic::run(&args, trials).exit();
}
