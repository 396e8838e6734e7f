//! Many engine nodes on one shared root, each a separate process: blocks one node stores are
//! found (probed) and loaded byte-exact by the others; a collector deleting under quota
//! pressure while another node loads yields exact bytes or an invalid block, never a mix; a
//! frozen FUSE mount makes every node's lookups answer within the probe deadline and loads end
//! by their deadline, the breakers open, and everything serves again after the thaw.
//!
//! The test process is node A; nodes B and C are this binary re-executed with [`node::NODE_ENV`]
//! set. FUSE tests print one `skip:` line and are ignored where FUSE cannot be mounted.

mod node;

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kvx_fusefs::{Backing, StallFs};
use kvx_posix::{CollectorConfig, IoEngine};
use libtest_mimic::{Arguments, Trial};
use node::*;

/// A and two child nodes on one directory: B and C, opened before A stores anything, find every
/// block by probing and load it byte-exact. What the nodes see is tested here, not when (the
/// frozen-mount test holds probes to their deadline): their probes wait [`PATIENT_PROBE`].
fn three_nodes_share_blocks(engine: IoEngine) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir");
    let root = dir.path().join("kv");
    let a = Node::open_probing(&root, engine, PATIENT_PROBE);
    let mut b = ChildNode::spawn_probing(&[], &root, engine, PATIENT_PROBE);
    let mut c = ChildNode::spawn_probing(&[], &root, engine, PATIENT_PROBE);
    // Before A stores, the probes find nothing.
    assert_eq!(b.ask("find 0 8", "found"), vec![0]);
    let keys: Vec<_> = (0..32).map(key).collect();
    a.store(&keys, 1);
    // The misses were cached for 100 ms only.
    std::thread::sleep(Duration::from_millis(150));
    for n in [&mut b, &mut c] {
        assert_eq!(n.ask("find 0 32", "found"), vec![32]);
        assert_eq!(n.ask("load 0 32 1", "load"), vec![32, 0, 0, 0]);
    }
    // A block another node removes is gone for the others too (a miss, not an error).
    assert!(a.files.remove(key(0)) || !a.files.contains(key(0)));
    assert!(wait_gone(&a, key(0)));
    assert_eq!(b.ask("load 0 1 1", "load"), vec![0, 0, 0, 1]);
    b.quit();
    c.quit();
}

fn wait_gone(a: &Node, k: kvx_core::BlockKey) -> bool {
    let path = a.files.block_path(k);
    let end = std::time::Instant::now() + SOON;
    while path.exists() {
        if std::time::Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// A re-stores 64 blocks round after round (a new generation each time) and runs its collector
/// with a quota of 16 blocks, while B loads the same blocks and C runs a collector of its own at
/// the same time: every load is byte-exact (some generation, whole) or reports its block
/// invalid, never a mix; two collectors at once fail no pass.
fn collector_under_readers(engine: IoEngine) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir");
    let root = dir.path().join("kv");
    let a = Node::open(&root, engine);
    let keys: Vec<_> = (0..64).map(key).collect();
    a.store(&keys, 0);
    let mut b = ChildNode::spawn(&root, engine);
    let mut c = ChildNode::spawn(&root, engine);
    let quota = CollectorConfig::new(16 * (BLOCK as u64 + 4096));
    b.send("churn 0 64 2500");
    c.send(&format!("collect {} 2500", quota.quota_bytes));
    let stop = AtomicBool::new(false);
    let end = std::time::Instant::now() + Duration::from_millis(2500);
    let (mut removed, mut refused, mut generation) = (0, 0, 0u8);
    while std::time::Instant::now() < end {
        generation = generation.wrapping_add(1);
        // A block whose collector remove is still queued is refused, not stored over by a
        // file the remove would then take.
        refused += a.store_unless_removing(&keys, generation);
        let r = a.files.collect(&quota, &stop).expect("collect");
        removed += r.removed.len();
    }
    println!(
        "collector_under_readers {engine}: {removed} blocks collected, {refused} stores refused while their remove was in flight"
    );
    assert!(removed >= 48, "the collector removed {removed} blocks");
    let v = b.answer("churn");
    let (exact, mixed, invalid, not_found) = (v[0], v[1], v[2], v[3]);
    assert_eq!(mixed, 0, "a load returned a mix of two writes");
    assert!(exact > 0, "some loads found their block: {v:?}");
    assert!(
        not_found + invalid > 0,
        "some loads met a removed block: {v:?}"
    );
    let v = c.answer("collect");
    assert!(v[0] >= 1, "C's collector ran beside A's: {v:?}");
    // Once the collector has run on a quiet store and its removes (queued, not awaited) have
    // landed, the root is under its quota.
    let r = a.files.collect(&quota, &stop).expect("collect");
    assert!(r.removed.iter().all(|k| wait_gone(&a, *k)), "{r:?}");
    let after = a.files.collect(&quota, &stop).expect("collect");
    assert!(after.bytes <= quota.quota_bytes, "{r:?} then {after:?}");
    b.quit();
    c.quit();
}

/// The shared root is a FUSE mount that freezes: B and C answer every lookup within the probe
/// deadline (a miss), end every load by its deadline, open their breakers, and after the thaw
/// find and load blocks again, byte-exact.
fn frozen_mount_all_nodes(engine: IoEngine) {
    let dir = tempfile::tempdir().expect("temp dir");
    let mount = StallFs::mount(dir.path(), Backing::Memory).expect("FUSE mount");
    let root = mount.path().join("kv");
    let a = Node::open(&root, engine);
    let mut b = ChildNode::spawn(&root, engine);
    let mut c = ChildNode::spawn(&root, engine);
    let keys: Vec<_> = (0..8).map(key).collect();
    a.store(&keys, 1);
    std::thread::sleep(Duration::from_millis(150));
    for n in [&mut b, &mut c] {
        assert_eq!(n.ask("find 0 8", "found"), vec![8]);
        assert_eq!(n.ask("load 0 8 1", "load"), vec![8, 0, 0, 0]);
    }
    mount.freeze();
    // B meets the freeze with its probes first, C with its loads first.
    b.send("frozen 100 104 0 4 0");
    c.send("frozen 200 204 0 4 1");
    let bound = PROBE_DEADLINE + MARGIN;
    for n in [&mut b, &mut c] {
        let v = n.answer("frozen");
        let (answer_us, first_absent, late_us, ok, open) = (v[0], v[1], v[2], v[3], v[4]);
        assert!(
            Duration::from_micros(answer_us) <= bound,
            "a lookup took {answer_us} us to answer (bound {bound:?})"
        );
        assert_eq!(
            first_absent, 1,
            "probes time out as misses; an open breaker answers at once"
        );
        assert!(
            Duration::from_micros(late_us) <= MARGIN,
            "a load ended {late_us} us after its deadline"
        );
        assert_eq!(ok, 0, "no load succeeds on a frozen mount");
        assert_eq!(open, 1, "the breaker opened");
        println!(
            "frozen mount: slowest lookup answered in {answer_us} us (bound {bound:?}); loads ended at most {late_us} us after their deadlines (bound {MARGIN:?})"
        );
    }
    mount.thaw();
    // After the thaw (and the breaker's cool-down) everything serves again.
    let more: Vec<_> = (8..12).map(key).collect();
    a.store(&more, 2);
    std::thread::sleep(Duration::from_millis(300));
    for n in [&mut b, &mut c] {
        let mut served = false;
        let end = std::time::Instant::now() + SOON;
        while !served && std::time::Instant::now() < end {
            served = n.ask("load 0 8 1", "load") == vec![8, 0, 0, 0]
                && n.ask("find 8 12", "found") == vec![4]
                && n.ask("load 8 12 2", "load") == vec![4, 0, 0, 0];
            if !served {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        assert!(served, "the node serves again after the thaw");
    }
    b.quit();
    c.quit();
    drop(a);
    drop(mount);
}

fn main() {
    if let Ok(spec) = std::env::var(NODE_ENV) {
        serve(&spec);
        return;
    }
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        args.test_threads = Some(1);
    }
    let no_fuse = match kvx_fusefs::fuse_available() {
        Ok(()) => false,
        Err(reason) => {
            println!("skip: shared-mount FUSE tests ignored: {reason}");
            true
        }
    };
    let mut trials = Vec::new();
    for e in [IoEngine::Uring, IoEngine::Psync] {
        trials.push(Trial::test(
            format!("three_nodes_share_blocks_{e}"),
            move || {
                three_nodes_share_blocks(e);
                Ok(())
            },
        ));
        trials.push(Trial::test(
            format!("collector_under_readers_{e}"),
            move || {
                collector_under_readers(e);
                Ok(())
            },
        ));
        trials.push(
            Trial::test(format!("frozen_mount_all_nodes_{e}"), move || {
                frozen_mount_all_nodes(e);
                Ok(())
            })
            .with_ignored_flag(no_fuse),
        );
    }
    libtest_mimic::run(&args, trials).exit();
}
