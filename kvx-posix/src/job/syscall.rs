//! The syscalls a block job asks an engine to run, as plain data with raw pointers into the job.

/// One syscall a job needs next. Pointers point into the job, which the engine keeps alive and
/// in place until the syscall returns.
#[derive(Debug)]
pub(crate) enum Syscall {
    /// `mkdir(path, 0755)`.
    Mkdir { path: *const libc::c_char },
    /// `open(path, flags, mode)`.
    Open {
        path: *const libc::c_char,
        flags: i32,
        mode: u32,
    },
    /// `preadv(fd, iov, n, 0)`.
    Readv {
        fd: i32,
        iov: *const libc::iovec,
        n: u32,
    },
    /// `pwritev(fd, iov, n, 0)`.
    Writev {
        fd: i32,
        iov: *const libc::iovec,
        n: u32,
    },
    /// `statx(fd, "", AT_EMPTY_PATH, STATX_SIZE, buf)`: the open file's size.
    Statx { fd: i32, buf: *mut libc::statx },
    /// `fdatasync(fd)`.
    Fdatasync { fd: i32 },
    /// `close(fd)`.
    Close { fd: i32 },
    /// `rename(from, to)`; with `noreplace`, `renameat2(.., RENAME_NOREPLACE)` (fails with
    /// `EEXIST` rather than replace `to`).
    Rename {
        from: *const libc::c_char,
        to: *const libc::c_char,
        noreplace: bool,
    },
    /// `unlink(path)`.
    Unlink { path: *const libc::c_char },
}

/// What an engine does next with a job.
#[derive(Debug)]
pub(crate) enum Next {
    /// Run this syscall, then call `advance` with its result.
    Call(Syscall),
    /// The job is finished; its verdict is in `result`.
    Done,
}
