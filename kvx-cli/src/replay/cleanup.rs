//! Removing the file tier's fresh directory at exit. One file per block, fanned out over two
//! levels of directories, makes tens of thousands of entries; removing them one after another
//! waits on the filesystem each time (milliseconds each on a disk mounted with `discard`), so
//! several threads remove them side by side: the files, then each level of directories from the
//! deepest up.

use std::path::{Path, PathBuf};

/// Threads removing entries.
const THREADS: usize = 16;

fn collect(
    dir: &Path,
    depth: usize,
    files: &mut Vec<PathBuf>,
    dirs: &mut Vec<(usize, PathBuf)>,
) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            collect(&e.path(), depth + 1, files, dirs)?;
            dirs.push((depth + 1, e.path()));
        } else {
            files.push(e.path());
        }
    }
    Ok(())
}

fn in_parallel(paths: &[PathBuf], remove: fn(&Path) -> std::io::Result<()>) {
    let chunk = paths.len().div_ceil(THREADS).max(1);
    std::thread::scope(|s| {
        for part in paths.chunks(chunk) {
            s.spawn(move || {
                for p in part {
                    let _ = remove(p);
                }
            });
        }
    });
}

/// Remove `dir` and everything under it.
pub fn remove_tree(dir: &Path) -> std::io::Result<()> {
    let (mut files, mut dirs) = (Vec::new(), Vec::new());
    collect(dir, 0, &mut files, &mut dirs)?;
    in_parallel(&files, |p| std::fs::remove_file(p));
    dirs.sort_by_key(|d| std::cmp::Reverse(d.0));
    for level in dirs.chunk_by(|a, b| a.0 == b.0) {
        let paths: Vec<PathBuf> = level.iter().map(|d| d.1.clone()).collect();
        in_parallel(&paths, |p| std::fs::remove_dir(p));
    }
    // Whatever is left (an entry that appeared meanwhile) goes the slow way.
    std::fs::remove_dir_all(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_a_nested_tree() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("tier");
        for i in 0..40 {
            let d = root.join(format!("{:02x}", i % 7)).join(format!("{i}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("b.kvb"), [i as u8; 10]).unwrap();
        }
        std::fs::write(root.join("top"), b"x").unwrap();
        remove_tree(&root).unwrap();
        assert!(!root.exists());
    }
}
