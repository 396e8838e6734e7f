//! A remove of a block stuck on a frozen mount never deletes (or recycles) a newer store of the
//! same key that lands before it: after the thaw, every block the store reported stored is on
//! disk and loads byte-exact, and the index names exactly the block files on disk.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_posix::IoEngine;

use crate::rig::*;

/// The byte the second store of each key writes (the first writes [`expected`]).
const NEWER: u8 = 0xA5;

/// How long the second stores have: far past the freeze, so that without the store's per-key
/// ordering they would land after the thaw instead of timing out.
const STORE_DEADLINE: Duration = Duration::from_secs(3);

/// One root on the mount. The mount freezes with a remove of each key stuck in it; a second
/// store of the same keys then ends at once (not at its deadline: it would land, racing the
/// stuck remove, after the thaw) and reports the blocks not stored. After the thaw the index
/// and the disk agree, and the keys store and load again.
pub fn remove_stuck_then_store(engine: IoEngine) {
    let r = Rig::new(engine, Place::Fuse, |_| {});
    let keys: Vec<BlockKey> = (9000..9008).map(key).collect();
    r.store_ok(&keys);
    r.mount().freeze();
    for &k in &keys {
        assert!(r.files.remove(k));
    }
    assert!(
        r.mount().wait_blocked(1, SOON),
        "the removes are stuck in the mount"
    );
    let blocks: Vec<OpBlock> = keys.iter().map(|&k| r.block(k, NEWER)).collect();
    let submitted = Instant::now();
    let t = r.submit(Direction::Store, blocks, submitted + STORE_DEADLINE);
    // The report must come while the mount is still frozen; the thaw comes either way.
    let early = r.driver.wait_report(t, submitted + MARGIN);
    r.mount().thaw();
    let rep = early.unwrap_or_else(|| r.report_by(t, submitted + STORE_DEADLINE + SOON));
    assert!(r.drained(), "the removes and stores drain after the thaw");
    let stored = assert_index_matches_disk(&r, std::slice::from_ref(&r.root), &keys, &rep);
    let ended = rep.finished_at.saturating_duration_since(submitted);
    println!(
        "remove_stuck_then_store {engine}: the store of 8 keys with a remove stuck ended {ended:?} after its submit (bound {MARGIN:?}); {stored} reported stored"
    );
    assert!(
        ended <= MARGIN,
        "{engine}: a store of a key whose remove is stuck waited {ended:?} for the mount"
    );
    for b in &rep.blocks {
        match &b.result {
            Err(BlockError::Unavailable(m)) => assert!(m.contains("remove"), "{m}"),
            other => panic!("{engine}: {}: {other:?} (a remove of it was stuck)", b.key),
        }
    }
    // Once the removes are over, the keys store again and load back.
    drop(rep);
    let rep = r.run(
        Direction::Store,
        keys.iter().map(|&k| r.block(k, NEWER)).collect(),
    );
    assert!(rep.is_ok(), "{engine}: {:?}", first_error(&rep));
    let again = assert_index_matches_disk(&r, std::slice::from_ref(&r.root), &keys, &rep);
    assert_eq!(again, keys.len());
}

/// Two roots: one on the mount, one on the local disk with spare files (removed block files
/// are recycled into them). Four removes stuck on the frozen mount fill the maintenance lane,
/// so the removes of the disk root's keys wait behind them; the disk root is not frozen, so a
/// second store of those keys would land before their removes. After the thaw every key the
/// store reported stored is on disk and loads byte-exact, and the index names exactly the
/// block files of both roots.
pub fn remove_queued_then_store_recycling(engine: IoEngine) {
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir");
    let disk_root = disk.path().join("kv");
    let r = Rig::new(engine, Place::Fuse, |c| {
        c.roots.push(disk_root.clone());
        c.rings = 1;
        c.spare_files = 16;
        c.spare_block_bytes = BLOCK;
        c.spare_refill = false;
    });
    let roots = [r.root.clone(), disk_root.clone()];
    let on_root = |root: usize, n: usize| -> Vec<BlockKey> {
        (10_000..)
            .map(key)
            .filter(|&k| r.files.root_of(k) == root)
            .take(n)
            .collect()
    };
    let (stuck, keys) = (on_root(0, 4), on_root(1, 8));
    let recycling = r.files.spare_files_ready()[1] > 0;
    if !recycling {
        println!(
            "note: remove_queued_then_store_recycling {engine}: {} is not on a local block file system: no spares, removes unlink",
            disk_root.display()
        );
    }
    r.store_ok(&stuck);
    r.store_ok(&keys);
    let recycled = r.files.stats().recycled;
    r.mount().freeze();
    for &k in &stuck {
        assert!(r.files.remove(k));
    }
    assert!(
        r.mount().wait_blocked(4, SOON),
        "4 removes stuck in the mount (blocked: {})",
        r.mount().blocked_requests()
    );
    for &k in &keys {
        assert!(r.files.remove(k));
    }
    let rep = r.run(
        Direction::Store,
        keys.iter().map(|&k| r.block(k, NEWER)).collect(),
    );
    let queued = r.files.stats().maintenance;
    r.mount().thaw();
    assert!(r.drained(), "the removes drain after the thaw");
    assert!(
        queued >= 4 + keys.len(),
        "{engine}: the removes were still queued when the stores ended ({queued} in flight)"
    );
    let stored = assert_index_matches_disk(&r, &roots, &keys, &rep);
    let recycled = r.files.stats().recycled - recycled;
    println!(
        "remove_queued_then_store_recycling {engine}: {stored} of {} second stores reported stored; {recycled} files recycled",
        keys.len()
    );
    if recycling {
        assert!(recycled > 0, "{engine}: the removes recycled their files");
    }
    for b in &rep.blocks {
        assert!(
            matches!(&b.result, Err(BlockError::Unavailable(m)) if m.contains("remove")),
            "{engine}: {}: {:?} (its remove was still queued)",
            b.key,
            b.result
        );
    }
    drop(rep);
    let rep = r.run(
        Direction::Store,
        keys.iter().map(|&k| r.block(k, NEWER)).collect(),
    );
    assert!(rep.is_ok(), "{engine}: {:?}", first_error(&rep));
    assert_eq!(
        assert_index_matches_disk(&r, &roots, &keys, &rep),
        keys.len()
    );
}

/// Every block of `rep` (a store of [`NEWER`] bytes) reported stored is in the index, and its
/// file loads byte-exact; and the index names exactly the block files under `roots`. Returns
/// how many blocks the store reported stored.
fn assert_index_matches_disk(
    r: &Rig,
    roots: &[PathBuf],
    keys: &[BlockKey],
    rep: &TaskReport,
) -> usize {
    let on_disk: BTreeSet<PathBuf> = roots
        .iter()
        .flat_map(|root| files_with_suffix(root, ".kvb"))
        .collect();
    let indexed: BTreeSet<PathBuf> = r
        .files
        .keys()
        .into_iter()
        .map(|k| r.files.block_path(k))
        .collect();
    assert_eq!(
        indexed.difference(&on_disk).collect::<Vec<_>>(),
        Vec::<&PathBuf>::new(),
        "blocks the index holds but the disk lacks"
    );
    assert_eq!(
        on_disk.difference(&indexed).collect::<Vec<_>>(),
        Vec::<&PathBuf>::new(),
        "block files the index does not hold"
    );
    let stored: Vec<BlockKey> = rep
        .blocks
        .iter()
        .filter(|b| b.result.is_ok())
        .map(|b| b.key)
        .collect();
    for &k in &stored {
        assert!(keys.contains(&k));
        assert!(r.files.contains(k), "{k} reported stored, not in the index");
        assert!(
            exists(&r.files.block_path(k)),
            "{k} reported stored, no file"
        );
    }
    if !stored.is_empty() {
        let back = r.load(&stored);
        for b in &back.blocks {
            assert!(b.result.is_ok(), "{}: {:?}", b.key, b.result);
            let data = b.buf.as_ref().expect("buffer").as_slice();
            assert!(
                data.len() == BLOCK && data.iter().all(|x| *x == NEWER),
                "{}: not the newer store's bytes",
                b.key
            );
        }
    }
    stored.len()
}

fn exists(p: &Path) -> bool {
    std::fs::metadata(p).is_ok()
}
