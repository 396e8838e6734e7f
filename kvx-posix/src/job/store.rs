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

use super::remove::Remove;
use super::{JobCore, Next, Syscall, aligned_sector, errno_name, open_flags};
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

/// What only the store machine needs.
#[derive(Default)]
pub(super) struct Store {
    /// The pending syscall (none while the undo runs).
    pub(super) step: Option<StoreStep>,
    /// The last, partial sector of an O_DIRECT store, zero-padded.
    tail: Option<kvx_core::AlignedBuf>,
    /// This store writes with O_DIRECT.
    direct: bool,
    /// The leaf directory was made (or found) by this store.
    pub(super) made_dirs: bool,
    retried_dirs: bool,
    /// The store asked to open its spare file (from then on the file is the store's to write,
    /// close and rename, or unlink).
    pub(super) spare_opened: bool,
    /// The payload's crc32c, computed before the store was queued.
    pub(super) payload_crc: Option<u32>,
    /// The remove machine undoing a rename that landed too late.
    undo: Option<Remove>,
}

/// The length of the block file the store in `c` writes: the header, then the payload
/// (rounded up to whole sectors with O_DIRECT).
pub(super) fn file_len(c: &JobCore) -> Option<u64> {
    let len = c.buf.as_ref()?.as_slice().len();
    let body = if writes_direct(c) {
        format::round_up(len)
    } else {
        len
    };
    Some((HEADER_LEN + body) as u64)
}

/// Whether the store in `c` writes with O_DIRECT: the root allows it and the buffer is
/// aligned.
fn writes_direct(c: &JobCore) -> bool {
    c.p.direct
        && c.buf
            .as_ref()
            .is_some_and(|b| (b.as_slice().as_ptr() as usize) % HEADER_LEN == 0)
}

impl Store {
    /// The rename landed too late and was removed again.
    pub(super) fn undone(&self) -> bool {
        self.undo.as_ref().is_some_and(Remove::unlinked)
    }

    fn call(&mut self, c: &mut JobCore, step: StoreStep, s: Syscall) -> Next {
        self.step = Some(step);
        c.call(s)
    }

    pub(super) fn start(&mut self, c: &mut JobCore) -> Next {
        if let Some(e) = c.over(c.p.margin) {
            return c.done(Err(e));
        }
        if c.paths.temp.is_none() || c.buf.is_none() {
            return c.done(Err(BlockError::Invalid(
                "a store job needs a buffer and a temporary name".into(),
            )));
        }
        if let Err(e) = c.header() {
            return c.done(Err(e));
        }
        if c.p.make_dirs {
            self.mkdirs(c)
        } else {
            self.open_temp(c)
        }
    }

    fn mkdirs(&mut self, c: &mut JobCore) -> Next {
        self.retried_dirs = true;
        let path = c.paths.dir.as_ptr();
        self.call(c, StoreStep::Mkdir, Syscall::Mkdir { path })
    }

    fn open_temp(&mut self, c: &mut JobCore) -> Next {
        self.direct = writes_direct(c);
        let flags = if c.paths.writes_spare() {
            self.spare_opened = true;
            open_flags(libc::O_WRONLY, self.direct)
        } else {
            open_flags(libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, self.direct)
        };
        let path = c.temp_ptr();
        self.call(
            c,
            StoreStep::OpenTemp,
            Syscall::Open {
                path,
                flags,
                mode: 0o644,
            },
        )
    }

    fn write(&mut self, c: &mut JobCore) -> Next {
        let key = c.key;
        let nonce = c.p.nonce.unwrap_or(0);
        let direct = self.direct;
        let Some(buf) = c.buf.take() else {
            return self.fail(c, BlockError::Invalid("store without a buffer".into()));
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
                        c.buf = Some(buf);
                        return self.fail(c, e);
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
        let header_ptr = match c.header() {
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
                c.buf = Some(buf);
                return self.fail(c, e);
            }
        };
        c.iov[0] = libc::iovec {
            iov_base: header_ptr.cast(),
            iov_len: HEADER_LEN,
        };
        let mut n = 1;
        if whole > 0 {
            c.iov[n] = libc::iovec {
                iov_base: payload.as_ptr() as *mut libc::c_void,
                iov_len: whole,
            };
            n += 1;
        }
        if let Some(t) = tail_ptr {
            c.iov[n] = libc::iovec {
                iov_base: t.cast(),
                iov_len: HEADER_LEN,
            };
            n += 1;
        }
        c.iov_n = n as u32;
        c.expect = c.iov[..n].iter().map(|v| v.iov_len).sum();
        c.bytes = len;
        // The payload's heap memory does not move with the `Buf` handle.
        c.buf = Some(buf);
        let fd = c.fd.unwrap_or(-1);
        let (iov, n) = (c.iov.as_ptr(), c.iov_n);
        self.call(c, StoreStep::Write, Syscall::Writev { fd, iov, n })
    }

    fn close_temp(&mut self, c: &mut JobCore) -> Next {
        let fd = c.fd.take().unwrap_or(-1);
        self.call(c, StoreStep::CloseTemp, Syscall::Close { fd })
    }

    fn unlink_temp(&mut self, c: &mut JobCore) -> Next {
        let path = c.temp_ptr();
        self.call(c, StoreStep::UnlinkTemp, Syscall::Unlink { path })
    }

    /// A store failed before its rename: close and unlink the temporary file.
    fn fail(&mut self, c: &mut JobCore, e: BlockError) -> Next {
        c.verdict = Some(Err(e));
        if let Some(fd) = c.fd.take() {
            return self.call(c, StoreStep::CloseTemp, Syscall::Close { fd });
        }
        self.unlink_temp(c)
    }

    pub(super) fn advance(&mut self, c: &mut JobCore, res: i64) -> Next {
        if let Some(undo) = &mut self.undo {
            return undo.advance(c, res);
        }
        let Some(step) = self.step else {
            return c.done(Err(BlockError::Io(
                "a store advanced before it started".into(),
            )));
        };
        match step {
            StoreStep::Mkdir => {
                if res < 0 && res != -(libc::EEXIST as i64) {
                    let msg = format!("mkdir {:?}: {}", c.paths.dir, errno_name(res));
                    return c.done(Err(BlockError::Io(msg)));
                }
                self.made_dirs = true;
                if let Some(e) = c.over(c.p.margin) {
                    return c.done(Err(e));
                }
                self.open_temp(c)
            }
            StoreStep::OpenTemp => {
                if res == -(libc::ENOENT as i64) && c.paths.drop_spare() {
                    // The spare file is gone: create a temporary file as without one.
                    return self.open_temp(c);
                }
                if res == -(libc::ENOENT as i64) && !self.retried_dirs {
                    return self.mkdirs(c);
                }
                if res < 0 {
                    // The spare (if this was one) is untouched: it goes back to the spares.
                    self.spare_opened = false;
                    let msg = format!(
                        "create {:?}: {}",
                        c.paths.temp.as_deref().unwrap_or_default(),
                        errno_name(res)
                    );
                    return c.done(Err(BlockError::Io(msg)));
                }
                c.fd = Some(res as i32);
                if let Some(e) = c.over(c.p.margin) {
                    return self.fail(c, e);
                }
                self.write(c)
            }
            StoreStep::Write => {
                if res < 0 {
                    let msg = format!("write {:?}: {}", c.block_path(), errno_name(res));
                    return self.fail(c, BlockError::Io(msg));
                }
                if res as usize != c.expect {
                    let msg = format!(
                        "write {:?}: short write of {res} of {} bytes",
                        c.block_path(),
                        c.expect
                    );
                    return self.fail(c, BlockError::Io(msg));
                }
                if let Some(e) = c.over(c.p.margin) {
                    return self.fail(c, e);
                }
                if c.p.fdatasync {
                    let fd = c.fd.unwrap_or(-1);
                    self.call(c, StoreStep::Sync, Syscall::Fdatasync { fd })
                } else {
                    self.close_temp(c)
                }
            }
            StoreStep::Sync => {
                if res < 0 {
                    let msg = format!("fdatasync {:?}: {}", c.block_path(), errno_name(res));
                    return self.fail(c, BlockError::Io(msg));
                }
                self.close_temp(c)
            }
            StoreStep::CloseTemp => {
                if c.verdict.is_none() && res < 0 {
                    let msg = format!("close {:?}: {}", c.block_path(), errno_name(res));
                    c.verdict = Some(Err(BlockError::Io(msg)));
                }
                if c.verdict.is_none()
                    && let Some(e) = c.over(c.p.margin)
                {
                    c.verdict = Some(Err(e));
                }
                if c.verdict.is_some() {
                    return self.unlink_temp(c);
                }
                let from = c.temp_ptr();
                let to = c.paths.block.as_ptr();
                self.call(
                    c,
                    StoreStep::Rename,
                    Syscall::Rename {
                        from,
                        to,
                        noreplace: false,
                    },
                )
            }
            StoreStep::Rename => {
                if res < 0 {
                    let msg = format!("rename to {:?}: {}", c.block_path(), errno_name(res));
                    c.verdict = Some(Err(BlockError::Io(msg)));
                    return self.unlink_temp(c);
                }
                if let Some(e) = c.over(c.p.margin) {
                    // Landed too late: the task already ended without this block. Remove it,
                    // but only if the file there is still this write.
                    c.verdict = Some(Err(e));
                    self.step = None;
                    return self.undo.insert(Remove::default()).open(c);
                }
                c.done(Ok(()))
            }
            StoreStep::UnlinkTemp => {
                if res < 0 && res != -(libc::ENOENT as i64) {
                    tracing::warn!(path = ?c.paths.temp, error = %errno_name(res),
                        "cannot remove a temporary file");
                }
                let r = c
                    .verdict
                    .take()
                    .unwrap_or(Err(BlockError::Io("store failed".into())));
                c.done(r)
            }
        }
    }
}
