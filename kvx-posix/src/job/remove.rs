//! Remove: `open(block)` → `readv(header)` → `close` → `unlink(block)`, unless the header says
//! the file must stay: a block of another format version (a newer node's block on a shared
//! mount) is never deleted, and a guarded remove (the undo of a late store) deletes only the
//! file whose header carries its write nonce. A missing file is success; a file too damaged to
//! parse is deleted by an unguarded remove (it is what a corrupt-block cleanup is for).
//!
//! The check and the unlink are two syscalls: a newer block renamed into place between them
//! would be deleted. The window is one syscall long; a remove never runs against a block the
//! same store is writing (the scheduler protects keys being stored).

use kvx_core::BlockError;

use super::{BlockJob, Next, Step, Syscall, errno_name};
use crate::format::{self, HEADER_LEN};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RemoveStep {
    Open,
    Read,
    Close,
    Unlink,
}

/// What the header read before an unlink decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// Delete it.
    No,
    /// Written by another format version.
    OtherVersion(u32),
    /// Not the write a guarded remove is undoing.
    NotOurs,
}

impl BlockJob {
    pub(super) fn remove_start(&mut self) -> Next {
        if let Err(e) = self.header() {
            return self.done(Err(e));
        }
        self.remove_open()
    }

    /// Start the remove machine on this job (also the undo of a store's late rename).
    pub(super) fn remove_open(&mut self) -> Next {
        let path = self.paths.block.as_ptr();
        self.call(
            Step::Remove(RemoveStep::Open),
            Syscall::Open {
                path,
                flags: libc::O_RDONLY | libc::O_CLOEXEC,
                mode: 0,
            },
        )
    }

    fn keep(&self, n: usize) -> Keep {
        let Some(h) = self.header.as_ref() else {
            return Keep::NotOurs;
        };
        let bytes = &h.as_slice()[..n.min(HEADER_LEN)];
        if let Some(v) = format::claimed_version(bytes)
            && v != format::VERSION
        {
            return Keep::OtherVersion(v);
        }
        match (self.p.nonce, format::parse_header(bytes)) {
            (None, _) => Keep::No,
            (Some(want), Ok(h)) if h.nonce == want && h.key == self.key => Keep::No,
            (Some(_), _) => Keep::NotOurs,
        }
    }

    fn finish_remove(&mut self, r: Result<(), BlockError>) -> Next {
        let r = match self.verdict.take() {
            // A store undoing its rename keeps the store's verdict.
            Some(v) => v,
            None => r,
        };
        self.done(r)
    }

    pub(super) fn remove_advance(&mut self, step: RemoveStep, res: i64) -> Next {
        match step {
            RemoveStep::Open => {
                if res == -(libc::ENOENT as i64) {
                    return self.finish_remove(Ok(()));
                }
                if res < 0 {
                    let msg = format!("open {:?}: {}", self.block_path(), errno_name(res));
                    return self.finish_remove(Err(BlockError::Io(msg)));
                }
                let fd = res as i32;
                self.fd = Some(fd);
                let ptr = match self.header() {
                    Ok(h) => h.as_mut_ptr(),
                    Err(e) => {
                        self.verdict.get_or_insert(Err(e));
                        return self.call(Step::Remove(RemoveStep::Close), Syscall::Close { fd });
                    }
                };
                self.iov[0] = libc::iovec {
                    iov_base: ptr.cast(),
                    iov_len: HEADER_LEN,
                };
                self.iov_n = 1;
                self.call(
                    Step::Remove(RemoveStep::Read),
                    Syscall::Readv {
                        fd,
                        iov: self.iov.as_ptr(),
                        n: 1,
                    },
                )
            }
            RemoveStep::Read => {
                // A read error reads as nothing: an unguarded remove still deletes the file.
                self.expect = if res < 0 { 0 } else { res as usize };
                let fd = self.fd.take().unwrap_or(-1);
                self.call(Step::Remove(RemoveStep::Close), Syscall::Close { fd })
            }
            RemoveStep::Close => match self.keep(self.expect) {
                Keep::No => {
                    let path = self.paths.block.as_ptr();
                    self.call(Step::Remove(RemoveStep::Unlink), Syscall::Unlink { path })
                }
                Keep::OtherVersion(v) => {
                    tracing::info!(path = ?self.block_path(), version = v,
                        "posix: not removing a block of another format version");
                    self.finish_remove(Ok(()))
                }
                Keep::NotOurs => {
                    tracing::debug!(path = ?self.block_path(),
                        "posix: a newer write replaced this block; left in place");
                    self.finish_remove(Ok(()))
                }
            },
            RemoveStep::Unlink => {
                if self.action == super::FileOp::Store {
                    self.undone = true;
                }
                if res < 0 && res != -(libc::ENOENT as i64) {
                    let msg = format!("unlink {:?}: {}", self.block_path(), errno_name(res));
                    tracing::warn!(error = %msg, "posix: remove failed");
                    return self.finish_remove(Err(BlockError::Io(msg)));
                }
                self.finish_remove(Ok(()))
            }
        }
    }
}
