//! A remove issued while a load or a store of the same key is in flight: whichever order the
//! engine's syscalls land in, the index never names a block whose file the remove took. The
//! load's read (or the store's rename) really runs; only its return is held, and the remove
//! runs in that window.

use std::time::{Duration, Instant};

use kvx_core::*;

use super::{BLOCK, rig};
use crate::IoEngine;
use crate::testing::{Late, Rig, SOON, key, wait_until};

both_engines!(
    remove_during_a_store_after_its_rename,
    remove_during_a_load_after_its_read,
);

/// How long the held completion is held.
const HOLD: Duration = Duration::from_millis(300);

/// The store of `k`'s rename has landed, its completion is held; `k` is removed (the remove
/// deletes the file the store just renamed into place). The store must not then report `k`
/// stored nor put it in the index; once the remove is over, `k` stores and loads again.
fn remove_during_a_store_after_its_rename(engine: IoEngine) {
    let r = rig(engine, 8, |_| {});
    let k = key(77);
    r.faults.late(Late::Rename, 1, HOLD);
    let t = r.submit(
        Direction::Store,
        vec![r.block(k, 0x3C)],
        Instant::now() + SOON,
    );
    assert!(
        wait_until(SOON, || r.faults.held() == 1),
        "the rename is held"
    );
    assert!(r.files.block_path(k).exists(), "the rename landed");
    assert!(!r.files.remove(k), "not in the index yet");
    assert!(
        wait_until(SOON, || r.files.stats().maintenance == 0),
        "the remove ran"
    );
    let rep = r.report(t);
    assert!(r.drained());
    assert_agrees(&r, k);
    assert!(
        matches!(&rep.blocks[0].result, Err(BlockError::Unavailable(m)) if m.contains("remove")),
        "{engine}: a store whose file a remove took reported {:?}",
        rep.blocks[0].result
    );
    drop(rep);
    assert!(r.store(k, 0x3D, SOON).is_ok());
    let rep = r.load_one(k, SOON);
    assert!(rep.is_ok(), "{engine}: {:?}", rep.blocks[0].result);
    let data = rep.blocks[0].buf.as_ref().expect("buffer").as_slice();
    assert!(data.len() == BLOCK && data.iter().all(|x| *x == 0x3D));
}

/// The load of `k` has read its file, its completion is held; `k` is removed (its file is
/// gone). The load still returns `k`'s bytes, but must not put `k` back in the index.
fn remove_during_a_load_after_its_read(engine: IoEngine) {
    let r = rig(engine, 8, |_| {});
    let k = key(78);
    assert!(r.store(k, 0x4B, SOON).is_ok());
    r.faults.late(Late::Read, 1, HOLD);
    let t = r.submit(
        Direction::Load,
        vec![r.empty_block(k)],
        Instant::now() + SOON,
    );
    assert!(
        wait_until(SOON, || r.faults.held() == 1),
        "the read is held"
    );
    assert!(r.files.remove(k));
    assert!(
        wait_until(SOON, || r.files.stats().maintenance == 0),
        "the remove ran"
    );
    let rep = r.report(t);
    assert!(r.drained());
    assert!(rep.is_ok(), "{engine}: {:?}", rep.blocks[0].result);
    let data = rep.blocks[0].buf.as_ref().expect("buffer").as_slice();
    assert!(data.iter().all(|x| *x == 0x4B), "the load got k's bytes");
    drop(rep);
    assert_agrees(&r, k);
}

/// The index holds `k` exactly when its block file exists.
fn assert_agrees(r: &Rig, k: BlockKey) {
    let on_disk = r.files.block_path(k).exists();
    assert_eq!(
        r.files.contains(k),
        on_disk,
        "the index says {k} is held: {}; its file exists: {on_disk}",
        r.files.contains(k)
    );
}
