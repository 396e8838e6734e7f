//! The FUSE [`Filesystem`] implementation: every request passes the [`Gate`], then the
//! [`Store`].
//!
//! Replies carry a zero attribute/entry TTL and every open is answered with
//! `FOPEN_DIRECT_IO`, so no read, write, lookup or stat can be served from the kernel's caches
//! while the mount is frozen: every call really reaches the filesystem, as on a hung device.
//! `release`, `releasedir` and `forget` are never held nor counted in `ops_served` (they free
//! resources and the kernel sends them in the background).

use std::ffi::OsStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    BsdFileFlags, Errno, FileHandle, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig,
    LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

use crate::backing::{FsResult, Owner, Store};
use crate::gate::{Fail, Gate};

/// Attributes and entries are never cached by the kernel.
const TTL: Duration = Duration::ZERO;

/// Every open bypasses the page cache, whatever the caller asked.
const OPEN_FLAGS: FopenFlags = FopenFlags::FOPEN_DIRECT_IO;

/// Concurrent background requests the kernel may send (async reads and direct I/O).
const MAX_BACKGROUND: u16 = 256;

macro_rules! impl_fail {
    ($($reply:ty),* $(,)?) => {
        $(impl Fail for $reply {
            fn fail(self, err: Errno) {
                self.error(err);
            }
        })*
    };
}

impl_fail!(
    ReplyAttr,
    ReplyCreate,
    ReplyData,
    ReplyDirectory,
    ReplyEmpty,
    ReplyEntry,
    ReplyOpen,
    ReplyStatfs,
    ReplyWrite,
);

/// A FUSE filesystem that serves a [`Backing`](crate::Backing) and can be frozen; mount it with
/// [`StallFs::mount`].
pub struct StallFs {
    store: Arc<dyn Store>,
    gate: Arc<Gate>,
}

impl std::fmt::Debug for StallFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StallFs")
            .field("gate", &self.gate)
            .finish_non_exhaustive()
    }
}

impl StallFs {
    /// A filesystem over `store`, held by `gate`.
    pub(crate) fn new(store: Arc<dyn Store>, gate: Arc<Gate>) -> Self {
        StallFs { store, gate }
    }

    /// Pass the gate, run `op` on the store, answer with `ok` or the error.
    fn serve<R: Fail, T: Send + 'static>(
        &self,
        reply: R,
        op: impl FnOnce(&dyn Store) -> FsResult<T> + Send + 'static,
        ok: impl FnOnce(R, T) + Send + 'static,
    ) {
        let store = Arc::clone(&self.store);
        self.gate.admit(reply, move |reply| match op(&*store) {
            Ok(value) => ok(reply, value),
            Err(err) => reply.fail(err),
        });
    }
}

fn owner(req: &Request) -> Owner {
    Owner {
        uid: req.uid(),
        gid: req.gid(),
    }
}

fn entry(reply: ReplyEntry, attr: fuser::FileAttr) {
    reply.entry(&TTL, &attr, Generation(0));
}

fn attr(reply: ReplyAttr, attr: fuser::FileAttr) {
    reply.attr(&TTL, &attr);
}

fn empty(reply: ReplyEmpty, (): ()) {
    reply.ok();
}

impl Filesystem for StallFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Both setters only refuse values of zero; keep the defaults if they ever refuse.
        let _ = config.set_max_background(MAX_BACKGROUND);
        let _ = config.set_congestion_threshold(MAX_BACKGROUND / 4 * 3);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = name.to_owned();
        self.serve(reply, move |s| s.lookup(parent.0, &name), entry);
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.store.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        self.serve(reply, move |s| s.getattr(ino.0, fh.map(|f| f.0)), attr);
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // Only the size is applied (truncate); mode, owner and time changes are accepted and
        // ignored, which is all a block store needs.
        let fh = fh.map(|f| f.0);
        self.serve(
            reply,
            move |s| match size {
                Some(size) => s.truncate(ino.0, fh, size),
                None => s.getattr(ino.0, fh),
            },
            attr,
        );
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let (name, owner) = (name.to_owned(), owner(req));
        let mode = mode & !umask;
        self.serve(reply, move |s| s.mkdir(parent.0, &name, mode, owner), entry);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name.to_owned();
        self.serve(reply, move |s| s.unlink(parent.0, &name), empty);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name.to_owned();
        self.serve(reply, move |s| s.rmdir(parent.0, &name), empty);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let (name, newname) = (name.to_owned(), newname.to_owned());
        self.serve(
            reply,
            move |s| s.rename(parent.0, &name, newparent.0, &newname, flags.bits()),
            empty,
        );
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        self.serve(
            reply,
            move |s| s.open(ino.0, flags.0),
            |reply, fh| reply.opened(FileHandle(fh), OPEN_FLAGS),
        );
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.serve(
            reply,
            move |s| s.read(fh.0, offset, size),
            |reply, data| reply.data(&data),
        );
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        // The request buffer is reused by the session thread: a parked write needs its own copy.
        let data = data.to_vec();
        self.serve(
            reply,
            move |s| s.write(fh.0, offset, &data),
            |reply, n| reply.written(n),
        );
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Data is never buffered here: flush only has to pass the gate, as close() on a hung
        // mount would.
        self.serve(reply, |_| Ok(()), empty);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.store.release(fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.serve(reply, move |s| s.fsync(fh.0, datasync), empty);
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.serve(
            reply,
            move |s| s.getattr(ino.0, None),
            |reply, _| reply.opened(FileHandle(0), FopenFlags::empty()),
        );
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        reply: ReplyDirectory,
    ) {
        self.serve(
            reply,
            move |s| s.readdir(ino.0),
            move |mut reply, entries| {
                let start = usize::try_from(offset).unwrap_or(usize::MAX);
                for (i, e) in entries.iter().enumerate().skip(start) {
                    if reply.add(INodeNo(e.ino), i as u64 + 1, e.kind, &e.name) {
                        break;
                    }
                }
                reply.ok();
            },
        );
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.serve(reply, |_| Ok(()), empty);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.serve(
            reply,
            |s| s.statfs(),
            |reply, st| {
                reply.statfs(
                    st.blocks, st.bfree, st.bavail, st.files, st.ffree, st.bsize, st.namelen,
                    st.frsize,
                );
            },
        );
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let (name, owner) = (name.to_owned(), owner(req));
        let mode = mode & !umask;
        self.serve(
            reply,
            move |s| s.create(parent.0, &name, mode, flags, owner),
            |reply, (attr, fh)| {
                reply.created(&TTL, &attr, Generation(0), FileHandle(fh), OPEN_FLAGS);
            },
        );
    }
}
