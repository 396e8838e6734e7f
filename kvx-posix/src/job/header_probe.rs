//! Probe: `open(block)` → `readv(header)` → `close`: is a valid block of this key and format
//! version on the mount? Runs on the maintenance lane, for a lookup that missed the index on a
//! root many nodes share. `Ok` means present; `NotFound` means absent (a block of another
//! format version too); anything else is the error the mount gave.

use kvx_core::BlockError;

use super::{JobCore, Next, Syscall, errno_name};
use crate::format::{self, HEADER_LEN};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ProbeStep {
    Open,
    Read,
    Close,
}

/// What only the probe machine needs.
#[derive(Default)]
pub(super) struct Probe {
    /// The pending syscall.
    step: Option<ProbeStep>,
}

impl Probe {
    fn call(&mut self, c: &mut JobCore, step: ProbeStep, s: Syscall) -> Next {
        self.step = Some(step);
        c.call(s)
    }

    pub(super) fn start(&mut self, c: &mut JobCore) -> Next {
        if let Err(e) = c.header() {
            return c.done(Err(e));
        }
        let path = c.paths.block.as_ptr();
        self.call(
            c,
            ProbeStep::Open,
            Syscall::Open {
                path,
                flags: libc::O_RDONLY | libc::O_CLOEXEC,
                mode: 0,
            },
        )
    }

    /// What the header read says about the block.
    fn verdict(c: &JobCore, n: usize) -> Result<(), BlockError> {
        let Some(h) = c.header.as_ref() else {
            return Err(BlockError::Io("no header buffer".into()));
        };
        let bytes = &h.as_slice()[..n.min(HEADER_LEN)];
        if let Some(v) = format::claimed_version(bytes)
            && v != format::VERSION
        {
            return Err(BlockError::NotFound);
        }
        match format::parse_header(bytes) {
            Ok(h) if h.key == c.key => Ok(()),
            Ok(h) => Err(BlockError::Corrupt(format!(
                "{:?} holds key {}",
                c.block_path(),
                h.key
            ))),
            Err(e) => Err(BlockError::Corrupt(format!("{:?}: {e}", c.block_path()))),
        }
    }

    pub(super) fn advance(&mut self, c: &mut JobCore, res: i64) -> Next {
        let Some(step) = self.step else {
            return c.done(Err(BlockError::Io(
                "a probe advanced before it started".into(),
            )));
        };
        match step {
            ProbeStep::Open => {
                let fd = match c.opened(res) {
                    Ok(fd) => fd,
                    Err(e) => return c.done(Err(e)),
                };
                c.fd = Some(fd);
                match c.read_header(fd) {
                    Ok(read) => self.call(c, ProbeStep::Read, read),
                    Err(e) => {
                        c.verdict = Some(Err(e));
                        c.fd = None;
                        self.call(c, ProbeStep::Close, Syscall::Close { fd })
                    }
                }
            }
            ProbeStep::Read => {
                c.verdict = Some(if res < 0 {
                    Err(BlockError::Io(format!(
                        "read {:?}: {}",
                        c.block_path(),
                        errno_name(res)
                    )))
                } else {
                    Probe::verdict(c, res as usize)
                });
                let fd = c.fd.take().unwrap_or(-1);
                self.call(c, ProbeStep::Close, Syscall::Close { fd })
            }
            ProbeStep::Close => {
                let r = c
                    .verdict
                    .take()
                    .unwrap_or(Err(BlockError::Io("probe without a verdict".into())));
                c.done(r)
            }
        }
    }
}
