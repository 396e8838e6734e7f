//! Removing the file tier's fresh directory at exit. One file per block makes thousands of
//! files; unlinking them one after another waits on the filesystem journal each time (seconds
//! on a virtual disk), so several threads remove them side by side.

use std::path::{Path, PathBuf};

/// Threads removing files.
const THREADS: usize = 8;

fn collect(dir: &Path, files: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            collect(&e.path(), files)?;
        } else {
            files.push(e.path());
        }
    }
    Ok(())
}

/// Remove `dir` and everything under it.
pub fn remove_tree(dir: &Path) -> std::io::Result<()> {
    let mut files = Vec::new();
    collect(dir, &mut files)?;
    let chunk = files.len().div_ceil(THREADS).max(1);
    std::thread::scope(|s| {
        for part in files.chunks(chunk) {
            s.spawn(move || {
                for f in part {
                    let _ = std::fs::remove_file(f);
                }
            });
        }
    });
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
        remove_tree(&root).unwrap();
        assert!(!root.exists());
    }
}
