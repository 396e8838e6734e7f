//! Blocking syscalls for the psync engine.

use super::Syscall;

fn ret(r: isize) -> i64 {
    if r < 0 {
        -(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO) as i64)
    } else {
        r as i64
    }
}

/// Run `call` on this thread; returns its result or `-errno`.
///
/// # Safety
/// Every pointer in `call` must be valid for the syscall (the job that made it is alive, not
/// moved, and not touched by anyone else until this returns).
pub(crate) unsafe fn run(call: &Syscall) -> i64 {
    // SAFETY: the caller guarantees the pointers (paths, iovecs and the buffers they name)
    // are owned by a live job that nobody else touches until we return; fds are the job's own.
    unsafe {
        match *call {
            Syscall::Mkdir { path } => ret(libc::mkdir(path, 0o755) as isize),
            Syscall::Open { path, flags, mode } => {
                ret(libc::open(path, flags, mode as libc::c_uint) as isize)
            }
            Syscall::Readv { fd, iov, n } => ret(libc::preadv(fd, iov, n as i32, 0)),
            Syscall::Writev { fd, iov, n } => ret(libc::pwritev(fd, iov, n as i32, 0)),
            Syscall::Statx { fd, buf } => {
                ret(
                    libc::statx(fd, c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_SIZE, buf)
                        as isize,
                )
            }
            Syscall::Fdatasync { fd } => ret(libc::fdatasync(fd) as isize),
            Syscall::Close { fd } => ret(libc::close(fd) as isize),
            Syscall::Rename {
                from,
                to,
                noreplace: false,
            } => ret(libc::rename(from, to) as isize),
            Syscall::Rename {
                from,
                to,
                noreplace: true,
            } => ret(libc::renameat2(
                libc::AT_FDCWD,
                from,
                libc::AT_FDCWD,
                to,
                libc::RENAME_NOREPLACE,
            ) as isize),
            Syscall::Unlink { path } => ret(libc::unlink(path) as isize),
        }
    }
}
