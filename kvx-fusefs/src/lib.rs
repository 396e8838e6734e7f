//! kvx-fusefs: a FUSE filesystem that reproduces a hung storage mount, for tests and fault
//! injection.
//!
//! [`StallFs::mount`] mounts a filesystem (files in memory, or passed through to a directory)
//! with the pure-Rust `fuser` mount; [`StallMount::freeze`] makes every following request block
//! inside the filesystem (open, create, lookup, stat, read, write, rename, unlink, mkdir, fsync
//! …) exactly as on a stuck device, and [`StallMount::thaw`] lets them all finish. Dropping the
//! mount aborts its FUSE connection and detaches it, so no process can stay stuck in it.
//!
//! ```no_run
//! use std::time::Duration;
//! use kvx_fusefs::{fuse_available, Backing, StallFs};
//!
//! if let Err(reason) = fuse_available() {
//!     println!("skip: {reason}");
//!     return;
//! }
//! let dir = tempfile::tempdir().unwrap();
//! let mount = StallFs::mount(dir.path(), Backing::Memory).unwrap();
//! let file = mount.path().join("block");
//! std::fs::write(&file, b"kv").unwrap();
//!
//! mount.freeze();
//! let reader = std::thread::spawn(move || std::fs::read(file));
//! assert!(mount.wait_blocked(1, Duration::from_secs(5))); // the read is stuck in the mount
//! mount.thaw();
//! assert_eq!(reader.join().unwrap().unwrap(), b"kv");
//! drop(mount); // aborts the connection and unmounts, even if something were still stuck
//! ```
//!
//! | item | what |
//! |---|---|
//! | [`StallFs::mount`] | mount over a [`Backing`] at a directory |
//! | [`StallMount`] | `freeze` / `thaw` / `is_frozen` / `blocked_requests` / `wait_blocked` / `ops_served` / `path` / `abort` |
//! | [`fuse_available`] | whether FUSE works here (root, `/dev/fuse`, a probe mount), else why not |
#![warn(missing_docs)]

mod backing;
mod error;
mod fs;
mod gate;
mod memory;
mod mount;
mod passthrough;
mod probe;
mod sys;

pub use backing::Backing;
pub use error::FuseError;
pub use fs::StallFs;
pub use mount::StallMount;
pub use probe::fuse_available;
