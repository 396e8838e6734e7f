//! A frozen mount: loads, stores and opens end at their deadline; buffers stay quarantined until
//! the kernel gives them back; a timed-out store never becomes visible.

use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_posix::IoEngine;

use crate::rig::*;

/// How long the 64 loads of [`stuck_mount_load`] have: long enough for all of them to reach the
/// frozen mount first (io_uring starts an io-wq thread for each, which a cold machine has taken
/// over 200 ms to do), so that the caller is already waiting for the reports when it passes.
const LOAD_DEADLINE: Duration = Duration::from_secs(1);

/// 64 loads in flight when the mount freezes: every task ends TimedOut on time, its report
/// reaches the waiting caller within a tick plus the allowance, and the engine's (host arena)
/// blocks are never written.
pub fn stuck_mount_load(engine: IoEngine) {
    let mut r = Rig::new(engine, Place::Fuse, |_| {});
    let keys: Vec<BlockKey> = (0..64).map(key).collect();
    r.store_ok(&keys);
    for i in 0..64 {
        r.arena_mut()
            .write_block(EngineBlockId(i), &vec![0xEE; BLOCK])
            .unwrap();
    }
    r.mount().freeze();
    let deadline = Instant::now() + LOAD_DEADLINE;
    let tasks: Vec<TaskId> = keys
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            let blocks = vec![OpBlock {
                key: k,
                engine: Some(EngineBlockId(i as u32)),
                buf: Buf::Owned(r.pool.take().unwrap()),
            }];
            r.submit_route(Direction::Load, vec![r.posix, r.host()], blocks, deadline)
        })
        .collect();
    assert!(
        r.mount().wait_blocked(64, SOON),
        "all 64 loads should be stuck in the mount (blocked: {})",
        r.mount().blocked_requests()
    );
    let ahead = deadline.saturating_duration_since(Instant::now());
    println!(
        "stuck_mount_load {engine}: all 64 loads stuck in the mount {ahead:?} before their deadline"
    );
    assert!(
        !ahead.is_zero(),
        "the loads reached the mount only after their deadline: the caller was not waiting"
    );
    for t in tasks {
        let rep = r.report_by(t, deadline + SOON);
        assert_timed_out_on_time(&rep, deadline);
        assert!(rep.blocks[0].buf.is_none(), "the stuck op keeps its buffer");
    }
    // The reports reached this thread within a tick plus the allowance of the deadline.
    let arrived = Instant::now().saturating_duration_since(deadline);
    println!(
        "stuck_mount_load {engine}: the last of 64 reports reached the caller {arrived:?} after the deadline (bound {MARGIN:?})"
    );
    assert!(arrived <= MARGIN);
    assert!(r.mount().blocked_requests() > 0, "the I/O is still stuck");
    let s = r.tracker();
    assert_eq!(s.zombie_ops, 64);
    assert_eq!(s.live_tasks, 0);
    for i in 0..64 {
        assert_eq!(
            r.arena().read_block(EngineBlockId(i)).unwrap(),
            vec![0xEE; BLOCK]
        );
    }
    r.mount().thaw();
    assert!(r.drained(), "late completions drain after thaw");
    for i in 0..64 {
        assert_eq!(
            r.arena().read_block(EngineBlockId(i)).unwrap(),
            vec![0xEE; BLOCK],
            "a late load must never reach engine memory"
        );
    }
    assert!(r.pool.is_whole(), "every quarantined buffer came back");
    assert!(r.tracker().late_completions >= 64);
}

/// Stores on a frozen mount time out on time; none becomes visible, even after thaw; no
/// temporary file is left; a retried store succeeds.
pub fn stuck_mount_store(engine: IoEngine) {
    // The timeouts open the root's breaker; a short cool-down lets the retry be its probe.
    let r = Rig::new(engine, Place::Fuse, |c| c.breaker.cool_down_ms = 200);
    let keys: Vec<BlockKey> = (1000..1016).map(key).collect();
    r.store_ok(&[key(1)]); // the root exists and the mount is warm
    r.mount().freeze();
    // The payloads are built before the clock starts: only submitting them is timed.
    let payloads: Vec<Vec<OpBlock>> = keys.iter().map(|&k| r.filled(&[k], BLOCK)).collect();
    let deadline = Instant::now() + DEADLINE;
    let tasks: Vec<TaskId> = payloads
        .into_iter()
        .map(|blocks| r.submit_route(Direction::Store, vec![r.posix], blocks, deadline))
        .collect();
    assert!(r.mount().wait_blocked(1, SOON));
    let mut late = Duration::ZERO;
    for t in tasks {
        late = late.max(assert_timed_out_on_time(
            &r.report_by(t, deadline + SOON),
            deadline,
        ));
    }
    println!(
        "stuck_mount_store {engine}: 16 stores timed out at most {late:?} after their deadline (bound {MARGIN:?})"
    );
    r.mount().thaw();
    assert!(r.drained());
    for &k in &keys {
        assert!(!r.files.contains(k), "timed-out block {k} is in the index");
        assert!(
            !r.files.block_path(k).exists(),
            "timed-out block {k} is visible"
        );
    }
    assert_eq!(
        files_with_suffix(&r.root, ".kvb.tmp"),
        Vec::<std::path::PathBuf>::new()
    );
    assert!(r.pool.is_whole());
    // After thaw (and the breaker's cool-down) the same stores succeed and read back.
    std::thread::sleep(std::time::Duration::from_millis(250));
    r.store_ok(&keys);
    assert_eq!(r.files.lookup(&keys), keys.len());
    let rep = r.load(&keys);
    assert!(rep.is_ok(), "{:?}", first_error(&rep));
    for (b, k) in rep.blocks.iter().zip(&keys) {
        assert_eq!(b.buf.as_ref().unwrap().as_slice(), &expected(*k, BLOCK)[..]);
    }
}

/// The freeze catches the open / create itself (nothing was opened before it): the load of an
/// existing block and the store of a new one still end on time.
pub fn stuck_open(engine: IoEngine) {
    let r = Rig::new(engine, Place::Fuse, |_| {});
    let old = key(2000);
    // A new key in the same leaf directory: its store starts with the create, not a mkdir.
    let new = (2001..)
        .map(key)
        .find(|k| k.0 >> 112 == old.0 >> 112)
        .expect("a key with the same 16-bit prefix");
    r.store_ok(&[old]);
    r.mount().freeze();
    let (empty, filled) = (r.empty(&[old]), r.filled(&[new], BLOCK));
    let deadline = Instant::now() + DEADLINE;
    let load = r.submit_route(Direction::Load, vec![r.posix], empty, deadline);
    let store = r.submit_route(Direction::Store, vec![r.posix], filled, deadline);
    // Frozen before either task started: the first request of each (the open of the block,
    // the create of the temporary file, or the lookup inside them) is what blocks.
    assert!(r.mount().wait_blocked(2, SOON), "open and create are stuck");
    let load_late = assert_timed_out_on_time(&r.report_by(load, deadline + SOON), deadline);
    let store_late = assert_timed_out_on_time(&r.report_by(store, deadline + SOON), deadline);
    println!(
        "stuck_open {engine}: load and store timed out {load_late:?} and {store_late:?} after their deadline (bound {MARGIN:?})"
    );
    r.mount().thaw();
    assert!(r.drained());
    assert!(!r.files.block_path(new).exists());
    assert!(files_with_suffix(&r.root, ".kvb.tmp").is_empty());
    assert!(r.load(&[old]).is_ok());
}

/// After timeouts the stuck ops' buffers stay lent (quarantined); buffers handed out meanwhile
/// carry a canary that no late completion overwrites; after thaw the buffers come back and the
/// zombie count returns to zero.
pub fn late_completion_quarantine(engine: IoEngine) {
    let r = Rig::with_pool(engine, Place::Fuse, 16, |_| {});
    let keys: Vec<BlockKey> = (3000..3008).map(key).collect();
    r.store_ok(&keys);
    assert!(r.pool.is_whole());
    r.mount().freeze();
    let deadline = Instant::now() + DEADLINE;
    let blocks = r.empty(&keys);
    let stuck: Vec<usize> = blocks
        .iter()
        .map(|b| match &b.buf {
            Buf::Owned(p) => p.index(),
            Buf::Shared(_) => unreachable!(),
        })
        .collect();
    let t = r.submit_route(Direction::Load, vec![r.posix], blocks, deadline);
    let rep = r.report_by(t, deadline + SOON);
    let late = assert_timed_out_on_time(&rep, deadline);
    println!(
        "late_completion_quarantine {engine}: timed out {late:?} after its deadline (bound {MARGIN:?})"
    );
    assert!(rep.blocks.iter().all(|b| b.buf.is_none()));
    assert_eq!(r.tracker().zombie_ops, 1);
    assert_eq!(r.pool.available(), 8, "the 8 stuck buffers are quarantined");
    assert!(stuck.iter().all(|&i| r.pool.is_lent(i)));
    // Hand out everything else and mark it.
    let mut canaries = Vec::new();
    while let Some(mut b) = r.pool.take() {
        assert!(
            !stuck.contains(&b.index()),
            "a quarantined buffer was handed out"
        );
        b.as_mut_slice().fill(0xC3);
        canaries.push(b);
    }
    assert_eq!(canaries.len(), 8);
    std::thread::sleep(Duration::from_millis(100));
    assert!(stuck.iter().all(|&i| r.pool.is_lent(i)), "still stuck");
    r.mount().thaw();
    assert!(r.drained());
    assert_eq!(r.tracker().zombie_ops, 0);
    assert!(r.tracker().late_completions >= 1);
    assert!(
        stuck.iter().all(|&i| !r.pool.is_lent(i)),
        "late completion returned them"
    );
    for c in &canaries {
        assert!(
            c.as_slice().iter().all(|&b| b == 0xC3),
            "buffer {} was written by a late completion",
            c.index()
        );
    }
    drop(canaries);
    assert!(r.pool.is_whole());
}
