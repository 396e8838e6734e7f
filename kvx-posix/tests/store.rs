//! The store on a real directory (no FUSE): round trips through the driver with both engines,
//! lookup/remove, the startup scan, several roots and the O_DIRECT fallback on tmpfs.

use std::path::Path;
use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_posix::{EngineKind, PosixConfig, PosixHandle, PosixStore};

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

#[test]
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
        {
            let rep = r.load(&keys);
            assert!(rep.is_ok(), "{engine}: {:?}", rep.blocks[0].result);
            for (b, k) in rep.blocks.iter().zip(&keys) {
                assert_eq!(
                    b.buf.as_ref().unwrap().as_slice(),
                    &expected(*k, 10_000)[..]
                );
            }
        }
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

#[test]
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
    let leaf = a.path().join("00").join("00");
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

/// Unmounts a ramfs mounted by the test.
struct Ramfs(std::path::PathBuf);

impl Drop for Ramfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn direct_io_on_disk_and_buffered_fallback_on_ramfs() {
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let s = PosixStore::open(PosixConfig::new(disk.path())).unwrap();
    let on_disk = s.capabilities().direct;
    drop(s);
    // ramfs has no direct I/O at all: open(O_DIRECT) answers EINVAL. (tmpfs accepts O_DIRECT
    // since Linux 6.6, so it no longer shows the fallback.)
    let dir = tempfile::tempdir().unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "ramfs", "ramfs"])
        .arg(dir.path())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        println!("skip: cannot mount ramfs here (disk direct = {on_disk})");
        return;
    }
    let _guard = Ramfs(dir.path().to_path_buf());
    for engine in ENGINES {
        let root = dir.path().join(engine.as_str());
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
