//! Spare files: files made ahead of the stores that write into them, so a store of a new
//! block does not create its file. On ext4 an inode allocation costs as much as writing a MiB
//! once many files were deleted in the last minutes (the allocator skips recently freed
//! inodes one by one); done here, off the store's path, it costs a store nothing.
//!
//! Each root with inline I/O (a local block file system, see [`crate::PosixConfig::inline_io`])
//! of a store that owns its roots (no shared mount) keeps `spare_files` of them in
//! `root/.kvx-spare/`, made at open and (unless `spare_refill` is off) topped up by a thread
//! of its own when half are used. With [`crate::PosixConfig::spare_block_bytes`] set, each is
//! preallocated to the length of one block's file, so its store's write allocates nothing
//! (and, the spares being made one after another, lands next to the one before it); only a
//! store of exactly that file length takes one. Spares are handed out oldest first.
//!
//! With preallocated spares, a removed block file of exactly that length (an eviction) is
//! recycled: moved into the spare folder instead of unlinked, while the root has fewer than
//! `spare_files` spares. Its space stays allocated and written, so the store that takes it
//! overwrites written space: no block is freed and allocated again, and on a thin-provisioned
//! virtual disk (a file system mounted with `discard`) no freed range is trimmed and allocated
//! again by the host underneath, which made writes into fresh space about 1.6x slower than
//! overwrites on this project's machines. The store hands a recycled file out only once no
//! load that may have opened it is in flight (see `crate::spare::recycle`).
//!
//! A store opens its spare (no create), writes, closes and renames it into place, exactly as it
//! would a fresh temporary file; a spare found gone falls back to a fresh temporary file. A
//! store that ends before it opens its spare (at its deadline, cancelled, refused by the
//! engine) gives the spare back, first in line. At open, the spares an earlier run left (files of exactly the spare length: empty ones, or
//! preallocated or recycled ones) are taken over, oldest name first, and any other file there
//! is removed. A store writes the whole file of a spare it takes, so what a spare held before
//! never shows.

pub(crate) mod recycle;

use std::collections::VecDeque;
use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_channel::Sender;

use crate::error::PosixError;

/// The directory of a root's spare files.
pub(crate) const SPARE_DIR: &str = ".kvx-spare";

/// One root's spare files.
struct RootSpares {
    dir: PathBuf,
    pool: Mutex<Pool>,
}

/// A root's spare files ready to be written, oldest first, and the recycled files promised to
/// it (a remove given a spare name that has not come back yet).
#[derive(Default)]
struct Pool {
    ready: VecDeque<CString>,
    promised: usize,
}

impl Pool {
    /// Ready and promised: what the pool will hold once every remove in flight came back.
    fn count(&self) -> usize {
        self.ready.len() + self.promised
    }
}

struct Inner {
    /// Per root; `None` for a root without spares.
    roots: Vec<Option<RootSpares>>,
    target: usize,
    /// Length each new spare is preallocated to; 0: empty spares.
    len: u64,
    refill: bool,
    tag: String,
    seq: AtomicU64,
}

/// The spare files of a store's roots (see the module docs).
pub(crate) struct Spares {
    inner: Arc<Inner>,
    wake: Sender<()>,
}

fn io_err(path: &Path, source: std::io::Error) -> PosixError {
    PosixError::Root {
        path: path.to_path_buf(),
        source,
    }
}

impl Inner {
    /// Top `root`'s spares up to the target; stops at the first error (logged).
    fn fill(&self, root: usize) {
        let Some(r) = self.roots.get(root).and_then(Option::as_ref) else {
            return;
        };
        loop {
            if kvx_core::lock(&r.pool).count() >= self.target {
                return;
            }
            match self.make(&r.dir) {
                Ok(c) => kvx_core::lock(&r.pool).ready.push_back(c),
                // A name an earlier process of the same pid left: the next one is free.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    tracing::warn!(dir = %r.dir.display(), error = %e,
                        "posix: cannot make a spare file; stores create their own");
                    return;
                }
            }
        }
    }

    /// A fresh spare name in `dir`.
    fn name(&self, dir: &Path) -> PathBuf {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        dir.join(format!("{}-{seq}", self.tag))
    }

    /// A new file in `dir`, preallocated to `len` bytes (empty when `len` is 0).
    fn make(&self, dir: &Path) -> std::io::Result<CString> {
        let path = self.name(dir);
        let file = std::fs::File::create_new(&path)?;
        if self.len > 0
            && let Err(e) = preallocate(&file, self.len)
        {
            // Still a good spare: its store allocates as it writes, as into an empty one.
            tracing::debug!(path = %path.display(), error = %e, "posix: spare not preallocated");
        }
        CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)
    }
}

impl Spares {
    /// Spares for the roots marked in `with_spares` (`target` per root, each preallocated to
    /// `len` bytes unless 0; none at all when `target` is zero or no root qualifies): take over
    /// an earlier run's empty spares, make the rest, and start the thread that tops them up.
    /// `tag` (host and pid) starts every spare's name.
    pub(crate) fn open(
        roots: &[PathBuf],
        with_spares: &[bool],
        target: usize,
        len: u64,
        refill: bool,
        tag: String,
    ) -> Result<Option<Spares>, PosixError> {
        if target == 0 || !with_spares.iter().any(|s| *s) {
            return Ok(None);
        }
        let mut per_root = Vec::with_capacity(roots.len());
        let mut next = 0;
        for (root, on) in roots.iter().zip(with_spares) {
            if !*on {
                per_root.push(None);
                continue;
            }
            let dir = root.join(SPARE_DIR);
            std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
            let (ready, after) = take_over(&dir, len, &tag)?;
            // A run of the same host and pid (a restarted container) numbers its names after
            // the spares it took over, so no new name is one of theirs.
            next = next.max(after);
            per_root.push(Some(RootSpares {
                dir,
                pool: Mutex::new(Pool { ready, promised: 0 }),
            }));
        }
        let inner = Arc::new(Inner {
            roots: per_root,
            target,
            len,
            refill,
            tag,
            seq: AtomicU64::new(next),
        });
        for root in 0..inner.roots.len() {
            inner.fill(root);
        }
        let (wake, rx) = crossbeam_channel::bounded::<()>(1);
        let filler = inner.clone();
        std::thread::Builder::new()
            .name("kvx-posix-spares".into())
            .spawn(move || {
                for () in rx {
                    for root in 0..filler.roots.len() {
                        filler.fill(root);
                    }
                }
            })
            .map_err(|e| PosixError::Engine {
                engine: "spares",
                msg: format!("cannot start the spare-file thread: {e}"),
            })?;
        Ok(Some(Spares { inner, wake }))
    }

    /// A spare file of `root` to write a block file of `file_len` bytes into, if one is ready
    /// and fits (any does when spares are empty, only one of exactly that length when they are
    /// preallocated); never blocks on the device (half used wakes the thread that tops them
    /// up).
    pub(crate) fn take(&self, root: usize, file_len: u64) -> Option<CString> {
        if self.inner.len != 0 && self.inner.len != file_len {
            return None;
        }
        let r = self.root(root)?;
        let (spare, left) = {
            let mut pool = kvx_core::lock(&r.pool);
            let spare = pool.ready.pop_front();
            (spare, pool.ready.len())
        };
        if self.inner.refill && left < self.inner.target / 2 + 1 {
            // Full: a wake-up is already pending; disconnected: the thread is gone.
            let _ = self.wake.try_send(());
        }
        spare
    }

    /// `root`'s spares, if it has any.
    fn root(&self, root: usize) -> Option<&RootSpares> {
        self.inner.roots.get(root)?.as_ref()
    }

    /// Whether removed block files are recycled: the spares are preallocated to one length.
    pub(crate) fn recycles(&self) -> bool {
        self.inner.len > 0
    }

    /// A fresh name in `root`'s spare folder to move a removed block file to instead of
    /// unlinking it, and the length that file must have to be recycled; `None` unless spares
    /// are preallocated and `root`'s spares, ready and promised, are fewer than `spare_files`.
    /// The name is promised to the pool until [`Spares::put`] or [`Spares::release`].
    pub(crate) fn recycle_name(&self, root: usize) -> Option<(CString, u64)> {
        if !self.recycles() {
            return None;
        }
        let r = self.root(root)?;
        let mut pool = kvx_core::lock(&r.pool);
        if pool.count() >= self.inner.target {
            return None;
        }
        let name = CString::new(self.inner.name(&r.dir).as_os_str().as_bytes()).ok()?;
        pool.promised += 1;
        Some((name, self.inner.len))
    }

    /// A promised recycled file, now in `root`'s spare folder, is ready for a store (the
    /// newest spare).
    pub(crate) fn put(&self, root: usize, spare: CString) {
        if let Some(r) = self.root(root) {
            let mut pool = kvx_core::lock(&r.pool);
            pool.promised = pool.promised.saturating_sub(1);
            pool.ready.push_back(spare);
        }
    }

    /// A spare taken by a store that never opened it, back in front (it is the oldest).
    pub(crate) fn give_back(&self, root: usize, spare: CString) {
        if let Some(r) = self.root(root) {
            kvx_core::lock(&r.pool).ready.push_front(spare);
        }
    }

    /// A promised recycled file will not come: its remove unlinked the file, or never ran.
    pub(crate) fn release(&self, root: usize) {
        if let Some(r) = self.root(root) {
            let mut pool = kvx_core::lock(&r.pool);
            pool.promised = pool.promised.saturating_sub(1);
        }
    }

    /// Spare files ready per root (zero for a root without them).
    pub(crate) fn ready(&self) -> Vec<usize> {
        self.inner
            .roots
            .iter()
            .map(|r| {
                r.as_ref()
                    .map_or(0, |r| kvx_core::lock(&r.pool).ready.len())
            })
            .collect()
    }
}

/// Every fan-out directory (`ab`) of each root marked in `with_spares`, made now: a spare is
/// renamed into one, so none is made on a store's path (256 per root); (root, `0xab`) of each.
pub(crate) fn make_fan_out_dirs(
    roots: &[PathBuf],
    with_spares: &[bool],
) -> Result<Vec<(usize, u16)>, PosixError> {
    let mut made = Vec::new();
    for (root, _) in with_spares.iter().enumerate().filter(|(_, s)| **s) {
        for ab in 0..=255u8 {
            let d = roots[root].join(format!("{ab:02x}"));
            std::fs::create_dir_all(&d).map_err(|e| io_err(&d, e))?;
            made.push((root, u16::from(ab)));
        }
    }
    Ok(made)
}

/// The files of exactly `len` bytes in `dir`, kept as spares (in name order, so a run's own
/// spares go oldest first), and the number after the highest of those named with `tag`; any
/// other file there is removed.
fn take_over(dir: &Path, len: u64, tag: &str) -> Result<(VecDeque<CString>, u64), PosixError> {
    let mut kept = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
        let e = e.map_err(|e| io_err(dir, e))?;
        let path = e.path();
        match e.metadata() {
            Ok(m) if m.is_file() && m.len() == len => kept.push(path),
            Ok(m) if m.is_file() => {
                if let Err(err) = std::fs::remove_file(&path)
                    && err.kind() != std::io::ErrorKind::NotFound
                {
                    return Err(io_err(&path, err));
                }
            }
            _ => {}
        }
    }
    let mut kept: Vec<((String, u64), PathBuf)> =
        kept.into_iter().map(|p| (spare_order(&p), p)).collect();
    kept.sort_unstable();
    let after = kept
        .iter()
        .filter(|((t, seq), _)| t == tag && *seq != u64::MAX)
        .map(|((_, seq), _)| seq + 1)
        .max()
        .unwrap_or(0);
    let ready = kept
        .into_iter()
        .filter_map(|(_, p)| CString::new(p.as_os_str().as_bytes()).ok())
        .collect();
    Ok((ready, after))
}

/// A spare's place in the order it was made: its tag (`host-pid`), then its number.
fn spare_order(path: &Path) -> (String, u64) {
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    match name.rsplit_once('-') {
        Some((tag, seq)) => (tag.to_string(), seq.parse().unwrap_or(u64::MAX)),
        None => (name, u64::MAX),
    }
}

/// Allocate `len` bytes of `file` (its length becomes `len`; the blocks read as zeros until
/// written).
fn preallocate(file: &std::fs::File, len: u64) -> std::io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(std::io::Error::other)?;
    // SAFETY: the descriptor belongs to `file`, which this call borrows, so it stays open for
    // the call; fallocate reads no memory of ours.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store of the same host and pid as the run that left spares (a restarted container)
    /// takes them over, oldest first, and names its own after them.
    #[test]
    fn names_follow_the_spares_taken_over() {
        let dir = tempfile::tempdir().expect("dir");
        let spare_dir = dir.path().join(SPARE_DIR);
        std::fs::create_dir_all(&spare_dir).expect("mkdir");
        for name in ["h-1-7", "h-1-3", "other-2-9"] {
            std::fs::write(spare_dir.join(name), [0u8; 16]).expect("write");
        }
        std::fs::write(spare_dir.join("h-1-12"), [0u8; 5]).expect("write");
        let roots = [dir.path().to_path_buf()];
        let s = Spares::open(&roots, &[true], 4, 16, false, "h-1".into())
            .expect("open")
            .expect("spares");
        assert!(
            !spare_dir.join("h-1-12").exists(),
            "another length is removed"
        );
        assert_eq!(s.ready(), vec![4], "three taken over, one made");
        let names: Vec<String> = kvx_core::lock(&s.inner.roots[0].as_ref().expect("root").pool)
            .ready
            .iter()
            .map(|c| {
                c.to_string_lossy()
                    .rsplit('/')
                    .next()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect();
        assert_eq!(names, ["h-1-3", "h-1-7", "other-2-9", "h-1-8"]);
        let (recycle, len) = s.recycle_name(0).map_or((None, 0), |(n, l)| (Some(n), l));
        assert_eq!(recycle, None, "the pool is full: no name promised");
        assert_eq!(len, 0);
        drop(
            kvx_core::lock(&s.inner.roots[0].as_ref().expect("root").pool)
                .ready
                .pop_front(),
        );
        let (name, len) = s.recycle_name(0).expect("a name, now that one was taken");
        assert_eq!(len, 16);
        assert!(name.to_string_lossy().ends_with("/h-1-9"), "{name:?}");
    }
}
