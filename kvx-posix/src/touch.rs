//! The touch lane of a store on a shared mount: after a successful load, the block file's mtime
//! is set to now (`utimensat`), which is the recency signal every node's collector orders
//! blocks by. One thread of its own with a bounded queue: the engine step only queues a path,
//! a full queue (a stuck mount) drops the touch (the block merely looks older), and a thread
//! stuck in the kernel holds nothing but that path.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_channel::{Sender, TrySendError};

/// Touches queued at most.
const TOUCH_QUEUE: usize = 4096;

/// See the module docs.
pub(crate) struct TouchLane {
    tx: Sender<CString>,
    dropped: AtomicU64,
}

/// Set `path`'s access and modification times to now; `Err` with the OS error.
pub(crate) fn touch_now(path: &CString) -> std::io::Result<()> {
    // SAFETY: `path` is a NUL-terminated string we own for the call; a null `times` means now.
    let r = unsafe { libc::utimensat(libc::AT_FDCWD, path.as_ptr(), std::ptr::null(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl TouchLane {
    /// Start the lane's thread.
    pub(crate) fn start() -> std::io::Result<TouchLane> {
        let (tx, rx) = crossbeam_channel::bounded::<CString>(TOUCH_QUEUE);
        std::thread::Builder::new()
            .name("kvx-posix-touch".into())
            .spawn(move || {
                for path in rx {
                    if let Err(e) = touch_now(&path)
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
    pub(crate) fn touch(&self, path: &Path) {
        let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
            return;
        };
        match self.tx.try_send(c) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
