//! Spare files: stores write into files made before they come (no create on the store's path),
//! preallocated to one block's file when the block size is known, taken over by a reopened
//! store, and refilled from the files of evicted blocks. Spares live only on a local block file
//! system; elsewhere these tests print one `skip:` line and are counted as ignored.

use std::path::PathBuf;

use kvx_core::*;
use kvx_posix::{IoEngine, PosixConfig, PosixStore};
use libtest_mimic::Trial;

use kvx_posix::testing::{SOON, files_with_suffix, key, wait_until};

use super::{ENGINES, rig};

/// One spare-file test, run once per engine.
type EngineTest = fn(IoEngine);

/// The spare-file trials for both engines, ignored (with one `skip:` line) where the temporary
/// directory is not on a local block file system.
pub fn trials() -> Vec<Trial> {
    let local = temp_dir_is_local();
    if !local {
        println!(
            "skip: spare_files_take_the_create_off_the_store_path, preallocated_spares_fit_one_block_size, evicted_block_files_become_spares: the temporary directory is not on a local block file system (spares live only there)"
        );
    }
    let tests: [(&str, EngineTest); 3] = [
        (
            "spare_files_take_the_create_off_the_store_path",
            spare_files_take_the_create_off_the_store_path,
        ),
        (
            "preallocated_spares_fit_one_block_size",
            preallocated_spares_fit_one_block_size,
        ),
        (
            "evicted_block_files_become_spares",
            evicted_block_files_become_spares,
        ),
    ];
    let mut out = Vec::new();
    for e in ENGINES {
        for (name, test) in tests {
            out.push(
                Trial::test(format!("{name}_{e}"), move || {
                    test(e);
                    Ok(())
                })
                .with_ignored_flag(!local),
            );
        }
    }
    out
}

/// A fresh directory, its spare folder, and a store config on it with 4 spares made at open
/// and none topped up.
fn four_spares_no_refill(engine: IoEngine) -> (tempfile::TempDir, PathBuf, PosixConfig) {
    let dir = tempfile::tempdir().unwrap();
    let spare_dir = dir.path().join(".kvx-spare");
    let mut cfg = PosixConfig::new(dir.path());
    cfg.io_engine = engine;
    cfg.spare_files = 4;
    cfg.spare_refill = false;
    (dir, spare_dir, cfg)
}

/// Stores write into spare files made at open (no create on the store's path); a spare found
/// gone falls back to a fresh temporary file; a reopened store takes over the empty spares and
/// removes a half-written one; a store of a shared mount makes none.
fn spare_files_take_the_create_off_the_store_path(engine: IoEngine) {
    let (dir, spare_dir, mut cfg) = four_spares_no_refill(engine);
    let keys: Vec<BlockKey> = (500..503).map(key).collect();
    {
        let r = rig(cfg.clone(), 16, 64 << 10);
        assert_eq!(r.files.spare_files_ready(), vec![4]);
        assert_eq!(std::fs::read_dir(&spare_dir).unwrap().count(), 4);
        // All 256 fan-out directories exist already.
        assert!(dir.path().join("00").is_dir() && dir.path().join("ff").is_dir());
        assert!(r.store_keys(&keys[..2], 10_000).is_ok(), "{engine}");
        assert_eq!(r.files.spare_files_ready(), vec![2]);
        assert_eq!(std::fs::read_dir(&spare_dir).unwrap().count(), 2);
        // The next spare disappears under the store: the store creates its own file.
        for e in std::fs::read_dir(&spare_dir).unwrap() {
            std::fs::remove_file(e.unwrap().path()).unwrap();
        }
        assert!(r.store_keys(&keys[2..], 10_000).is_ok(), "{engine}");
        assert_eq!(r.files.spare_files_ready(), vec![1]);
        r.assert_loads_back(&keys, &[10_000; 3], engine);
        assert!(files_with_suffix(dir.path(), ".kvb.tmp").is_empty());
    }
    // A spare that was being written when its process died, and an empty one it left.
    std::fs::write(spare_dir.join("deadhost-1-0"), b"half a block").unwrap();
    std::fs::write(spare_dir.join("deadhost-1-1"), b"").unwrap();
    {
        let r = rig(cfg.clone(), 16, 64 << 10);
        assert!(
            !spare_dir.join("deadhost-1-0").exists(),
            "half-written spare removed"
        );
        assert!(
            spare_dir.join("deadhost-1-1").exists(),
            "empty spare taken over"
        );
        assert_eq!(r.files.spare_files_ready(), vec![4]);
        assert_eq!(r.files.lookup(&keys), 3, "the blocks are still there");
    }
    // With refills, the spares are topped up as they are used.
    cfg.spare_refill = true;
    {
        let r = rig(cfg.clone(), 16, 64 << 10);
        let more: Vec<BlockKey> = (600..604).map(key).collect();
        assert!(r.store_keys(&more, 10_000).is_ok(), "{engine}");
        assert!(
            wait_until(SOON, || r.files.spare_files_ready() == vec![4]),
            "{:?}",
            r.files.spare_files_ready()
        );
    }
    let shared = tempfile::tempdir().unwrap();
    let mut scfg = PosixConfig::new(shared.path());
    scfg.spare_files = 4;
    scfg.shared = Some(kvx_posix::SharedMount::default());
    let r = rig(scfg, 16, 64 << 10);
    assert_eq!(r.files.spare_files_ready(), vec![0]);
    assert!(!shared.path().join(".kvx-spare").exists());
}

/// With `spare_block_bytes`, spares are preallocated to one block's file (header included):
/// stores of that size take them oldest first and load back byte-exact, a store of another
/// size creates its own file and leaves them, and a reopened store takes over the spares of
/// that length an earlier run left (whatever they hold), hands them out first, and removes
/// any other file there.
fn preallocated_spares_fit_one_block_size(engine: IoEngine) {
    use std::os::unix::fs::MetadataExt;
    const BLOCK: usize = 12_288;
    const FILE_LEN: u64 = 4096 + BLOCK as u64;
    let (dir, spare_dir, mut cfg) = four_spares_no_refill(engine);
    cfg.spare_block_bytes = BLOCK;
    let spares = || -> Vec<(String, u64, u64)> {
        let mut v: Vec<(String, u64, u64)> = std::fs::read_dir(&spare_dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let m = e.metadata().unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    m.len(),
                    m.blocks() * 512,
                )
            })
            .collect();
        v.sort();
        v
    };
    let keys: Vec<BlockKey> = (700..703).map(key).collect();
    {
        let r = rig(cfg.clone(), 16, 64 << 10);
        let made = spares();
        assert_eq!(made.len(), 4);
        for (name, len, allocated) in &made {
            assert_eq!(*len, FILE_LEN, "{name}: one block's file");
            assert!(
                *allocated >= FILE_LEN,
                "{name}: {allocated} bytes allocated"
            );
        }
        assert!(r.store_keys(&keys[..2], BLOCK).is_ok(), "{engine}");
        assert_eq!(r.files.spare_files_ready(), vec![2]);
        // Oldest first: the two made first are the ones gone.
        let left: Vec<String> = spares().into_iter().map(|s| s.0).collect();
        let mut by_age: Vec<String> = made.iter().map(|s| s.0.clone()).collect();
        by_age.sort_by_key(|n| n.rsplit('-').next().unwrap().parse::<u64>().unwrap());
        assert_eq!(left, by_age[2..].to_vec(), "{engine}");
        // Another size does not fit a spare: the store creates its own file.
        assert!(r.store_keys(&keys[2..], 20_000).is_ok(), "{engine}");
        assert_eq!(r.files.spare_files_ready(), vec![2]);
        r.assert_loads_back(&keys, &[BLOCK, BLOCK, 20_000], engine);
        assert!(files_with_suffix(dir.path(), ".kvb.tmp").is_empty());
    }
    // What this run left: its two spares, one of them written into (as a process that died
    // mid-write leaves it), and a file of another length.
    let left: Vec<String> = spares().into_iter().map(|s| s.0).collect();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(spare_dir.join(&left[0]))
        .unwrap();
    std::io::Write::write_all(&mut f, b"left by an earlier run").unwrap();
    std::fs::write(spare_dir.join("deadhost-1-9"), b"short").unwrap();
    let r = rig(cfg, 16, 64 << 10);
    assert_eq!(r.files.spare_files_ready(), vec![4]);
    assert!(
        !spare_dir.join("deadhost-1-9").exists(),
        "a file of another length is removed"
    );
    let after = spares();
    assert_eq!(after.len(), 4);
    for (name, len, _) in &after {
        assert_eq!(*len, FILE_LEN, "{name}");
    }
    // Taken over, and handed out first: the next two stores write into them.
    let more: Vec<BlockKey> = (710..712).map(key).collect();
    assert!(r.store_keys(&more, BLOCK).is_ok(), "{engine}");
    let now: Vec<String> = spares().into_iter().map(|s| s.0).collect();
    assert!(
        left.iter().all(|n| !now.contains(n)),
        "{engine}: {left:?} taken first, left {now:?}"
    );
    r.assert_loads_back(&more, &[BLOCK; 2], engine);
    assert_eq!(r.files.lookup(&keys), 3, "the blocks are still there");
}

/// With preallocated spares, an evicted block's file of one block's length moves into the
/// spare folder instead of being unlinked while the root's spares, ready and promised to
/// removes in flight, are fewer than `spare_files`: of a burst of six removes, two are
/// recycled and four unlinked. The next stores write into those very files and load back
/// byte-exact. A file of another length is unlinked and its promise given back.
fn evicted_block_files_become_spares(engine: IoEngine) {
    use std::os::unix::fs::MetadataExt;
    const BLOCK: usize = 12_288;
    let (_dir, spare_dir, mut cfg) = four_spares_no_refill(engine);
    cfg.spare_files = 2;
    cfg.spare_block_bytes = BLOCK;
    let r = rig(cfg, 16, 64 << 10);
    let in_spare_dir = || std::fs::read_dir(&spare_dir).unwrap().count();
    let inode = |k: BlockKey| std::fs::metadata(r.files.block_path(k)).unwrap().ino();
    // Two into the spares, four into files of their own.
    let keys: Vec<BlockKey> = (800..806).map(key).collect();
    assert!(r.store_keys(&keys, BLOCK).is_ok(), "{engine}");
    assert_eq!(r.files.spare_files_ready(), vec![0]);
    let mut recycled = [inode(keys[0]), inode(keys[1])];
    recycled.sort_unstable();

    for k in &keys {
        r.files.remove(*k);
    }
    assert!(
        wait_until(SOON, || r.files.spare_files_ready() == vec![2]
            && r.files.stats().maintenance == 0),
        "{engine}: {:?}",
        r.files.spare_files_ready()
    );
    assert_eq!(in_spare_dir(), 2, "{engine}: four unlinked");
    assert_eq!(r.files.stats().recycled, 2);
    for k in &keys {
        assert!(!r.files.block_path(*k).exists(), "{engine}: {k} removed");
    }

    let next: Vec<BlockKey> = (810..812).map(key).collect();
    assert!(r.store_keys(&next[..1], BLOCK).is_ok(), "{engine}");
    assert!(r.store_keys(&next[1..], BLOCK).is_ok(), "{engine}");
    let mut reused = [inode(next[0]), inode(next[1])];
    reused.sort_unstable();
    assert_eq!(
        reused, recycled,
        "{engine}: written into the evicted blocks' files"
    );
    r.assert_loads_back(&next, &[BLOCK; 2], engine);

    // Another length: promised a spare name, unlinked, and the promise given back (taken in
    // by the poll that ends the next op), so both blocks removed next are recycled.
    let other = key(820);
    assert!(r.store_keys(&[other], 20_000).is_ok(), "{engine}");
    r.files.remove(other);
    assert!(wait_until(SOON, || r.files.stats().maintenance == 0));
    assert_eq!(
        r.load(&[key(821)]).blocks[0].result,
        Err(BlockError::NotFound)
    );
    assert!(!r.files.block_path(other).exists());
    r.files.remove(next[0]);
    r.files.remove(next[1]);
    assert!(
        wait_until(SOON, || r.files.spare_files_ready() == vec![2]
            && r.files.stats().maintenance == 0),
        "{engine}: {:?}",
        r.files.spare_files_ready()
    );
    assert_eq!(r.files.stats().recycled, 4, "{engine}");
}

/// Whether a store in a temporary directory gets inline I/O (a local block file system).
fn temp_dir_is_local() -> bool {
    let dir = tempfile::tempdir().unwrap();
    let store = PosixStore::open(PosixConfig::new(dir.path())).unwrap();
    store.capabilities().inline_per_root == vec![true]
}
