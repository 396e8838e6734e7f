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

use super::{BlockJob, Next, Step, Syscall, errno_name, round_up};
use crate::format::{self, HEADER_LEN};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LoadStep {
    Open,
    Stat,
    Read,
    Close,
}

impl BlockJob {
    pub(super) fn load_start(&mut self) -> Next {
        if let Some(e) = self.over(Duration::ZERO) {
            return self.done(Err(e));
        }
        let Some(Buf::Owned(b)) = &self.buf else {
            return self.done(Err(BlockError::Invalid(
                "a load needs an owned destination buffer".into(),
            )));
        };
        self.direct_now =
            self.p.direct && b.capacity() >= HEADER_LEN && (b.as_ptr() as usize) % HEADER_LEN == 0;
        if let Err(e) = self.header() {
            return self.done(Err(e));
        }
        let flags = self.open_flags(libc::O_RDONLY);
        let path = self.paths.block.as_ptr();
        self.call(
            Step::Load(LoadStep::Open),
            Syscall::Open {
                path,
                flags,
                mode: 0,
            },
        )
    }

    fn read(&mut self) -> Next {
        let direct = self.direct_now;
        let header_ptr = match self.header() {
            Ok(h) => h.as_mut_ptr(),
            Err(e) => return self.finish_load(Err(e)),
        };
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
            iov_base: header_ptr.cast(),
            iov_len: HEADER_LEN,
        };
        self.iov[1] = libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: rlen,
        };
        self.iov_n = if rlen > 0 { 2 } else { 1 };
        self.expect = HEADER_LEN + rlen;
        let fd = self.fd.unwrap_or(-1);
        self.call(
            Step::Load(LoadStep::Read),
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
            Some(fd) => self.call(Step::Load(LoadStep::Close), Syscall::Close { fd }),
            None => {
                let r = self.verdict.take().unwrap_or(Ok(()));
                self.done(r)
            }
        }
    }

    fn verify(&mut self, n: usize) -> Result<(), BlockError> {
        let path = self.block_path();
        let file_len = self.file_len;
        let key = self.key;
        let header = self
            .header
            .as_ref()
            .ok_or_else(|| BlockError::Io("no header buffer".into()))?;
        let Some(Buf::Owned(b)) = self.buf.as_mut() else {
            return Err(BlockError::Invalid("load without an owned buffer".into()));
        };
        let cap = b.capacity();
        let len = format::check_header(
            &path,
            header.as_slice(),
            n.min(HEADER_LEN),
            key,
            file_len,
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
        if self.p.crc_off_ring {
            self.payload_unchecked = true;
        } else {
            format::check_payload(&path, header.as_slice(), b.as_slice())
                .map_err(|e| e.to_block_error())?;
        }
        self.bytes = len;
        Ok(())
    }

    pub(super) fn load_advance(&mut self, step: LoadStep, res: i64) -> Next {
        match step {
            LoadStep::Open => {
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
                if self.p.inline {
                    self.file_len = usize::MAX;
                    return self.read();
                }
                let fd = res as i32;
                let buf: *mut libc::statx = &mut *self.stx;
                self.call(Step::Load(LoadStep::Stat), Syscall::Statx { fd, buf })
            }
            LoadStep::Stat => {
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
            LoadStep::Read => {
                let r = if res < 0 {
                    Err(BlockError::Io(format!(
                        "read {:?}: {}",
                        self.block_path(),
                        errno_name(res)
                    )))
                } else if let Some(e) = self.over(Duration::ZERO) {
                    // The bytes came back after the deadline (or a cancel): the task may
                    // already have ended, so this load did not make it in time.
                    Err(e)
                } else {
                    if self.p.inline && (res as usize) < self.expect {
                        self.file_len = res as usize;
                    }
                    self.verify(res as usize)
                };
                self.finish_load(r)
            }
            LoadStep::Close => {
                let r = self.verdict.take().unwrap_or(Ok(()));
                self.done(r)
            }
        }
    }
}
