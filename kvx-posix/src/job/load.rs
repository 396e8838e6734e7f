//! Load: `open(block)` → `statx` (its length) → `readv(header, payload)` → `close`, then the
//! header and checksum are verified; any mismatch fails this block only. A read that returns
//! after the op's deadline is reported timed out, whatever it read.
//!
//! On a root with inline I/O (a local block file system) there is no `statx`: the read asks for
//! the whole buffer, and a read that returns less than it asked for ended at the end of the
//! file, whose length it then is. Elsewhere the length comes first: an async O_DIRECT read past
//! the end of a FUSE file can come back zero-filled to the full length.

use std::time::Duration;

use kvx_core::{BlockError, Buf};

use super::{JobCore, Next, Syscall, errno_name, open_flags, replaced, zeroed_statx};
use crate::format::{self, HEADER_LEN, round_up};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LoadStep {
    Open,
    Stat,
    Read,
    Close,
}

/// What only the load machine needs.
pub(super) struct Load {
    /// The pending syscall.
    pub(super) step: Option<LoadStep>,
    stx: Box<libc::statx>,
    file_len: usize,
    /// This load reads with O_DIRECT.
    direct: bool,
    /// The header read and checked; the payload checksum is still to be checked.
    pub(super) payload_unchecked: bool,
}

impl Default for Load {
    fn default() -> Self {
        Load {
            step: None,
            stx: zeroed_statx(),
            file_len: 0,
            direct: false,
            payload_unchecked: false,
        }
    }
}

impl Load {
    fn call(&mut self, c: &mut JobCore, step: LoadStep, s: Syscall) -> Next {
        self.step = Some(step);
        c.call(s)
    }

    pub(super) fn start(&mut self, c: &mut JobCore) -> Next {
        if let Some(e) = c.over(Duration::ZERO) {
            return c.done(Err(e));
        }
        let Some(Buf::Owned(b)) = &c.buf else {
            return c.done(Err(BlockError::Invalid(
                "a load needs an owned destination buffer".into(),
            )));
        };
        self.direct =
            c.p.direct && b.capacity() >= HEADER_LEN && (b.as_ptr() as usize) % HEADER_LEN == 0;
        if let Err(e) = c.header() {
            return c.done(Err(e));
        }
        let flags = open_flags(libc::O_RDONLY, self.direct);
        let path = c.paths.block.as_ptr();
        self.call(
            c,
            LoadStep::Open,
            Syscall::Open {
                path,
                flags,
                mode: 0,
            },
        )
    }

    fn read(&mut self, c: &mut JobCore) -> Next {
        let header_ptr = match c.header() {
            Ok(h) => h.as_mut_ptr(),
            Err(e) => return self.finish(c, Err(e)),
        };
        let Some(Buf::Owned(b)) = c.buf.as_mut() else {
            return self.finish(
                c,
                Err(BlockError::Invalid(
                    "a load needs an owned destination buffer".into(),
                )),
            );
        };
        let cap = b.capacity();
        // Never ask for more than the file holds: an async O_DIRECT read past the end of a
        // FUSE file can come back zero-filled to the full length.
        let in_file = self.file_len.saturating_sub(HEADER_LEN);
        let rlen = if self.direct {
            (cap / HEADER_LEN * HEADER_LEN).min(round_up(in_file))
        } else {
            cap.min(in_file)
        };
        let payload_ptr = b.as_mut_ptr();
        c.iov[0] = libc::iovec {
            iov_base: header_ptr.cast(),
            iov_len: HEADER_LEN,
        };
        c.iov[1] = libc::iovec {
            iov_base: payload_ptr.cast(),
            iov_len: rlen,
        };
        c.iov_n = if rlen > 0 { 2 } else { 1 };
        c.expect = HEADER_LEN + rlen;
        let fd = c.fd.unwrap_or(-1);
        let (iov, n) = (c.iov.as_ptr(), c.iov_n);
        self.call(c, LoadStep::Read, Syscall::Readv { fd, iov, n })
    }

    fn finish(&mut self, c: &mut JobCore, r: Result<(), BlockError>) -> Next {
        c.verdict = Some(r);
        match c.fd.take() {
            Some(fd) => self.call(c, LoadStep::Close, Syscall::Close { fd }),
            None => {
                let r = c.verdict.take().unwrap_or(Ok(()));
                c.done(r)
            }
        }
    }

    fn verify(&mut self, c: &mut JobCore, n: usize) -> Result<(), BlockError> {
        let path = c.block_path();
        let header = c
            .header
            .as_ref()
            .ok_or_else(|| BlockError::Io("no header buffer".into()))?;
        let Some(Buf::Owned(b)) = c.buf.as_mut() else {
            return Err(BlockError::Invalid("load without an owned buffer".into()));
        };
        let cap = b.capacity();
        let len = format::check_header(
            &path,
            header.as_slice(),
            n.min(HEADER_LEN),
            c.key,
            self.file_len,
            n.saturating_sub(HEADER_LEN),
            cap,
        )
        .map_err(|e| {
            if let crate::error::PosixError::NotReadable { .. } = e {
                tracing::info!(error = %e, "posix: block of another format version is a miss");
            }
            e.to_block_error()
        })?;
        b.set_len(len);
        if c.p.crc_off_ring {
            self.payload_unchecked = true;
        } else {
            format::check_payload(&path, header.as_slice(), b.as_slice())
                .map_err(|e| e.to_block_error())?;
        }
        c.bytes = len;
        Ok(())
    }

    pub(super) fn advance(&mut self, c: &mut JobCore, res: i64) -> Next {
        let Some(step) = self.step else {
            return c.done(Err(BlockError::Io(
                "a load advanced before it started".into(),
            )));
        };
        match step {
            LoadStep::Open => {
                let fd = match c.opened(res) {
                    Ok(fd) => fd,
                    Err(e) => return c.done(Err(e)),
                };
                c.fd = Some(fd);
                if let Some(e) = c.over(Duration::ZERO) {
                    return self.finish(c, Err(e));
                }
                if c.p.inline {
                    self.file_len = usize::MAX;
                    return self.read(c);
                }
                let buf: *mut libc::statx = &mut *self.stx;
                self.call(c, LoadStep::Stat, Syscall::Statx { fd, buf })
            }
            LoadStep::Stat => {
                if replaced(res) {
                    return self.finish(c, Err(BlockError::NotFound));
                }
                if res < 0 {
                    let msg = format!("statx {:?}: {}", c.block_path(), errno_name(res));
                    return self.finish(c, Err(BlockError::Io(msg)));
                }
                self.file_len = usize::try_from(self.stx.stx_size).unwrap_or(usize::MAX);
                if let Some(e) = c.over(Duration::ZERO) {
                    return self.finish(c, Err(e));
                }
                self.read(c)
            }
            LoadStep::Read => {
                let r = if replaced(res) {
                    Err(BlockError::NotFound)
                } else if res < 0 {
                    Err(BlockError::Io(format!(
                        "read {:?}: {}",
                        c.block_path(),
                        errno_name(res)
                    )))
                } else if let Some(e) = c.over(Duration::ZERO) {
                    // The bytes came back after the deadline (or a cancel): the task may
                    // already have ended, so this load did not make it in time.
                    Err(e)
                } else {
                    if c.p.inline && (res as usize) < c.expect {
                        self.file_len = res as usize;
                    }
                    self.verify(c, res as usize)
                };
                self.finish(c, r)
            }
            LoadStep::Close => {
                let r = c.verdict.take().unwrap_or(Ok(()));
                c.done(r)
            }
        }
    }
}
