//! Store: `mkdir` (only for a new fan-out directory) → `open(temp, O_CREAT|O_EXCL)` (or
//! `open(spare)`, an empty file made ahead, see `crate::spare`; one found gone falls back to a
//! temporary file) → `writev(header, payload[, zero-padded tail])` → `fdatasync` (optional) →
//! `close` → `rename(temp, block)`.
//! Any error, a cancel or a deadline before the rename closes and unlinks the temporary file;
//! a rename that lands after the deadline (or a cancel) is undone by the remove machine,
//! guarded by this write's nonce (under the temporary name, now free, as the aside name), so
//! a block whose task ended without success is never left visible and a newer block of the
//! same key is never deleted.
//!
//! With O_DIRECT the last partial sector of the payload is copied into a zeroed sector of the
//! job's own, so the padding on disk is zeros whatever kind of buffer the payload is in.

use kvx_core::BlockError;

use super::{BlockJob, FileOp, Next, Step, Syscall, aligned_sector, errno_name};
use crate::format::{self, HEADER_LEN};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StoreStep {
    Mkdir,
    OpenTemp,
    Write,
    Sync,
    CloseTemp,
    Rename,
    UnlinkTemp,
}

impl BlockJob {
    pub(super) fn store_start(&mut self) -> Next {
        if let Some(e) = self.over(self.p.margin) {
            return self.done(Err(e));
        }
        if self.paths.temp.is_none() || self.buf.is_none() {
            return self.done(Err(BlockError::Invalid(
                "a store job needs a buffer and a temporary name".into(),
            )));
        }
        if let Err(e) = self.header() {
            return self.done(Err(e));
        }
        if self.p.make_dirs {
            self.mkdirs()
        } else {
            self.open_temp()
        }
    }

    fn mkdirs(&mut self) -> Next {
        self.retried_dirs = true;
        let path = self.paths.dir.as_ptr();
        self.call(Step::Store(StoreStep::Mkdir), Syscall::Mkdir { path })
    }

    /// Whether this store writes with O_DIRECT: the root allows it and the buffer is aligned.
    fn writes_direct(&self) -> bool {
        self.p.direct
            && self
                .buf
                .as_ref()
                .is_some_and(|b| (b.as_slice().as_ptr() as usize) % HEADER_LEN == 0)
    }

    /// The length of the block file this store writes: the header, then the payload (rounded
    /// up to whole sectors with O_DIRECT); `None` for a job that is not a store.
    pub(crate) fn store_file_len(&self) -> Option<u64> {
        if self.action != FileOp::Store {
            return None;
        }
        let len = self.buf.as_ref()?.as_slice().len();
        let body = if self.writes_direct() {
            super::round_up(len)
        } else {
            len
        };
        Some((HEADER_LEN + body) as u64)
    }

    fn open_temp(&mut self) -> Next {
        self.direct_now = self.writes_direct();
        let flags = if self.paths.writes_spare() {
            self.spare_opened = true;
            self.open_flags(libc::O_WRONLY)
        } else {
            self.open_flags(libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL)
        };
        let path = self.temp_ptr();
        self.call(
            Step::Store(StoreStep::OpenTemp),
            Syscall::Open {
                path,
                flags,
                mode: 0o644,
            },
        )
    }

    fn write(&mut self) -> Next {
        let key = self.key;
        let nonce = self.p.nonce.unwrap_or(0);
        let direct = self.direct_now;
        let Some(buf) = self.buf.take() else {
            return self.fail_store(BlockError::Invalid("store without a buffer".into()));
        };
        let payload = buf.as_slice();
        let len = payload.len();
        // O_DIRECT: whole sectors straight from the buffer, the partial last one from a zeroed
        // sector of the job's own. Buffered: the payload as is.
        let whole = if direct {
            len / HEADER_LEN * HEADER_LEN
        } else {
            len
        };
        let rest = len - whole;
        let tail_ptr = if rest > 0 {
            if self.tail.is_none() {
                match aligned_sector() {
                    Ok(t) => self.tail = Some(t),
                    Err(e) => {
                        self.buf = Some(buf);
                        return self.fail_store(e);
                    }
                }
            }
            self.tail.as_mut().map(|t| {
                let full = t.as_mut_full();
                full[..rest].copy_from_slice(&payload[whole..]);
                full[rest..HEADER_LEN].fill(0);
                full.as_mut_ptr()
            })
        } else {
            None
        };
        let payload_crc = self.payload_crc;
        let header_ptr = match self.header() {
            Ok(h) => {
                match payload_crc {
                    Some(crc) => {
                        format::encode_header_parts(h.as_mut_full(), key, len, crc, nonce);
                    }
                    None => format::encode_header(h.as_mut_full(), key, payload, nonce),
                }
                h.as_mut_ptr()
            }
            Err(e) => {
                self.buf = Some(buf);
                return self.fail_store(e);
            }
        };
        self.iov[0] = libc::iovec {
            iov_base: header_ptr.cast(),
            iov_len: HEADER_LEN,
        };
        let mut n = 1;
        if whole > 0 {
            self.iov[n] = libc::iovec {
                iov_base: payload.as_ptr() as *mut libc::c_void,
                iov_len: whole,
            };
            n += 1;
        }
        if let Some(t) = tail_ptr {
            self.iov[n] = libc::iovec {
                iov_base: t.cast(),
                iov_len: HEADER_LEN,
            };
            n += 1;
        }
        self.iov_n = n as u32;
        self.expect = self.iov[..n].iter().map(|v| v.iov_len).sum();
        self.bytes = len;
        // The payload's heap memory does not move with the `Buf` handle.
        self.buf = Some(buf);
        let fd = self.fd.unwrap_or(-1);
        self.call(
            Step::Store(StoreStep::Write),
            Syscall::Writev {
                fd,
                iov: self.iov.as_ptr(),
                n: self.iov_n,
            },
        )
    }

    fn close_temp(&mut self) -> Next {
        let fd = self.fd.take().unwrap_or(-1);
        self.call(Step::Store(StoreStep::CloseTemp), Syscall::Close { fd })
    }

    fn unlink_temp(&mut self) -> Next {
        let path = self.temp_ptr();
        self.call(Step::Store(StoreStep::UnlinkTemp), Syscall::Unlink { path })
    }

    /// A store failed before its rename: close and unlink the temporary file.
    fn fail_store(&mut self, e: BlockError) -> Next {
        self.verdict = Some(Err(e));
        if let Some(fd) = self.fd.take() {
            return self.call(Step::Store(StoreStep::CloseTemp), Syscall::Close { fd });
        }
        self.unlink_temp()
    }

    pub(super) fn store_advance(&mut self, step: StoreStep, res: i64) -> Next {
        match step {
            StoreStep::Mkdir => {
                if res < 0 && res != -(libc::EEXIST as i64) {
                    let msg = format!("mkdir {:?}: {}", self.paths.dir, errno_name(res));
                    return self.done(Err(BlockError::Io(msg)));
                }
                self.made_dirs = true;
                if let Some(e) = self.over(self.p.margin) {
                    return self.done(Err(e));
                }
                self.open_temp()
            }
            StoreStep::OpenTemp => {
                if res == -(libc::ENOENT as i64) && self.paths.drop_spare() {
                    // The spare file is gone: create a temporary file as without one.
                    return self.open_temp();
                }
                if res == -(libc::ENOENT as i64) && !self.retried_dirs {
                    return self.mkdirs();
                }
                if res < 0 {
                    // The spare (if this was one) is untouched: it goes back to the spares.
                    self.spare_opened = false;
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
            StoreStep::Write => {
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
                    self.call(Step::Store(StoreStep::Sync), Syscall::Fdatasync { fd })
                } else {
                    self.close_temp()
                }
            }
            StoreStep::Sync => {
                if res < 0 {
                    let msg = format!("fdatasync {:?}: {}", self.block_path(), errno_name(res));
                    return self.fail_store(BlockError::Io(msg));
                }
                self.close_temp()
            }
            StoreStep::CloseTemp => {
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
                    return self.unlink_temp();
                }
                let from = self.temp_ptr();
                let to = self.paths.block.as_ptr();
                self.call(
                    Step::Store(StoreStep::Rename),
                    Syscall::Rename {
                        from,
                        to,
                        noreplace: false,
                    },
                )
            }
            StoreStep::Rename => {
                if res < 0 {
                    let msg = format!("rename to {:?}: {}", self.block_path(), errno_name(res));
                    self.verdict = Some(Err(BlockError::Io(msg)));
                    return self.unlink_temp();
                }
                if let Some(e) = self.over(self.p.margin) {
                    // Landed too late: the task already ended without this block. Remove it,
                    // but only if the file there is still this write.
                    self.verdict = Some(Err(e));
                    return self.remove_open();
                }
                self.done(Ok(()))
            }
            StoreStep::UnlinkTemp => {
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
        }
    }
}
