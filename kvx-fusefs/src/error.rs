//! Errors of kvx-fusefs.

use std::io;
use std::path::PathBuf;

/// What went wrong while mounting or tearing down a [`StallMount`](crate::StallMount).
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    /// The mountpoint cannot be used (missing, not a directory, or already a mount root).
    #[error("mountpoint {path}: {reason}")]
    Mountpoint {
        /// The mountpoint asked for.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
    /// The passthrough directory cannot be used.
    #[error("passthrough directory {path}: {source}")]
    Backing {
        /// The directory asked for.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The kernel refused the FUSE mount or the session handshake failed.
    #[error("mounting FUSE at {path}: {source}")]
    Mount {
        /// The mountpoint.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The mount call returned but the mountpoint does not show a new filesystem.
    #[error("FUSE mount at {path} is not visible (device {dev:#x} is the parent's)")]
    NotMounted {
        /// The mountpoint.
        path: PathBuf,
        /// The device number seen at the mountpoint.
        dev: u64,
    },
    /// Neither the fusectl abort nor a forced unmount released the mount.
    #[error("tearing down FUSE mount at {path}: abort: {abort}; unmount: {unmount}")]
    Teardown {
        /// The mountpoint.
        path: PathBuf,
        /// Why writing to `/sys/fs/fuse/connections/<dev>/abort` failed.
        abort: String,
        /// Why `umount2(MNT_FORCE | MNT_DETACH)` failed.
        unmount: io::Error,
    },
}
