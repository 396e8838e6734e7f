//! Remove: read the file's header, then unlink it, unless the header says the file must stay:
//! a block of another format version (a newer node's block on a shared mount) is never deleted,
//! and a guarded remove (the undo of a late store) deletes only the file whose header carries
//! its write nonce. A missing file is success; a file too damaged to parse is deleted by an
//! unguarded remove (it is what a corrupt-block cleanup is for).
//!
//! Unguarded: `open(block)` → `readv(header)` → `close` → `unlink(block)`. A block of another
//! version renamed into place between the read and the unlink would be deleted; the window is
//! one syscall long.
//!
//! Recycled (an unguarded remove given a spare name, see `crate::spare`): `open(block)` →
//! `readv(header)` → `statx` → `close` → `renameat2(block, spare, RENAME_NOREPLACE)` when the
//! file has exactly the spare length, else (or if that rename fails) `unlink(block)`.
//!
//! Guarded: `rename(block, aside)` → `open(aside)` → `readv(header)` → `close` → `unlink(aside)`
//! when it is this write; otherwise `renameat2(aside, block, RENAME_NOREPLACE)` puts it back,
//! and if a newer block took the name meanwhile (`EEXIST`) the one moved aside, superseded,
//! is unlinked. No newer block is ever deleted; a reader may see a miss while a foreign block is
//! aside. A crash leaves the aside file under a temporary name, which the startup scan collects.

use std::ffi::{CStr, CString};

use kvx_core::BlockError;

use super::{JobCore, Next, Syscall, errno_name, zeroed_statx};
use crate::format::{self, HEADER_LEN};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RemoveStep {
    MoveAside,
    Open,
    Read,
    Stat,
    Close,
    Recycle,
    Unlink,
    PutBack,
    DropAside,
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

/// What only the remove machine needs.
pub(super) struct Remove {
    /// The pending syscall.
    pub(super) step: Option<RemoveStep>,
    /// A guarded remove moved the block to the temporary name.
    moved_aside: bool,
    /// The spare name to move the file to instead of unlinking it, and the length the file
    /// must have for that (see `crate::spare`).
    pub(super) recycle: Option<(CString, u64)>,
    /// The file was moved to its spare name.
    pub(super) recycled: bool,
    /// The unlink of the file was issued.
    unlinked: bool,
    stx: Box<libc::statx>,
    file_len: usize,
}

impl Default for Remove {
    fn default() -> Self {
        Remove {
            step: None,
            moved_aside: false,
            recycle: None,
            recycled: false,
            unlinked: false,
            stx: zeroed_statx(),
            file_len: 0,
        }
    }
}

impl Remove {
    /// The unlink of the file was issued (whatever it returned).
    pub(super) fn unlinked(&self) -> bool {
        self.unlinked
    }

    fn call(&mut self, c: &mut JobCore, step: RemoveStep, s: Syscall) -> Next {
        self.step = Some(step);
        c.call(s)
    }

    pub(super) fn start(&mut self, c: &mut JobCore) -> Next {
        if let Err(e) = c.header() {
            return c.done(Err(e));
        }
        self.open(c)
    }

    /// Start the remove machine (also the undo of a store's late rename).
    pub(super) fn open(&mut self, c: &mut JobCore) -> Next {
        self.moved_aside = false;
        if c.p.nonce.is_some() && c.paths.temp.is_some() {
            let from = c.paths.block.as_ptr();
            let to = c.temp_ptr();
            return self.call(
                c,
                RemoveStep::MoveAside,
                Syscall::Rename {
                    from,
                    to,
                    noreplace: false,
                },
            );
        }
        self.open_target(c)
    }

    /// The file the remove works on: the block, or where it was moved aside.
    fn target(&self, c: &JobCore) -> *const libc::c_char {
        if self.moved_aside {
            c.temp_ptr()
        } else {
            c.paths.block.as_ptr()
        }
    }

    fn open_target(&mut self, c: &mut JobCore) -> Next {
        let path = self.target(c);
        self.call(
            c,
            RemoveStep::Open,
            Syscall::Open {
                path,
                flags: libc::O_RDONLY | libc::O_CLOEXEC,
                mode: 0,
            },
        )
    }

    fn keep(c: &JobCore, n: usize) -> Keep {
        let Some(h) = c.header.as_ref() else {
            return Keep::NotOurs;
        };
        let bytes = &h.as_slice()[..n.min(HEADER_LEN)];
        if let Some(v) = format::claimed_version(bytes)
            && v != format::VERSION
        {
            return Keep::OtherVersion(v);
        }
        match (c.p.nonce, format::parse_header(bytes)) {
            (None, _) => Keep::No,
            (Some(want), Ok(h)) if h.nonce == want && h.key == c.key => Keep::No,
            (Some(_), _) => Keep::NotOurs,
        }
    }

    fn finish(c: &mut JobCore, r: Result<(), BlockError>) -> Next {
        let r = match c.verdict.take() {
            // A store undoing its rename keeps the store's verdict.
            Some(v) => v,
            None => r,
        };
        c.done(r)
    }

    fn unlink_target(&mut self, c: &mut JobCore, step: RemoveStep) -> Next {
        let path = self.target(c);
        self.call(c, step, Syscall::Unlink { path })
    }

    fn target_name(&self, c: &JobCore) -> String {
        let p = self.target(c);
        if p.is_null() {
            return String::new();
        }
        // SAFETY: `target` points at one of the job's own NUL-terminated path strings.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    pub(super) fn advance(&mut self, c: &mut JobCore, res: i64) -> Next {
        let Some(step) = self.step else {
            return c.done(Err(BlockError::Io(
                "a remove advanced before it started".into(),
            )));
        };
        match step {
            RemoveStep::MoveAside => {
                if res == -(libc::ENOENT as i64) {
                    return Remove::finish(c, Ok(()));
                }
                if res < 0 {
                    let msg = format!("rename {:?} aside: {}", c.block_path(), errno_name(res));
                    return Remove::finish(c, Err(BlockError::Io(msg)));
                }
                self.moved_aside = true;
                self.open_target(c)
            }
            RemoveStep::Open => {
                if res == -(libc::ENOENT as i64) {
                    return Remove::finish(c, Ok(()));
                }
                if res < 0 {
                    let msg = format!("open {:?}: {}", self.target_name(c), errno_name(res));
                    return Remove::finish(c, Err(BlockError::Io(msg)));
                }
                let fd = res as i32;
                c.fd = Some(fd);
                match c.read_header(fd) {
                    Ok(read) => self.call(c, RemoveStep::Read, read),
                    Err(e) => {
                        c.verdict.get_or_insert(Err(e));
                        self.call(c, RemoveStep::Close, Syscall::Close { fd })
                    }
                }
            }
            RemoveStep::Read => {
                // A read error reads as nothing: an unguarded remove still deletes the file.
                c.expect = if res < 0 { 0 } else { res as usize };
                if self.recycle.is_some() {
                    let fd = c.fd.unwrap_or(-1);
                    let buf: *mut libc::statx = &mut *self.stx;
                    return self.call(c, RemoveStep::Stat, Syscall::Statx { fd, buf });
                }
                let fd = c.fd.take().unwrap_or(-1);
                self.call(c, RemoveStep::Close, Syscall::Close { fd })
            }
            RemoveStep::Stat => {
                // A failed statx leaves the length unknown: the file is unlinked.
                self.file_len = if res == 0 {
                    self.stx.stx_size as usize
                } else {
                    usize::MAX
                };
                let fd = c.fd.take().unwrap_or(-1);
                self.call(c, RemoveStep::Close, Syscall::Close { fd })
            }
            RemoveStep::Close => match Remove::keep(c, c.expect) {
                Keep::No => match &self.recycle {
                    // Only a file whose header read back whole: one that fails to read may sit
                    // on failing sectors, which no store should write into again.
                    Some((spare, len))
                        if self.file_len as u64 == *len && c.expect == HEADER_LEN =>
                    {
                        let from = self.target(c);
                        let to = spare.as_ptr();
                        self.call(
                            c,
                            RemoveStep::Recycle,
                            Syscall::Rename {
                                from,
                                to,
                                noreplace: true,
                            },
                        )
                    }
                    _ => self.unlink_target(c, RemoveStep::Unlink),
                },
                keep => {
                    if let Keep::OtherVersion(v) = keep {
                        tracing::info!(path = ?c.block_path(), version = v,
                            "posix: not removing a block of another format version");
                    } else {
                        tracing::debug!(path = ?c.block_path(),
                            "posix: a newer write replaced this block; left in place");
                    }
                    if !self.moved_aside {
                        return Remove::finish(c, Ok(()));
                    }
                    let from = c.temp_ptr();
                    let to = c.paths.block.as_ptr();
                    self.call(
                        c,
                        RemoveStep::PutBack,
                        Syscall::Rename {
                            from,
                            to,
                            noreplace: true,
                        },
                    )
                }
            },
            RemoveStep::Recycle => {
                if res == 0 {
                    self.recycled = true;
                    return Remove::finish(c, Ok(()));
                }
                // The block gone meanwhile, the spare folder gone, a name taken: unlink (which
                // finds nothing in the first case).
                tracing::debug!(path = ?c.block_path(), error = %errno_name(res),
                    "posix: cannot recycle a block file; unlinking it");
                self.unlink_target(c, RemoveStep::Unlink)
            }
            RemoveStep::Unlink => {
                self.unlinked = true;
                if res < 0 && res != -(libc::ENOENT as i64) {
                    let msg = format!("unlink {:?}: {}", self.target_name(c), errno_name(res));
                    tracing::warn!(error = %msg, "posix: remove failed");
                    return Remove::finish(c, Err(BlockError::Io(msg)));
                }
                Remove::finish(c, Ok(()))
            }
            RemoveStep::PutBack => {
                if res == -(libc::EEXIST as i64) {
                    // A newer block took the name while this one was aside: this one is
                    // superseded, as a rename over it would have left it.
                    return self.unlink_target(c, RemoveStep::DropAside);
                }
                if res < 0 {
                    tracing::warn!(path = ?c.block_path(), error = %errno_name(res),
                        "posix: cannot put a block back; left under its temporary name");
                }
                Remove::finish(c, Ok(()))
            }
            RemoveStep::DropAside => {
                if res < 0 && res != -(libc::ENOENT as i64) {
                    tracing::warn!(path = %self.target_name(c), error = %errno_name(res),
                        "posix: cannot remove a superseded block");
                }
                Remove::finish(c, Ok(()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;
    use std::path::Path;

    use kvx_core::{BlockKey, OpId};

    use super::*;
    use crate::job::{BlockJob, FileOp, JobParams, Machine};
    use crate::paths::Layout;

    fn block_file(path: &Path, key: BlockKey, nonce: u64, fill: u8) {
        let payload = vec![fill; 100];
        let mut bytes = vec![0u8; HEADER_LEN];
        format::encode_header(&mut bytes, key, &payload, nonce);
        bytes.extend_from_slice(&payload);
        std::fs::create_dir_all(path.parent().expect("leaf")).expect("mkdir");
        std::fs::write(path, bytes).expect("write");
    }

    /// A remove job of `key`, guarded by `nonce` if there is one.
    fn remove_job(layout: &Layout, key: BlockKey, nonce: Option<u64>) -> BlockJob {
        BlockJob::new(
            OpId(0),
            0,
            FileOp::Remove,
            key,
            None,
            layout.paths(key, nonce.is_some()),
            JobParams::remove(nonce),
        )
    }

    /// Run a guarded remove of `key` (nonce 7) to the end with blocking syscalls; `after` runs
    /// after each syscall, with the step it belonged to.
    fn run(layout: &Layout, key: BlockKey, after: impl FnMut(RemoveStep)) {
        run_job(remove_job(layout, key, Some(7)), after);
    }

    /// Run `job` to the end with blocking syscalls, as the psync engine does; it must succeed.
    fn run_job(mut job: BlockJob, mut after: impl FnMut(RemoveStep)) -> BlockJob {
        let mut next = job.start();
        while let Next::Call(call) = next {
            // SAFETY: the job is alive, in place and touched by no one else during the call.
            let res = unsafe { crate::job::sys::run(&call) };
            if let Machine::Remove(Remove { step: Some(s), .. }) = &job.machine {
                after(*s);
            }
            next = job.advance(res);
        }
        assert_eq!(job.core.result, Ok(()));
        job
    }

    /// A remove of `key` (guarded by `nonce` if there is one) given the spare name `spare` for
    /// a file of `len` bytes, run to the end; the spare name it moved the file to, if it did.
    fn recycle(
        layout: &Layout,
        key: BlockKey,
        nonce: Option<u64>,
        spare: &Path,
        len: u64,
    ) -> Option<CString> {
        let mut job = remove_job(layout, key, nonce);
        let name = CString::new(spare.as_os_str().as_encoded_bytes()).expect("no NUL");
        job.recycle_into(name, len);
        run_job(job, |_| {})
            .take_recycle()
            .and_then(|(name, moved)| moved.then_some(name))
    }

    #[test]
    fn unguarded_remove_recycles_only_a_file_of_the_spare_length() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("dir");
        let spares = dir.path().join(".kvx-spare");
        std::fs::create_dir(&spares).expect("mkdir");
        let layout = Layout::new(vec![dir.path().to_path_buf()]);
        let key = BlockKey(5);
        let path = layout.block_path(key);
        block_file(&path, key, 1, 1);
        let len = std::fs::metadata(&path).expect("stat").len();
        let inode = std::fs::metadata(&path).expect("stat").ino();

        // The spare length: moved, the same file under the spare name.
        let spare = spares.join("h-1-0");
        let moved = recycle(&layout, key, None, &spare, len);
        assert_eq!(
            moved.as_deref().map(CStr::to_bytes),
            Some(spare.as_os_str().as_encoded_bytes())
        );
        assert!(!path.exists());
        assert_eq!(std::fs::metadata(&spare).expect("the spare").ino(), inode);

        // Another length: unlinked, nothing recycled.
        block_file(&path, key, 2, 2);
        assert_eq!(
            recycle(&layout, key, None, &spares.join("h-1-1"), len + 4096),
            None
        );
        assert!(!path.exists() && !spares.join("h-1-1").exists());

        // The spare folder gone: unlinked all the same.
        block_file(&path, key, 3, 3);
        std::fs::remove_dir_all(&spares).expect("rm");
        assert_eq!(
            recycle(&layout, key, None, &spares.join("h-1-2"), len),
            None
        );
        assert!(!path.exists());

        // A guarded remove never recycles.
        std::fs::create_dir(&spares).expect("mkdir");
        block_file(&path, key, 7, 4);
        let spare = spares.join("h-1-3");
        assert_eq!(recycle(&layout, key, Some(7), &spare, len), None);
        assert!(!path.exists() && !spare.exists());
    }

    fn temps(dir: &Path) -> usize {
        let mut n = 0;
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.path().is_dir() {
                    stack.push(e.path());
                } else if e.path().to_string_lossy().ends_with(".kvb.tmp") {
                    n += 1;
                }
            }
        }
        n
    }

    #[test]
    fn guarded_remove_deletes_only_its_own_write() {
        let dir = tempfile::tempdir().expect("dir");
        let layout = Layout::new(vec![dir.path().to_path_buf()]);
        let key = BlockKey(99);
        let path = layout.block_path(key);

        // Its own write: removed.
        block_file(&path, key, 7, 1);
        run(&layout, key, |_| {});
        assert!(!path.exists());

        // Another write: put back, byte for byte.
        block_file(&path, key, 8, 2);
        let before = std::fs::read(&path).expect("read");
        run(&layout, key, |_| {});
        assert_eq!(std::fs::read(&path).expect("still there"), before);

        // Another write, and a newer one lands while it is aside: the newer one stays, the
        // superseded one is dropped.
        block_file(&path, key, 8, 3);
        let mut newer = Vec::new();
        run(&layout, key, |step| {
            if step == RemoveStep::MoveAside {
                block_file(&path, key, 9, 4);
                newer = std::fs::read(&path).expect("newer");
            }
        });
        assert_eq!(std::fs::read(&path).expect("newer stays"), newer);
        assert_eq!(temps(dir.path()), 0, "nothing left aside");

        // Nothing there: success, nothing created.
        std::fs::remove_file(&path).expect("rm");
        run(&layout, key, |_| {});
        assert!(!path.exists());
        assert_eq!(temps(dir.path()), 0);
    }
}
