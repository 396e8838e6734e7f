//! The touch lane of a store on a shared mount: after a successful load, the block file's mtime
//! is set to now (`utimensat`), which is the recency signal every node's collector orders
//! blocks by; a block a node writes back from its host tier gets its last use there instead. One thread of its own with a bounded queue: the engine step only queues a path,
//! a full queue (a stuck mount) drops the touch (the block merely looks older), and a thread
//! stuck in the kernel holds nothing but that path.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Sender, TrySendError};

/// Touches queued at most.
const TOUCH_QUEUE: usize = 4096;

/// See the module docs.
pub(crate) struct TouchLane {
    tx: Sender<(CString, Option<SystemTime>)>,
    dropped: AtomicU64,
}

/// Set `path`'s access and modification times to `at` (`None`: now); `Err` with the OS error.
pub(crate) fn touch(path: &CString, at: Option<SystemTime>) -> std::io::Result<()> {
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

impl TouchLane {
    /// Start the lane's thread.
    pub(crate) fn start() -> std::io::Result<TouchLane> {
        let (tx, rx) = crossbeam_channel::bounded::<(CString, Option<SystemTime>)>(TOUCH_QUEUE);
        std::thread::Builder::new()
            .name("kvx-posix-touch".into())
            .spawn(move || {
                for (path, at) in rx {
                    if let Err(e) = touch(&path, at)
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

    /// Queue a touch of `path` setting its times to `at` (`None`: now); never blocks.
    pub(crate) fn touch(&self, path: &Path, at: Option<SystemTime>) {
        let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
            return;
        };
        match self.tx.try_send((c, at)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
