//! Probe: `open(block)` → `readv(header)` → `close`: is a valid block of this key and format
//! version on the mount? Runs on the maintenance lane, for a lookup that missed the index on a
//! root many nodes share. `Ok` means present; `NotFound` means absent (a block of another
//! format version too); anything else is the error the mount gave.

use kvx_core::BlockError;

use super::{BlockJob, Next, Step, Syscall, errno_name};
use crate::format::{self, HEADER_LEN};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ProbeStep {
    Open,
    Read,
    Close,
}

impl BlockJob {
    pub(super) fn probe_start(&mut self) -> Next {
        if let Err(e) = self.header() {
            return self.done(Err(e));
        }
        let path = self.paths.block.as_ptr();
        self.call(
            Step::Probe(ProbeStep::Open),
            Syscall::Open {
                path,
                flags: libc::O_RDONLY | libc::O_CLOEXEC,
                mode: 0,
            },
        )
    }

    /// What the header read says about the block.
    fn probe_verdict(&self, n: usize) -> Result<(), BlockError> {
        let Some(h) = self.header.as_ref() else {
            return Err(BlockError::Io("no header buffer".into()));
        };
        let bytes = &h.as_slice()[..n.min(HEADER_LEN)];
        if let Some(v) = format::claimed_version(bytes)
            && v != format::VERSION
        {
            return Err(BlockError::NotFound);
        }
        match format::parse_header(bytes) {
            Ok(h) if h.key == self.key => Ok(()),
            Ok(h) => Err(BlockError::Corrupt(format!(
                "{:?} holds key {}",
                self.block_path(),
                h.key
            ))),
            Err(e) => Err(BlockError::Corrupt(format!("{:?}: {e}", self.block_path()))),
        }
    }

    pub(super) fn probe_advance(&mut self, step: ProbeStep, res: i64) -> Next {
        match step {
            ProbeStep::Open => {
                if res == -(libc::ENOENT as i64) {
                    return self.done(Err(BlockError::NotFound));
                }
                if res < 0 {
                    let msg = format!("open {:?}: {}", self.block_path(), errno_name(res));
                    return self.done(Err(BlockError::Io(msg)));
                }
                let fd = res as i32;
                self.fd = Some(fd);
                let ptr = match self.header() {
                    Ok(h) => h.as_mut_ptr(),
                    Err(e) => {
                        self.verdict = Some(Err(e));
                        self.fd = None;
                        return self.call(Step::Probe(ProbeStep::Close), Syscall::Close { fd });
                    }
                };
                self.iov[0] = libc::iovec {
                    iov_base: ptr.cast(),
                    iov_len: HEADER_LEN,
                };
                self.iov_n = 1;
                self.call(
                    Step::Probe(ProbeStep::Read),
                    Syscall::Readv {
                        fd,
                        iov: self.iov.as_ptr(),
                        n: 1,
                    },
                )
            }
            ProbeStep::Read => {
                self.verdict = Some(if res < 0 {
                    Err(BlockError::Io(format!(
                        "read {:?}: {}",
                        self.block_path(),
                        errno_name(res)
                    )))
                } else {
                    self.probe_verdict(res as usize)
                });
                let fd = self.fd.take().unwrap_or(-1);
                self.call(Step::Probe(ProbeStep::Close), Syscall::Close { fd })
            }
            ProbeStep::Close => {
                let r = self
                    .verdict
                    .take()
                    .unwrap_or(Err(BlockError::Io("probe without a verdict".into())));
                self.done(r)
            }
        }
    }
}
