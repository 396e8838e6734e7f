//! io_uring operations on a StallFs mount, the way kvx-posix's uring engine issues them:
//! openat/write/fsync/close/statx/renameat/read as ring ops with `IOSQE_ASYNC`.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::mpsc;
use std::thread;

use io_uring::{IoUring, opcode, squeue, types};

use crate::{Fixture, SOON, STUCK, TestResult, aligned, check, pattern};

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)
}

/// Submit one entry with `IOSQE_ASYNC` and wait for its completion; the result or the errno.
///
/// # Safety
/// Every pointer in `sqe` must stay valid until this returns (it returns only after the
/// kernel completed the entry, so locals of the caller qualify).
unsafe fn complete(ring: &mut IoUring, sqe: squeue::Entry) -> io::Result<i32> {
    let sqe = sqe.flags(squeue::Flags::ASYNC);
    // SAFETY: the caller keeps the entry's buffers alive until the completion below is reaped.
    unsafe { ring.submission().push(&sqe) }.map_err(io::Error::other)?;
    ring.submit_and_wait(1)?;
    let cqe = ring
        .completion()
        .next()
        .ok_or_else(|| io::Error::other("no completion after submit_and_wait(1)"))?;
    match cqe.result() {
        res if res < 0 => Err(io::Error::from_raw_os_error(-res)),
        res => Ok(res),
    }
}

fn cwd() -> types::Fd {
    types::Fd(libc::AT_FDCWD)
}

pub(crate) fn ops(passthrough: bool) -> TestResult {
    let fx = Fixture::new(passthrough)?;
    let (tmp, fin) = (c_path(&fx.path("x.tmp"))?, c_path(&fx.path("x.kvb"))?);
    let data = pattern(64 << 10, 5);
    let mut wbuf = Vec::new();
    let wchunk = aligned(&mut wbuf, data.len());
    wchunk.copy_from_slice(&data);
    let mut ring = IoUring::new(8)?;

    let flags = libc::O_CREAT | libc::O_WRONLY | libc::O_DIRECT | libc::O_CLOEXEC;
    let open = opcode::OpenAt::new(cwd(), tmp.as_ptr())
        .flags(flags)
        .mode(0o644);
    // SAFETY: `tmp` outlives the call.
    let fd = unsafe { complete(&mut ring, open.build()) }?;
    let write = opcode::Write::new(types::Fd(fd), wchunk.as_ptr(), data.len() as u32).offset(0);
    // SAFETY: `wchunk` outlives the call.
    let n = unsafe { complete(&mut ring, write.build()) }?;
    check(
        n as usize == data.len(),
        format!("wrote {n} of {}", data.len()),
    )?;
    let sync = opcode::Fsync::new(types::Fd(fd)).flags(types::FsyncFlags::DATASYNC);
    // SAFETY: no pointers.
    unsafe { complete(&mut ring, sync.build()) }?;
    // SAFETY: no pointers; `fd` came from the openat above and is closed once.
    unsafe { complete(&mut ring, opcode::Close::new(types::Fd(fd)).build()) }?;

    // SAFETY: all-zero is a valid statx value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let statx = opcode::Statx::new(cwd(), tmp.as_ptr(), (&raw mut stx).cast::<types::statx>())
        .mask(libc::STATX_SIZE | libc::STATX_TYPE);
    // SAFETY: `tmp` and `stx` outlive the call.
    unsafe { complete(&mut ring, statx.build()) }?;
    check(
        stx.stx_size == data.len() as u64,
        format!("statx size {}", stx.stx_size),
    )?;

    let rename = opcode::RenameAt::new(cwd(), tmp.as_ptr(), cwd(), fin.as_ptr());
    // SAFETY: `tmp` and `fin` outlive the call.
    unsafe { complete(&mut ring, rename.build()) }?;
    check(!fx.path("x.tmp").exists(), "temp name gone after renameat")?;

    let open = opcode::OpenAt::new(cwd(), fin.as_ptr()).flags(libc::O_RDONLY | libc::O_DIRECT);
    // SAFETY: `fin` outlives the call.
    let fd = unsafe { complete(&mut ring, open.build()) }?;
    let mut rbuf = Vec::new();
    let rchunk = aligned(&mut rbuf, data.len());
    let read = opcode::Read::new(types::Fd(fd), rchunk.as_mut_ptr(), data.len() as u32).offset(0);
    // SAFETY: `rchunk` outlives the call and nothing else touches it meanwhile.
    let n = unsafe { complete(&mut ring, read.build()) }?;
    // SAFETY: no pointers; `fd` came from the openat above and is closed once.
    unsafe { complete(&mut ring, opcode::Close::new(types::Fd(fd)).build()) }?;
    check(
        n as usize == data.len(),
        format!("read {n} of {}", data.len()),
    )?;
    check(rchunk == data.as_slice(), "io_uring read back")
}

pub(crate) fn open_blocks_while_frozen() -> TestResult {
    let fx = Fixture::new(false)?;
    let file = fx.path("block.kvb");
    std::fs::write(&file, b"kv")?;
    let path = c_path(&file)?;
    fx.mount().freeze();

    let (submitted_tx, submitted) = mpsc::channel();
    let (done_tx, done) = mpsc::channel();
    thread::spawn(move || {
        let res = (|| -> io::Result<i32> {
            let mut ring = IoUring::new(4)?;
            let open = opcode::OpenAt::new(cwd(), path.as_ptr())
                .flags(libc::O_RDONLY | libc::O_CLOEXEC)
                .build()
                .flags(squeue::Flags::ASYNC);
            // SAFETY: `path` lives in this closure until the completion is reaped below.
            unsafe { ring.submission().push(&open) }.map_err(io::Error::other)?;
            ring.submit()?;
            let _ = submitted_tx.send(());
            ring.submit_and_wait(1)?;
            let res = ring.completion().next().map_or(-libc::EIO, |c| c.result());
            if res < 0 {
                return Err(io::Error::from_raw_os_error(-res));
            }
            // SAFETY: no pointers; `res` is the fd the openat returned, closed once.
            unsafe { complete(&mut ring, opcode::Close::new(types::Fd(res)).build()) }?;
            Ok(res)
        })();
        let _ = done_tx.send(res);
    });

    submitted
        .recv_timeout(SOON)
        .map_err(|_| "io_uring submit blocked on a frozen mount")?;
    check(
        fx.mount().wait_blocked(1, SOON),
        "openat never reached the filesystem",
    )?;
    thread::sleep(STUCK);
    check(done.try_recv().is_err(), "openat completed while frozen")?;
    fx.mount().thaw();
    let fd = done
        .recv_timeout(SOON)
        .map_err(|_| "openat not released by thaw")??;
    check(fd >= 0, "openat result after thaw")
}
