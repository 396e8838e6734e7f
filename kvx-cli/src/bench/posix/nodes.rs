//! `kvx bench posix --node-dir A --node-dir B ...`: several engine nodes on one shared volume,
//! each through its own directory (its own mount). The directories are first checked to show
//! one directory. In each round every node, on a thread of its own, stores its blocks through
//! its own directory at the same time as the others (into a store root of its own, `kv<i>`);
//! then every node opens the root of the next node (`kv<i+1>`, through its own directory, so
//! the blocks are found by the open's scan as another node's are) and loads that node's blocks
//! at once: every load is a cross-node load, of bytes another mount wrote, checked against
//! their checksum. Throughput is all nodes' bytes over the longest node's phase.

use std::path::{Path, PathBuf};
use std::sync::{Barrier, Mutex};
use std::time::Duration;

use kvx_core::{BlockKey, Direction};
use kvx_posix::IoEngine;
use kvx_posix::bench::{BenchRig, Phase, bench_keys};

use super::{
    PosixArgs, backlog, failures, median, remove_in_background, spare_files, store_config, work_dir,
};
use crate::replay::node_dirs;

/// One node's phases in one round.
#[derive(Default)]
struct NodeRound {
    store: Phase,
    load: Phase,
    /// A store that could not be opened.
    error: Option<String>,
}

impl NodeRound {
    fn is_clean(&self) -> bool {
        self.error.is_none() && self.store.is_clean() && self.load.is_clean()
    }
}

/// Throughput of phases that ran at once: all their bytes over the longest one.
fn aggregate_gib_s<'a>(phases: impl Iterator<Item = &'a Phase>) -> f64 {
    let (bytes, longest) = phases.fold((0u64, Duration::ZERO), |(b, l), p| {
        (b + p.bytes, l.max(p.elapsed))
    });
    bytes as f64 / (1u64 << 30) as f64 / longest.as_secs_f64().max(1e-9)
}

/// Node `i`'s store root in the shared folder `work` (as node `i` or any other sees it).
fn root(work: &Path, i: usize) -> PathBuf {
    work.join(format!("kv{i}"))
}

/// Open a rig on `root`, or say why not.
fn open(args: &PosixArgs, engine: IoEngine, root: &Path, spare: bool) -> Result<BenchRig, String> {
    let mut cfg = store_config(args, engine, root);
    if !spare {
        cfg.spare_files = 0;
    }
    BenchRig::new(cfg, args.block_size, backlog(args))
        .map_err(|e| format!("{}: {e}", root.display()))
}

/// One round on every node at once; also whether node 0's store used O_DIRECT.
fn round(
    args: &PosixArgs,
    engine: IoEngine,
    works: &[PathBuf],
    r: usize,
) -> (Vec<NodeRound>, bool) {
    let n = works.len();
    let deadline = Duration::from_millis(args.deadline_ms);
    let barrier = Barrier::new(n);
    // What each node stored, and whether the loads may start (no store gave up or failed to
    // open: on a stuck mount every load would wait out its deadline too).
    let stored: Mutex<Vec<Option<Vec<BlockKey>>>> = Mutex::new(vec![None; n]);
    let direct = Mutex::new(false);
    let rounds: Vec<NodeRound> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..n)
            .map(|i| {
                let (barrier, stored, direct) = (&barrier, &stored, &direct);
                let work = &works[i];
                scope.spawn(move || {
                    let mut out = NodeRound::default();
                    // Every node passes each barrier once, whatever failed.
                    let rig = open(args, engine, &root(work, i), true);
                    barrier.wait();
                    match rig {
                        Ok(mut rig) => {
                            if i == 0 {
                                *kvx_core::lock(direct) = rig.handle().capabilities().direct;
                            }
                            let keys = bench_keys(((r as u64) << 16) | i as u64, args.blocks);
                            out.store = rig.run(Direction::Store, &keys, deadline);
                        }
                        Err(e) => out.error = Some(e),
                    }
                    let ok = out.error.is_none() && !out.store.gave_up;
                    kvx_core::lock(stored)[i] = ok.then(|| out.store.ok.clone());
                    barrier.wait();
                    let next = (i + 1) % n;
                    let keys = {
                        let all = kvx_core::lock(stored);
                        all.iter().all(Option::is_some).then(|| all[next].clone())
                    };
                    let rig = keys
                        .as_ref()
                        .map(|_| open(args, engine, &root(work, next), false));
                    barrier.wait();
                    match (rig, keys.flatten()) {
                        (Some(Ok(mut rig)), Some(keys)) => {
                            out.load = rig.run(Direction::Load, &keys, deadline);
                        }
                        (Some(Err(e)), Some(keys)) => {
                            out.error.get_or_insert(e);
                            out.load.not_started = keys.len();
                        }
                        _ => out.load.not_started = out.store.ok.len(),
                    }
                    out
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join().unwrap_or_else(|_| NodeRound {
                    error: Some("the node's thread panicked".into()),
                    ..NodeRound::default()
                })
            })
            .collect()
    });
    let direct = *kvx_core::lock(&direct);
    (rounds, direct)
}

/// Run the benchmark on the node directories `dirs`; returns the exit code.
pub fn run(args: &PosixArgs, engine: IoEngine, dirs: &[PathBuf]) -> i32 {
    if args.fio || args.after_evictions {
        eprintln!(
            "kvx bench posix: --fio and --after-evictions measure one directory: use --dir with them"
        );
        return 2;
    }
    if let Err(e) = node_dirs::check_shared(dirs, node_dirs::VISIBLE_WITHIN) {
        eprintln!("kvx bench posix: {e}");
        return 2;
    }
    let works: Vec<PathBuf> = dirs.iter().map(|d| work_dir(d)).collect();
    for w in &works {
        if let Err(e) = std::fs::create_dir_all(w) {
            eprintln!("kvx bench posix: cannot create {}: {e}", w.display());
            return 2;
        }
    }
    let mut all = Vec::new();
    let mut direct = false;
    for r in 0..args.rounds.max(1) {
        let (nodes, d) = round(args, engine, &works, r);
        if nodes.iter().any(|n| !n.is_clean()) {
            println!(
                "kvx bench posix: engine {engine}, deadline {} ms, {} nodes, round {}: ops did not all succeed",
                args.deadline_ms,
                dirs.len(),
                r + 1
            );
            for (i, n) in nodes.iter().enumerate() {
                if let Some(e) = &n.error {
                    println!("node {i}: {e}");
                }
                for (name, p) in [("store", &n.store), ("load", &n.load)] {
                    if let Some(line) = failures(&format!("node {i} {name}"), p) {
                        println!("{line}");
                    }
                }
            }
            remove_in_background(&works[0]);
            return 1;
        }
        direct = d;
        for (i, w) in works.iter().enumerate() {
            let _ = std::fs::remove_dir_all(root(w, i));
        }
        eprintln!(
            "round {}: {} nodes store {:.2} GiB/s, load (cross-node) {:.2} GiB/s",
            r + 1,
            nodes.len(),
            aggregate_gib_s(nodes.iter().map(|n| &n.store)),
            aggregate_gib_s(nodes.iter().map(|n| &n.load))
        );
        all.push(nodes);
    }
    remove_in_background(&works[0]);
    report(args, engine, dirs, &all, direct);
    0
}

/// Print the medians over `rounds` (each: every node's phases).
fn report(
    args: &PosixArgs,
    engine: IoEngine,
    dirs: &[PathBuf],
    rounds: &[Vec<NodeRound>],
    direct: bool,
) {
    let agg = |f: fn(&NodeRound) -> &Phase| {
        median(
            rounds
                .iter()
                .map(|r| aggregate_gib_s(r.iter().map(f)))
                .collect(),
        )
    };
    let (store, load) = (agg(|n| &n.store), agg(|n| &n.load));
    let per_node = |i: usize, f: fn(&NodeRound) -> &Phase, stat: fn(&Phase) -> f64| {
        median(rounds.iter().map(|r| stat(f(&r[i]))).collect())
    };
    println!(
        "kvx bench posix: {} nodes (one directory each, loads cross-node: node i loads node i+1's blocks), engine {engine}, direct {direct}, block {} KiB, {} blocks per node, queue depth {} (+ {} waiting) per node, {} spare files, {} round(s), medians",
        dirs.len(),
        args.block_size >> 10,
        args.blocks,
        args.queue_depth,
        backlog(args),
        spare_files(args),
        rounds.len()
    );
    println!(
        "{:<10} {:>12} {:>12} {:>10} {:>10}",
        "node", "store GiB/s", "load GiB/s", "store p50", "load p50"
    );
    let mut nodes_json = Vec::new();
    for (i, d) in dirs.iter().enumerate() {
        let s = per_node(i, |n| &n.store, Phase::gib_s);
        let l = per_node(i, |n| &n.load, Phase::gib_s);
        let sp50 = per_node(i, |n| &n.store, |p| p.percentile_us(50.0));
        let lp50 = per_node(i, |n| &n.load, |p| p.percentile_us(50.0));
        println!(
            "{:<10} {s:>12.3} {l:>12.3} {sp50:>8.0}us {lp50:>8.0}us",
            format!("node {i}")
        );
        nodes_json.push(serde_json::json!({
            "dir": d.display().to_string(),
            "store_gib_s": s, "load_gib_s": l, "store_p50_us": sp50, "load_p50_us": lp50,
        }));
    }
    println!("{:<10} {store:>12.3} {load:>12.3}", "all nodes");
    if args.json {
        let v = serde_json::json!({
            "engine": engine.as_str(),
            "direct": direct,
            "nodes": dirs.len(),
            "block_size": args.block_size,
            "blocks_per_node": args.blocks,
            "queue_depth": args.queue_depth,
            "backlog": backlog(args),
            "rounds": rounds.len(),
            "cross_node_loads": true,
            "store_gib_s": store,
            "load_gib_s": load,
            "per_node": nodes_json,
        });
        println!("{v}");
    }
}
