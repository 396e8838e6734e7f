//! The shared file tier on a real distributed file system: a GlusterFS volume in loopback
//! ([`volume`]), kvx nodes in separate processes each on its own FUSE mount of it, and brick
//! faults (stopped, killed), a node killed mid-store, and shutdown on a stuck volume.
//!
//! The test process is node A; the other nodes are this binary re-executed as kvx-posix's
//! shared-mount child nodes ([`node`]) or as a store loop ([`writer`]). Where GlusterFS, root
//! or `/dev/fuse` is missing, one `skip:` line is printed and every test is ignored. The
//! suite's last step checks that no mount, GlusterFS process or network namespace it started
//! is left.

#[path = "../../../kvx-posix/tests/shared_mount/node.rs"]
mod node;
mod volume;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use kvx_posix::maintenance::{VerifyOptions, verify};
use kvx_posix::{CollectorConfig, IoEngine};
use libtest_mimic::{Arguments, Failed, Trial};
use node::*;
use volume::{Gluster, Layout, Volume};

/// Mount `n` FUSE mounts of `v`; the store root on each.
fn roots(v: &mut Volume<'_>, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|_| v.mount().expect("mount the volume").join("kv"))
        .collect()
}

/// `kvx verify` (the library call it runs) on `root` finds no problem; returns the blocks
/// checked.
fn verify_clean(root: &std::path::Path) -> u64 {
    let opts = VerifyOptions {
        deadline: Duration::from_secs(5),
        stale_after: Duration::from_secs(600),
        repair: false,
    };
    let r = verify(root, &opts, &mut |_| {}).expect("verify ran");
    assert_eq!(r.problems(), 0, "verify found problems: {:?}", r.findings);
    r.blocks_checked
}

/// a. Three nodes, each on its own mount of a replica-2 volume: blocks A stores are found and
/// loaded byte-exact by B and C; with A storing, B loading and C collecting at once, the
/// collectors keep the volume under its quota; `kvx verify` is clean afterwards.
fn three_nodes_share_the_volume(g: &Gluster, engine: IoEngine) {
    let mut v = g.volume(Layout::Replica2).expect("volume");
    let roots = roots(&mut v, 3);
    let a = Node::open(&roots[0], engine);
    let mut b = ChildNode::spawn(&roots[1], engine);
    let mut c = ChildNode::spawn(&roots[2], engine);
    assert_eq!(b.ask("find 0 8", "found"), vec![0], "nothing stored yet");
    let keys: Vec<_> = (0..32).map(key).collect();
    a.store(&keys, 1);
    // The misses B cached expire after 100 ms.
    std::thread::sleep(Duration::from_millis(150));
    for n in [&mut b, &mut c] {
        assert_eq!(n.ask("find 0 32", "found"), vec![32], "every block found");
        assert_eq!(
            n.ask("load 0 32 1", "load"),
            vec![32, 0, 0, 0],
            "every block byte-exact"
        );
    }
    // A re-stores and collects with a quota of 16 blocks; B loads; C collects too.
    let quota = CollectorConfig::new(16 * (BLOCK as u64 + 4096));
    b.send("churn 0 32 3000");
    c.send(&format!("collect {} 3000", quota.quota_bytes));
    let stop = AtomicBool::new(false);
    let end = Instant::now() + Duration::from_millis(3000);
    let mut generation = 1u8;
    while Instant::now() < end {
        generation = generation.wrapping_add(1);
        a.store(&keys, generation);
        a.files.collect(&quota, &stop).expect("collect");
    }
    let v = b.answer("churn");
    assert_eq!(v[1], 0, "a load returned a mix of two writes: {v:?}");
    assert!(v[0] > 0, "loads found whole blocks: {v:?}");
    let passes = c.answer("collect");
    assert!(passes[0] >= 1, "C's collector ran beside A's: {passes:?}");
    // A quiet pass, its removes landed: the volume is under the quota.
    let r = a.files.collect(&quota, &stop).expect("collect");
    assert!(
        kvx_posix::testing::wait_until(SOON, || r
            .removed
            .iter()
            .all(|k| !a.files.block_path(*k).exists())),
        "the removes landed: {r:?}"
    );
    let after = a.files.collect(&quota, &stop).expect("collect");
    assert!(
        after.bytes <= quota.quota_bytes,
        "{} bytes over the quota of {}",
        after.bytes,
        quota.quota_bytes
    );
    b.quit();
    c.quit();
    drop(a);
    let checked = verify_clean(&roots[1]);
    assert!(checked > 0, "verify checked the kept blocks");
    println!(
        "three nodes: byte-exact cross-node loads, {} bytes kept (quota {}), verify clean ({checked} blocks)",
        after.bytes, quota.quota_bytes
    );
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
    let gluster = match volume::available() {
        Ok(()) => Some(Arc::new(Gluster::start().expect("start glusterd"))),
        Err(reason) => {
            println!("skip: GlusterFS tests ignored: {reason}");
            None
        }
    };
    let mut trials = Vec::new();
    let mut add = |name: &str, test: fn(&Gluster)| {
        let g = gluster.clone();
        trials.push(
            Trial::test(name, move || {
                test(g.as_deref().ok_or_else(|| Failed::from("no GlusterFS"))?);
                Ok(())
            })
            .with_ignored_flag(gluster.is_none()),
        );
    };
    add("three_nodes_share_the_volume_uring", |g| {
        three_nodes_share_the_volume(g, IoEngine::Uring)
    });
    let conclusion = libtest_mimic::run(&args, trials);
    // The suite's last step: nothing it started is left.
    if let Some(g) = gluster {
        let g = Arc::try_unwrap(g).unwrap_or_else(|_| panic!("a test still holds the fixture"));
        let left = g.stop();
        if !left.is_empty() {
            eprintln!("GlusterFS suite left behind: {left:?}");
            std::process::exit(1);
        }
        println!("GlusterFS suite: no mount, GlusterFS process or network namespace left");
    }
    conclusion.exit();
}
