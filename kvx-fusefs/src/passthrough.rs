//! The passthrough backing: every operation is done on a real directory.
//!
//! Inodes are numbered by this store and mapped to paths relative to the directory; renames
//! move the mapping (and that of everything below a renamed directory), a removed name leaves
//! its inode without a path (still usable through its open handles). Open handles are real
//! files. `O_DIRECT` and `O_APPEND` are not passed on: the kernel sends explicit offsets, and
//! request buffers are not aligned for direct I/O on the backing file.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{self, DirBuilder, File, Metadata, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, DirEntryExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{Errno, FileAttr, FileType, INodeNo};
use kvx_core::sync::lock;

use crate::FuseError;
use crate::backing::{
    DirEntry, FsResult, Owner, ROOT_INO, StatFs, Store, errno, rename_noreplace, rename_unsupported,
};
use crate::sys;

#[derive(Debug)]
struct Inode {
    /// Path relative to the root; `None` once the name was removed.
    path: Option<PathBuf>,
    /// Kernel references (lookups not yet forgotten).
    nlookup: u64,
}

#[derive(Debug)]
struct Table {
    inodes: HashMap<u64, Inode>,
    by_path: HashMap<PathBuf, u64>,
    handles: HashMap<u64, Arc<File>>,
    next_ino: u64,
    next_fh: u64,
}

impl Table {
    fn path(&self, ino: u64) -> FsResult<&Path> {
        self.inodes
            .get(&ino)
            .and_then(|i| i.path.as_deref())
            .ok_or(Errno::ENOENT)
    }

    /// The inode for `rel`, created if new, with one more kernel reference.
    fn remember(&mut self, rel: PathBuf) -> u64 {
        if let Some(&ino) = self.by_path.get(&rel) {
            if let Some(inode) = self.inodes.get_mut(&ino) {
                inode.nlookup += 1;
                return ino;
            }
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.by_path.insert(rel.clone(), ino);
        self.inodes.insert(
            ino,
            Inode {
                path: Some(rel),
                nlookup: 1,
            },
        );
        ino
    }

    /// `rel` no longer names anything.
    fn vanish(&mut self, rel: &Path) {
        if let Some(ino) = self.by_path.remove(rel) {
            if let Some(inode) = self.inodes.get_mut(&ino) {
                inode.path = None;
            }
        }
    }

    /// `from` (and everything below it) is now at `to`.
    fn moved(&mut self, from: &Path, to: &Path) {
        let moves: Vec<(PathBuf, PathBuf)> = self
            .by_path
            .keys()
            .filter_map(|p| {
                let rest = p.strip_prefix(from).ok()?;
                // Joining an empty rest would add a trailing slash.
                let new = if rest.as_os_str().is_empty() {
                    to.to_owned()
                } else {
                    to.join(rest)
                };
                Some((p.clone(), new))
            })
            .collect();
        for (old, new) in moves {
            if let Some(ino) = self.by_path.remove(&old) {
                if let Some(inode) = self.inodes.get_mut(&ino) {
                    inode.path = Some(new.clone());
                }
                self.by_path.insert(new, ino);
            }
        }
    }

    fn handle(&self, fh: u64) -> FsResult<Arc<File>> {
        self.handles.get(&fh).cloned().ok_or(Errno::EBADF)
    }

    fn add_handle(&mut self, file: File) -> u64 {
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, Arc::new(file));
        fh
    }
}

/// Files kept in a real directory.
#[derive(Debug)]
pub(crate) struct PassthroughStore {
    root: PathBuf,
    table: Mutex<Table>,
}

impl PassthroughStore {
    /// Pass through to `dir`, which must be an existing directory.
    pub(crate) fn new(dir: PathBuf) -> Result<Self, FuseError> {
        let root = dir.canonicalize().map_err(|source| FuseError::Backing {
            path: dir.clone(),
            source,
        })?;
        if !root.is_dir() {
            return Err(FuseError::Backing {
                path: dir,
                source: io::Error::from_raw_os_error(libc::ENOTDIR),
            });
        }
        let mut inodes = HashMap::new();
        inodes.insert(
            ROOT_INO,
            Inode {
                path: Some(PathBuf::new()),
                nlookup: 1,
            },
        );
        let mut by_path = HashMap::new();
        by_path.insert(PathBuf::new(), ROOT_INO);
        Ok(PassthroughStore {
            root,
            table: Mutex::new(Table {
                inodes,
                by_path,
                handles: HashMap::new(),
                next_ino: ROOT_INO + 1,
                next_fh: 1,
            }),
        })
    }

    fn full(&self, rel: &Path) -> PathBuf {
        self.root.join(rel)
    }

    /// Relative path of `name` in directory `parent`.
    fn child(&self, parent: u64, name: &OsStr) -> FsResult<PathBuf> {
        Ok(lock(&self.table).path(parent)?.join(name))
    }

    /// Stat `rel` and count a kernel reference to it.
    fn entry(&self, rel: PathBuf) -> FsResult<FileAttr> {
        let meta = fs::symlink_metadata(self.full(&rel)).map_err(|e| errno(&e))?;
        let ino = lock(&self.table).remember(rel);
        Ok(attr(ino, &meta))
    }
}

fn time(secs: i64, nsecs: i64) -> SystemTime {
    let nanos = u32::try_from(nsecs).unwrap_or(0);
    match u64::try_from(secs) {
        Ok(s) => UNIX_EPOCH + Duration::new(s, nanos),
        Err(_) => UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs()),
    }
}

fn attr(ino: u64, meta: &Metadata) -> FileAttr {
    let ctime = time(meta.ctime(), meta.ctime_nsec());
    FileAttr {
        ino: INodeNo(ino),
        size: meta.size(),
        blocks: meta.blocks(),
        atime: time(meta.atime(), meta.atime_nsec()),
        mtime: time(meta.mtime(), meta.mtime_nsec()),
        ctime,
        crtime: meta.created().unwrap_or(ctime),
        kind: FileType::from_std(meta.file_type()).unwrap_or(FileType::RegularFile),
        perm: (meta.mode() & 0o7777) as u16,
        nlink: u32::try_from(meta.nlink()).unwrap_or(u32::MAX),
        uid: meta.uid(),
        gid: meta.gid(),
        rdev: u32::try_from(meta.rdev()).unwrap_or(0),
        blksize: u32::try_from(meta.blksize()).unwrap_or(4096),
        flags: 0,
    }
}

/// Open options for FUSE open flags: access mode only (see the module doc).
fn options(flags: i32) -> OpenOptions {
    let mut o = OpenOptions::new();
    match flags & libc::O_ACCMODE {
        libc::O_WRONLY => o.write(true),
        libc::O_RDWR => o.read(true).write(true),
        _ => o.read(true),
    };
    o
}

impl Store for PassthroughStore {
    fn lookup(&self, parent: u64, name: &OsStr) -> FsResult<FileAttr> {
        let rel = self.child(parent, name)?;
        self.entry(rel)
    }

    fn forget(&self, ino: u64, nlookup: u64) {
        if ino == ROOT_INO {
            return;
        }
        let mut table = lock(&self.table);
        let Some(inode) = table.inodes.get_mut(&ino) else {
            return;
        };
        inode.nlookup = inode.nlookup.saturating_sub(nlookup);
        if inode.nlookup == 0 {
            if let Some(path) = table.inodes.remove(&ino).and_then(|i| i.path) {
                if table.by_path.get(&path) == Some(&ino) {
                    table.by_path.remove(&path);
                }
            }
        }
    }

    fn getattr(&self, ino: u64, fh: Option<u64>) -> FsResult<FileAttr> {
        let handle = fh.and_then(|fh| lock(&self.table).handle(fh).ok());
        let meta = match handle {
            Some(file) => file.metadata(),
            None => {
                let rel = lock(&self.table).path(ino)?.to_owned();
                fs::symlink_metadata(self.full(&rel))
            }
        };
        Ok(attr(ino, &meta.map_err(|e| errno(&e))?))
    }

    fn truncate(&self, ino: u64, fh: Option<u64>, size: u64) -> FsResult<FileAttr> {
        let handle = fh.and_then(|fh| lock(&self.table).handle(fh).ok());
        let file = match handle {
            Some(file) => file,
            None => {
                let rel = lock(&self.table).path(ino)?.to_owned();
                let file = OpenOptions::new().write(true).open(self.full(&rel));
                Arc::new(file.map_err(|e| errno(&e))?)
            }
        };
        file.set_len(size).map_err(|e| errno(&e))?;
        Ok(attr(ino, &file.metadata().map_err(|e| errno(&e))?))
    }

    fn mkdir(&self, parent: u64, name: &OsStr, mode: u32, _owner: Owner) -> FsResult<FileAttr> {
        let rel = self.child(parent, name)?;
        DirBuilder::new()
            .mode(mode & 0o7777)
            .create(self.full(&rel))
            .map_err(|e| errno(&e))?;
        self.entry(rel)
    }

    fn create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        _owner: Owner,
    ) -> FsResult<(FileAttr, u64)> {
        let rel = self.child(parent, name)?;
        let mut o = options(flags);
        if flags & libc::O_ACCMODE == libc::O_RDONLY {
            // Creating needs write access on the backing file; the kernel still enforces the
            // caller's read-only descriptor.
            o.write(true);
        }
        o.mode(mode & 0o7777);
        if flags & libc::O_EXCL != 0 {
            o.create_new(true);
        } else {
            o.create(true).truncate(flags & libc::O_TRUNC != 0);
        }
        let file = o.open(self.full(&rel)).map_err(|e| errno(&e))?;
        let meta = file.metadata().map_err(|e| errno(&e))?;
        let mut table = lock(&self.table);
        let ino = table.remember(rel);
        let fh = table.add_handle(file);
        Ok((attr(ino, &meta), fh))
    }

    fn open(&self, ino: u64, flags: i32) -> FsResult<u64> {
        let rel = lock(&self.table).path(ino)?.to_owned();
        let mut o = options(flags);
        if flags & libc::O_TRUNC != 0 {
            o.truncate(true);
        }
        let file = o.open(self.full(&rel)).map_err(|e| errno(&e))?;
        Ok(lock(&self.table).add_handle(file))
    }

    fn read(&self, fh: u64, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let file = lock(&self.table).handle(fh)?;
        let mut buf = vec![0u8; size as usize];
        let mut filled = 0;
        while filled < buf.len() {
            match file.read_at(&mut buf[filled..], offset + filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(errno(&e)),
            }
        }
        buf.truncate(filled);
        Ok(buf)
    }

    fn write(&self, fh: u64, offset: u64, data: &[u8]) -> FsResult<u32> {
        let file = lock(&self.table).handle(fh)?;
        file.write_all_at(data, offset).map_err(|e| errno(&e))?;
        u32::try_from(data.len()).map_err(|_| Errno::EINVAL)
    }

    fn fsync(&self, fh: u64, datasync: bool) -> FsResult<()> {
        let file = lock(&self.table).handle(fh)?;
        let res = if datasync {
            file.sync_data()
        } else {
            file.sync_all()
        };
        res.map_err(|e| errno(&e))
    }

    fn release(&self, fh: u64) {
        lock(&self.table).handles.remove(&fh);
    }

    fn rename(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
    ) -> FsResult<()> {
        if rename_unsupported(flags) {
            return Err(Errno::EINVAL);
        }
        let from = self.child(parent, name)?;
        let to = self.child(newparent, newname)?;
        let (full_from, full_to) = (self.full(&from), self.full(&to));
        if rename_noreplace(flags) && fs::symlink_metadata(&full_to).is_ok() {
            return Err(Errno::EEXIST);
        }
        fs::rename(&full_from, &full_to).map_err(|e| errno(&e))?;
        let mut table = lock(&self.table);
        if from != to {
            table.vanish(&to);
            table.moved(&from, &to);
        }
        Ok(())
    }

    fn unlink(&self, parent: u64, name: &OsStr) -> FsResult<()> {
        let rel = self.child(parent, name)?;
        fs::remove_file(self.full(&rel)).map_err(|e| errno(&e))?;
        lock(&self.table).vanish(&rel);
        Ok(())
    }

    fn rmdir(&self, parent: u64, name: &OsStr) -> FsResult<()> {
        let rel = self.child(parent, name)?;
        fs::remove_dir(self.full(&rel)).map_err(|e| errno(&e))?;
        lock(&self.table).vanish(&rel);
        Ok(())
    }

    fn readdir(&self, ino: u64) -> FsResult<Vec<DirEntry>> {
        let rel = lock(&self.table).path(ino)?.to_owned();
        let dir = self.full(&rel);
        let mut out = vec![
            DirEntry {
                ino,
                kind: FileType::Directory,
                name: ".".into(),
            },
            DirEntry {
                ino,
                kind: FileType::Directory,
                name: "..".into(),
            },
        ];
        for entry in fs::read_dir(&dir).map_err(|e| errno(&e))? {
            let entry = entry.map_err(|e| errno(&e))?;
            let kind = entry.file_type().map_err(|e| errno(&e))?;
            out.push(DirEntry {
                ino: entry.ino(),
                kind: FileType::from_std(kind).unwrap_or(FileType::RegularFile),
                name: entry.file_name(),
            });
        }
        Ok(out)
    }

    fn statfs(&self) -> FsResult<StatFs> {
        sys::statvfs(&self.root).map_err(|e| errno(&e))
    }
}
