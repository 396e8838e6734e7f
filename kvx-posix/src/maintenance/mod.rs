//! Operator tools for a block store directory, run while nodes use it: [`verify`] checks every
//! block as a load would and can remove what is corrupt; [`gc`] brings the store under a byte
//! quota by removing the least recently used blocks. Both remove crash leftovers (temporary
//! files older than a stale age).
//!
//! Every file operation runs on a [`Worker`] thread and is waited for only until its deadline,
//! so on a frozen mount a run ends with [`MaintenanceError::Frozen`] instead of hanging (the
//! stuck thread is left behind; a process can end only once the mount answers or is aborted).
//!
//! The recency signal is the block file's mtime: a store writes it, a load touches it. A block
//! of another format version is reported by `verify` and left alone.
//!
//! ```
//! use kvx_posix::maintenance::{GcOptions, VerifyOptions, gc, verify};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let report = verify(dir.path(), &VerifyOptions::default(), &mut |_| {}).unwrap();
//! assert_eq!(report.problems(), 0);
//! let collected = gc(dir.path(), &GcOptions::new(1 << 30), &mut |_| {}).unwrap();
//! assert_eq!(collected.bytes_after, 0);
//! ```

mod files;
mod gc;
#[cfg(test)]
mod tests;
mod verify;
mod walk;
mod worker;

use std::path::PathBuf;
use std::time::Duration;

pub use files::{FileId, Removal, remove_if_unchanged};
pub use gc::{Collected, GcOptions, GcReport, gc};
pub use verify::{Action, Finding, FindingKind, VerifyOptions, VerifyReport, verify};
pub use walk::{FileEntry, Kind, kind_of, walk};
pub use worker::Worker;

/// Default deadline of one file operation.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(5);
/// Default age after which a temporary file is a crash leftover.
pub const DEFAULT_STALE_AFTER: Duration = Duration::from_secs(600);

/// Which part of a run a [`Progress`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Listing directories (`done` counts leaf directories; no total).
    Walk,
    /// Checking files (`verify`).
    Check,
    /// Removing files (`gc`).
    Remove,
}

/// How far a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// The phase.
    pub phase: Phase,
    /// Items done in this phase.
    pub done: u64,
    /// Items in this phase, when known.
    pub total: Option<u64>,
}

/// Why a maintenance run stopped.
#[derive(Debug, thiserror::Error)]
pub enum MaintenanceError {
    /// A file operation passed its deadline.
    #[error("{op} {path} did not answer within {ms} ms: the mount may be frozen")]
    Frozen {
        /// The operation (`list`, `read`, `remove`, ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The deadline.
        ms: u64,
    },
    /// The I/O thread cannot start.
    #[error("cannot start the I/O thread: {0}")]
    Thread(std::io::Error),
    /// A directory of the tree cannot be listed.
    #[error("cannot {op} {path}: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
}
