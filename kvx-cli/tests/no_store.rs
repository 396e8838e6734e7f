//! `kvx verify DIR` and `kvx gc DIR` on a directory that holds no block store (the parent of
//! stores, say) exit 2 with a message naming the stores found below it; on an empty directory
//! (a store not written yet) they report it clean.

use std::process::{Command, Output};

fn kvx(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvx"))
        .args(args)
        .output()
        .expect("run kvx")
}

/// A directory holding two store roots, `a` and `nodes/b`, each with one `ab/` directory.
fn parent_of_stores() -> tempfile::TempDir {
    let d = tempfile::tempdir().expect("temp dir");
    for store in ["a", "nodes/b"] {
        let leaf = d.path().join(store).join("ab");
        std::fs::create_dir_all(&leaf).expect("mkdir");
        std::fs::write(leaf.join("note.txt"), b"not a block").expect("write");
    }
    std::fs::write(d.path().join("README"), b"several stores below").expect("write");
    d
}

#[test]
fn verify_and_gc_refuse_a_directory_without_a_store() {
    let d = parent_of_stores();
    let dir = d.path().to_str().expect("path");
    for args in [vec!["verify", dir], vec!["gc", dir, "--max-bytes", "1GiB"]] {
        let out = kvx(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("holds no block store"), "{stderr}");
        let a = d.path().join("a").display().to_string();
        let b = d.path().join("nodes/b").display().to_string();
        assert!(
            stderr.contains(&a) && stderr.contains(&b),
            "names the stores below: {stderr}"
        );
    }
}

#[test]
fn an_empty_directory_is_a_store_not_written_yet() {
    let d = tempfile::tempdir().expect("temp dir");
    let dir = d.path().to_str().expect("path");
    let out = kvx(&["verify", dir]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
