//! The blocking file operations the maintenance commands run on the [`Worker`](super::Worker):
//! list a directory, stat a leaf directory's files, read a block, remove a file only if it is
//! still the one that was looked at.

use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::format::{HEADER_LEN, parse_header};

/// Which file a path named when it was looked at: device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    /// Device number.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
}

/// What `stat` said about a file.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stat {
    pub(super) id: FileId,
    pub(super) len: u64,
    pub(super) modified: SystemTime,
    /// Status change time (seconds, nanoseconds): a rename or a write moves it.
    changed: (i64, i64),
}

fn stat_of(m: &std::fs::Metadata) -> Stat {
    Stat {
        id: FileId {
            dev: m.dev(),
            ino: m.ino(),
        },
        len: m.len(),
        modified: m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        changed: (m.ctime(), m.ctime_nsec()),
    }
}

/// Names of the subdirectories of `dir` (entries that vanish while listed are skipped).
pub(super) fn list_subdirs(dir: &Path) -> io::Result<Vec<String>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type().is_ok_and(|t| t.is_dir())
            && let Some(name) = e.file_name().to_str()
        {
            out.push(name.to_string());
        }
    }
    Ok(out)
}

/// Every regular file of `dir` with its `lstat` (files removed meanwhile are skipped; a file
/// whose `lstat` fails otherwise is kept with none).
pub(super) fn list_files(dir: &Path) -> io::Result<Vec<(PathBuf, Option<Stat>)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        match e.metadata() {
            Ok(m) if m.is_file() => out.push((e.path(), Some(stat_of(&m)))),
            Ok(_) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(_) => out.push((e.path(), None)),
        }
    }
    Ok(out)
}

/// The bytes of a block file as a load sees them.
#[derive(Debug)]
pub(super) struct BlockBytes {
    pub(super) stat: Stat,
    /// The file was renamed, written or replaced while it was read (a live store recycled an
    /// evicted block's file, say): the bytes may mix two blocks, and say nothing of either.
    pub(super) changed: bool,
    /// The first [`HEADER_LEN`] bytes (fewer when the file is shorter).
    pub(super) header: Vec<u8>,
    /// The payload, as many bytes as the header asks for and the file holds (empty when the
    /// header is not readable).
    pub(super) payload: Vec<u8>,
}

fn read_up_to(f: &mut std::fs::File, want: usize) -> io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(want);
    f.take(want as u64).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Read the header of `path` and, when it parses, its payload (never more than the file holds).
pub(super) fn read_block(path: &Path) -> io::Result<BlockBytes> {
    let mut f = std::fs::File::open(path)?;
    let stat = stat_of(&f.metadata()?);
    if !names(path, stat.id)? {
        // Moved away between the open and its stat: not the file the path names.
        return Ok(BlockBytes {
            stat,
            changed: true,
            header: Vec::new(),
            payload: Vec::new(),
        });
    }
    let header = read_up_to(&mut f, HEADER_LEN)?;
    let payload = match parse_header(&header) {
        Ok(h) => {
            let in_file = stat.len.saturating_sub(HEADER_LEN as u64);
            read_up_to(&mut f, h.len.min(in_file) as usize)?
        }
        Err(_) => Vec::new(),
    };
    let changed = !unchanged_since(&f, path, &stat)?;
    Ok(BlockBytes {
        stat,
        changed,
        header,
        payload,
    })
}

/// Whether open file `f` is still as `before` described it (no rename, write or truncate since:
/// the same length, mtime and ctime) and `path` still names it.
fn unchanged_since(f: &std::fs::File, path: &Path, before: &Stat) -> io::Result<bool> {
    let now = stat_of(&f.metadata()?);
    if now.len != before.len || now.modified != before.modified || now.changed != before.changed {
        return Ok(false);
    }
    names(path, before.id)
}

/// Whether `path` names file `id` right now.
fn names(path: &Path, id: FileId) -> io::Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(m) => Ok(stat_of(&m).id == id),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// What happened to a file that was to be removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// Removed.
    Removed,
    /// Already gone (another node or another run removed it): fine.
    AlreadyGone,
    /// The path now names another file, or the file was written or loaded since it was looked
    /// at: left alone.
    Changed,
}

/// Remove `path` if it is still file `id` and (when given) still has mtime `modified`.
pub fn remove_if_unchanged(
    path: &Path,
    id: FileId,
    modified: Option<SystemTime>,
) -> io::Result<Removal> {
    let now = match std::fs::symlink_metadata(path) {
        Ok(m) => stat_of(&m),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Removal::AlreadyGone),
        Err(e) => return Err(e),
    };
    if now.id != id || modified.is_some_and(|m| m != now.modified) {
        return Ok(Removal::Changed);
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(Removal::Removed),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Removal::AlreadyGone),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// `path` opened, with the `Stat` a read starts from.
    fn opened(path: &Path) -> (std::fs::File, Stat) {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let st = stat_of(&f.metadata().unwrap());
        (f, st)
    }

    /// File times move with the kernel's coarse clock (a tick of up to 10 ms): wait one out so
    /// that a change made next shows in them.
    fn tick() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    /// A file renamed away, written in place, or replaced at its path after it was opened is
    /// changed; one left alone is not.
    #[test]
    fn a_file_moved_or_rewritten_under_a_read_is_changed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.kvb");
        let other = dir.path().join("elsewhere");
        let fresh = || std::fs::write(&path, vec![7u8; 8192]).unwrap();

        fresh();
        let (f, st) = opened(&path);
        assert!(unchanged_since(&f, &path, &st).unwrap(), "left alone");
        assert!(!read_block(&path).unwrap().changed);

        tick();
        std::fs::rename(&path, &other).unwrap();
        assert!(!unchanged_since(&f, &path, &st).unwrap(), "renamed away");
        std::fs::rename(&other, &path).unwrap();
        assert!(
            !unchanged_since(&f, &path, &st).unwrap(),
            "renamed away and back: its ctime moved"
        );

        fresh();
        let (mut f, st) = opened(&path);
        tick();
        f.write_all(&[9u8; 4096]).unwrap();
        assert!(
            !unchanged_since(&f, &path, &st).unwrap(),
            "written in place"
        );

        let (f, st) = opened(&path);
        std::fs::write(&other, vec![1u8; 8192]).unwrap();
        std::fs::rename(&other, &path).unwrap();
        assert!(
            !unchanged_since(&f, &path, &st).unwrap(),
            "another file renamed over its path"
        );
    }
}
