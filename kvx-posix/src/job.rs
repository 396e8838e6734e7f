//! One block's file operation as a state machine of syscalls, shared by both engines.
//!
//! A job owns everything the kernel touches while a syscall of it is in flight: the block's
//! buffer, its header buffer, the iovecs and the path strings. An engine keeps the job (boxed,
//! so its address is stable) until that syscall returns, then calls [`BlockJob::advance`] with
//! the result and runs whatever comes next. The psync engine runs the syscalls on a worker
//! thread; the uring engine turns them into ring ops.
//!
//! Store: `mkdir` (only for a new directory) → `open(temp, O_CREAT|O_EXCL)` → `writev(header,
//! payload)` → `fdatasync` (optional) → `close` → `rename(temp, block)`. Any error, a cancel or
//! a deadline before the rename closes and unlinks the temporary file; a rename that lands after
//! the deadline (or a cancel) is undone by unlinking the block again, so a block whose task
//! ended without success is never left visible.
//!
//! Load: `open(block)` → `statx` (its length) → `readv(header, payload)` → `close`, then the header and checksum are
//! verified; any mismatch fails this block only.

use std::ffi::CStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvx_core::{AlignedBuf, BlockError, BlockKey, Buf, OpId};

use crate::format::{self, HEADER_LEN};
use crate::paths::BlockPaths;

/// What a job does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    /// Read and verify a block into the job's owned buffer.
    Load,
    /// Write the job's buffer as a block.
    Store,
    /// Unlink a block file (errors other than "not there" are reported).
    Remove,
}

/// One syscall a job needs next. Pointers point into the job, which the engine keeps alive and
/// in place until the syscall returns.
#[derive(Debug)]
pub enum Syscall {
    /// `mkdir(path, 0755)`.
    Mkdir {
        /// Directory.
        path: *const libc::c_char,
    },
    /// `open(path, flags, mode)`.
    Open {
        /// File.
        path: *const libc::c_char,
        /// Open flags.
        flags: i32,
        /// Creation mode.
        mode: u32,
    },
    /// `preadv(fd, iov, n, 0)`.
    Readv {
        /// Open file.
        fd: i32,
        /// The job's iovecs.
        iov: *const libc::iovec,
        /// Number of iovecs.
        n: u32,
    },
    /// `pwritev(fd, iov, n, 0)`.
    Writev {
        /// Open file.
        fd: i32,
        /// The job's iovecs.
        iov: *const libc::iovec,
        /// Number of iovecs.
        n: u32,
    },
    /// `statx(fd, "", AT_EMPTY_PATH, STATX_SIZE, buf)`: the open file's size.
    Statx {
        /// Open file.
        fd: i32,
        /// The job's statx buffer.
        buf: *mut libc::statx,
    },
    /// `fdatasync(fd)`.
    Fdatasync {
        /// Open file.
        fd: i32,
    },
    /// `close(fd)`.
    Close {
        /// Open file.
        fd: i32,
    },
    /// `rename(from, to)`.
    Rename {
        /// Temporary name.
        from: *const libc::c_char,
        /// Final name.
        to: *const libc::c_char,
    },
    /// `unlink(path)`.
    Unlink {
        /// File.
        path: *const libc::c_char,
    },
}

/// What an engine does next with a job.
#[derive(Debug)]
pub enum Next {
    /// Run this syscall, then call `advance` with its result.
    Call(Syscall),
    /// The job is finished; its verdict is in `result`.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Idle,
    MkdirOuter,
    MkdirInner,
    OpenTemp,
    Write,
    Sync,
    CloseTemp,
    Rename,
    UndoRename,
    UnlinkTemp,
    OpenBlock,
    Stat,
    Read,
    CloseBlock,
    Unlink,
    Finished,
}

/// The settings a job is created with.
#[derive(Debug, Clone)]
pub struct JobParams {
    /// Use O_DIRECT when the buffer allows it.
    pub direct: bool,
    /// fdatasync before the rename.
    pub fdatasync: bool,
    /// The leaf directory may not exist yet: create it first.
    pub make_dirs: bool,
    /// The op's deadline.
    pub deadline: Instant,
    /// Set when the op is cancelled.
    pub cancel: Arc<AtomicBool>,
    /// See `PosixConfig::visibility_margin`.
    pub margin: Duration,
}

/// One block's file operation (see the module docs).
pub struct BlockJob {
    /// Op the block belongs to.
    pub op: OpId,
    /// Position of the block in the op.
    pub index: usize,
    /// Root the block lives on.
    pub root: usize,
    /// Load, store or remove.
    pub kind: JobKind,
    /// Block key.
    pub key: BlockKey,
    /// The block's buffer (none for a remove).
    pub buf: Option<Buf>,
    /// The verdict, once `advance` returned `Done`.
    pub result: Result<(), BlockError>,
    /// The leaf directory was created by this job.
    pub made_dirs: bool,
    /// Bytes moved by the data transfer.
    pub bytes: usize,
    /// The block was renamed into place too late and unlinked again.
    pub undone: bool,
    header: AlignedBuf,
    paths: BlockPaths,
    p: JobParams,
    step: Step,
    fd: Option<i32>,
    iov: [libc::iovec; 2],
    iov_n: u32,
    stx: Box<libc::statx>,
    file_len: usize,
    expect: usize,
    direct_now: bool,
    retried_dirs: bool,
    verdict: Option<Result<(), BlockError>>,
}

// SAFETY: the raw pointers inside (`iov`) point into the job's own heap buffers; the job is
// moved between threads only while no syscall of it is in flight.
unsafe impl Send for BlockJob {}

fn errno_name(res: i64) -> String {
    std::io::Error::from_raw_os_error((-res) as i32).to_string()
}

fn round_up(n: usize) -> usize {
    n.div_ceil(HEADER_LEN) * HEADER_LEN
}

impl BlockJob {
    /// A new job; `header` is a [`HEADER_LEN`]-byte buffer aligned for O_DIRECT.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        op: OpId,
        index: usize,
        root: usize,
        kind: JobKind,
        key: BlockKey,
        buf: Option<Buf>,
        header: AlignedBuf,
        paths: BlockPaths,
        p: JobParams,
    ) -> BlockJob {
        BlockJob {
            op,
            index,
            root,
            kind,
            key,
            buf,
            result: Err(BlockError::Io("job did not run".into())),
            made_dirs: false,
            bytes: 0,
            undone: false,
            header,
            paths,
            p,
            step: Step::Idle,
            fd: None,
            iov: [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; 2],
            iov_n: 0,
            // SAFETY: statx is a plain C struct of integers; all-zero is a valid value.
            stx: Box::new(unsafe { std::mem::zeroed() }),
            file_len: 0,
            expect: 0,
            direct_now: false,
            retried_dirs: false,
            verdict: None,
        }
    }

    /// The op's deadline.
    pub fn deadline(&self) -> Instant {
        self.p.deadline
    }

    /// True when the pending syscall is the close that ends a load: nothing depends on its
    /// result, so an engine may issue it and finish the job without waiting for it.
    pub fn is_final_close(&self) -> bool {
        self.step == Step::CloseBlock
    }

    /// The op's cancel flag.
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        self.p.cancel.clone()
    }

    /// True once the job's op was cancelled or its deadline passed (the job is written off).
    pub fn is_overdue(&self, now: Instant) -> bool {
        self.p.cancel.load(Ordering::Acquire) || now >= self.p.deadline
    }

    /// True when the job is a store or load whose op is past its deadline or cancelled, given
    /// `margin` of slack before the deadline.
    fn over(&self, margin: Duration) -> Option<BlockError> {
        if self.kind == JobKind::Remove {
            return None;
        }
        if self.p.cancel.load(Ordering::Acquire) {
            return Some(BlockError::Cancelled);
        }
        if Instant::now() + margin >= self.p.deadline {
            return Some(BlockError::TimedOut);
        }
        None
    }

    /// Final path, for messages.
    pub fn block_path(&self) -> PathBuf {
        PathBuf::from(std::ffi::OsStr::from_bytes(self.paths.block.as_bytes()))
    }

    fn done(&mut self, r: Result<(), BlockError>) -> Next {
        self.step = Step::Finished;
        self.result = r;
        Next::Done
    }

    fn call(&mut self, step: Step, s: Syscall) -> Next {
        self.step = step;
        Next::Call(s)
    }

    fn open_flags(&self, base: i32) -> i32 {
        let mut f = base | libc::O_CLOEXEC;
        if self.direct_now {
            f |= libc::O_DIRECT;
        }
        f
    }

    fn temp_ptr(&self) -> *const libc::c_char {
        self.paths
            .temp
            .as_deref()
            .map_or(std::ptr::null(), CStr::as_ptr)
    }

    /// The first syscall.
    pub fn start(&mut self) -> Next {
        match self.kind {
            JobKind::Remove => {
                let path = self.paths.block.as_ptr();
                self.call(Step::Unlink, Syscall::Unlink { path })
            }
            JobKind::Load => {
                if let Some(e) = self.over(Duration::ZERO) {
                    return self.done(Err(e));
                }
                let Some(Buf::Owned(b)) = &self.buf else {
                    return self.done(Err(BlockError::Invalid(
                        "a load needs an owned destination buffer".into(),
                    )));
                };
                self.direct_now = self.p.direct
                    && b.capacity() >= HEADER_LEN
                    && (b.as_ptr() as usize) % HEADER_LEN == 0;
                let flags = self.open_flags(libc::O_RDONLY);
                let path = self.paths.block.as_ptr();
                self.call(
                    Step::OpenBlock,
                    Syscall::Open {
                        path,
                        flags,
                        mode: 0,
                    },
                )
            }
            JobKind::Store => {
                if let Some(e) = self.over(self.p.margin) {
                    return self.done(Err(e));
                }
                if self.paths.temp.is_none() || self.buf.is_none() {
                    return self.done(Err(BlockError::Invalid(
                        "a store job needs a buffer and a temporary name".into(),
                    )));
                }
                if self.p.make_dirs {
                    self.mkdirs()
                } else {
                    self.open_temp()
                }
            }
        }
    }

    fn mkdirs(&mut self) -> Next {
        self.retried_dirs = true;
        let path = self.paths.dir1.as_ptr();
        self.call(Step::MkdirOuter, Syscall::Mkdir { path })
    }

    fn open_temp(&mut self) -> Next {
        let (len, cap, aligned) = match &self.buf {
            Some(b) => (
                b.len(),
                b.capacity(),
                (b.as_slice().as_ptr() as usize) % HEADER_LEN == 0,
            ),
            None => (0, 0, false),
        };
        self.direct_now = self.p.direct && aligned && cap >= round_up(len);
        let flags = self.open_flags(libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL);
        let path = self.temp_ptr();
        self.call(
            Step::OpenTemp,
            Syscall::Open {
                path,
                flags,
                mode: 0o644,
            },
        )
    }

    fn write(&mut self) -> Next {
        let Some(buf) = self.buf.as_mut() else {
            return self.fail_store(BlockError::Invalid("store without a buffer".into()));
        };
        let len = buf.len();
        let wlen = if self.direct_now { round_up(len) } else { len };
        // Zero the O_DIRECT padding of an owned buffer so no stale bytes reach the disk.
        if let Buf::Owned(b) = buf
            && wlen > len
        {
            b.as_mut_full()[len..wlen].fill(0);
        }
        let payload_ptr = buf.as_slice().as_ptr() as *mut libc::c_void;
        format::encode_header(self.header.as_mut_full(), self.key, buf.as_slice());
        self.iov[0] = libc::iovec {
            iov_base: self.header.as_mut_ptr().cast(),
            iov_len: HEADER_LEN,
        };
        self.iov[1] = libc::iovec {
            iov_base: payload_ptr,
            iov_len: wlen,
        };
        self.iov_n = if wlen > 0 { 2 } else { 1 };
        self.expect = HEADER_LEN + wlen;
        self.bytes = len;
        let fd = self.fd.unwrap_or(-1);
        self.call(
            Step::Write,
            Syscall::Writev {
                fd,
                iov: self.iov.as_ptr(),
                n: self.iov_n,
            },
        )
    }

    fn close_temp(&mut self) -> Next {
        let fd = self.fd.take().unwrap_or(-1);
        self.call(Step::CloseTemp, Syscall::Close { fd })
    }

    /// A store failed before its rename: close and unlink the temporary file.
    fn fail_store(&mut self, e: BlockError) -> Next {
        self.verdict = Some(Err(e));
        if let Some(fd) = self.fd.take() {
            return self.call(Step::CloseTemp, Syscall::Close { fd });
        }
        let path = self.temp_ptr();
        self.call(Step::UnlinkTemp, Syscall::Unlink { path })
    }

    fn read(&mut self) -> Next {
        let direct = self.direct_now;
        let Some(Buf::Owned(b)) = self.buf.as_mut() else {
            return self.finish_load(Err(BlockError::Invalid(
                "a load needs an owned destination buffer".into(),
            )));
        };
        let cap = b.capacity();
        // Never ask for more than the file holds: an async O_DIRECT read past the end of a
        // FUSE file can come back zero-filled to the full length.
        let in_file = self.file_len.saturating_sub(HEADER_LEN);
        let rlen = if direct {
            (cap / HEADER_LEN * HEADER_LEN).min(round_up(in_file))
        } else {
            cap.min(in_file)
        };
        self.iov[0] = libc::iovec {
            iov_base: self.header.as_mut_ptr().cast(),
            iov_len: HEADER_LEN,
        };
        self.iov[1] = libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: rlen,
        };
        self.iov_n = if rlen > 0 { 2 } else { 1 };
        let fd = self.fd.unwrap_or(-1);
        self.call(
            Step::Read,
            Syscall::Readv {
                fd,
                iov: self.iov.as_ptr(),
                n: self.iov_n,
            },
        )
    }

    fn finish_load(&mut self, r: Result<(), BlockError>) -> Next {
        self.verdict = Some(r);
        match self.fd.take() {
            Some(fd) => self.call(Step::CloseBlock, Syscall::Close { fd }),
            None => {
                let r = self.verdict.take().unwrap_or(Ok(()));
                self.done(r)
            }
        }
    }

    fn verify(&mut self, n: usize) -> Result<(), BlockError> {
        let path = self.block_path();
        let Some(Buf::Owned(b)) = self.buf.as_mut() else {
            return Err(BlockError::Invalid("load without an owned buffer".into()));
        };
        let cap = b.capacity();
        let n = n.min(self.file_len);
        let header_bytes = n.min(HEADER_LEN);
        let file_payload = n.saturating_sub(HEADER_LEN);
        let len = format::check_header(
            &path,
            self.header.as_slice(),
            header_bytes,
            self.key,
            file_payload,
            cap,
        )
        .map_err(|e| e.to_block_error())?;
        b.set_len(len);
        format::check_payload(&path, self.header.as_slice(), b.as_slice())
            .map_err(|e| e.to_block_error())?;
        self.bytes = len;
        Ok(())
    }

    /// Feed the result of the last syscall (`>= 0`, or `-errno`) and get the next one.
    pub fn advance(&mut self, res: i64) -> Next {
        match self.step {
            Step::Idle | Step::Finished => self.done(Err(BlockError::Io(
                "job advanced without a syscall in flight".into(),
            ))),
            Step::Unlink => {
                if res < 0 && res != -(libc::ENOENT as i64) {
                    let msg = format!("unlink {:?}: {}", self.block_path(), errno_name(res));
                    self.done(Err(BlockError::Io(msg)))
                } else {
                    self.done(Ok(()))
                }
            }
            Step::MkdirOuter => {
                if res < 0 && res != -(libc::EEXIST as i64) {
                    let msg = format!("mkdir {:?}: {}", self.paths.dir1, errno_name(res));
                    return self.done(Err(BlockError::Io(msg)));
                }
                let path = self.paths.dir2.as_ptr();
                self.call(Step::MkdirInner, Syscall::Mkdir { path })
            }
            Step::MkdirInner => {
                if res < 0 && res != -(libc::EEXIST as i64) {
                    let msg = format!("mkdir {:?}: {}", self.paths.dir2, errno_name(res));
                    return self.done(Err(BlockError::Io(msg)));
                }
                self.made_dirs = true;
                if let Some(e) = self.over(self.p.margin) {
                    return self.done(Err(e));
                }
                self.open_temp()
            }
            Step::OpenTemp => {
                if res == -(libc::ENOENT as i64) && !self.retried_dirs {
                    return self.mkdirs();
                }
                if res < 0 {
                    let msg = format!(
                        "create {:?}: {}",
                        self.paths.temp.as_deref().unwrap_or_default(),
                        errno_name(res)
                    );
                    return self.done(Err(BlockError::Io(msg)));
                }
                self.fd = Some(res as i32);
                if let Some(e) = self.over(self.p.margin) {
                    return self.fail_store(e);
                }
                self.write()
            }
            Step::Write => {
                if res < 0 {
                    let msg = format!("write {:?}: {}", self.block_path(), errno_name(res));
                    return self.fail_store(BlockError::Io(msg));
                }
                if res as usize != self.expect {
                    let msg = format!(
                        "write {:?}: short write of {res} of {} bytes",
                        self.block_path(),
                        self.expect
                    );
                    return self.fail_store(BlockError::Io(msg));
                }
                if let Some(e) = self.over(self.p.margin) {
                    return self.fail_store(e);
                }
                if self.p.fdatasync {
                    let fd = self.fd.unwrap_or(-1);
                    self.call(Step::Sync, Syscall::Fdatasync { fd })
                } else {
                    self.close_temp()
                }
            }
            Step::Sync => {
                if res < 0 {
                    let msg = format!("fdatasync {:?}: {}", self.block_path(), errno_name(res));
                    return self.fail_store(BlockError::Io(msg));
                }
                self.close_temp()
            }
            Step::CloseTemp => {
                if self.verdict.is_none() && res < 0 {
                    let msg = format!("close {:?}: {}", self.block_path(), errno_name(res));
                    self.verdict = Some(Err(BlockError::Io(msg)));
                }
                if self.verdict.is_none()
                    && let Some(e) = self.over(self.p.margin)
                {
                    self.verdict = Some(Err(e));
                }
                if self.verdict.is_some() {
                    let path = self.temp_ptr();
                    return self.call(Step::UnlinkTemp, Syscall::Unlink { path });
                }
                let from = self.temp_ptr();
                let to = self.paths.block.as_ptr();
                self.call(Step::Rename, Syscall::Rename { from, to })
            }
            Step::Rename => {
                if res < 0 {
                    let msg = format!("rename to {:?}: {}", self.block_path(), errno_name(res));
                    self.verdict = Some(Err(BlockError::Io(msg)));
                    let path = self.temp_ptr();
                    return self.call(Step::UnlinkTemp, Syscall::Unlink { path });
                }
                if let Some(e) = self.over(self.p.margin) {
                    // Landed too late: the task already ended without this block.
                    self.verdict = Some(Err(e));
                    let path = self.paths.block.as_ptr();
                    return self.call(Step::UndoRename, Syscall::Unlink { path });
                }
                self.done(Ok(()))
            }
            Step::UndoRename => {
                self.undone = true;
                if res < 0 && res != -(libc::ENOENT as i64) {
                    tracing::warn!(path = ?self.block_path(), error = %errno_name(res),
                        "cannot undo a late rename");
                }
                let r = self.verdict.take().unwrap_or(Err(BlockError::TimedOut));
                self.done(r)
            }
            Step::UnlinkTemp => {
                if res < 0 && res != -(libc::ENOENT as i64) {
                    tracing::warn!(path = ?self.paths.temp, error = %errno_name(res),
                        "cannot remove a temporary file");
                }
                let r = self
                    .verdict
                    .take()
                    .unwrap_or(Err(BlockError::Io("store failed".into())));
                self.done(r)
            }
            Step::OpenBlock => {
                if res == -(libc::ENOENT as i64) {
                    return self.done(Err(BlockError::NotFound));
                }
                if res < 0 {
                    let msg = format!("open {:?}: {}", self.block_path(), errno_name(res));
                    return self.done(Err(BlockError::Io(msg)));
                }
                self.fd = Some(res as i32);
                if let Some(e) = self.over(Duration::ZERO) {
                    return self.finish_load(Err(e));
                }
                let fd = res as i32;
                let buf: *mut libc::statx = &mut *self.stx;
                self.call(Step::Stat, Syscall::Statx { fd, buf })
            }
            Step::Stat => {
                if res < 0 {
                    let msg = format!("statx {:?}: {}", self.block_path(), errno_name(res));
                    return self.finish_load(Err(BlockError::Io(msg)));
                }
                self.file_len = usize::try_from(self.stx.stx_size).unwrap_or(usize::MAX);
                if let Some(e) = self.over(Duration::ZERO) {
                    return self.finish_load(Err(e));
                }
                self.read()
            }
            Step::Read => {
                let r = if res < 0 {
                    Err(BlockError::Io(format!(
                        "read {:?}: {}",
                        self.block_path(),
                        errno_name(res)
                    )))
                } else {
                    self.verify(res as usize)
                };
                self.finish_load(r)
            }
            Step::CloseBlock => {
                let r = self.verdict.take().unwrap_or(Ok(()));
                self.done(r)
            }
        }
    }
}

impl std::fmt::Debug for BlockJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockJob")
            .field("op", &self.op)
            .field("index", &self.index)
            .field("kind", &self.kind)
            .field("key", &self.key)
            .field("step", &self.step)
            .finish()
    }
}

/// A fresh header buffer.
pub fn header_buf() -> Result<AlignedBuf, BlockError> {
    AlignedBuf::new(HEADER_LEN, HEADER_LEN)
        .map_err(|e| BlockError::Io(format!("cannot allocate a header buffer: {e}")))
}
