//! `--node-dir`, once per node, through the built binary: `kvx replay --nodes N` and `kvx bench
//! posix` with each node on its own path to one shared directory (here symlinks to one real
//! directory, as mounts of one volume are on a distributed file system) run as with `--dir`,
//! every node through its own path; a count that does not match `--nodes`, directories that do
//! not show one directory, and options that measure one directory are refused with one clear
//! line and exit 2.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::last_json;

fn kvx(args: &[&str], dirs: &[PathBuf]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvx"));
    cmd.args(args);
    for d in dirs {
        cmd.arg("--node-dir").arg(d);
    }
    cmd.output().expect("run kvx")
}

/// `n` paths to the one directory `shared` (itself, then symlinks in `links`).
fn paths_to(shared: &Path, links: &Path, n: usize) -> Vec<PathBuf> {
    let mut dirs = vec![shared.to_path_buf()];
    for i in 1..n {
        let link = links.join(format!("node{i}"));
        std::os::unix::fs::symlink(shared, &link).expect("symlink");
        dirs.push(link);
    }
    dirs
}

fn refused(out: &Output, needle: &str) {
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(needle), "{stderr}");
}

const REPLAY: [&str; 13] = [
    "replay",
    "--limit",
    "150",
    "--block-bytes",
    "4K",
    "--host-blocks",
    "256",
    "--shared-writes",
    "through",
    "--json",
    "--nodes",
    "3",
    "--keep",
];

#[test]
fn replay_nodes_share_one_directory_each_through_its_own_path() {
    let shared = tempfile::tempdir().expect("tempdir");
    let links = tempfile::tempdir().expect("tempdir");
    let dirs = paths_to(shared.path(), links.path(), 3);
    let j = last_json(&kvx(&REPLAY, &dirs));
    assert_eq!(j["nodes"], 3);
    let named: Vec<&str> = j["node_dirs"]
        .as_array()
        .expect("node_dirs")
        .iter()
        .map(|d| d.as_str().expect("a path"))
        .collect();
    let given: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    assert_eq!(named, given, "every node's directory, in node order");
    assert!(j["cross_node_hits"].as_u64() > Some(0), "{j}");
    assert!(j["ideal_shared_lru_hit_rate"].as_f64() > Some(0.0), "{j}");
    assert_eq!(j["failed_requests"], 0, "{j}");
    // The blocks the nodes stored are in the shared directory, whole: `kvx verify` through the
    // last node's path checks every one.
    let out = Command::new(env!("CARGO_BIN_EXE_kvx"))
        .arg("verify")
        .arg(&dirs[2])
        .arg("--json")
        .output()
        .expect("run kvx verify");
    let verify = last_json(&out);
    assert!(verify["blocks_checked"].as_u64() > Some(0), "{verify}");
    assert_eq!(verify["problems"], 0, "{verify}");
    let left: Vec<_> = std::fs::read_dir(shared.path())
        .expect("read_dir")
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(".kvx-node-dirs")
        })
        .collect();
    assert!(left.is_empty(), "the check's marker is removed: {left:?}");
}

#[test]
fn replay_refuses_node_dirs_that_do_not_fit() {
    let shared = tempfile::tempdir().expect("tempdir");
    let links = tempfile::tempdir().expect("tempdir");
    let two = paths_to(shared.path(), links.path(), 2);
    refused(
        &kvx(&REPLAY, &two),
        "--node-dir given 2 time(s) for 3 node(s)",
    );
    let apart: Vec<PathBuf> = (0..3)
        .map(|i| links.path().join(format!("apart{i}")))
        .collect();
    refused(&kvx(&REPLAY, &apart), "(node 1) does not show the files");
    let mut with_dir = REPLAY.to_vec();
    let d = shared.path().to_str().expect("utf-8 path");
    with_dir.extend(["--dir", d]);
    refused(
        &kvx(
            &with_dir,
            &paths_to(shared.path(), &links.path().join("x"), 1),
        ),
        "cannot be used with",
    );
}

const BENCH: [&str; 9] = [
    "bench",
    "posix",
    "--block-size",
    "64KiB",
    "--blocks",
    "64",
    "--queue-depth",
    "4",
    "--json",
];

#[test]
fn bench_posix_nodes_store_through_their_own_paths_and_load_each_others_blocks() {
    let shared = tempfile::tempdir().expect("tempdir");
    let links = tempfile::tempdir().expect("tempdir");
    let dirs = paths_to(shared.path(), links.path(), 3);
    let j = last_json(&kvx(&BENCH, &dirs));
    assert_eq!(j["nodes"], 3);
    assert_eq!(j["cross_node_loads"], true);
    let per_node = j["per_node"].as_array().expect("per_node");
    assert_eq!(per_node.len(), 3);
    for (p, d) in per_node.iter().zip(&dirs) {
        assert_eq!(p["dir"], d.display().to_string());
        assert!(p["store_gib_s"].as_f64() > Some(0.0), "{p}");
        assert!(p["load_gib_s"].as_f64() > Some(0.0), "{p}");
    }
    assert!(j["load_gib_s"].as_f64() > Some(0.0), "{j}");
    let left: Vec<_> = std::fs::read_dir(shared.path())
        .expect("read_dir")
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert!(left.is_empty(), "the bench folder is removed: {left:?}");
}

#[test]
fn bench_posix_refuses_node_dirs_that_do_not_fit() {
    let links = tempfile::tempdir().expect("tempdir");
    let apart: Vec<PathBuf> = (0..2)
        .map(|i| links.path().join(format!("apart{i}")))
        .collect();
    refused(&kvx(&BENCH, &apart), "(node 1) does not show the files");
    let shared = tempfile::tempdir().expect("tempdir");
    let dirs = paths_to(shared.path(), links.path(), 2);
    let mut fio = BENCH.to_vec();
    fio.push("--fio");
    refused(&kvx(&fio, &dirs), "measure one directory");
    refused(&kvx(&BENCH, &[]), "--dir");
}
