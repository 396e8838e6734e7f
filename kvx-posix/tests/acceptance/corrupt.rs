//! Damaged block files: each fails exactly its own block with a clear error, nothing panics,
//! and the other blocks of the task still load.

use std::fs::OpenOptions;
use std::io::{Seek, SeekFrom, Write};

use kvx_core::*;
use kvx_posix::IoEngine;
use kvx_posix::format::HEADER_LEN;

use crate::rig::*;

pub fn corrupt_block(engine: IoEngine, place: Place) {
    let r = Rig::new(engine, place, |_| {});
    // The disk here is a local block file system: its loads read without a statx and are
    // issued inline; a FUSE mount's never are. Both must fail the same blocks the same way.
    let local = matches!(place, Place::Disk)
        && on_local_fs(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")));
    assert_eq!(r.files.capabilities().inline_per_root, vec![local]);
    let keys: Vec<BlockKey> = (7000..7006).map(key).collect();
    r.store_ok(&keys);
    let path = |i: usize| r.files.block_path(keys[i]);
    let rewrite = |i: usize, off: u64, bytes: &[u8]| {
        let mut f = OpenOptions::new().write(true).open(path(i)).unwrap();
        f.seek(SeekFrom::Start(off)).unwrap();
        f.write_all(bytes).unwrap();
    };
    // 1: one payload byte flipped.
    let mut f1 = std::fs::read(path(1)).unwrap();
    f1[HEADER_LEN + 1234] ^= 0x01;
    std::fs::write(path(1), &f1).unwrap();
    // 2: truncated in the middle of the payload.
    OpenOptions::new()
        .write(true)
        .open(path(2))
        .unwrap()
        .set_len((HEADER_LEN + BLOCK / 2) as u64)
        .unwrap();
    // 3: another block's file under this key's name.
    std::fs::copy(path(0), path(3)).unwrap();
    // 4: wrong magic.
    rewrite(4, 0, b"NOTKVX!!");
    // 5: zero-length file.
    std::fs::write(path(5), b"").unwrap();

    let rep = r.load(&keys);
    assert!(matches!(rep.state, TaskState::Failed(_)), "{:?}", rep.state);
    assert!(rep.blocks[0].result.is_ok(), "{:?}", rep.blocks[0].result);
    assert_eq!(
        rep.blocks[0].buf.as_ref().unwrap().as_slice(),
        &expected(keys[0], BLOCK)[..],
        "the intact block still loads"
    );
    let want = [
        (1, "checksum"),
        (2, "short file"),
        (3, "holds block"),
        (4, "wrong magic"),
        (5, "short file: 0 bytes"),
    ];
    for (i, what) in want {
        match &rep.blocks[i].result {
            Err(BlockError::Corrupt(msg)) => {
                assert!(msg.contains(what), "block {i}: {msg:?} should say {what:?}");
                assert!(
                    msg.contains(&keys[i].to_hex()),
                    "block {i}: {msg:?} names the file"
                );
            }
            other => panic!("block {i}: expected Corrupt({what}), got {other:?}"),
        }
    }
    assert_eq!(r.files.stats().corrupt, 5);
    assert_eq!(r.files.lookup(&keys[..1]), 1);
    for k in &keys[1..] {
        assert!(!r.files.contains(*k), "a corrupt block leaves the index");
    }
    // A store over a corrupt block replaces it.
    drop(rep);
    r.store_ok(&keys[1..2]);
    assert!(r.load(&keys[1..2]).is_ok());
}

/// Whether `dir` is on ext2/3/4, XFS, Btrfs, F2FS or tmpfs, as `stat -f` reports it.
fn on_local_fs(dir: &std::path::Path) -> bool {
    let out = std::process::Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(dir)
        .output()
        .expect("stat -f runs");
    let kind = String::from_utf8_lossy(&out.stdout);
    ["ext2/ext3", "xfs", "btrfs", "f2fs", "tmpfs"].contains(&kind.trim())
}
