//! Where a [`StallFs`](crate::StallFs) keeps its files, and the inode-level interface both
//! backings implement.

use std::ffi::{OsStr, OsString};
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use fuser::{Errno, FileAttr, FileType};

use crate::FuseError;
use crate::memory::MemoryStore;
use crate::passthrough::PassthroughStore;

/// Where the files of a mount live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    /// In this process's memory; gone when the mount is dropped.
    Memory,
    /// Every operation is passed through to this existing directory.
    Passthrough(PathBuf),
}

impl Backing {
    /// Build the store for this backing.
    pub(crate) fn open(self) -> Result<Arc<dyn Store>, FuseError> {
        Ok(match self {
            Backing::Memory => Arc::new(MemoryStore::new()),
            Backing::Passthrough(dir) => Arc::new(PassthroughStore::new(dir)?),
        })
    }
}

/// Result of a store operation: an errno goes back to the kernel as is.
pub(crate) type FsResult<T> = Result<T, Errno>;

/// The inode number FUSE gives the root directory.
pub(crate) const ROOT_INO: u64 = 1;

/// One directory entry for readdir.
#[derive(Debug, Clone)]
pub(crate) struct DirEntry {
    /// Inode number (informational for readdir).
    pub(crate) ino: u64,
    /// Kind of entry.
    pub(crate) kind: FileType,
    /// Name within the directory.
    pub(crate) name: OsString,
}

/// Numbers for statfs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StatFs {
    pub(crate) blocks: u64,
    pub(crate) bfree: u64,
    pub(crate) bavail: u64,
    pub(crate) files: u64,
    pub(crate) ffree: u64,
    pub(crate) bsize: u32,
    pub(crate) namelen: u32,
    pub(crate) frsize: u32,
}

/// Who creates a file or directory (from the FUSE request).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

/// The operations a block store needs, by inode number and file handle.
///
/// Every call that returns an attribute for a new name (lookup, mkdir, create) counts as one
/// kernel lookup of that inode; `forget` gives them back.
pub(crate) trait Store: Send + Sync + 'static {
    /// Find `name` in directory `parent`.
    fn lookup(&self, parent: u64, name: &OsStr) -> FsResult<FileAttr>;
    /// The kernel dropped `nlookup` references to `ino`.
    fn forget(&self, ino: u64, nlookup: u64);
    /// Attributes of `ino` (through the open handle `fh` when given).
    fn getattr(&self, ino: u64, fh: Option<u64>) -> FsResult<FileAttr>;
    /// Change the size of `ino` (through `fh` when given).
    fn truncate(&self, ino: u64, fh: Option<u64>, size: u64) -> FsResult<FileAttr>;
    /// Create directory `name` in `parent`.
    fn mkdir(&self, parent: u64, name: &OsStr, mode: u32, owner: Owner) -> FsResult<FileAttr>;
    /// Create (or with no `O_EXCL`, open) file `name` in `parent` and open it.
    fn create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        owner: Owner,
    ) -> FsResult<(FileAttr, u64)>;
    /// Open `ino`; returns the file handle.
    fn open(&self, ino: u64, flags: i32) -> FsResult<u64>;
    /// Read up to `size` bytes at `offset` (short only at end of file).
    fn read(&self, fh: u64, offset: u64, size: u32) -> FsResult<Vec<u8>>;
    /// Write all of `data` at `offset`.
    fn write(&self, fh: u64, offset: u64, data: &[u8]) -> FsResult<u32>;
    /// Make the file's data (and with `!datasync` its metadata) durable.
    fn fsync(&self, fh: u64, datasync: bool) -> FsResult<()>;
    /// Close handle `fh`.
    fn release(&self, fh: u64);
    /// Rename, replacing an existing target unless `RENAME_NOREPLACE` is in `flags`.
    fn rename(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
    ) -> FsResult<()>;
    /// Remove file `name` from `parent`.
    fn unlink(&self, parent: u64, name: &OsStr) -> FsResult<()>;
    /// Remove empty directory `name` from `parent`.
    fn rmdir(&self, parent: u64, name: &OsStr) -> FsResult<()>;
    /// Every entry of directory `ino`, `.` and `..` first.
    fn readdir(&self, ino: u64) -> FsResult<Vec<DirEntry>>;
    /// Filesystem capacity numbers.
    fn statfs(&self) -> FsResult<StatFs>;
}

/// The errno of an I/O error (EIO when it carries none).
pub(crate) fn errno(e: &io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

/// Whether a rename asks not to replace an existing target.
pub(crate) fn rename_noreplace(flags: u32) -> bool {
    flags & libc::RENAME_NOREPLACE != 0
}

/// Rename flags neither backing implements (exchange, whiteout).
pub(crate) fn rename_unsupported(flags: u32) -> bool {
    flags & !libc::RENAME_NOREPLACE != 0
}
