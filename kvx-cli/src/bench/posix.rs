//! `kvx bench posix`: store then load blocks through the file block store, and (with `--fio`)
//! run fio's sequential read and write at the same block size and queue depth on a file of the
//! same size in the same directory, alternating with kvx, to report kvx/fio ratios.
//!
//! Every op has a deadline (`--deadline-ms`, default 30000): on a mount that stops answering,
//! each phase ends within its deadline plus a fraction of a second, the report says how many
//! ops timed out, and the benchmark directory is removed in the background (left in place,
//! with a message, if the mount does not answer within [`CLEANUP_WAIT`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use clap::Args;
use kvx_core::Direction;
use kvx_posix::bench::{BenchRig, Phase, bench_keys};
use kvx_posix::{IoEngine, PosixConfig};

mod nodes;

/// Options of `kvx bench posix`.
#[derive(Args)]
pub struct PosixArgs {
    /// Directory to benchmark in (a `kvx-bench-<pid>` folder is made and removed inside it).
    #[arg(
        long,
        required_unless_present = "node_dir",
        conflicts_with = "node_dir"
    )]
    dir: Option<PathBuf>,
    /// One node's directory of a shared volume (its own mount), given once per node (instead of
    /// --dir): every node stores its blocks through its own directory at once, then loads the
    /// blocks the next node stored (cross-node loads); throughput is summed over the nodes.
    #[arg(long, value_name = "DIR")]
    node_dir: Vec<PathBuf>,
    /// Block size, e.g. 256KiB, 1MiB, 4MiB.
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    block_size: usize,
    /// Blocks stored then loaded per round.
    #[arg(long, default_value_t = 1024)]
    blocks: usize,
    /// Block I/Os in flight: the store runs this many ops at a time, as fio's iodepth and the
    /// NIXL peer's descriptors per request.
    #[arg(long, default_value_t = 32)]
    queue_depth: usize,
    /// Ops submitted beyond the queue depth, waiting in the store, so the next op starts as
    /// soon as one ends, as when an engine hands over a step's blocks at once (default: the
    /// queue depth; 0: the next op is submitted only once a completion is seen).
    #[arg(long)]
    backlog: Option<usize>,
    /// io_uring rings, each with its own thread (uring engine only).
    #[arg(long, default_value_t = 1)]
    rings: usize,
    /// Send every uring op through the kernel's workers, also on a local block file system
    /// (`PosixConfig::inline_io` off).
    #[arg(long)]
    no_inline_io: bool,
    /// I/O engine: uring or psync.
    #[arg(long, default_value = "uring")]
    engine: String,
    /// Rounds; medians are reported (with --fio, kvx and fio alternate each round).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Also run fio (io_uring, O_DIRECT, same block size and queue depth) for kvx/fio ratios.
    #[arg(long)]
    fio: bool,
    /// fio's buffers in huge pages (`--iomem=shmhuge`), as kvx's are: from 4 KiB pages a disk
    /// that takes few segments per request (a virtio disk: 254) splits each 1 MiB I/O in two.
    /// Needs free huge pages (`vm.nr_hugepages`): queue depth x block size in them, plus two.
    #[arg(long, requires = "fio")]
    fio_huge_pages: bool,
    /// fdatasync each block before its rename.
    #[arg(long)]
    fdatasync: bool,
    /// Spare files made when the store opens, before the clock starts, as fio and NIXL make
    /// their files before theirs (default: one per block; 0: every store creates its file).
    #[arg(long)]
    spare_files: Option<usize>,
    /// Before the clock, store as many blocks again and evict them, as a full tier does to
    /// make room: the timed stores then write into the recycled files of evicted blocks
    /// (space written before) instead of fresh spare files.
    #[arg(long)]
    after_evictions: bool,
    /// Print the results as one JSON object on the last line.
    #[arg(long)]
    json: bool,
    /// Deadline of each op in milliseconds; an op past it is cancelled and counted as timed
    /// out.
    #[arg(long, default_value_t = 30_000)]
    deadline_ms: u64,
}

/// The benchmark's own folder in `dir`.
fn work_dir(dir: &Path) -> PathBuf {
    dir.join(format!("kvx-bench-{}", std::process::id()))
}

/// How long the benchmark waits for its directory to be removed before leaving it in place.
pub const CLEANUP_WAIT: Duration = Duration::from_millis(300);

/// Remove `dir` on a background thread; false (with a message) if it did not finish within
/// [`CLEANUP_WAIT`] (a stuck mount): the thread goes on, and the process does not wait for it.
fn remove_in_background(dir: &Path) -> bool {
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dir.to_path_buf();
    let spawned = std::thread::Builder::new()
        .name("kvx-bench-cleanup".into())
        .spawn(move || {
            let _ = tx.send(std::fs::remove_dir_all(&d));
        });
    if spawned.is_err() {
        eprintln!(
            "kvx bench posix: {} left in place (no cleanup thread)",
            dir.display()
        );
        return false;
    }
    match rx.recv_timeout(CLEANUP_WAIT) {
        Ok(Ok(())) => true,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => true,
        Ok(Err(e)) => {
            eprintln!("kvx bench posix: could not remove {}: {e}", dir.display());
            false
        }
        Err(_) => {
            eprintln!(
                "kvx bench posix: {} left in place: the filesystem did not answer within {CLEANUP_WAIT:?}",
                dir.display()
            );
            false
        }
    }
}

/// One line about a phase's failures, or `None` when every op succeeded.
fn failures(name: &str, p: &Phase) -> Option<String> {
    (!p.is_clean()).then(|| {
        format!(
            "{name}: {} ok, {} timed out, {} failed, {} refused, {} not started{}",
            p.ok.len(),
            p.timed_out,
            p.failed,
            p.refused,
            p.not_started,
            p.first_error
                .as_deref()
                .map(|e| format!(" (first error: {e})"))
                .unwrap_or_default()
        )
    })
}

/// A block size in bytes (see [`crate::size::parse_size`]).
fn parse_size(s: &str) -> Result<usize, String> {
    let v = crate::size::parse_size(s)?;
    usize::try_from(v).map_err(|_| format!("size {s:?} is too large"))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Run fio once at the bench's block size and queue depth; returns GiB/s.
fn fio(dir: &Path, rw: &str, args: &PosixArgs, size: u64) -> Result<f64, String> {
    let file = dir.join("fio.dat");
    let mut cmd = Command::new("fio");
    cmd.arg(format!("--name=kvx-{rw}"))
        .arg(format!("--filename={}", file.display()))
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={}", args.block_size))
        .arg(format!("--iodepth={}", args.queue_depth))
        .arg(format!("--size={size}"))
        .args(["--direct=1", "--ioengine=io_uring", "--output-format=json"]);
    if args.fio_huge_pages {
        cmd.arg("--iomem=shmhuge");
    }
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run fio: {e} (apt-get install fio)"))?;
    if !out.status.success() {
        return Err(format!(
            "fio --rw={rw} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text.find('{').ok_or("fio printed no JSON")?;
    let v: serde_json::Value =
        serde_json::from_str(&text[start..]).map_err(|e| format!("fio JSON: {e}"))?;
    let side = if rw == "read" { "read" } else { "write" };
    let bw = v["jobs"][0][side]["bw_bytes"]
        .as_f64()
        .ok_or("fio JSON has no bw_bytes")?;
    Ok(bw / (1u64 << 30) as f64)
}

struct Round {
    store: Phase,
    load: Phase,
    fio_write: Option<f64>,
    fio_read: Option<f64>,
}

/// The store's spare files: `--spare-files`, or one per block.
fn spare_files(args: &PosixArgs) -> usize {
    args.spare_files.unwrap_or(args.blocks)
}

fn backlog(args: &PosixArgs) -> usize {
    args.backlog.unwrap_or(args.queue_depth)
}

/// The block store's settings for a rig on `root`.
fn store_config(args: &PosixArgs, engine: IoEngine, root: &Path) -> PosixConfig {
    let mut cfg = PosixConfig::new(root);
    cfg.io_engine = engine;
    cfg.queue_depth = args.queue_depth;
    cfg.rings = args.rings;
    cfg.inline_io = !args.no_inline_io;
    cfg.fdatasync = args.fdatasync;
    cfg.spare_files = spare_files(args);
    cfg.spare_block_bytes = args.block_size;
    cfg.spare_refill = false;
    cfg
}

fn one_round(
    args: &PosixArgs,
    engine: IoEngine,
    work: &Path,
    round: usize,
) -> Result<(Round, bool), String> {
    let root = work.join("kv");
    let cfg = store_config(args, engine, &root);
    let mut rig = BenchRig::new(cfg, args.block_size, backlog(args)).map_err(|e| e.to_string())?;
    let direct = rig.handle().capabilities().direct;
    let keys = bench_keys(round as u64, args.blocks);
    let deadline = Duration::from_millis(args.deadline_ms);
    if args.after_evictions {
        let evicted = bench_keys(u64::MAX - round as u64, args.blocks);
        let fill = rig.run(Direction::Store, &evicted, deadline);
        if !fill.is_clean() {
            return Err(format!(
                "round {}: filling the store before the clock: {}",
                round + 1,
                failures("store", &fill).unwrap_or_default()
            ));
        }
        if !rig.evict(&fill.ok, deadline) {
            return Err(format!(
                "round {}: evictions not done within {} ms",
                round + 1,
                args.deadline_ms
            ));
        }
        let recycled = rig.handle().stats().recycled;
        if recycled < fill.ok.len() as u64 {
            eprintln!(
                "round {}: {recycled} of {} evicted files recycled (the rest were unlinked: spare files full, or not on a local block file system)",
                round + 1,
                fill.ok.len()
            );
        }
    }
    let store = rig.run(Direction::Store, &keys, deadline);
    // Load what was stored, unless a store timed out: on a stuck mount every load would wait
    // out its deadline too.
    eprintln!(
        "round {}: stored {} of {} blocks; {}",
        round + 1,
        store.ok.len(),
        keys.len(),
        if store.gave_up {
            "a store timed out, so no loads"
        } else {
            "loading them"
        }
    );
    let load = if store.gave_up {
        Phase {
            not_started: store.ok.len(),
            ..Phase::default()
        }
    } else {
        rig.run(Direction::Load, &store.ok, deadline)
    };
    drop(rig);
    if !store.is_clean() || !load.is_clean() {
        return Ok((
            Round {
                store,
                load,
                fio_write: None,
                fio_read: None,
            },
            direct,
        ));
    }
    std::fs::remove_dir_all(&root).map_err(|e| format!("cleanup {}: {e}", root.display()))?;
    let size = (args.blocks * args.block_size) as u64;
    let (fio_write, fio_read) = if args.fio {
        if args.after_evictions {
            // fio's timed write then overwrites space written before, as kvx's stores do.
            fio(work, "write", args, size)?;
        }
        let w = fio(work, "write", args, size)?;
        let r = fio(work, "read", args, size)?;
        let _ = std::fs::remove_file(work.join("fio.dat"));
        (Some(w), Some(r))
    } else {
        (None, None)
    };
    Ok((
        Round {
            store,
            load,
            fio_write,
            fio_read,
        },
        direct,
    ))
}

/// Run the benchmark; returns the exit code.
pub fn run(args: PosixArgs) -> i32 {
    let engine: IoEngine = match args.engine.parse() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("kvx bench posix: {e}");
            return 2;
        }
    };
    if args.deadline_ms == 0 {
        eprintln!("kvx bench posix: --deadline-ms must be at least 1");
        return 2;
    }
    let dir = match (&args.dir, args.node_dir.as_slice()) {
        (Some(d), _) | (None, [d]) => d.clone(),
        (None, []) => {
            eprintln!("kvx bench posix: give --dir, or --node-dir once per node");
            return 2;
        }
        (None, dirs) => return nodes::run(&args, engine, dirs),
    };
    let work = work_dir(&dir);
    if let Err(e) = std::fs::create_dir_all(&work) {
        eprintln!("kvx bench posix: cannot create {}: {e}", work.display());
        return 2;
    }
    let mut rounds = Vec::new();
    let mut direct = false;
    for i in 0..args.rounds.max(1) {
        match one_round(&args, engine, &work, i) {
            Ok((r, _)) if !r.store.is_clean() || !r.load.is_clean() => {
                // Report at once what did not finish, then clean up without blocking on it.
                println!(
                    "kvx bench posix: engine {engine}, deadline {} ms, round {}: ops did not all succeed",
                    args.deadline_ms,
                    i + 1
                );
                for (name, p) in [("store", &r.store), ("load", &r.load)] {
                    if let Some(line) = failures(name, p) {
                        println!("{line}");
                    }
                }
                if args.json {
                    let phase = |p: &Phase| {
                        serde_json::json!({
                            "ok": p.ok.len(), "timed_out": p.timed_out, "failed": p.failed,
                            "refused": p.refused, "not_started": p.not_started,
                        })
                    };
                    let v = serde_json::json!({
                        "engine": engine.as_str(),
                        "deadline_ms": args.deadline_ms,
                        "store": phase(&r.store),
                        "load": phase(&r.load),
                    });
                    println!("{v}");
                }
                use std::io::Write;
                let _ = std::io::stdout().flush();
                remove_in_background(&work);
                return 1;
            }
            Ok((r, d)) => {
                direct = d;
                if !args.json {
                    eprintln!(
                        "round {}: store {:.2} GiB/s, load {:.2} GiB/s{}",
                        i + 1,
                        r.store.gib_s(),
                        r.load.gib_s(),
                        match (r.fio_write, r.fio_read) {
                            (Some(w), Some(rd)) => format!("; fio write {w:.2}, read {rd:.2}"),
                            _ => String::new(),
                        }
                    );
                }
                rounds.push(r);
            }
            Err(e) => {
                eprintln!("kvx bench posix: {e}");
                remove_in_background(&work);
                return 1;
            }
        }
    }
    remove_in_background(&work);
    let store = median(rounds.iter().map(|r| r.store.gib_s()).collect());
    let load = median(rounds.iter().map(|r| r.load.gib_s()).collect());
    let p50 = median(rounds.iter().map(|r| r.load.percentile_us(50.0)).collect());
    let p99 = median(rounds.iter().map(|r| r.load.percentile_us(99.0)).collect());
    let sp50 = median(rounds.iter().map(|r| r.store.percentile_us(50.0)).collect());
    let sp99 = median(rounds.iter().map(|r| r.store.percentile_us(99.0)).collect());
    let fio_w: Vec<f64> = rounds.iter().filter_map(|r| r.fio_write).collect();
    let fio_r: Vec<f64> = rounds.iter().filter_map(|r| r.fio_read).collect();
    let (fw, fr) = (median(fio_w), median(fio_r));
    println!(
        "kvx bench posix: engine {engine}, direct {direct}, block {} KiB, {} blocks, queue depth {} (+ {} waiting), {} spare files{}, {} round(s), medians",
        args.block_size >> 10,
        args.blocks,
        args.queue_depth,
        backlog(&args),
        spare_files(&args),
        if args.after_evictions {
            ", stores after evictions"
        } else {
            ""
        },
        rounds.len()
    );
    if args.fio && !args.fio_huge_pages {
        eprintln!(
            "kvx bench posix: fio ran with its buffers in 4 KiB pages, which a disk taking few segments per request (a virtio disk) splits into more requests than kvx's; --fio-huge-pages measures the physical path"
        );
    }
    println!(
        "{:<8} {:>9} {:>10} {:>10} {:>12}",
        "phase", "GiB/s", "p50 us", "p99 us", "kvx/fio"
    );
    let ratio = |k: f64, f: f64| {
        if args.fio && f > 0.0 {
            format!("{:.2}", k / f)
        } else {
            "-".into()
        }
    };
    println!(
        "{:<8} {store:>9.3} {sp50:>10.0} {sp99:>10.0} {:>12}",
        "store",
        ratio(store, fw)
    );
    println!(
        "{:<8} {load:>9.3} {p50:>10.0} {p99:>10.0} {:>12}",
        "load",
        ratio(load, fr)
    );
    if args.fio {
        println!(
            "{:<8} {fw:>9.3} {:>10} {:>10} {:>12}",
            "fio wr", "-", "-", "-"
        );
        println!(
            "{:<8} {fr:>9.3} {:>10} {:>10} {:>12}",
            "fio rd", "-", "-", "-"
        );
    }
    if args.json {
        let mut v = serde_json::json!({
            "engine": engine.as_str(),
            "direct": direct,
            "block_size": args.block_size,
            "blocks": args.blocks,
            "queue_depth": args.queue_depth,
            "backlog": backlog(&args),
            "spare_files": spare_files(&args),
            "after_evictions": args.after_evictions,
            "rounds": rounds.len(),
            "store_gib_s": store,
            "load_gib_s": load,
            "store_p50_us": sp50,
            "store_p99_us": sp99,
            "load_p50_us": p50,
            "load_p99_us": p99,
        });
        if args.fio {
            v["fio_huge_pages"] = args.fio_huge_pages.into();
            v["fio_write_gib_s"] = fw.into();
            v["fio_read_gib_s"] = fr.into();
            v["store_vs_fio"] = (store / fw.max(1e-9)).into();
            v["load_vs_fio"] = (load / fr.max(1e-9)).into();
        }
        println!("{v}");
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("256KiB"), Ok(256 << 10));
        assert_eq!(parse_size("4M"), Ok(4 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("0").is_err());
        assert!(parse_size("1XB").is_err());
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
