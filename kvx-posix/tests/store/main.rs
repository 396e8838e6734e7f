//! The store on a real directory (no FUSE): round trips through the driver with both engines,
//! lookup/remove, the startup scan, several roots, the O_DIRECT fallback on ramfs, zero padding
//! of O_DIRECT writes from shared buffers and blocks of a newer format version; spare files in
//! `spares.rs`.
//!
//! Tests that cannot run here (no ramfs mount, a disk without O_DIRECT) print one `skip:` line
//! and are counted as ignored.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_posix::format::HEADER_LEN;
use kvx_posix::testing::{Rig, RigShape, SOON, expected, files_with_suffix, fill, key, wait_until};
use kvx_posix::{IoEngine, PosixConfig, PosixStore};
use libtest_mimic::{Arguments, Trial};

mod spares;

const ENGINES: [IoEngine; 2] = [IoEngine::Uring, IoEngine::Psync];

/// A rig on `cfg` with `bufs` staging buffers of `size` bytes.
fn rig(cfg: PosixConfig, bufs: usize, size: usize) -> Rig {
    Rig::open(cfg, RigShape::new(bufs, size))
}

fn round_trip_lookup_remove_both_engines() {
    for engine in ENGINES {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = PosixConfig::new(dir.path());
        cfg.io_engine = engine;
        let r = rig(cfg, 16, 64 << 10);
        assert_eq!(r.files.capabilities().io_engine, engine);
        let keys: Vec<BlockKey> = (0..6).map(key).collect();
        // A length that is not a multiple of 4096 exercises the O_DIRECT padding.
        assert!(r.store_keys(&keys, 10_000).is_ok(), "{engine}");
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
        assert!(r.store_keys(&keys, 8192).is_ok());
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
        cfg.io_engine = engine;
        let r = rig(cfg, 4, 8192);
        assert!(!r.files.capabilities().direct, "ramfs refuses O_DIRECT");
        let k = [key(7)];
        assert!(r.store_keys(&k, 5000).is_ok());
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
fn write_through_padding_is_zeros(engine: IoEngine) {
    let dir = disk_dir();
    let mut cfg = PosixConfig::new(dir.path());
    cfg.io_engine = engine;
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
fn newer_format_version_is_a_miss_and_stays(engine: IoEngine) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = PosixConfig::new(dir.path());
    cfg.io_engine = engine;
    let r = rig(cfg, 8, 8192);
    let keys = [key(21), key(22)];
    assert!(r.store_keys(&keys, 8192).is_ok());
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
    let gone = wait_until(SOON, || {
        !r.files.block_path(keys[1]).exists() && r.files.stats().maintenance == 0
    });
    assert!(gone, "the removes ran");
    assert_eq!(
        std::fs::read(&newer).unwrap(),
        bytes,
        "{engine}: left on disk, untouched"
    );
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
    trials.extend(spares::trials());
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
