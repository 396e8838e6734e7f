//! verify and gc on real files in a temporary directory.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use kvx_core::BlockKey;

use super::*;
use crate::format::{HEADER_LEN, encode_header};
use crate::paths::Layout;

/// Write a block file where a store would, with mtime `age` ago.
fn put(root: &Path, key: BlockKey, payload: &[u8], age: Duration) -> PathBuf {
    let path = Layout::new(vec![root.to_path_buf()]).block_path(key);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut bytes = vec![0u8; HEADER_LEN];
    encode_header(&mut bytes, key, payload, 1);
    bytes.extend_from_slice(payload);
    std::fs::write(&path, &bytes).unwrap();
    age_file(&path, age);
    path
}

fn age_file(path: &Path, age: Duration) {
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_modified(SystemTime::now() - age).unwrap();
}

fn key(i: u128) -> BlockKey {
    BlockKey(i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835) | 1)
}

fn kinds(r: &VerifyReport) -> Vec<(String, FindingKind)> {
    let mut v: Vec<_> = r
        .findings
        .iter()
        .map(|f| (f.path.file_name().unwrap().to_string_lossy().into(), f.kind))
        .collect();
    v.sort();
    v
}

#[test]
fn verify_names_each_problem_and_repair_removes_them() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    let min = Duration::from_secs(60);
    for i in 0..5 {
        put(root, key(i), &[i as u8; 5000], min);
    }
    let flipped = put(root, key(10), &[3u8; 5000], min);
    let mut b = std::fs::read(&flipped).unwrap();
    b[HEADER_LEN + 1234] ^= 0x10;
    std::fs::write(&flipped, b).unwrap();
    let truncated = put(root, key(11), &[4u8; 5000], min);
    std::fs::File::options()
        .write(true)
        .open(&truncated)
        .unwrap()
        .set_len(HEADER_LEN as u64 + 100)
        .unwrap();
    let foreign = Layout::new(vec![root.into()]).block_path(key(12));
    std::fs::create_dir_all(foreign.parent().unwrap()).unwrap();
    std::fs::write(&foreign, vec![b'x'; 8192]).unwrap();
    let wrong_key = put(root, key(13), &[5u8; 100], min);
    let other = put(root, key(14), &[5u8; 100], min);
    std::fs::rename(&other, &wrong_key).unwrap();
    let newer = put(root, key(15), &[6u8; 100], min);
    let mut b = std::fs::read(&newer).unwrap();
    b[8] = 9;
    std::fs::write(&newer, b).unwrap();
    let dir = flipped.parent().unwrap();
    let stale = dir.join(format!("{}.oldhost-77-3.kvb.tmp", key(10).to_hex()));
    std::fs::write(&stale, b"half").unwrap();
    age_file(&stale, Duration::from_secs(3600));
    let fresh = dir.join(format!("{}.4242-9.kvb.tmp", key(10).to_hex()));
    std::fs::write(&fresh, b"writing").unwrap();
    let notes = dir.join("notes.txt");
    std::fs::write(&notes, b"operator notes").unwrap();

    let opts = VerifyOptions::default();
    let r = verify(root, &opts, &mut |_| {}).unwrap();
    let name = |p: &Path| p.file_name().unwrap().to_string_lossy().into_owned();
    let mut want = vec![
        (name(&flipped), FindingKind::ChecksumMismatch),
        (name(&truncated), FindingKind::Truncated),
        (name(&foreign), FindingKind::Foreign),
        (name(&wrong_key), FindingKind::WrongKey),
        (name(&newer), FindingKind::NewerFormat),
        (name(&stale), FindingKind::StaleTemp),
        (name(&notes), FindingKind::UnknownFile),
    ];
    want.sort();
    assert_eq!(kinds(&r), want);
    assert_eq!(r.problems(), 5);
    assert_eq!(r.blocks_checked, 10);
    assert_eq!(r.blocks_ok, 5);
    assert_eq!(r.bytes_ok, 5 * 5000);
    assert_eq!(r.temps_in_flight, 1);
    let reason = |k: FindingKind| &r.findings.iter().find(|f| f.kind == k).unwrap().reason;
    assert!(
        reason(FindingKind::ChecksumMismatch).contains("checksum mismatch"),
        "{}",
        reason(FindingKind::ChecksumMismatch)
    );
    assert!(reason(FindingKind::NewerFormat).contains("format version 9"));
    assert!(reason(FindingKind::NewerFormat).contains("left alone"));
    assert!(r.findings.iter().all(|f| f.action == Action::Reported));
    assert!(
        stale.exists() && flipped.exists(),
        "no repair: nothing removed"
    );

    let repair = VerifyOptions {
        repair: true,
        ..opts.clone()
    };
    let r = verify(root, &repair, &mut |_| {}).unwrap();
    assert_eq!(r.problems(), 5);
    assert_eq!(r.unresolved(), 0);
    for f in &r.findings {
        let removed = f.action == Action::Removed;
        assert_eq!(removed, f.kind.is_problem(), "{f:?}");
        assert_eq!(f.path.exists(), !removed, "{f:?}");
    }
    assert!(newer.exists() && notes.exists() && fresh.exists());

    let r = verify(root, &opts, &mut |_| {}).unwrap();
    assert_eq!(r.problems(), 0, "{:?}", r.findings);
    assert_eq!(r.blocks_ok, 5);
}

#[test]
fn a_block_of_the_older_two_level_layout_is_foreign_and_repaired() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    let kept = put(root, key(1), &[1u8; 3000], Duration::ZERO);
    // Where the older layout kept a block: `root/ab/cd/<hex>.kvb`; a valid block, read by no
    // store of this layout.
    let hex = key(2).to_hex();
    let old_dir = root.join(&hex[0..2]).join(&hex[2..4]);
    std::fs::create_dir_all(&old_dir).unwrap();
    let old = old_dir.join(format!("{hex}.kvb"));
    let mut bytes = vec![0u8; HEADER_LEN];
    encode_header(&mut bytes, key(2), &[2u8; 3000], 1);
    bytes.extend_from_slice(&[2u8; 3000]);
    std::fs::write(&old, &bytes).unwrap();

    let opts = VerifyOptions::default();
    let r = verify(root, &opts, &mut |_| {}).unwrap();
    let name = |p: &Path| p.file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(kinds(&r), vec![(name(&old), FindingKind::Foreign)]);
    assert_eq!(r.blocks_ok, 1);
    let repair = VerifyOptions {
        repair: true,
        ..opts.clone()
    };
    let r = verify(root, &repair, &mut |_| {}).unwrap();
    assert_eq!(r.unresolved(), 0);
    assert!(!old.exists() && kept.exists());
    let r = verify(root, &opts, &mut |_| {}).unwrap();
    assert_eq!(r.problems(), 0, "{:?}", r.findings);
}

#[test]
fn a_truncated_header_and_a_corrupt_header_are_problems() {
    let d = tempfile::tempdir().unwrap();
    let short = put(d.path(), key(1), &[1u8; 10], Duration::ZERO);
    std::fs::File::options()
        .write(true)
        .open(&short)
        .unwrap()
        .set_len(10)
        .unwrap();
    let bad = put(d.path(), key(2), &[1u8; 10], Duration::ZERO);
    let mut b = std::fs::read(&bad).unwrap();
    b[33] ^= 1;
    std::fs::write(&bad, b).unwrap();
    let r = verify(d.path(), &VerifyOptions::default(), &mut |_| {}).unwrap();
    let name = |p: &Path| p.file_name().unwrap().to_string_lossy().into_owned();
    let mut want = vec![
        (name(&short), FindingKind::Truncated),
        (name(&bad), FindingKind::HeaderCorrupt),
    ];
    want.sort();
    assert_eq!(kinds(&r), want);
    assert!(
        r.findings
            .iter()
            .all(|f| f.reason.contains("short file") || f.reason.contains("header checksum"))
    );
}

#[test]
fn gc_removes_oldest_first_down_to_the_quota() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    let file = (HEADER_LEN + 1000) as u64;
    // Block i was last used i minutes ago: the highest i are the oldest.
    let paths: Vec<PathBuf> = (0..10)
        .map(|i| {
            put(
                root,
                key(i),
                &[1u8; 1000],
                Duration::from_secs(60 * i as u64 + 1),
            )
        })
        .collect();
    let stale = paths[0].with_file_name("dead.h-1-1.kvb.tmp");
    std::fs::write(&stale, b"x").unwrap();
    age_file(&stale, Duration::from_secs(7200));

    let dry = GcOptions {
        dry_run: true,
        ..GcOptions::new(6 * file)
    };
    let r = gc(root, &dry, &mut |_| {}).unwrap();
    assert_eq!((r.bytes_before, r.bytes_after), (10 * file, 6 * file));
    assert_eq!(r.blocks.len(), 4);
    assert!(r.blocks.iter().all(|c| c.outcome.is_none()));
    assert!(paths.iter().all(|p| p.exists()) && stale.exists());

    let r = gc(root, &GcOptions::new(6 * file + 10), &mut |_| {}).unwrap();
    let removed: Vec<&PathBuf> = r.blocks.iter().map(|c| &c.path).collect();
    let oldest: Vec<&PathBuf> = paths[6..].iter().rev().collect();
    assert_eq!(removed, oldest, "oldest first");
    assert_eq!(r.bytes_after, 6 * file);
    assert_eq!(r.blocks_after, 6);
    assert_eq!(r.temps.len(), 1);
    for (i, p) in paths.iter().enumerate() {
        assert_eq!(p.exists(), i < 6, "{i}");
    }
    assert!(!stale.exists());

    // Already under quota: nothing to do.
    let r = gc(root, &GcOptions::new(6 * file), &mut |_| {}).unwrap();
    assert!(r.blocks.is_empty() && r.temps.is_empty());
    assert_eq!(r.bytes_before, r.bytes_after);
}

#[test]
fn concurrent_gc_runs_end_consistent() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().to_path_buf();
    let file = (HEADER_LEN + 100) as u64;
    let paths: Vec<PathBuf> = (0..200)
        .map(|i| {
            put(
                &root,
                key(i),
                &[2u8; 100],
                Duration::from_secs(10 * i as u64 + 1),
            )
        })
        .collect();
    let runs: Vec<_> = (0..2)
        .map(|_| {
            let root = root.clone();
            std::thread::spawn(move || gc(&root, &GcOptions::new(50 * file), &mut |_| {}))
        })
        .collect();
    for r in runs {
        let r = r.join().unwrap().unwrap();
        assert!(r.failed.is_empty(), "{:?}", r.failed);
        assert!(r.bytes_after <= 50 * file);
    }
    for (i, p) in paths.iter().enumerate() {
        assert_eq!(p.exists(), i < 50, "block {i}: the 50 newest stay");
    }
}

#[test]
fn removal_leaves_a_changed_file_alone() {
    let d = tempfile::tempdir().unwrap();
    let p = put(d.path(), key(1), &[1u8; 10], Duration::from_secs(100));
    let m = std::fs::metadata(&p).unwrap();
    use std::os::unix::fs::MetadataExt;
    let id = FileId {
        dev: m.dev(),
        ino: m.ino(),
    };
    let walked = m.modified().unwrap();
    // A load touched it since.
    age_file(&p, Duration::ZERO);
    assert_eq!(
        files::remove_if_unchanged(&p, id, Some(walked)).unwrap(),
        Removal::Changed
    );
    assert!(p.exists());
    // Replaced by a new store: a new file renamed over it (another inode).
    let other = d.path().join("other");
    let q = put(&other, key(1), &[1u8; 10], Duration::ZERO);
    std::fs::rename(&q, &p).unwrap();
    let q = p;
    assert_eq!(
        files::remove_if_unchanged(&q, id, None).unwrap(),
        Removal::Changed
    );
    let m = std::fs::metadata(&q).unwrap();
    let id = FileId {
        dev: m.dev(),
        ino: m.ino(),
    };
    assert_eq!(
        files::remove_if_unchanged(&q, id, None).unwrap(),
        Removal::Removed
    );
    assert_eq!(
        files::remove_if_unchanged(&q, id, None).unwrap(),
        Removal::AlreadyGone
    );
}
