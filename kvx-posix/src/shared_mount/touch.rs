//! The touch lane of a store on a shared mount: after a successful load, the block file's mtime
//! is set to now (`utimensat`), which is the recency signal every node's collector orders
//! blocks by; a block a node writes back from its host tier gets its last use there instead.
//! One thread of its own with a bounded queue: the engine step only queues a path, a full
//! queue (a stuck mount) drops the touch (the block merely looks older), and a thread stuck in
//! the kernel holds nothing but that path.

use std::ffi::{CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Sender, TrySendError};

/// Touches queued at most.
const TOUCH_QUEUE: usize = 4096;

/// The times a touch sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stamp {
    /// Now (a load).
    Now,
    /// `to`, an earlier time, unless the file's mtime is already later than `unless_after`
    /// (a node touched it since it was written: that newer use stands).
    Back {
        to: SystemTime,
        unless_after: SystemTime,
    },
}

/// See the module docs.
pub(crate) struct TouchLane {
    tx: Sender<(CString, Stamp)>,
    dropped: AtomicU64,
}

/// Set `path`'s access and modification times to `at` (`None`: now); `Err` with the OS error.
fn set_times(path: &CString, at: Option<SystemTime>) -> std::io::Result<()> {
    let times = at.map(|t| {
        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        let ts = libc::timespec {
            tv_sec: d.as_secs() as libc::time_t,
            tv_nsec: d.subsec_nanos() as libc::c_long,
        };
        [ts, ts]
    });
    let times_ptr = times.as_ref().map_or(std::ptr::null(), |t| t.as_ptr());
    // SAFETY: `path` is a NUL-terminated string and `times` (when not null) two timespecs, both
    // owned by this frame for the call; a null `times` means now.
    let r = unsafe { libc::utimensat(libc::AT_FDCWD, path.as_ptr(), times_ptr, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Apply `stamp` to `path`; `Err` with the OS error.
pub(crate) fn touch(path: &CString, stamp: Stamp) -> std::io::Result<()> {
    match stamp {
        Stamp::Now => set_times(path, None),
        Stamp::Back { to, unless_after } => {
            let mtime =
                std::fs::metadata(Path::new(OsStr::from_bytes(path.as_bytes())))?.modified()?;
            if mtime > unless_after {
                return Ok(());
            }
            set_times(path, Some(to))
        }
    }
}

impl TouchLane {
    /// Start the lane's thread.
    pub(crate) fn start() -> std::io::Result<TouchLane> {
        let (tx, rx) = crossbeam_channel::bounded::<(CString, Stamp)>(TOUCH_QUEUE);
        std::thread::Builder::new()
            .name("kvx-posix-touch".into())
            .spawn(move || {
                for (path, stamp) in rx {
                    if let Err(e) = touch(&path, stamp)
                        && e.kind() != std::io::ErrorKind::NotFound
                    {
                        tracing::debug!(path = ?path, error = %e, "posix: touch failed");
                    }
                }
            })?;
        Ok(TouchLane {
            tx,
            dropped: AtomicU64::new(0),
        })
    }

    /// Touches dropped because the queue was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Queue a touch of `path`; never blocks.
    pub(crate) fn touch(&self, path: &Path, stamp: Stamp) {
        let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
            return;
        };
        match self.tx.try_send((c, stamp)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn mtime(p: &Path) -> SystemTime {
        std::fs::metadata(p).unwrap().modified().unwrap()
    }

    /// Equal as far as a file system with one-second times can tell.
    fn about(a: SystemTime, b: SystemTime) -> bool {
        a.duration_since(b).unwrap_or_else(|e| e.duration()) < Duration::from_secs(1)
    }

    #[test]
    fn a_stamp_back_yields_to_a_later_touch() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.kvb");
        std::fs::write(&p, b"x").unwrap();
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        let written = SystemTime::now();
        let earlier = written - Duration::from_secs(60);
        let back = Stamp::Back {
            to: earlier,
            unless_after: written,
        };
        touch(&c, back).unwrap();
        assert!(about(mtime(&p), earlier), "set back to the last use");
        // Another node loads it after the write: its touch stands.
        let later = written + Duration::from_secs(5);
        set_times(&c, Some(later)).unwrap();
        touch(&c, back).unwrap();
        assert!(about(mtime(&p), later), "a newer use is never undone");
        touch(&c, Stamp::Now).unwrap();
        assert!(about(mtime(&p), SystemTime::now()), "now");
        let gone = CString::new(dir.path().join("gone.kvb").as_os_str().as_bytes()).unwrap();
        let e = touch(&gone, back).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
    }
}
