//! Issue 11's acceptance tests that run without FUSE, each for both engines: an eviction burst,
//! a stall and a thaw, a late rename next to a newer store, and a read that returns after its
//! deadline.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvx_core::*;

use super::{rig, rig_in};
use crate::testing::Late;
use crate::testing::{SOON, key, wait_until};
use crate::{IoEngine, PosixStore};

both_engines!(
    eviction_burst_leaves_the_tier_serving,
    stall_then_thaw_recovers_every_worker,
    late_rename_never_deletes_a_newer_block,
    read_after_the_deadline_is_timed_out,
    full_queue_is_busy_at_submit,
);

/// 5,000 removes of block files on disk, then 1,000 stores and 1,000 loads submitted while the
/// removes are still running: every store and load succeeds within its deadline, nothing is
/// written off, and every removed file is gone at the end.
fn eviction_burst_leaves_the_tier_serving(engine: IoEngine) {
    let dir = tempfile::tempdir().expect("temp dir");
    // 5,000 block files already on disk (the store adopts them when it opens).
    let doomed: Vec<BlockKey> = (0..5000).map(|i| key(1_000_000 + i)).collect();
    let layout = crate::paths::Layout::new(vec![dir.path().to_path_buf()]);
    for k in &doomed {
        let p = layout.block_path(*k);
        std::fs::create_dir_all(p.parent().expect("leaf dir")).expect("mkdir");
        std::fs::write(&p, b"old block").expect("write");
    }
    let r = rig_in(engine, 1100, dir, |c| c.queue_depth = 16);
    assert_eq!(r.files.capabilities().scanned_blocks, 5000);
    for k in &doomed {
        assert!(r.files.remove(*k));
    }
    assert!(r.engine().maintenance > 0, "the removes are still running");
    let fresh: Vec<BlockKey> = (0..1000).map(key).collect();
    let deadline = Instant::now() + Duration::from_secs(8);
    let stores: Vec<TaskId> = fresh
        .chunks(10)
        .map(|c| {
            let blocks = c.iter().map(|k| r.block(*k, (k.0 % 251) as u8)).collect();
            r.submit(Direction::Store, blocks, deadline)
        })
        .collect();
    for t in stores {
        let rep = r.report(t);
        assert!(rep.is_ok(), "{engine}: store {:?}", rep.state);
        assert!(rep.finished_at <= deadline);
    }
    let deadline = Instant::now() + Duration::from_secs(8);
    let loads: Vec<(TaskId, &[BlockKey])> = fresh
        .chunks(10)
        .map(|c| {
            let blocks = c.iter().map(|k| r.empty_block(*k)).collect();
            (r.submit(Direction::Load, blocks, deadline), c)
        })
        .collect();
    for (t, keys) in loads {
        let rep = r.report(t);
        assert!(rep.is_ok(), "{engine}: load {:?}", rep.state);
        for (b, k) in rep.blocks.iter().zip(keys) {
            let data = b.buf.as_ref().expect("buffer back").as_slice();
            assert!(data.len() == 8192 && data.iter().all(|x| *x == (k.0 % 251) as u8));
        }
    }
    assert_eq!(r.engine().written_off, 0, "removes are never written off");
    assert!(r.drained());
    for k in &doomed {
        assert!(!layout.block_path(*k).exists(), "{k} was removed");
    }
    assert_eq!(r.files.len(), 1000);
}

/// 300 ops queued behind a 3 s stall, then a thaw: once the breaker's cool-down has passed,
/// every new store and load succeeds, nothing is left written off, and the engine is back at
/// its target; psync never runs more than `queue_depth + max_stuck` load and store threads.
fn stall_then_thaw_recovers_every_worker(engine: IoEngine) {
    const QD: usize = 8;
    const MAX_STUCK: usize = 16;
    let cool_down = Duration::from_millis(300);
    let r = rig(engine, 400, |c| {
        c.queue_depth = QD;
        c.max_stuck = MAX_STUCK;
        c.breaker.cool_down_ms = cool_down.as_millis() as u64;
    });
    let old: Vec<BlockKey> = (0..20).map(|i| key(500 + i)).collect();
    for k in &old {
        assert!(r.store(*k, 1, SOON).is_ok());
    }
    let e = r.engine();
    assert_eq!(e.workers, e.target);

    r.faults.freeze();
    let frozen_at = Instant::now();
    let tasks: Vec<TaskId> = (0..300u64)
        .map(|i| {
            let deadline = Instant::now() + Duration::from_millis(200);
            if i % 2 == 0 {
                r.submit(
                    Direction::Store,
                    vec![r.block(key(10_000 + i), 2)],
                    deadline,
                )
            } else {
                r.submit(
                    Direction::Load,
                    vec![r.empty_block(old[i as usize % 20])],
                    deadline,
                )
            }
        })
        .collect();
    let mut most_threads = 0;
    while frozen_at.elapsed() < Duration::from_secs(3) {
        most_threads = most_threads.max(r.engine().threads);
        std::thread::sleep(Duration::from_millis(10));
    }
    for t in &tasks {
        let rep = r.report(*t);
        assert!(!rep.is_ok(), "nothing completes during the stall");
    }
    let during = r.engine();
    assert!(r.faults.held() > 0, "syscalls are held by the stall");
    assert!(
        during.written_off > 0,
        "{engine}: stuck ops are written off"
    );
    if engine == IoEngine::Psync {
        assert!(
            most_threads <= QD + MAX_STUCK,
            "psync ran {most_threads} threads, bound {}",
            QD + MAX_STUCK
        );
        assert!(
            most_threads > QD,
            "replacements started while threads were stuck"
        );
    }

    r.faults.thaw();
    assert!(r.drained(), "every held op returned after the thaw");
    std::thread::sleep(cool_down + Duration::from_millis(50));
    for (i, k) in old.iter().enumerate() {
        let rep = r.store(key(20_000 + i as u64), 3, Duration::from_secs(5));
        assert!(
            rep.is_ok(),
            "{engine}: store after the thaw: {:?}",
            rep.blocks[0].result
        );
        let rep = r.load_one(*k, Duration::from_secs(5));
        assert!(
            rep.is_ok(),
            "{engine}: load after the thaw: {:?}",
            rep.blocks[0].result
        );
    }
    let after = r.engine();
    assert_eq!(after.written_off, 0);
    assert_eq!(after.workers, after.target, "{engine}: back at target");
    if engine == IoEngine::Psync {
        assert!(
            wait_until(SOON, || r.engine().threads == QD),
            "{:?}",
            r.engine()
        );
    }
    assert!(r.pool.is_whole() || wait_until(SOON, || r.pool.is_whole()));
}

/// A store whose rename lands after its deadline undoes only its own file: a newer store of the
/// same key that landed meanwhile survives; without one, the late block is removed.
fn late_rename_never_deletes_a_newer_block(engine: IoEngine) {
    let r = rig(engine, 16, |_| {});
    let k = key(42);
    r.faults.late(Late::Rename, 1, Duration::from_millis(700));
    let late = r.submit(
        Direction::Store,
        vec![r.block(k, 0xAA)],
        Instant::now() + Duration::from_millis(300),
    );
    // The late store's rename has happened (its completion is held); a newer store lands.
    assert!(wait_until(SOON, || r.files.block_path(k).exists()));
    assert!(r.store(k, 0xBB, SOON).is_ok());
    assert_eq!(r.report(late).state, TaskState::TimedOut);
    assert!(r.drained());
    let rep = r.load_one(k, SOON);
    assert!(
        rep.is_ok(),
        "{engine}: the newer block survives: {:?}",
        rep.blocks[0].result
    );
    let data = rep.blocks[0].buf.as_ref().expect("buffer").as_slice();
    assert!(data.iter().all(|x| *x == 0xBB), "the newer block's bytes");
    drop(rep);

    // Alone, a late rename is undone.
    let k2 = key(43);
    let undone = r.files.stats().undone;
    r.faults.late(Late::Rename, 1, Duration::from_millis(500));
    let rep = r.store(k2, 0xCC, Duration::from_millis(200));
    assert_eq!(rep.state, TaskState::TimedOut);
    assert!(r.drained());
    assert!(
        !r.files.block_path(k2).exists(),
        "the late block was removed"
    );
    assert!(r.files.stats().undone > undone);
    assert!(!r.files.contains(k2));
    let dir = r.root.as_path().to_path_buf();
    let names: HashSet<String> = walk(&dir);
    assert!(names.iter().all(|n| !n.ends_with(".kvb.tmp")), "{names:?}");
}

/// A load whose read returns after the op's deadline is reported timed out by the store
/// itself (called as a driver calls it, so no tracker decides first).
fn read_after_the_deadline_is_timed_out(engine: IoEngine) {
    let dir = tempfile::tempdir().expect("temp dir");
    let faults = std::sync::Arc::new(crate::testing::Faults::default());
    let mut cfg = crate::PosixConfig::new(dir.path());
    cfg.io_engine = engine;
    let mut store = PosixStore::open_with_faults(cfg, faults.clone()).expect("open");
    let pool = BufferPool::new(4, 8192, DEFAULT_ALIGN).expect("pool");
    let k = key(7);
    let op = |id: u64, dir: Direction, deadline: Duration| {
        let mut buf = pool.take().expect("buffer");
        buf.set_len(8192);
        buf.as_mut_slice().fill(9);
        Op {
            id: OpId(id),
            task: TaskId(id),
            request: RequestId(1),
            dir,
            deadline: Instant::now() + deadline,
            blocks: vec![OpBlock {
                key: k,
                engine: None,
                buf: Buf::Owned(buf),
            }],
        }
    };
    let run = |store: &mut PosixStore, o: Op| -> OpCompletion {
        let id = o.id;
        store.submit(o).expect("accepted");
        assert_eq!(
            store.wait(&[id], Instant::now() + SOON),
            WaitOutcome::Completed
        );
        let mut out = Vec::new();
        store.poll(&mut out);
        out.pop().expect("a completion")
    };
    let c = run(&mut store, op(1, Direction::Store, SOON));
    assert_eq!(c.results, vec![Ok(())]);
    faults.late(Late::Read, 1, Duration::from_millis(400));
    let t0 = Instant::now();
    let c = run(
        &mut store,
        op(2, Direction::Load, Duration::from_millis(100)),
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(400),
        "the read was held"
    );
    assert_eq!(c.results, vec![Err(BlockError::TimedOut)], "{engine}");
    assert_eq!(store.handle().stats().loaded, 0);
    // In time, the same block loads.
    let c = run(&mut store, op(3, Direction::Load, SOON));
    assert_eq!(c.results, vec![Ok(())]);
    assert_eq!(store.handle().stats().loaded, 1);
}

fn walk(dir: &std::path::Path) -> HashSet<String> {
    let mut out = HashSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.to_string_lossy().into_owned());
            }
        }
    }
    out
}

/// The job queue is bounded: with the one worker stuck and `max_queued` jobs waiting, the next
/// op is refused with `Busy` at submit, whole; after the thaw every accepted op completes once.
fn full_queue_is_busy_at_submit(engine: IoEngine) {
    let dir = tempfile::tempdir().expect("temp dir");
    let faults = std::sync::Arc::new(crate::testing::Faults::default());
    let mut cfg = crate::PosixConfig::new(dir.path());
    cfg.io_engine = engine;
    cfg.queue_depth = 1;
    cfg.rings = 1;
    cfg.max_queued = 4;
    let mut store = PosixStore::open_with_faults(cfg, faults.clone()).expect("open");
    let pool = BufferPool::new(8, 8192, DEFAULT_ALIGN).expect("pool");
    faults.freeze();
    let op = |id: u64| {
        let mut buf = pool.take().expect("buffer");
        buf.set_len(8192);
        Op {
            id: OpId(id),
            task: TaskId(id),
            request: RequestId(1),
            dir: Direction::Store,
            deadline: Instant::now() + SOON,
            blocks: vec![OpBlock {
                key: key(id),
                engine: None,
                buf: Buf::Owned(buf),
            }],
        }
    };
    store.submit(op(1)).expect("the first op runs");
    // The engine has taken it when its worker holds it.
    assert!(wait_until(SOON, || store.handle().stats().queued == 0));
    for id in 2..=5 {
        store.submit(op(id)).expect("queued");
    }
    let e = store.submit(op(6)).expect_err("the queue is full");
    assert!(
        matches!(&e.kind, SubmitErrorKind::Busy(m) if m.contains("queue full")),
        "{:?}",
        e.kind
    );
    assert_eq!(e.op.blocks.len(), 1, "a refused op comes back whole");
    drop(e);
    faults.thaw();
    let mut done = Vec::new();
    assert!(wait_until(SOON, || {
        store.poll(&mut done);
        done.len() == 5
    }));
    let mut ids: Vec<u64> = done.iter().map(|c| c.op.id.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![1, 2, 3, 4, 5]);
    assert!(done.iter().all(|c| c.results == vec![Ok(())]));
}

/// uring, local file system: a store whose data is written leaves its I/O slot while it closes
/// and renames its file. With queue depth 1 and the first store's rename held for 800 ms, a
/// second store still ends (ok) within 300 ms of the hold, and the first ends ok once its
/// rename lands. (psync runs a whole store on one thread and has no such slot.)
#[test]
fn closing_store_leaves_its_io_slot_uring() {
    const HOLD: Duration = Duration::from_millis(800);
    let r = rig(IoEngine::Uring, 4, |c| c.queue_depth = 1);
    assert!(
        r.files.capabilities().inline_per_root[0],
        "this test needs its temporary directory on a local block file system"
    );
    r.faults.late(Late::Rename, 1, HOLD);
    let first = r.submit(
        Direction::Store,
        vec![r.block(key(7), 0x11)],
        Instant::now() + SOON,
    );
    assert!(wait_until(SOON, || r.faults.held() == 1), "rename held");
    let held_at = Instant::now();
    let second = r.store(key(8), 0x22, SOON);
    assert!(second.is_ok(), "second store: {:?}", second.state);
    let waited = second.finished_at.saturating_duration_since(held_at);
    println!("second store ended {waited:?} after the first one's rename was held (hold {HOLD:?})");
    assert!(
        waited < Duration::from_millis(300),
        "the second store waited {waited:?} for the first one's rename"
    );
    let first = r.report(first);
    assert!(first.is_ok(), "first store: {:?}", first.state);
    assert!(first.finished_at >= held_at + HOLD - Duration::from_millis(50));
    assert!(r.drained());
    for (k, fill) in [(key(7), 0x11), (key(8), 0x22)] {
        let rep = r.load_one(k, SOON);
        let data = rep.blocks[0].buf.as_ref().expect("buffer").as_slice();
        assert!(rep.is_ok() && data.iter().all(|x| *x == fill), "{k}");
    }
}
