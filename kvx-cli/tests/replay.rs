//! `kvx replay` through the built binary: bad input gives one clear line and exit code 2; a
//! short replay prints the summary and a JSON line whose counters add up; the Mooncake trace
//! (when `../shared/traces` is present) and a FUSE disk stall (when FUSE is usable) run too.
//! A test that cannot run here prints one `skip:` line and is counted as ignored.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::Value;

fn kvx(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvx"))
        .arg("replay")
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

/// The run failed with exit code 2 and one stderr line containing every one of `needles`.
fn bad_input(args: &[&str], needles: &[&str]) -> Result<(), Failed> {
    let out = kvx(args);
    let err = text(&out.stderr);
    check(
        out.status.code() == Some(2),
        &format!("exit code {:?}, stderr {err:?}", out.status.code()),
    )?;
    check(
        err.trim_end().lines().count() == 1,
        &format!("one line: {err:?}"),
    )?;
    for n in needles {
        check(err.contains(n), &format!("{err:?} should mention {n:?}"))?;
    }
    check(out.stdout.is_empty(), "nothing on stdout")
}

fn write_trace(dir: &Path, lines: &[&str]) -> PathBuf {
    let p = dir.join("trace.jsonl");
    std::fs::write(&p, lines.join("\n")).expect("write trace");
    p
}

const GOOD: &str =
    r#"{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}"#;

fn missing_file() -> Result<(), Failed> {
    bad_input(
        &["/nonexistent/kvx/trace.jsonl"],
        &["cannot read trace", "/nonexistent/kvx/trace.jsonl"],
    )
}

fn empty_file() -> Result<(), Failed> {
    let d = tempfile::tempdir()?;
    let p = write_trace(d.path(), &[]);
    bad_input(&[p.to_str().unwrap_or_default()], &["has no requests"])
}

fn negative_length() -> Result<(), Failed> {
    let d = tempfile::tempdir()?;
    let p = write_trace(
        d.path(),
        &[
            GOOD,
            r#"{"timestamp": 5, "input_length": -1024, "output_length": 5, "hash_ids": [1, 2]}"#,
        ],
    );
    bad_input(
        &[p.to_str().unwrap_or_default()],
        &["trace.jsonl:2:", "input_length", "negative"],
    )
}

fn hash_ids_not_a_list() -> Result<(), Failed> {
    let d = tempfile::tempdir()?;
    let p = write_trace(
        d.path(),
        &[
            r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": 17}"#,
            GOOD,
        ],
    );
    bad_input(
        &[p.to_str().unwrap_or_default()],
        &["trace.jsonl:1:", "hash_ids", "must be a list"],
    )
}

fn malformed_line_number_and_skip() -> Result<(), Failed> {
    let d = tempfile::tempdir()?;
    let p = write_trace(d.path(), &[GOOD, GOOD, "{not json", GOOD]);
    let path = p.to_str().unwrap_or_default();
    bad_input(&[path], &["trace.jsonl:3:", "not valid JSON"])?;
    let out = kvx(&[path, "--skip-bad-lines", "--block-bytes", "4K", "--json"]);
    check(
        out.status.success(),
        &format!("skip-bad-lines runs: {}", text(&out.stderr)),
    )?;
    check(
        text(&out.stderr).contains("skipped 1 malformed lines (first: line 3"),
        "says what it skipped",
    )?;
    let j = last_json(&out)?;
    check(j["requests"] == 3, "the three good lines ran")
}

fn last_json(out: &Output) -> Result<Value, Failed> {
    let stdout = text(&out.stdout);
    let last = stdout.lines().last().ok_or("no output")?;
    Ok(serde_json::from_str(last).map_err(|e| format!("last line is not JSON: {e}: {last}"))?)
}

fn num(j: &Value, k: &str) -> Result<f64, Failed> {
    Ok(j.get(k)
        .and_then(Value::as_f64)
        .ok_or_else(|| format!("JSON lacks {k}"))?)
}

/// The counters of a JSON result add up.
fn adds_up(j: &Value, requests: f64) -> Result<(), Failed> {
    check(num(j, "requests")? == requests, "request count")?;
    let blocks = num(j, "blocks")?;
    let hits = num(j, "hit_rate")? * blocks;
    let sum = hits.round()
        + num(j, "missed_blocks")?
        + num(j, "recomputed_blocks")?
        + num(j, "failed_request_blocks")?;
    check(
        sum == blocks,
        &format!("hits + missed + recomputed + failed = {sum}, blocks {blocks}"),
    )?;
    check(
        num(j, "verified_bytes")? == num(j, "verified_blocks")? * num(j, "block_bytes")?,
        "verified bytes",
    )?;
    check(
        num(j, "verified_blocks")? >= hits.round(),
        "every used block verified",
    )?;
    check(
        num(j, "bytes_loaded_moved")? == hits.round() * num(j, "block_bytes")?,
        "loaded bytes",
    )?;
    for k in [
        "ideal_hit_rate",
        "load_p99_ms",
        "deadline_misses",
        "failed_requests",
        "load_failed_blocks_after_recovery",
    ] {
        num(j, k)?;
    }
    let loads = by_reason(j, "load_failures_by_reason")?;
    let stores = by_reason(j, "store_failures_by_reason")?;
    check(
        loads["timed_out"] == num(j, "deadline_missed_blocks")?,
        "timed-out load blocks",
    )?;
    check(
        loads["corrupt"] + loads["not_found"] == num(j, "load_corrupt_blocks")?,
        "corrupt or gone load blocks",
    )?;
    check(
        stores["timed_out"] >= num(j, "store_timeouts")?,
        "timed-out store blocks",
    )?;
    let total: f64 = stores.values().sum();
    check(
        total >= num(j, "store_failed_file_blocks")?,
        "every failed file store has a reason",
    )?;
    Ok(())
}

const REASONS: [&str; 8] = [
    "timed_out",
    "breaker_open",
    "busy",
    "no_room",
    "pool_exhausted",
    "corrupt",
    "not_found",
    "other",
];

/// A `{reason: blocks}` object of the JSON result, with every reason present.
fn by_reason(j: &Value, k: &str) -> Result<std::collections::HashMap<&'static str, f64>, Failed> {
    let o = j.get(k).ok_or_else(|| format!("JSON lacks {k}"))?;
    REASONS
        .iter()
        .map(|r| {
            let n = o
                .get(*r)
                .and_then(Value::as_f64)
                .ok_or_else(|| format!("{k} lacks {r}"))?;
            Ok((*r, n))
        })
        .collect()
}

fn short_replay_summary_and_json() -> Result<(), Failed> {
    let out = kvx(&[
        "--limit",
        "300",
        "--speedup",
        "20",
        "--host-blocks",
        "96",
        "--block-bytes",
        "4K",
        "--json",
    ]);
    check(
        out.status.success(),
        &format!("exit {:?}: {}", out.status.code(), text(&out.stderr)),
    )?;
    let stdout = text(&out.stdout);
    for row in [
        "block hit rate",
        "ideal LRU hit rate",
        "load latency p50 / p99",
        "deadline misses",
        "blocks recomputed",
        "requests failed",
        "TTFT with cache",
        "load throughput",
    ] {
        check(stdout.contains(row), &format!("summary has {row:?}"))?;
    }
    let j = last_json(&out)?;
    adds_up(&j, 300.0)?;
    check(num(&j, "file_hit_rate")? > 0.0, "the file tier served hits")?;
    check(num(&j, "host_hit_rate")? > 0.0, "the host tier served hits")?;
    check(
        !text(&out.stderr).contains('\u{1b}'),
        "no progress bar when stderr is not a terminal",
    )
}

fn mooncake_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces/synthetic_trace.jsonl")
}

fn mooncake_trace() -> Result<(), Failed> {
    let p = mooncake_path();
    let out = kvx(&[
        p.to_str().unwrap_or_default(),
        "--limit",
        "150",
        "--speedup",
        "200",
        "--block-bytes",
        "4K",
        "--json",
    ]);
    check(
        out.status.success(),
        &format!("exit {:?}: {}", out.status.code(), text(&out.stderr)),
    )?;
    let j = last_json(&out)?;
    adds_up(&j, 150.0)
}

fn disk_stall() -> Result<(), Failed> {
    let deadline = 200.0;
    let out = kvx(&[
        "--limit",
        "350",
        "--host-blocks",
        "64",
        "--block-bytes",
        "4K",
        "--deadline-ms",
        "200",
        "--fault",
        "stall-disk@1+2",
        "--json",
    ]);
    check(
        out.status.success(),
        &format!("exit {:?}: {}", out.status.code(), text(&out.stderr)),
    )?;
    let j = last_json(&out)?;
    adds_up(&j, 350.0)?;
    let max = num(&j, "load_max_ms")?;
    // One tick (1 ms) plus the stated 50 ms allowance past the deadline.
    check(
        max <= deadline + 51.0,
        &format!("a load waited {max} ms, deadline {deadline} ms"),
    )?;
    check(
        num(&j, "deadline_misses")? + num(&j, "load_rejected_blocks")? > 0.0,
        "the stall cut loads short",
    )?;
    check(
        num(&j, "file_hits_after_stall")? > 0.0,
        "the file tier serves hits after the stall",
    )?;
    // The phases split the failures by reason exactly.
    let all = by_reason(&j, "load_failures_by_reason")?;
    let phases = j
        .get("load_failures_by_phase")
        .ok_or("JSON lacks load_failures_by_phase")?;
    for r in REASONS {
        let mut sum = 0.0;
        for p in [
            "before_stall",
            "during_stall",
            "after_thaw_until_breaker_closed",
            "after_recovery",
        ] {
            sum += phases[p][r]
                .as_f64()
                .ok_or_else(|| format!("{p} lacks {r}"))?;
        }
        check(sum == all[r], &format!("{r}: phases add up"))?;
    }
    let after: f64 = REASONS
        .iter()
        .map(|r| phases["after_recovery"][*r].as_f64().unwrap_or(0.0))
        .sum();
    check(
        after == num(&j, "load_failed_blocks_after_recovery")?,
        "load_failed_blocks_after_recovery is the after-recovery phase",
    )?;
    check(
        j["store_failures_by_phase"]["during_stall"].is_object(),
        "stores by phase",
    )?;
    let stdout = text(&out.stdout);
    check(stdout.contains("disk stall"), "the summary shows the stall")?;
    check(
        stdout.contains("load failures by reason"),
        "the summary breaks failures down",
    )
}

/// With `--on-load-failure fail`, the loads the stall cuts short fail their requests instead:
/// each still ends exactly once and the counters still add up.
fn disk_stall_fail_policy() -> Result<(), Failed> {
    let out = kvx(&[
        "--limit",
        "250",
        "--host-blocks",
        "64",
        "--block-bytes",
        "4K",
        "--deadline-ms",
        "200",
        "--fault",
        "stall-disk@1+1.5",
        "--on-load-failure",
        "fail",
        "--json",
    ]);
    check(
        out.status.success(),
        &format!("exit {:?}: {}", out.status.code(), text(&out.stderr)),
    )?;
    let j = last_json(&out)?;
    adds_up(&j, 250.0)?;
    check(num(&j, "failed_requests")? > 0.0, "some requests failed")?;
    check(
        num(&j, "failed_request_blocks")? > 0.0,
        "their blocks are counted",
    )?;
    check(
        num(&j, "recomputed_blocks")? == 0.0,
        "the fail policy recomputes nothing",
    )
}

/// `--fault stall-disk` where FUSE cannot be used: one line saying why, non-zero exit. Runs as
/// an unprivileged user: directly when not root, through `setpriv` as `nobody` when root.
fn fault_without_fuse() -> Result<(), Failed> {
    let d = tempfile::tempdir()?;
    let uid = std::fs::metadata(d.path())?.uid();
    let args = ["replay", "--fault", "stall-disk@1+1", "--limit", "10"];
    let out = if uid == 0 {
        // A copy nobody can run, in a directory nobody can enter.
        let bin = d.path().join("kvx");
        std::fs::copy(env!("CARGO_BIN_EXE_kvx"), &bin)?;
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755))?;
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&bin)
            .args(args)
            .output()?
    } else {
        Command::new(env!("CARGO_BIN_EXE_kvx"))
            .args(args)
            .output()?
    };
    let err = text(&out.stderr);
    check(
        out.status.code() == Some(1),
        &format!("exit code {:?}: {err:?}", out.status.code()),
    )?;
    check(
        err.trim_end().lines().count() == 1 && err.contains("needs a FUSE mount"),
        &format!("one line saying why: {err:?}"),
    )
}

/// What a scrape of a replay with a file tier must show.
const WANTED_METRICS: [&str; 7] = [
    "# TYPE kvx_tasks_total counter",
    "kvx_tasks_total{dir=\"load\",outcome=\"done\"}",
    "kvx_tasks_total{dir=\"store\",outcome=\"done\"}",
    "kvx_timeouts_total{dir=\"load\"}",
    "kvx_zombie_ops",
    "kvx_breaker_state{target=",
    "kvx_tier_blocks_total{",
];

/// While a replay runs with `--metrics-addr`, a scrape returns kvx metrics in the Prometheus
/// text format: loads, stores, timeouts, zombies and the file tier's breaker state.
fn metrics_endpoint() -> Result<(), Failed> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvx"))
        .args(["replay", "--limit", "400", "--speedup", "2"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run kvx");
    let scraped = scrape_while_running(child.stderr.take().expect("stderr"));
    let _ = child.kill();
    let _ = child.wait();
    let body = scraped?;
    check(
        body.starts_with("HTTP/1.0 200 OK"),
        &format!("status: {body:.200}"),
    )?;
    for w in WANTED_METRICS {
        check(
            body.contains(w),
            &format!("{w:?} missing from the scrape:\n{body}"),
        )?;
    }
    Ok(())
}

/// Reads the metrics address the replay prints, then scrapes until every wanted metric has
/// appeared (loads need a few steps of the trace) or 30 s pass; returns the last scrape.
fn scrape_while_running(stderr: std::process::ChildStderr) -> Result<String, Failed> {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        match lines.next() {
            Some(Ok(l)) => {
                if let Some(rest) = l.strip_prefix("kvx replay: metrics at http://") {
                    break rest.trim_end_matches("/metrics").to_string();
                }
            }
            _ => return Err("the replay never printed its metrics address".into()),
        }
    };
    let mut body = String::new();
    let t0 = std::time::Instant::now();
    while t0.elapsed() < std::time::Duration::from_secs(30) {
        let mut s =
            std::net::TcpStream::connect(&addr).map_err(|e| format!("connect {addr}: {e}"))?;
        write!(s, "GET /metrics HTTP/1.0\r\n\r\n").map_err(|e| e.to_string())?;
        body.clear();
        s.read_to_string(&mut body).map_err(|e| e.to_string())?;
        if WANTED_METRICS.iter().all(|w| body.contains(w)) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    Ok(body)
}

fn setpriv_available() -> bool {
    Command::new("setpriv")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn main() {
    let args = Arguments::from_args();
    let fuse = kvx_fusefs::fuse_available();
    if let Err(why) = &fuse {
        println!("skip: disk stall test ({why})");
    }
    let trace = mooncake_path().exists();
    if !trace {
        println!(
            "skip: Mooncake trace test ({} is absent)",
            mooncake_path().display()
        );
    }
    let root = tempfile::tempdir()
        .and_then(|d| std::fs::metadata(d.path()))
        .is_ok_and(|m| m.uid() == 0);
    let unprivileged = !root || setpriv_available();
    if !unprivileged {
        println!("skip: FUSE-unavailable test (running as root without setpriv to drop it)");
    }
    let trials = vec![
        Trial::test("missing_file", missing_file),
        Trial::test("empty_file", empty_file),
        Trial::test("negative_length", negative_length),
        Trial::test("hash_ids_not_a_list", hash_ids_not_a_list),
        Trial::test(
            "malformed_line_number_and_skip",
            malformed_line_number_and_skip,
        ),
        Trial::test(
            "short_replay_summary_and_json",
            short_replay_summary_and_json,
        ),
        Trial::test("mooncake_trace", mooncake_trace).with_ignored_flag(!trace),
        Trial::test("metrics_endpoint", metrics_endpoint),
        Trial::test("disk_stall", disk_stall).with_ignored_flag(fuse.is_err()),
        Trial::test("disk_stall_fail_policy", disk_stall_fail_policy)
            .with_ignored_flag(fuse.is_err()),
        Trial::test("fault_without_fuse", fault_without_fuse).with_ignored_flag(!unprivileged),
    ];
    libtest_mimic::run(&args, trials).exit();
}
