//! The store on a real directory (no FUSE): round trips through the driver with both engines,
//! lookup/remove, the startup scan, several roots, the O_DIRECT fallback on ramfs, zero padding
//! of O_DIRECT writes from shared buffers, blocks of a newer format version, and spare files.
//!
//! Tests that cannot run here (no ramfs mount, a disk without O_DIRECT) print one `skip:` line
//! and are counted as ignored.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_posix::format::HEADER_LEN;
use kvx_posix::{EngineKind, PosixConfig, PosixHandle, PosixStore};
use libtest_mimic::{Arguments, Trial};

const ENGINES: [EngineKind; 2] = [EngineKind::Uring, EngineKind::Psync];

fn key(i: u64) -> BlockKey {
    BlockKey::chain(None, &i.to_le_bytes())
}

fn fill(buf: &mut PoolBuf, k: BlockKey, len: usize) {
    buf.set_len(len);
    let seed = k.to_be_bytes();
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = seed[i % 16].wrapping_add((i / 16) as u8);
    }
}

fn expected(k: BlockKey, len: usize) -> Vec<u8> {
    let seed = k.to_be_bytes();
    (0..len)
        .map(|i| seed[i % 16].wrapping_add((i / 16) as u8))
        .collect()
}

struct Rig {
    driver: Driver,
    posix: BackendId,
    files: PosixHandle,
    pool: BufferPool,
}

fn rig(cfg: PosixConfig, bufs: usize, size: usize) -> Rig {
    let store = PosixStore::open(cfg).unwrap();
    let files = store.handle();
    let mut b = DriverBuilder::new(DriverConfig::default());
    let posix = b.backend(Box::new(store));
    Rig {
        driver: b.spawn().unwrap(),
        posix,
        files,
        pool: BufferPool::new(bufs, size, DEFAULT_ALIGN).unwrap(),
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

impl Rig {
    fn store(&self, keys: &[BlockKey], len: usize) -> TaskReport {
        let blocks = keys
            .iter()
            .map(|&k| {
                let mut buf = self.pool.take().unwrap();
                fill(&mut buf, k, len);
                OpBlock {
                    key: k,
                    engine: None,
                    buf: Buf::Owned(buf),
                }
            })
            .collect();
        self.run(Direction::Store, blocks)
    }

    fn load(&self, keys: &[BlockKey]) -> TaskReport {
        let blocks = keys
            .iter()
            .map(|&k| OpBlock {
                key: k,
                engine: None,
                buf: Buf::Owned(self.pool.take().unwrap()),
            })
            .collect();
        self.run(Direction::Load, blocks)
    }

    /// Load `keys` and check each comes back whole with the bytes `store` wrote for it at its
    /// length in `lens`.
    fn assert_loads_back(&self, keys: &[BlockKey], lens: &[usize], engine: EngineKind) {
        let rep = self.load(keys);
        assert!(rep.is_ok(), "{engine}: {:?}", rep.state);
        for ((b, k), len) in rep.blocks.iter().zip(keys).zip(lens) {
            assert_eq!(
                b.buf.as_ref().unwrap().as_slice(),
                &expected(*k, *len)[..],
                "{engine}: {k}"
            );
        }
    }

    fn run(&self, dir: Direction, blocks: Vec<OpBlock>) -> TaskReport {
        let t = self
            .driver
            .submit(TaskSpec {
                request: RequestId(1),
                dir,
                route: vec![self.posix],
                blocks,
                deadline: soon(),
                deferred: false,
            })
            .unwrap();
        self.driver.wait_report(t, soon()).unwrap()
    }
}

fn files_with_suffix(dir: &Path, suffix: &str) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().ends_with(suffix) {
                out.push(p);
            }
        }
    }
    out
}

fn round_trip_lookup_remove_both_engines() {
    for engine in ENGINES {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = PosixConfig::new(dir.path());
        cfg.engine = engine;
        let r = rig(cfg, 16, 64 << 10);
        assert_eq!(r.files.capabilities().engine, engine);
        let keys: Vec<BlockKey> = (0..6).map(key).collect();
        // A length that is not a multiple of 4096 exercises the O_DIRECT padding.
        assert!(r.store(&keys, 10_000).is_ok(), "{engine}");
        assert_eq!(r.files.lookup(&keys), 6);
        assert_eq!(r.files.lookup(&[keys[0], key(99), keys[1]]), 1);
        r.assert_loads_back(&keys, &[10_000; 6], engine);
        assert!(r.files.remove(keys[2]));
        assert!(!r.files.remove(keys[2]));
        let deadline = Instant::now() + Duration::from_secs(5);
        while r.files.block_path(keys[2]).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!r.files.block_path(keys[2]).exists());
        let rep = r.load(&keys[1..4]);
        assert_eq!(rep.blocks[1].result, Err(BlockError::NotFound));
        assert!(rep.blocks[0].result.is_ok() && rep.blocks[2].result.is_ok());
        assert_eq!(r.files.lookup(&keys), 2);
        assert_eq!(r.files.stats().stored, 6);
        drop(rep);
        drop(r.driver);
        assert!(r.pool.is_whole());
        assert!(files_with_suffix(dir.path(), ".kvb.tmp").is_empty());
    }
}

fn scan_rebuilds_the_index_over_several_roots() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let mut cfg = PosixConfig::new(a.path());
    cfg.roots.push(b.path().to_path_buf());
    let keys: Vec<BlockKey> = (100..140).map(key).collect();
    {
        let r = rig(cfg.clone(), 64, 8192);
        assert!(r.store(&keys, 8192).is_ok());
        let roots: std::collections::HashSet<usize> =
            keys.iter().map(|k| r.files.root_of(*k)).collect();
        assert_eq!(roots.len(), 2, "keys spread over both roots");
    }
    // A stale temporary file of a process that is gone, and an unrelated file.
    let leaf = a.path().join("00");
    std::fs::create_dir_all(&leaf).unwrap();
    let stale = leaf.join(format!("{}.999999999-1.kvb.tmp", key(1).to_hex()));
    std::fs::write(&stale, b"partial").unwrap();
    std::fs::write(leaf.join("README"), b"keep").unwrap();

    let r = rig(cfg, 64, 8192);
    let caps = r.files.capabilities().clone();
    assert_eq!(caps.scanned_blocks, 40);
    assert_eq!(caps.removed_temps, 1);
    assert!(!stale.exists());
    assert!(leaf.join("README").exists());
    assert_eq!(r.files.lookup(&keys), 40);
    let rep = r.load(&keys);
    assert!(rep.is_ok());
}

/// A ramfs mounted for the fallback test; unmounted on drop.
struct Ramfs {
    dir: tempfile::TempDir,
}

impl Ramfs {
    /// Mount one, or say why not.
    fn mount() -> Result<Ramfs, String> {
        let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
        let out = std::process::Command::new("mount")
            .args(["-t", "ramfs", "ramfs"])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t ramfs failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Ramfs { dir })
    }
}

impl Drop for Ramfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.dir.path())
            .status();
    }
}

/// ramfs has no direct I/O at all (open with O_DIRECT answers EINVAL), so the store falls back
/// to buffered I/O there. (tmpfs takes O_DIRECT since Linux 6.6.)
fn buffered_fallback_on_ramfs(ramfs: &Path) {
    for engine in ENGINES {
        let root = ramfs.join(engine.as_str());
        let mut cfg = PosixConfig::new(&root);
        cfg.engine = engine;
        let r = rig(cfg, 4, 8192);
        assert!(!r.files.capabilities().direct, "ramfs refuses O_DIRECT");
        let k = [key(7)];
        assert!(r.store(&k, 5000).is_ok());
        let rep = r.load(&k);
        assert!(rep.is_ok(), "{:?}", rep.blocks[0].result);
        assert_eq!(
            rep.blocks[0].buf.as_ref().unwrap().as_slice(),
            &expected(k[0], 5000)[..]
        );
    }
}

/// A directory on the real disk (the target directory), where O_DIRECT works if the disk
/// takes it.
fn disk_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// Whether the disk under the target directory takes O_DIRECT.
fn disk_takes_direct() -> bool {
    let d = disk_dir();
    PosixStore::open(PosixConfig::new(d.path())).is_ok_and(|s| s.capabilities().direct)
}

/// An O_DIRECT store of a payload that does not fill its last sector, from a *shared* buffer
/// whose bytes past the payload are not zero: the padding on disk is zeros, and the block loads
/// back exactly.
fn write_through_padding_is_zeros(engine: EngineKind) {
    let dir = disk_dir();
    let mut cfg = PosixConfig::new(dir.path());
    cfg.engine = engine;
    let r = rig(cfg, 4, 16 << 10);
    assert!(r.files.capabilities().direct);
    let k = key(11);
    let len = 10_000;
    let mut buf = r.pool.take().unwrap();
    buf.as_mut_full().fill(0xAB); // stale bytes past the payload
    fill(&mut buf, k, len);
    let rep = r.run(
        Direction::Store,
        vec![OpBlock {
            key: k,
            engine: None,
            buf: Buf::Shared(Arc::new(buf)),
        }],
    );
    assert!(rep.is_ok(), "{engine}: {:?}", rep.blocks[0].result);
    drop(rep);
    let file = std::fs::read(r.files.block_path(k)).unwrap();
    let padded = len.div_ceil(HEADER_LEN) * HEADER_LEN;
    assert_eq!(
        file.len(),
        HEADER_LEN + padded,
        "{engine}: padded to a sector"
    );
    assert_eq!(&file[HEADER_LEN..HEADER_LEN + len], &expected(k, len)[..]);
    assert!(
        file[HEADER_LEN + len..].iter().all(|b| *b == 0),
        "{engine}: the padding is zeros"
    );
    let rep = r.load(&[k]);
    assert!(rep.is_ok());
    assert_eq!(
        rep.blocks[0].buf.as_ref().unwrap().as_slice(),
        &expected(k, len)[..]
    );
}

/// A block whose header names a newer format version is a miss here, and stays on disk even
/// when the caller then asks the store to remove it (as the connector does after a miss).
fn newer_format_version_is_a_miss_and_stays(engine: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = PosixConfig::new(dir.path());
    cfg.engine = engine;
    let r = rig(cfg, 8, 8192);
    let keys = [key(21), key(22)];
    assert!(r.store(&keys, 8192).is_ok());
    let newer = r.files.block_path(keys[0]);
    let mut bytes = std::fs::read(&newer).unwrap();
    bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&newer, &bytes).unwrap();
    let rep = r.load(&keys);
    assert_eq!(rep.blocks[0].result, Err(BlockError::NotFound), "{engine}");
    assert!(rep.blocks[1].result.is_ok());
    assert_eq!(r.files.stats().corrupt, 0, "not corrupt");
    assert!(!r.files.contains(keys[0]), "a miss leaves the index");
    drop(rep);
    r.files.remove(keys[0]);
    r.files.remove(keys[1]);
    let gone = wait(|| !r.files.block_path(keys[1]).exists() && r.files.stats().maintenance == 0);
    assert!(gone, "the removes ran");
    assert_eq!(
        std::fs::read(&newer).unwrap(),
        bytes,
        "{engine}: left on disk, untouched"
    );
}

/// A fresh directory, its spare folder, and a store config on it with 4 spares made at open
/// and none topped up.
fn four_spares_no_refill(engine: EngineKind) -> (tempfile::TempDir, PathBuf, PosixConfig) {
    let dir = tempfile::tempdir().unwrap();
    let spare_dir = dir.path().join(".kvx-spare");
    let mut cfg = PosixConfig::new(dir.path());
    cfg.engine = engine;
    cfg.spare_files = 4;
    cfg.spare_refill = false;
    (dir, spare_dir, cfg)
}

/// Stores write into spare files made at open (no create on the store's path); a spare found
/// gone falls back to a fresh temporary file; a reopened store takes over the empty spares and
/// removes a half-written one; a store of a shared mount makes none.
fn spare_files_take_the_create_off_the_store_path(engine: EngineKind) {
    let (dir, spare_dir, mut cfg) = four_spares_no_refill(engine);
    let keys: Vec<BlockKey> = (500..503).map(key).collect();
    {
        let r = rig(cfg.clone(), 16, 64 << 10);
        assert_eq!(r.files.spare_files_ready(), vec![4]);
        assert_eq!(std::fs::read_dir(&spare_dir).unwrap().count(), 4);
        // All 256 fan-out directories exist already.
        assert!(dir.path().join("00").is_dir() && dir.path().join("ff").is_dir());
        assert!(r.store(&keys[..2], 10_000).is_ok(), "{engine}");
        assert_eq!(r.files.spare_files_ready(), vec![2]);
        assert_eq!(std::fs::read_dir(&spare_dir).unwrap().count(), 2);
        // The next spare disappears under the store: the store creates its own file.
        for e in std::fs::read_dir(&spare_dir).unwrap() {
            std::fs::remove_file(e.unwrap().path()).unwrap();
        }
        assert!(r.store(&keys[2..], 10_000).is_ok(), "{engine}");
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
        assert!(r.store(&more, 10_000).is_ok(), "{engine}");
        assert!(
            wait(|| r.files.spare_files_ready() == vec![4]),
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
fn preallocated_spares_fit_one_block_size(engine: EngineKind) {
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
        assert!(r.store(&keys[..2], BLOCK).is_ok(), "{engine}");
        assert_eq!(r.files.spare_files_ready(), vec![2]);
        // Oldest first: the two made first are the ones gone.
        let left: Vec<String> = spares().into_iter().map(|s| s.0).collect();
        let mut by_age: Vec<String> = made.iter().map(|s| s.0.clone()).collect();
        by_age.sort_by_key(|n| n.rsplit('-').next().unwrap().parse::<u64>().unwrap());
        assert_eq!(left, by_age[2..].to_vec(), "{engine}");
        // Another size does not fit a spare: the store creates its own file.
        assert!(r.store(&keys[2..], 20_000).is_ok(), "{engine}");
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
    assert!(r.store(&more, BLOCK).is_ok(), "{engine}");
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
fn evicted_block_files_become_spares(engine: EngineKind) {
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
    assert!(r.store(&keys, BLOCK).is_ok(), "{engine}");
    assert_eq!(r.files.spare_files_ready(), vec![0]);
    let mut recycled = [inode(keys[0]), inode(keys[1])];
    recycled.sort_unstable();

    for k in &keys {
        r.files.remove(*k);
    }
    assert!(
        wait(|| r.files.spare_files_ready() == vec![2] && r.files.stats().maintenance == 0),
        "{engine}: {:?}",
        r.files.spare_files_ready()
    );
    assert_eq!(in_spare_dir(), 2, "{engine}: four unlinked");
    assert_eq!(r.files.stats().recycled, 2);
    for k in &keys {
        assert!(!r.files.block_path(*k).exists(), "{engine}: {k} removed");
    }

    let next: Vec<BlockKey> = (810..812).map(key).collect();
    assert!(r.store(&next[..1], BLOCK).is_ok(), "{engine}");
    assert!(r.store(&next[1..], BLOCK).is_ok(), "{engine}");
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
    assert!(r.store(&[other], 20_000).is_ok(), "{engine}");
    r.files.remove(other);
    assert!(wait(|| r.files.stats().maintenance == 0));
    assert_eq!(
        r.load(&[key(821)]).blocks[0].result,
        Err(BlockError::NotFound)
    );
    assert!(!r.files.block_path(other).exists());
    r.files.remove(next[0]);
    r.files.remove(next[1]);
    assert!(
        wait(|| r.files.spare_files_ready() == vec![2] && r.files.stats().maintenance == 0),
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

fn wait(mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

fn main() {
    let args = Arguments::from_args();
    let mut trials = vec![
        Trial::test("round_trip_lookup_remove_both_engines", || {
            round_trip_lookup_remove_both_engines();
            Ok(())
        }),
        Trial::test("scan_rebuilds_the_index_over_several_roots", || {
            scan_rebuilds_the_index_over_several_roots();
            Ok(())
        }),
    ];
    let local = temp_dir_is_local();
    if !local {
        println!(
            "skip: spare_files_take_the_create_off_the_store_path, preallocated_spares_fit_one_block_size, evicted_block_files_become_spares: the temporary directory is not on a local block file system (spares live only there)"
        );
    }
    let direct = disk_takes_direct();
    if !direct {
        println!(
            "skip: write_through_padding_is_zeros: the disk under the target directory refuses O_DIRECT"
        );
    }
    for e in ENGINES {
        trials.push(
            Trial::test(format!("write_through_padding_is_zeros_{e}"), move || {
                write_through_padding_is_zeros(e);
                Ok(())
            })
            .with_ignored_flag(!direct),
        );
        trials.push(
            Trial::test(
                format!("spare_files_take_the_create_off_the_store_path_{e}"),
                move || {
                    spare_files_take_the_create_off_the_store_path(e);
                    Ok(())
                },
            )
            .with_ignored_flag(!local),
        );
        trials.push(
            Trial::test(
                format!("evicted_block_files_become_spares_{e}"),
                move || {
                    evicted_block_files_become_spares(e);
                    Ok(())
                },
            )
            .with_ignored_flag(!local),
        );
        trials.push(
            Trial::test(
                format!("preallocated_spares_fit_one_block_size_{e}"),
                move || {
                    preallocated_spares_fit_one_block_size(e);
                    Ok(())
                },
            )
            .with_ignored_flag(!local),
        );
        trials.push(Trial::test(
            format!("newer_format_version_is_a_miss_and_stays_{e}"),
            move || {
                newer_format_version_is_a_miss_and_stays(e);
                Ok(())
            },
        ));
    }
    let ramfs = match Ramfs::mount() {
        Ok(r) => Some(r),
        Err(why) => {
            println!("skip: buffered_fallback_on_ramfs: {why}");
            None
        }
    };
    let at: Option<PathBuf> = ramfs.as_ref().map(|r| r.dir.path().to_path_buf());
    trials.push(
        Trial::test("buffered_fallback_on_ramfs", move || {
            buffered_fallback_on_ramfs(at.as_deref().ok_or("no ramfs")?);
            Ok(())
        })
        .with_ignored_flag(ramfs.is_none()),
    );
    let conclusion = libtest_mimic::run(&args, trials);
    drop(ramfs);
    conclusion.exit();
}
