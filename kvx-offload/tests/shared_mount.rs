//! Two connectors (two engine nodes) on one shared file-tier directory: a block one node stored
//! is found by the other's lookup through a probe ("ask again later" while it runs), loaded
//! byte-exact from the file tier, and an eviction from a node's index leaves the file on the
//! mount. (The same with nodes in separate processes: kvx-posix's `shared_mount` tests.)

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvx_core::*;
use kvx_offload::*;

const T: Duration = Duration::from_secs(10);

fn shared(file_blocks: usize) -> Opts {
    Opts {
        host_blocks: 8,
        file_blocks,
        shared: Some(SharedMount {
            probe_ttl: Duration::from_millis(20),
            ..SharedMount::default()
        }),
        ..Opts::default()
    }
}

/// Ask until the lookup is not "ask again later"; returns the answer and how many times it
/// said "later".
fn lookup(r: &mut Rig, req: u64, keys: &[BlockKey]) -> (u64, usize) {
    let end = Instant::now() + T;
    let mut later = 0;
    loop {
        if let Some(n) = r.sched.get_num_new_matched_tokens(RequestId(req), keys, 0) {
            return (n, later);
        }
        later += 1;
        assert!(Instant::now() < end, "the lookup never answered");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Load `keys` (all found by a lookup of `req`) into engine `blocks`: the load must end with
/// no invalid block; true when the blocks then hold the keys' bytes.
fn load_all(r: &mut Rig, req: u64, keys: &[BlockKey], blocks: &[u32]) -> bool {
    let alloc: Vec<EngineBlockId> = blocks.iter().copied().map(EngineBlockId).collect();
    r.sched
        .update_state_after_alloc(RequestId(req), &alloc)
        .unwrap();
    assert!(
        r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(req))),
        "the load of request {req} never ended"
    );
    assert!(
        r.out.invalid_blocks.is_empty(),
        "{:?}",
        r.out.invalid_blocks
    );
    r.holds(keys, blocks)
}

#[test]
fn a_block_another_node_stored_is_found_and_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = rig(dir.path(), shared(64));
    let mut b = rig(dir.path(), shared(64));
    let ks = keys(7, 0, 7, 4);
    // Nothing is on the mount yet: after its probe, B's lookup is a miss.
    let (n, later) = lookup(&mut b, 1, &ks);
    assert_eq!(n, 0);
    assert!(later >= 1, "the first lookup waits for its probe");
    assert!(a.offload(1, &ks, &[0, 1, 2, 3], T));
    std::thread::sleep(Duration::from_millis(30)); // B's cached miss expires
    let (n, later) = lookup(&mut b, 2, &ks);
    assert_eq!(n, 4 * BT as u64, "B finds all four blocks A stored");
    assert!(later >= 1, "B's index lacked them: it asked the mount");
    for k in &ks {
        assert!(b.sched.manager().is_stored(Tier::File, *k));
    }
    assert!(
        load_all(&mut b, 2, &ks, &[10, 11, 12, 13]),
        "byte-exact from A's files"
    );
}

#[test]
fn an_eviction_from_a_nodes_index_leaves_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = rig(dir.path(), shared(64));
    let mut b = rig(dir.path(), shared(2));
    let ks = keys(8, 0, 8, 4);
    assert!(a.offload(1, &ks, &[0, 1, 2, 3], T));
    // B's file index holds 2 blocks: adopting the first two fills it.
    let (n, _) = lookup(&mut b, 1, &ks);
    assert_eq!(n, 2 * BT as u64, "a prefix as long as B's index holds");
    let first = [EngineBlockId(10), EngineBlockId(11)];
    b.sched
        .update_state_after_alloc(RequestId(1), &first)
        .unwrap();
    assert!(b.step_until(T, |r| r.out.finished_recving.contains(&RequestId(1))));
    assert!(
        b.files.contains(ks[0]),
        "a loaded block is in B's store index"
    );
    // Two more evict the first two from B's index (only: the files stay for the other nodes).
    let (n, _) = lookup(&mut b, 2, &ks[2..]);
    assert_eq!(n, 2 * BT as u64);
    let second = [EngineBlockId(12), EngineBlockId(13)];
    b.sched
        .update_state_after_alloc(RequestId(2), &second)
        .unwrap();
    assert!(b.step_until(T, |r| r.out.finished_recving.contains(&RequestId(2))));
    assert!(!b.sched.manager().is_stored(Tier::File, ks[0]));
    assert!(b.step_until(T, |r| !r.files.contains(ks[0])), "B forgot it");
    for k in &ks {
        assert!(
            b.files.block_path(*k).exists(),
            "{k}: a node's eviction never removes a shared block"
        );
    }
}

#[test]
fn blocks_another_node_removed_leave_the_index_at_the_next_collector_pass() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = rig(dir.path(), shared(64));
    // B runs a collector whose quota never bites: its passes only list the mount.
    let interval = 20;
    let mut opts = shared(64);
    if let Some(m) = opts.shared.as_mut() {
        m.quota_bytes = Some(1 << 40);
        m.collect_interval = Duration::from_millis(interval);
    }
    let mut b = rig(dir.path(), opts);
    let ks = keys(9, 0, 9, 4);
    assert!(a.offload(1, &ks, &[0, 1, 2, 3], T));
    std::thread::sleep(Duration::from_millis(30)); // B's cached misses expire
    let (n, _) = lookup(&mut b, 1, &ks);
    assert_eq!(n, 4 * BT as u64, "B adopted A's four blocks");
    b.finish(1);
    // Another node's collector removes the last two files.
    for k in &ks[2..] {
        std::fs::remove_file(a.files.block_path(*k)).unwrap();
    }
    let removed_at = Instant::now();
    // The first pass that began after the removal drops them from B's index (one interval
    // for the pass to start, one for it to end, and 50 ms of slack). Held at the last check
    // that still found them listed (the test's own stepping between checks is not B's).
    let bound = Duration::from_millis(2 * interval + 50);
    // Both removed blocks (a pass already under way may drop one before the other).
    let listed = b
        .step_until_last_miss(removed_at, T, |r| {
            ks[2..]
                .iter()
                .all(|k| !r.sched.manager().is_stored(Tier::File, *k))
        })
        .expect("B never forgot the removed blocks");
    println!("B still listed the removed blocks {listed:?} after the removal (bound {bound:?})");
    assert!(
        listed <= bound,
        "still listed {listed:?} after the removal, bound {bound:?}"
    );
    assert!(
        b.sched.manager().is_stored(Tier::File, ks[0]),
        "still listed"
    );
    assert!(
        b.step_until(T, |r| !r.files.contains(ks[2])),
        "the store forgot it too"
    );
    // B's lookup now stops where the mount does: no load that would fail.
    let (n, _) = lookup(&mut b, 2, &ks);
    assert_eq!(n, 2 * BT as u64);
    for k in &ks[..2] {
        assert!(a.files.block_path(*k).exists(), "{k}: listed blocks stay");
    }
}

#[test]
fn written_back_blocks_reach_the_mount_as_they_leave_the_host_tier() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = shared(64);
    if let Some(m) = opts.shared.as_mut() {
        m.write_back = true;
    }
    let mut a = rig(dir.path(), opts);
    let mut b = rig(dir.path(), shared(64));
    let first = keys(10, 0, 10, 4);
    assert!(a.offload(1, &first, &[0, 1, 2, 3], T));
    for k in &first {
        assert!(a.sched.manager().is_stored(Tier::Host, *k));
        assert!(!a.files.block_path(*k).exists(), "{k}: not written through");
    }
    let (n, _) = lookup(&mut b, 1, &first);
    assert_eq!(n, 0, "B cannot see blocks still only in A's host tier");
    b.finish(1);
    let last_use = std::time::SystemTime::now();
    std::thread::sleep(Duration::from_millis(1100)); // mtimes a second apart at least
    // Eight more blocks fill A's host tier of 8: the first four leave it for the mount.
    let more = keys(11, 0, 11, 8);
    assert!(a.offload(2, &more, &[4, 5, 6, 7, 8, 9, 10, 11], T));
    for k in &first {
        assert!(!a.sched.manager().is_stored(Tier::Host, *k));
        assert!(
            a.sched.manager().is_stored(Tier::File, *k),
            "{k}: written back"
        );
    }
    // Their recency on the mount is their last use in A's host tier, not the write's time.
    for k in &first {
        let path = a.files.block_path(*k);
        let end = Instant::now() + T;
        let mtime = loop {
            let m = std::fs::metadata(&path).unwrap().modified().unwrap();
            if m <= last_use || Instant::now() >= end {
                break m;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(
            mtime <= last_use,
            "{k}: mtime {mtime:?} after its last use {last_use:?}"
        );
    }
    std::thread::sleep(Duration::from_millis(30)); // B's cached misses expire
    let (n, _) = lookup(&mut b, 2, &first);
    assert_eq!(n, 4 * BT as u64, "B finds the written-back blocks");
    assert!(
        load_all(&mut b, 2, &first, &[20, 21, 22, 23]),
        "byte-exact from A's host buffers"
    );
    assert!(
        a.settle(T) && a.pool_whole(),
        "the write-back gave its buffers back"
    );
}

#[test]
fn shared_mount_settings_are_checked() {
    let bad = |f: fn(&mut SharedMount), field: &str| {
        let mut m = SharedMount::default();
        f(&mut m);
        let mut cfg = shared(4).config(std::path::Path::new("/tmp/x"));
        cfg.file.as_mut().unwrap().shared = Some(m);
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains(field), "{e}");
    };
    bad(
        |m| m.probe_deadline = Duration::ZERO,
        "file.shared.probe_deadline_ms",
    );
    bad(|m| m.probe_entries = 0, "file.shared.probe_entries");
    bad(
        |m| m.collect_interval = Duration::ZERO,
        "file.shared.collect_interval_ms",
    );
    bad(|m| m.quota_bytes = Some(0), "file.shared.quota_bytes");
    let toml = r#"
        host_blocks = 4
        [file]
        roots = ["/tmp/kv"]
        blocks = 16
        [file.shared]
        quota_bytes = 1048576
    "#;
    let cfg = OffloadConfig::from_toml(toml).unwrap();
    let m = cfg.file.unwrap().shared.unwrap();
    assert_eq!(m.quota_bytes, Some(1 << 20));
    assert_eq!(
        m.probe_deadline,
        Duration::from_millis(200),
        "documented default"
    );
}
