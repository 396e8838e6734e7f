//! Mounting a [`StallFs`] and tearing it down so that nothing can stay stuck in it.
//!
//! Teardown (on [`StallMount::abort`] or drop) always runs the same steps, whatever state the
//! mount is in: close the gate (held requests fail with `ENOTCONN`, new ones too), abort the
//! FUSE connection by writing `1` to `/sys/fs/fuse/connections/<dev>/abort` (every request
//! still in the kernel fails and no new one can block), detach the mount with
//! `umount2(MNT_FORCE | MNT_DETACH)` (a forced FUSE unmount aborts the connection too, which
//! covers machines without fusectl mounted), then wait briefly for the session threads.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use fuser::{BackgroundSession, Config, MountOption, Session};

use crate::backing::Backing;
use crate::fs::StallFs;
use crate::gate::Gate;
use crate::{FuseError, sys};

/// FUSE session threads reading requests from the kernel.
const SESSION_THREADS: usize = 4;

/// How long teardown waits for the session threads to leave before detaching them.
const JOIN_GRACE: Duration = Duration::from_secs(5);

/// Where the kernel lists FUSE connections (the fusectl filesystem).
const FUSECTL: &str = "/sys/fs/fuse/connections";

impl StallFs {
    /// Mount a new filesystem over `backing` at `mountpoint` (an existing directory that is
    /// not itself a mount root) and serve it on background threads.
    pub fn mount(mountpoint: &Path, backing: Backing) -> Result<StallMount, FuseError> {
        let bad = |reason: String| FuseError::Mountpoint {
            path: mountpoint.to_owned(),
            reason,
        };
        let path = mountpoint.canonicalize().map_err(|e| bad(e.to_string()))?;
        let under = fs::metadata(&path).map_err(|e| bad(e.to_string()))?;
        if !under.is_dir() {
            return Err(bad("not a directory".into()));
        }
        if let Some(parent) = path.parent() {
            let parent_dev = fs::metadata(parent).map_err(|e| bad(e.to_string()))?.dev();
            if parent_dev != under.dev() {
                // Teardown detaches by path; on a mount root that could hit the wrong mount.
                return Err(bad("already a mount root; use a directory inside it".into()));
            }
        }

        let gate = Arc::new(Gate::new());
        let fs = StallFs::new(backing.open()?, Arc::clone(&gate));
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName("kvx-stallfs".into()),
            MountOption::Subtype("kvx-stallfs".into()),
            MountOption::NoAtime,
        ];
        config.n_threads = Some(SESSION_THREADS);
        let mount_err = |source| FuseError::Mount {
            path: path.clone(),
            source,
        };
        let session = Session::new(fs, &path, &config)
            .and_then(Session::spawn)
            .map_err(mount_err)?;

        let mut mount = StallMount {
            path,
            gate,
            session: Some(session),
            conn: None,
        };
        // Stat the new root while the filesystem is open: it answers the getattr. The device
        // number names the connection in fusectl; teardown must not touch the mount to find it.
        let dev = match fs::metadata(&mount.path) {
            Ok(meta) => meta.dev(),
            Err(source) => {
                let err = FuseError::Mount {
                    path: mount.path.clone(),
                    source,
                };
                let _ = mount.teardown();
                return Err(err);
            }
        };
        if dev == under.dev() {
            let err = FuseError::NotMounted {
                path: mount.path.clone(),
                dev,
            };
            let _ = mount.teardown();
            return Err(err);
        }
        mount.conn = Some(connection_id(dev));
        Ok(mount)
    }
}

/// The fusectl name of the connection of a FUSE mount with device number `dev`: the kernel's
/// own dev_t encoding (`major << 20 | minor`; FUSE mounts have major 0, so it is the minor).
fn connection_id(dev: u64) -> u64 {
    (u64::from(libc::major(dev)) << 20) | u64::from(libc::minor(dev))
}

/// A mounted [`StallFs`]. Freeze and thaw it from the test; dropping it (or [`abort`]) always
/// releases every process stuck in it and unmounts it.
///
/// [`abort`]: StallMount::abort
#[derive(Debug)]
pub struct StallMount {
    path: PathBuf,
    gate: Arc<Gate>,
    /// `None` once torn down.
    session: Option<BackgroundSession>,
    /// fusectl connection id, once known.
    conn: Option<u64>,
}

impl StallMount {
    /// The mountpoint (canonical path).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// From now on every request blocks in the filesystem until [`thaw`](Self::thaw).
    pub fn freeze(&self) {
        self.gate.freeze();
    }

    /// Serve the blocked requests and every following one.
    pub fn thaw(&self) {
        self.gate.thaw();
    }

    /// Whether requests currently block.
    pub fn is_frozen(&self) -> bool {
        self.gate.is_frozen()
    }

    /// Requests blocked in the filesystem right now.
    pub fn blocked_requests(&self) -> usize {
        self.gate.blocked()
    }

    /// Wait until at least `n` requests are blocked; false if `timeout` passed first.
    pub fn wait_blocked(&self, n: usize, timeout: Duration) -> bool {
        self.gate.wait_blocked(n, timeout)
    }

    /// Requests let through to the backing so far (counted as they pass the gate, so a
    /// snapshot taken after [`freeze`](Self::freeze) cannot grow until thaw).
    pub fn ops_served(&self) -> u64 {
        self.gate.served()
    }

    /// Release everything stuck in the mount with an error, abort the FUSE connection and
    /// unmount it. Dropping the mount does the same and ignores the error.
    pub fn abort(mut self) -> Result<(), FuseError> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<(), FuseError> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        self.gate.close();
        let aborted = match self.conn {
            Some(conn) => fs::write(format!("{FUSECTL}/{conn}/abort"), "1")
                .map_err(|e| format!("{FUSECTL}/{conn}/abort: {e}")),
            None => Err("connection id unknown".to_owned()),
        };
        let unmounted = sys::umount2(&self.path, libc::MNT_FORCE | libc::MNT_DETACH);

        // The session threads leave once the connection is gone. Should one still be busy,
        // detach it rather than hang the caller.
        let end = Instant::now() + JOIN_GRACE;
        while !session.guard.is_finished() && Instant::now() < end {
            thread::sleep(Duration::from_millis(5));
        }
        if session.guard.is_finished() {
            let _ = session.join();
        } else {
            tracing::warn!(
                "stallfs {}: session threads still busy after teardown",
                self.path.display()
            );
            drop(session);
        }

        match (aborted, unmounted) {
            (Err(abort), Err(unmount)) => Err(FuseError::Teardown {
                path: self.path.clone(),
                abort,
                unmount,
            }),
            _ => Ok(()),
        }
    }
}

impl Drop for StallMount {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::warn!("{e}");
        }
    }
}
