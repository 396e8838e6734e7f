//! `kvx replay --nodes N`: N engine nodes, each a `kvx replay` process of its own (this binary,
//! re-run with hidden `--node-index`, `--shared-dir` and `--start-unix-ms`), share one file-tier
//! directory. The trace's requests are spread over them (round robin, or by a hash of the first
//! block so that a conversation stays on one node); every node starts on the same wall clock,
//! probes the shared directory for blocks its own index lacks, and runs a collector that keeps
//! the directory under the file tier's capacity. A node writes a block into the directory as it
//! leaves its host tier (`--shared-writes back`, the default: host tiers and directory hold
//! different blocks) or as soon as it is stored (`through`). The parent sums the nodes'
//! counters and compares the hit rate with an ideal LRU cache shared by all nodes, of their
//! total capacity (every node's host tier plus the one file tier), and with one of the capacity
//! written-through tiers have for distinct blocks: every host tier then holds copies of
//! file-tier blocks, and the distinct capacity is the larger of the two.
//!
//! With `--node-dir DIR` once per node, node I reaches the shared directory through the I-th
//! path (its own mount of one volume, as engine nodes on a distributed file system do); the
//! paths are checked to show one directory before any node starts ([`super::node_dirs`]).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvx_core::BlockKey;
use serde_json::{Value, json};

use super::args::{ReplayArgs, Settings, Spread};
use super::error::ReplayError;
use super::ideal::ideal_lru_hits;
use super::trace::TraceRequest;

/// Time the nodes get to set up before the shared clock starts.
const SETUP: Duration = Duration::from_secs(2);

/// The node that serves request `i` (its block keys `keys`).
pub fn node_of(spread: Spread, nodes: usize, i: usize, keys: &[BlockKey]) -> usize {
    match spread {
        Spread::RoundRobin => i % nodes,
        Spread::Hash => keys.first().map_or(0, |k| (k.0 % nodes as u128) as usize),
    }
}

/// Counters summed over the nodes' JSON reports.
const SUMMED: [&str; 14] = [
    "requests",
    "blocks",
    "hit_host_blocks",
    "hit_file_blocks",
    "cross_node_hits",
    "missed_blocks",
    "recomputed_blocks",
    "failed_requests",
    "verified_blocks",
    "deadline_misses",
    "load_rejected_blocks",
    "stored_file_blocks",
    "store_failed_file_blocks",
    "retries",
];

fn args_without_metrics(args: impl Iterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    let mut skip_next = false;
    for a in args {
        if skip_next {
            skip_next = false;
            continue;
        }
        let text = a.to_string_lossy();
        if text == "--metrics-addr" {
            skip_next = true;
            continue;
        }
        if text.starts_with("--metrics-addr=") {
            continue;
        }
        out.push(a);
    }
    out
}

/// Run the nodes over `requests` and print the combined summary (and JSON with `--json`).
pub fn run(args: &ReplayArgs, s: &Settings, requests: &[TraceRequest]) -> Result<(), ReplayError> {
    let keys: Vec<Vec<BlockKey>> = requests.iter().map(TraceRequest::keys).collect();
    let capacity = s.nodes * s.host_blocks + s.file_blocks;
    let ideal = ideal_lru_hits(capacity, keys.iter().map(Vec::as_slice));
    let inclusive = (s.nodes * s.host_blocks).max(s.file_blocks);
    let ideal_inclusive = ideal_lru_hits(inclusive, keys.iter().map(Vec::as_slice));
    if !s.node_dirs.is_empty() {
        super::node_dirs::check_shared(&s.node_dirs, super::node_dirs::VISIBLE_WITHIN)
            .map_err(ReplayError::BadOption)?;
    }
    let (dir, fresh) = match (&s.dir, s.node_dirs.first()) {
        (_, Some(d)) => (d.clone(), None),
        (Some(d), None) => {
            std::fs::create_dir_all(d)
                .map_err(|e| ReplayError::Setup(format!("cannot create {}: {e}", d.display())))?;
            (d.clone(), None)
        }
        (None, None) => {
            let t = tempfile::Builder::new()
                .prefix("kvx-replay-shared-")
                .tempdir()
                .map_err(|e| ReplayError::Setup(format!("cannot create a temp dir: {e}")))?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let start = SystemTime::now() + SETUP;
    let start_ms = start
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let exe = std::env::current_exe()
        .map_err(|e| ReplayError::Setup(format!("cannot find the kvx binary: {e}")))?;
    let base = args_without_metrics(std::env::args_os().skip(1));
    let mut children = Vec::with_capacity(s.nodes);
    for i in 0..s.nodes {
        let child = Command::new(&exe)
            .args(&base)
            .arg("--node-index")
            .arg(i.to_string())
            .arg("--shared-dir")
            .arg(s.node_dirs.get(i).unwrap_or(&dir))
            .arg("--start-unix-ms")
            .arg(start_ms.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                // End the nodes already started (by their own ids) before giving up.
                for mut c in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(ReplayError::Setup(format!("cannot start node {i}: {e}")));
            }
        }
    }
    let shared = shared_dirs(s, &dir);
    eprintln!(
        "kvx replay: {} nodes share {shared} ({} requests spread {})",
        s.nodes,
        requests.len(),
        s.spread.as_str()
    );
    let mut reports = Vec::with_capacity(s.nodes);
    let mut failure = None;
    for (i, mut child) in children.into_iter().enumerate() {
        let mut last = String::new();
        if let Some(out) = child.stdout.take() {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if !line.trim().is_empty() {
                    last = line;
                }
            }
        }
        let status = child
            .wait()
            .map_err(|e| ReplayError::Setup(format!("node {i}: {e}")))?;
        match serde_json::from_str::<Value>(&last) {
            Ok(v) if status.success() => reports.push(v),
            _ => {
                failure.get_or_insert(format!("node {i} failed ({status})"));
            }
        }
    }
    if let Some(t) = fresh {
        if args.keep {
            let kept = t.keep();
            eprintln!("kvx replay: kept {}", kept.display());
        } else if let Err(e) = super::cleanup::remove_tree(&t.keep()) {
            eprintln!("kvx replay: could not remove {}: {e}", dir.display());
        }
    }
    if let Some(f) = failure {
        return Err(ReplayError::Accounting(f));
    }
    let ideals = Ideals {
        hits: ideal,
        capacity,
        inclusive_hits: ideal_inclusive,
        inclusive_capacity: inclusive,
    };
    let combined = combine(s, &reports, &ideals, &shared);
    print!("{}", summary(&combined));
    if args.json {
        println!("{combined}");
    }
    Ok(())
}

/// The shared file tier as the report names it: `dir`, or every node's directory in node order.
fn shared_dirs(s: &Settings, dir: &Path) -> String {
    if s.node_dirs.is_empty() {
        return dir.display().to_string();
    }
    let all: Vec<String> = s
        .node_dirs
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    format!("one directory per node: {}", all.join(", "))
}

fn num(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

fn rate(n: u64, d: u64) -> f64 {
    if d == 0 { 0.0 } else { n as f64 / d as f64 }
}

/// Hits of the ideal shared LRU caches over the whole trace.
struct Ideals {
    /// Of every node's host tier plus the file tier.
    hits: u64,
    capacity: usize,
    /// Of the larger of all host tiers together and the file tier.
    inclusive_hits: u64,
    inclusive_capacity: usize,
}

/// The nodes' reports, summed, with the ideal shared LRU beside them.
fn combine(s: &Settings, reports: &[Value], ideal: &Ideals, shared: &str) -> Value {
    let mut m = serde_json::Map::new();
    for k in SUMMED {
        m.insert(
            k.into(),
            json!(reports.iter().map(|r| num(r, k)).sum::<u64>()),
        );
    }
    for k in ["store_failures_by_reason", "load_failures_by_reason"] {
        let mut sum = serde_json::Map::new();
        for r in reports {
            if let Some(o) = r.get(k).and_then(Value::as_object) {
                for (reason, n) in o {
                    let add = n.as_u64().unwrap_or(0);
                    let prev = sum.get(reason).and_then(Value::as_u64).unwrap_or(0);
                    sum.insert(reason.clone(), json!(prev + add));
                }
            }
        }
        m.insert(k.into(), Value::Object(sum));
    }
    let blocks = num(&Value::Object(m.clone()), "blocks");
    let host = num(&Value::Object(m.clone()), "hit_host_blocks");
    let file = num(&Value::Object(m.clone()), "hit_file_blocks");
    let hit_rate = rate(host + file, blocks);
    let ideal_rate = rate(ideal.hits, blocks);
    let inclusive_rate = rate(ideal.inclusive_hits, blocks);
    m.insert("nodes".into(), json!(s.nodes));
    m.insert("spread".into(), json!(s.spread.as_str()));
    m.insert("shared_writes".into(), json!(s.shared_writes.as_str()));
    m.insert("shared_dir".into(), json!(shared));
    m.insert(
        "node_dirs".into(),
        json!(
            s.node_dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
        ),
    );
    m.insert("hit_rate".into(), json!(hit_rate));
    m.insert("host_hit_rate".into(), json!(rate(host, blocks)));
    m.insert("file_hit_rate".into(), json!(rate(file, blocks)));
    m.insert("ideal_shared_lru_hit_rate".into(), json!(ideal_rate));
    m.insert(
        "ideal_shared_lru_capacity_blocks".into(),
        json!(ideal.capacity),
    );
    m.insert(
        "hit_rate_gap_points".into(),
        json!(100.0 * (ideal_rate - hit_rate)),
    );
    m.insert(
        "ideal_shared_lru_inclusive_hit_rate".into(),
        json!(inclusive_rate),
    );
    m.insert(
        "ideal_shared_lru_inclusive_capacity_blocks".into(),
        json!(ideal.inclusive_capacity),
    );
    m.insert(
        "inclusive_gap_points".into(),
        json!(100.0 * (inclusive_rate - hit_rate)),
    );
    m.insert("host_blocks_per_node".into(), json!(s.host_blocks));
    m.insert("file_blocks".into(), json!(s.file_blocks));
    m.insert(
        "per_node".into(),
        Value::Array(
            reports
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    json!({
                        "node": i,
                        "requests": num(r, "requests"),
                        "blocks": num(r, "blocks"),
                        "hit_host_blocks": num(r, "hit_host_blocks"),
                        "hit_file_blocks": num(r, "hit_file_blocks"),
                        "cross_node_hits": num(r, "cross_node_hits"),
                        "wall_s": r.get("wall_s").cloned().unwrap_or(Value::Null),
                    })
                })
                .collect(),
        ),
    );
    Value::Object(m)
}

/// The combined summary, as text.
fn summary(v: &Value) -> String {
    let n = |k: &str| num(v, k);
    let f = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let mut out = String::new();
    out.push_str(&format!(
        "nodes            {} (requests spread {}, written {}), shared file tier {}\n",
        n("nodes"),
        v.get("spread").and_then(Value::as_str).unwrap_or(""),
        v.get("shared_writes").and_then(Value::as_str).unwrap_or(""),
        v.get("shared_dir").and_then(Value::as_str).unwrap_or("")
    ));
    out.push_str(&format!(
        "requests         {}   blocks {}\n",
        n("requests"),
        n("blocks")
    ));
    out.push_str(&format!(
        "hits             {:.1} % (host {:.1} %, file {:.1} %; {} file hits on blocks another node stored)\n",
        100.0 * f("hit_rate"),
        100.0 * f("host_hit_rate"),
        100.0 * f("file_hit_rate"),
        n("cross_node_hits")
    ));
    out.push_str(&format!(
        "ideal shared LRU {:.1} % ({} blocks: every node's host tier plus the file tier); gap {:.2} points\n",
        100.0 * f("ideal_shared_lru_hit_rate"),
        n("ideal_shared_lru_capacity_blocks"),
        f("hit_rate_gap_points")
    ));
    out.push_str(&format!(
        "ideal inclusive  {:.1} % ({} blocks: what write-through tiers hold distinct); gap {:.2} points\n",
        100.0 * f("ideal_shared_lru_inclusive_hit_rate"),
        n("ideal_shared_lru_inclusive_capacity_blocks"),
        f("inclusive_gap_points")
    ));
    out.push_str(&format!(
        "missed           {} blocks, recomputed {}, failed requests {}, deadline misses {}\n",
        n("missed_blocks"),
        n("recomputed_blocks"),
        n("failed_requests"),
        n("deadline_misses")
    ));
    out
}
