//! The shared file tier on a real distributed file system: a GlusterFS volume in loopback
//! ([`volume`]), kvx nodes in separate processes each on its own FUSE mount of it, and brick
//! faults (stopped, killed), a node killed mid-store, and shutdown on a stuck volume.
//!
//! The test process is node A; the other nodes are this binary re-executed as kvx-posix's
//! shared-mount child nodes ([`node`]) or as a store loop ([`writer`]). Where GlusterFS, root
//! or `/dev/fuse` is missing, one `skip:` line is printed and every test is ignored. The
//! suite's last step checks that no mount, GlusterFS process or network namespace it started
//! is left.

#[path = "../common/mod.rs"]
mod common;
mod netns;
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
/// collectors keep the volume under its quota; `kvx verify` is clean afterwards. What the
/// nodes see is tested here, not when (tests b and d hold probes to their deadline): their
/// probes wait [`PATIENT_PROBE`] (one answered past the usual deadline under load, 16 blocks
/// of 32 then missed, the breaker open).
fn three_nodes_share_the_volume(g: &Gluster, engine: IoEngine) {
    let mut v = g.volume(Layout::Replica2).expect("volume");
    let roots = roots(&mut v, 3);
    let a = Node::open_probing(&roots[0], engine, PATIENT_PROBE);
    let mut b = ChildNode::spawn_probing(&[], &roots[1], engine, PATIENT_PROBE);
    let mut c = ChildNode::spawn_probing(&[], &roots[2], engine, PATIENT_PROBE);
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
    let (mut generation, mut refused) = (1u8, 0);
    while Instant::now() < end {
        generation = generation.wrapping_add(1);
        // A block whose remove by A's own collector is still in flight is refused, not stored
        // over by a file that remove would then take.
        refused += a.store_unless_removing(&keys, generation);
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
        "three nodes: byte-exact cross-node loads, {} bytes kept (quota {}), verify clean ({checked} blocks), {refused} of A's stores refused while A's remove of their block was in flight",
        after.bytes, quota.quota_bytes
    );
}

/// True when the breaker of `node`'s root is open.
fn breaker_open(node: &Node) -> bool {
    matches!(
        node.files.breaker_state(0),
        Some(kvx_policy::BreakerState::Open { .. })
    )
}

/// b. One brick of a replica-2 volume stopped (SIGSTOP) while B and C probe and load and A
/// stores: every op ends by its deadline plus a tick and 50 ms, the breakers open, lookups then
/// answer at once; after SIGCONT every node serves again within the breaker's cool-down, no
/// block is torn and every block reported stored is there, byte-exact.
fn stopped_brick(g: &Gluster, engine: IoEngine) {
    let mut v = g.volume(Layout::Replica2).expect("volume");
    let roots = roots(&mut v, 3);
    let a = Node::open(&roots[0], engine);
    let mut b = ChildNode::spawn(&roots[1], engine);
    let mut c = ChildNode::spawn(&roots[2], engine);
    let keys: Vec<_> = (0..8).map(key).collect();
    a.store(&keys, 1);
    std::thread::sleep(Duration::from_millis(150));
    for n in [&mut b, &mut c] {
        assert_eq!(n.ask("load 0 8 1", "load"), vec![8, 0, 0, 0]);
    }
    v.stop_brick(0);
    // B meets the stop with its probes first, C with its loads first; A stores meanwhile.
    b.send("frozen 100 104 0 4 0");
    c.send("frozen 200 204 0 4 1");
    let mut stored = Vec::new();
    let mut store_late = Duration::ZERO;
    // kvx's threads of node A (this process): a verdict late because the OS did not run them
    // is excused that much.
    let mut unscheduled = kvx_thread_clock::UnscheduledLog::new("kvx-");
    for i in 8..16 {
        let deadline = Instant::now() + LOAD_DEADLINE;
        unscheduled.sample();
        let (ok, at) = a.store_by(key(i), 2, deadline);
        unscheduled.sample();
        let late = at.saturating_duration_since(deadline);
        let excused = unscheduled.between(deadline, at);
        assert!(
            late <= MARGIN + excused,
            "a store ended {late:?} after its deadline (bound {MARGIN:?} plus the {excused:?} \
             kvx's threads were not scheduled)"
        );
        store_late = store_late.max(late);
        if ok {
            stored.push(i);
        }
    }
    assert!(breaker_open(&a), "A's breaker opened");
    let bound = PROBE_DEADLINE + MARGIN;
    for n in [&mut b, &mut c] {
        let r = n.answer("frozen");
        let (answer_us, first_absent, late_us, open) = (r[0], r[1], r[2], r[4]);
        assert!(
            Duration::from_micros(answer_us) <= bound,
            "a lookup took {answer_us} us (bound {bound:?})"
        );
        assert_eq!(first_absent, 1, "probes end as misses, then answer at once");
        assert!(
            Duration::from_micros(late_us) <= MARGIN,
            "a load ended {late_us} us after its deadline (bound {MARGIN:?})"
        );
        assert_eq!(open, 1, "the breaker opened");
        println!(
            "stopped brick: slowest lookup {answer_us} us (bound {bound:?}), loads at most {late_us} us late, stores at most {store_late:?} late (bound {MARGIN:?})"
        );
    }
    v.continue_brick(0);
    let continued = Instant::now();
    // Served again: B loads a block stored before the stop, byte-exact.
    let cool_down = Duration::from_millis(config(&roots[0], engine).breaker.cool_down_ms);
    let mut served = None;
    while served.is_none() && continued.elapsed() < SOON {
        if b.ask("load 0 1 1", "load") == vec![1, 0, 0, 0] {
            served = Some(continued.elapsed());
        } else {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let served = served.expect("B serves again after SIGCONT");
    println!("after SIGCONT B served again in {served:?} (cool-down {cool_down:?})");
    assert!(
        served <= cool_down + MARGIN,
        "served again {served:?} after SIGCONT (bound: cool-down {cool_down:?} + {MARGIN:?})"
    );
    // Nothing torn, nothing reported stored lost.
    std::thread::sleep(Duration::from_millis(150));
    for n in [&mut b, &mut c] {
        assert!(
            kvx_posix::testing::wait_until(SOON, || n.ask("load 0 8 1", "load")
                == vec![8, 0, 0, 0]),
            "the blocks stored before the stop are all there"
        );
        for &i in &stored {
            assert_eq!(
                n.ask(&format!("load {i} {} 2", i + 1), "load"),
                vec![1, 0, 0, 0],
                "block {i} was reported stored during the stop"
            );
        }
        let r = n.ask("load 8 16 2", "load");
        assert_eq!((r[1], r[2]), (0, 0), "no torn or foreign block: {r:?}");
    }
    b.quit();
    c.quit();
    drop(a);
    verify_clean(&roots[1]);
}

/// Whether brick `i` of `v` holds key `k`'s data (the brick keeps the volume's paths; a
/// distributed volume leaves an empty link file on the brick a renamed file's name hashes to).
fn on_brick(v: &Volume<'_>, i: usize, node: &Node, k: kvx_core::BlockKey) -> bool {
    let path = node.files.block_path(k);
    let below_mount = path
        .strip_prefix(path.ancestors().nth(3).expect("the mount"))
        .expect("below the mount");
    std::fs::metadata(v.bricks[i].path.join(below_mount)).is_ok_and(|m| m.len() > 0)
}

/// c. A brick killed: on the replica-2 volume every block is still served, and new blocks
/// are stored; on the distributed volume the blocks whose data was on the dead brick fail one
/// by one (invalid: recompute) and the others are served byte-exact, each load given the
/// breaker's cool-down after a failure (three failures in a row open the root's breaker, and
/// an open breaker refuses every block of the root). GlusterFS keeps a renamed file's data
/// on the brick its temporary name hashed to, with a link file under the final name: the
/// brick directories say which blocks' data each holds, and the victim is the brick holding
/// the most.
fn killed_brick(g: &Gluster, layout: Layout, engine: IoEngine) {
    let mut v = g.volume(layout).expect("volume");
    let roots = roots(&mut v, 3);
    let a = Node::open(&roots[0], engine);
    let mut b = ChildNode::spawn(&roots[1], engine);
    let keys: Vec<_> = (0..32).map(key).collect();
    a.store(&keys, 1);
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(b.ask("load 0 32 1", "load"), vec![32, 0, 0, 0]);
    let data_on =
        |i: usize| -> Vec<u64> { (0..32).filter(|&k| on_brick(&v, i, &a, key(k))).collect() };
    let (on0, on1) = (data_on(0), data_on(1));
    let (victim, on_dead) = if on0.len() >= on1.len() {
        (0, on0)
    } else {
        (1, on1)
    };
    // C opens before the kill (its store's setup needs both bricks) and reads no block before.
    let mut c = ChildNode::spawn(&roots[2], engine);
    v.kill_brick(victim);
    if layout == Layout::Replica2 {
        assert_eq!(on_dead.len(), 32, "every block is on both bricks");
        assert_eq!(
            b.ask("load 0 32 1", "load"),
            vec![32, 0, 0, 0],
            "the other brick serves every block"
        );
        let more: Vec<_> = (32..48).map(key).collect();
        a.store(&more, 1);
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(b.ask("load 32 48 1", "load"), vec![16, 0, 0, 0]);
        println!("replica 2, one brick killed: all 48 blocks served");
    } else {
        // C's mount never read the blocks (B's client may serve them from its cache). A block
        // whose data was on the dead brick fails its read (ENOTCONN), an I/O failure of the
        // root: three in a row open C's breaker, which then refuses every block of the root,
        // on the live brick too, for its cool-down. So after a failure the next load waits
        // out the cool-down, and each load's verdict is its own block's.
        let cool_down = Duration::from_millis(config(&roots[2], engine).breaker.cool_down_ms);
        let mut failed = Vec::new();
        for i in 0..32 {
            let r = c.ask(&format!("load {i} {} 1", i + 1), "load");
            assert_eq!((r[1], r[2]), (0, 0), "block {i}: never foreign or torn");
            if r[0] != 1 {
                failed.push(i);
                std::thread::sleep(cool_down + MARGIN);
            }
        }
        println!(
            "distributed, brick {victim} killed: {} of 32 blocks failed, {} had their data there (each load after a failure waited out the breaker's cool-down of {cool_down:?})",
            failed.len(),
            on_dead.len()
        );
        assert!(!failed.is_empty(), "blocks on the dead brick fail");
        assert_eq!(failed, on_dead, "exactly the blocks on the dead brick fail");
    }
    c.quit();
    b.quit();
}

/// d. One node cut from the bricks: C's FUSE client and C itself run in a network namespace
/// that reaches the bricks through one veth pair, and the link is dropped. C's loads, probes
/// and stores end by their deadline plus a tick and 50 ms (at kvx's verdict) and its breaker
/// opens; meanwhile B loads and probes and A stores with nothing failed and no breaker open;
/// after the link returns C serves again, and loads byte-exact what A stored during the cut.
fn node_cut_off(g: &Gluster, engine: IoEngine) {
    let island = netns::Island::create().expect("a network namespace");
    // The bricks are named by the host's end of the pair: reached from here and the island.
    let mut v = g
        .volume_at(Layout::Replica2, netns::HOST_ADDR)
        .expect("volume");
    let mut roots = roots(&mut v, 2);
    let island_mount = v.mount_under(&island.enter()).expect("mount in the island");
    roots.push(island_mount.join("kv"));
    let a = Node::open(&roots[0], engine);
    let mut b = ChildNode::spawn(&roots[1], engine);
    let mut c = ChildNode::spawn_under(&island.enter(), &roots[2], engine);
    let keys: Vec<_> = (0..16).map(key).collect();
    a.store(&keys, 1);
    std::thread::sleep(Duration::from_millis(150));
    for n in [&mut b, &mut c] {
        assert_eq!(n.ask("load 0 8 1", "load"), vec![8, 0, 0, 0]);
    }
    island.cut().expect("drop the link");
    // C loads keys 8..12, B keys 12..16, neither read before (their FUSE clients cache what
    // they read: quick-read keeps small files), then both probe new keys.
    c.send("frozen 100 104 8 12 1");
    b.send("frozen 200 204 12 16 1");
    let mut a_stored = 0;
    for i in 16..24 {
        let deadline = Instant::now() + LOAD_DEADLINE;
        a_stored += usize::from(a.store_by(key(i), 1, deadline).0);
    }
    let rb = b.answer("frozen");
    let rc = c.answer("frozen");
    let cut_stores = c.ask(
        &format!("stores 300 304 1 {}", LOAD_DEADLINE.as_millis()),
        "stores",
    );
    let bound = PROBE_DEADLINE + MARGIN;
    let (answer_us, first_absent, late_us, open) = (rc[0], rc[1], rc[2], rc[4]);
    let store_late_us = cut_stores[1];
    println!(
        "node cut off: C loaded {} of 4 and stored {} of 4, its slowest lookup {answer_us} us (bound {bound:?}), loads at most {late_us} us late, stores at most {store_late_us} us late (bound {MARGIN:?}); B loaded {} of 4, slowest lookup {} us; A stored {a_stored} of 8",
        rc[3], cut_stores[0], rb[3], rb[0]
    );
    assert!(
        Duration::from_micros(answer_us) <= bound,
        "C: a lookup took {answer_us} us (bound {bound:?})"
    );
    assert_eq!(
        first_absent, 1,
        "C: probes end as misses, then answer at once"
    );
    assert!(
        Duration::from_micros(late_us) <= MARGIN,
        "C: a load ended {late_us} us after its deadline (bound {MARGIN:?})"
    );
    assert!(
        Duration::from_micros(store_late_us) <= MARGIN,
        "C: a store ended {store_late_us} us after its deadline (bound {MARGIN:?})"
    );
    assert_eq!(rc[3], 0, "C loaded nothing it had not cached: {rc:?}");
    assert_eq!(open, 1, "C's breaker opened");
    // The others: every load and store served within its deadline, no breaker open.
    assert_eq!(rb[3], 4, "B loaded every block during the cut: {rb:?}");
    assert_eq!(rb[4], 0, "B's breaker stayed closed: {rb:?}");
    assert_eq!(a_stored, 8, "A stored every block during the cut");
    assert!(!breaker_open(&a), "A's breaker stayed closed");
    island.restore().expect("bring the link back");
    let restored = Instant::now();
    let mut served = None;
    while served.is_none() && restored.elapsed() < SOON {
        if c.ask("load 16 24 1", "load") == vec![8, 0, 0, 0] {
            served = Some(restored.elapsed());
        } else {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let served = served.expect("C serves again after the link returns");
    println!(
        "node cut off: after the link returned C loaded A's 8 blocks of the cut in {served:?}"
    );
    // What C reported stored during the cut is there for B, byte-exact.
    std::thread::sleep(Duration::from_millis(150));
    let r = b.ask("load 300 304 1", "load");
    assert_eq!(
        r[0], cut_stores[0],
        "C's stores reported ok are whole: {r:?}"
    );
    assert_eq!((r[1], r[2]), (0, 0), "no torn or foreign block: {r:?}");
    c.quit();
    b.quit();
    drop(a);
    verify_clean(&roots[1]);
}

/// Store keys 0..16 round after round until killed (the writer node of test e).
fn write_forever(spec: &str) {
    let (engine, root) = spec.split_once(' ').expect("writer spec: <engine> <root>");
    let node = Node::open(std::path::Path::new(root), engine.parse().expect("engine"));
    println!("ready");
    let keys: Vec<_> = (0..16).map(key).collect();
    for generation in 1u8.. {
        node.store(&keys, generation);
    }
}

/// Environment variable that turns the test binary into [`write_forever`].
const WRITER_ENV: &str = "KVX_GLUSTER_WRITER";

/// e. A node SIGKILLed mid-store: B, loading the same keys all along, never loads a torn or
/// partial block, and no load is refused (a block replaced under a load is a miss); the dead
/// node's temporary files go at the next collector pass.
fn node_killed_mid_store(g: &Gluster, engine: IoEngine) {
    use std::io::BufRead;
    let mut v = g.volume(Layout::Replica2).expect("volume");
    let roots = roots(&mut v, 3);
    let a = Node::open(&roots[0], engine);
    a.store(&(0..16).map(key).collect::<Vec<_>>(), 0);
    let mut b = ChildNode::spawn(&roots[1], engine);
    let mut leftovers = Vec::new();
    let mut loads = 0;
    for attempt in 0..10 {
        b.send("churn 0 16 800");
        let mut w = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .env(WRITER_ENV, format!("{engine} {}", roots[2].display()))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn the writer");
        let mut ready = String::new();
        std::io::BufReader::new(w.stdout.take().expect("stdout"))
            .read_line(&mut ready)
            .expect("writer ready");
        std::thread::sleep(Duration::from_millis(300 + 37 * attempt));
        w.kill().expect("SIGKILL the writer");
        w.wait().expect("reap the writer");
        let r = b.answer("churn");
        let (exact, mixed, invalid) = (r[0], r[1], r[2]);
        assert_eq!(mixed, 0, "a load returned a mix of two writes: {r:?}");
        // A block replaced or removed under a load is a miss (not found), never an I/O
        // failure: none of B's loads was refused, so its breaker never opened.
        assert_eq!(invalid, 0, "loads refused under churn: {r:?}");
        loads += exact + r[3];
        assert!(exact > 0, "{r:?}");
        let dead = format!("-{}-", w.id());
        leftovers = kvx_posix::testing::files_with_suffix(&roots[2], ".kvb.tmp")
            .into_iter()
            .filter(|p| p.to_string_lossy().contains(&dead))
            .collect();
        if !leftovers.is_empty() {
            break;
        }
    }
    assert!(
        !leftovers.is_empty(),
        "no kill in 10 landed mid-store (no temporary file left)"
    );
    // On the same host a dead writer's temporaries are stale at once; another host's after
    // `stale_temp_age`.
    let cfg = CollectorConfig::new(1 << 40);
    let r = a
        .files
        .collect(&cfg, &AtomicBool::new(false))
        .expect("collect");
    assert!(r.removed_temps >= leftovers.len(), "{r:?}, {leftovers:?}");
    // Seen through the writer's mount, whose client caches names for up to a second.
    assert!(
        kvx_posix::testing::wait_until(SOON, || leftovers.iter().all(|p| !p.exists())),
        "{leftovers:?}"
    );
    assert_eq!(b.ask("load 0 16 0", "load")[2], 0, "no torn block");
    println!(
        "node killed mid-store: {} temporaries collected; {loads} loads under churn, none torn or refused",
        leftovers.len()
    );
    b.quit();
    drop(a);
    verify_clean(&roots[1]);
}

/// The bound on `OffloadRuntime::shutdown` with I/O stuck in a stopped brick: one tick plus the
/// 50 ms allowance (it stops the driver thread and drops the backends, which wait for no I/O).
const SHUTDOWN_BOUND: Duration = MARGIN;

/// Shutdown on a stuck volume (the item 3): with stores and loads stuck in a stopped
/// brick, `runtime.shutdown()` returns within [`SHUTDOWN_BOUND`].
fn shutdown_on_a_stopped_brick(g: &Gluster) {
    use kvx_offload::SharedMount;
    let mut v = g.volume(Layout::Replica2).expect("volume");
    let root = roots(&mut v, 1).remove(0);
    let opts = || common::Opts {
        host_blocks: 4,
        load_ms: 300,
        store_ms: 300,
        shared: Some(SharedMount::default()),
        ..common::Opts::default()
    };
    let mut r = common::rig(&root, opts());
    let stored = common::keys(1, 0, 1, 8);
    assert!(
        r.offload(1, &stored, &[0, 1, 2, 3, 4, 5, 6, 7], SOON),
        "stored"
    );
    v.stop_brick(0);
    // Stores of new blocks and loads of stored ones, all stuck in the brick.
    let fresh = common::keys(2, 0, 2, 8);
    r.offload(
        2,
        &fresh,
        &[8, 9, 10, 11, 12, 13, 14, 15],
        Duration::from_millis(100),
    );
    r.load(3, &stored, &[16, 17, 18, 19, 20, 21, 22, 23]);
    let end = Instant::now() + Duration::from_millis(400);
    while Instant::now() < end {
        r.step();
        std::thread::sleep(Duration::from_millis(5));
    }
    let t0 = Instant::now();
    r.worker.take();
    r.runtime.take().expect("runtime").shutdown();
    let took = t0.elapsed();
    println!("shutdown with I/O stuck in a stopped brick took {took:?} (bound {SHUTDOWN_BOUND:?})");
    assert!(
        took <= SHUTDOWN_BOUND,
        "shutdown took {took:?} (bound {SHUTDOWN_BOUND:?})"
    );
    drop(r);
    v.continue_brick(0);
}

fn main() {
    if let Ok(spec) = std::env::var(NODE_ENV) {
        serve(&spec);
        return;
    }
    if let Ok(spec) = std::env::var(WRITER_ENV) {
        write_forever(&spec);
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
    add("stopped_brick_uring", |g| stopped_brick(g, IoEngine::Uring));
    add("stopped_brick_psync", |g| stopped_brick(g, IoEngine::Psync));
    add("killed_brick_replica2", |g| {
        killed_brick(g, Layout::Replica2, IoEngine::Uring)
    });
    add("killed_brick_distributed", |g| {
        killed_brick(g, Layout::Distributed, IoEngine::Uring)
    });
    add("node_cut_off", |g| node_cut_off(g, IoEngine::Uring));
    add("node_killed_mid_store", |g| {
        node_killed_mid_store(g, IoEngine::Uring)
    });
    add("shutdown_on_a_stopped_brick", shutdown_on_a_stopped_brick);
    let conclusion = libtest_mimic::run(&args, trials);
    // The suite's last step: nothing it started is left.
    if let Some(g) = gluster {
        let g = Arc::try_unwrap(g).unwrap_or_else(|_| panic!("a test still holds the fixture"));
        let mut left = g.stop();
        left.extend(
            netns::left()
                .into_iter()
                .map(|n| format!("network namespace {n}")),
        );
        if !left.is_empty() {
            eprintln!("GlusterFS suite left behind: {left:?}");
            std::process::exit(1);
        }
        println!("GlusterFS suite: no mount, GlusterFS process or network namespace left");
    }
    conclusion.exit();
}
