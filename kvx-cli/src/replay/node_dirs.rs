//! Per-node directories (`--node-dir`, one per node): each node reaches the shared file tier
//! through its own path, as engine nodes on a distributed file system each reach the volume
//! through their own mount (one FUSE mount per node on GlusterFS). Before the nodes start, the
//! directories are checked to show one directory: a file made through the first is seen
//! through every other, so that mounts of different volumes (or plain local directories) are
//! refused with a clear message instead of giving a run in which no node sees another's blocks.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long a file made through the first directory may take to show through the others (a
/// client's lookup cache on a distributed file system).
pub const VISIBLE_WITHIN: Duration = Duration::from_secs(2);

/// The node directories for `nodes` nodes: every one of `dirs`, or an error that says how many
/// were given against how many are needed.
pub fn for_nodes(dirs: &[PathBuf], nodes: usize) -> Result<&[PathBuf], String> {
    if dirs.len() != nodes {
        return Err(format!(
            "--node-dir given {} time(s) for {nodes} node(s): give it once per node, in node order",
            dirs.len()
        ));
    }
    Ok(dirs)
}

/// Create every one of `dirs` and check that they show one directory: a marker file made
/// through the first is seen through each other within `within`; the marker is removed.
pub fn check_shared(dirs: &[PathBuf], within: Duration) -> Result<(), String> {
    for d in dirs {
        std::fs::create_dir_all(d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
    }
    let Some(first) = dirs.first() else {
        return Ok(());
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let name = format!(".kvx-node-dirs-{}-{nanos}", std::process::id());
    let marker = first.join(&name);
    std::fs::write(&marker, b"kvx node-dir check\n")
        .map_err(|e| format!("cannot write {}: {e}", marker.display()))?;
    let unseen = dirs[1..]
        .iter()
        .enumerate()
        .find(|(_, d)| !seen_within(&d.join(&name), within));
    let _ = std::fs::remove_file(&marker);
    match unseen {
        None => Ok(()),
        Some((i, d)) => Err(format!(
            "--node-dir {} (node {}) does not show the files of --node-dir {} (node 0): a file \
             made through node 0's was not seen through it within {within:?}; every node's \
             directory must be the same shared directory (its own mount of one volume)",
            d.display(),
            i + 1,
            first.display()
        )),
    }
}

/// True when `path` exists, or comes to exist within `within`.
fn seen_within(path: &Path, within: Duration) -> bool {
    let end = Instant::now() + within;
    loop {
        if path.exists() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_must_match_the_nodes() {
        let dirs = vec![PathBuf::from("/a"), PathBuf::from("/b")];
        assert_eq!(for_nodes(&dirs, 2), Ok(&dirs[..]));
        let e = for_nodes(&dirs, 3).expect_err("two dirs for three nodes");
        assert!(e.contains("given 2 time(s) for 3 node(s)"), "{e}");
    }

    #[test]
    fn paths_to_one_directory_pass_and_separate_directories_are_refused() {
        let shared = tempfile::tempdir().expect("tempdir");
        let links = tempfile::tempdir().expect("tempdir");
        let link = links.path().join("node1");
        std::os::unix::fs::symlink(shared.path(), &link).expect("symlink");
        let ok = [shared.path().to_path_buf(), link];
        assert_eq!(check_shared(&ok, Duration::from_millis(100)), Ok(()));
        assert_eq!(
            std::fs::read_dir(shared.path()).expect("read_dir").count(),
            0,
            "the marker is removed"
        );
        let other = tempfile::tempdir().expect("tempdir");
        let bad = [shared.path().to_path_buf(), other.path().to_path_buf()];
        let e = check_shared(&bad, Duration::from_millis(100)).expect_err("two directories");
        assert!(e.contains("(node 1) does not show the files"), "{e}");
    }
}
