//! The in-memory index of blocks present, and the startup scan that rebuilds it.

use std::path::Path;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, SystemTime};

use kvx_core::BlockKey;
use rustc_hash::FxHashSet;

use crate::error::PosixError;
use crate::paths::{Entry, Layout, classify};

/// Keys of the blocks the store holds.
#[derive(Debug, Default)]
pub(crate) struct Index {
    keys: RwLock<FxHashSet<BlockKey>>,
}

impl Index {
    fn read(&self) -> RwLockReadGuard<'_, FxHashSet<BlockKey>> {
        kvx_core::sync::read(&self.keys)
    }

    fn write(&self) -> RwLockWriteGuard<'_, FxHashSet<BlockKey>> {
        kvx_core::sync::write(&self.keys)
    }

    /// How many of `keys`, from the first, are present.
    pub(crate) fn lookup(&self, keys: &[BlockKey]) -> usize {
        let k = self.read();
        keys.iter().take_while(|key| k.contains(key)).count()
    }

    /// Whether `key` is present.
    pub(crate) fn contains(&self, key: BlockKey) -> bool {
        self.read().contains(&key)
    }

    /// Blocks present.
    pub(crate) fn len(&self) -> usize {
        self.read().len()
    }

    /// True when no block is present.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Record `key` as present.
    pub(crate) fn insert(&self, key: BlockKey) {
        self.write().insert(key);
    }

    /// Forget `key`; true if it was present.
    pub(crate) fn remove(&self, key: BlockKey) -> bool {
        self.write().remove(&key)
    }

    /// Record many keys.
    pub(crate) fn extend(&self, keys: impl IntoIterator<Item = BlockKey>) {
        self.write().extend(keys);
    }

    /// Every key (for tests and tools).
    pub(crate) fn keys(&self) -> Vec<BlockKey> {
        self.read().iter().copied().collect()
    }
}

/// What the startup scan found.
#[derive(Debug, Default)]
pub(crate) struct Scan {
    /// Block files found.
    pub(crate) keys: Vec<BlockKey>,
    /// Leaf directories that exist: (root, 16-bit key prefix).
    pub(crate) dirs: Vec<(usize, u16)>,
    /// Stale temporary files removed.
    pub(crate) removed_temps: usize,
}

/// The value of a fan-out directory name: two lowercase hex digits.
pub(crate) fn hex2(name: &str) -> Option<u8> {
    if name.len() == 2
        && name
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    {
        u8::from_str_radix(name, 16).ok()
    } else {
        None
    }
}

fn process_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks whether the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn io_err(path: &Path, source: std::io::Error) -> PosixError {
    PosixError::Root {
        path: path.to_path_buf(),
        source,
    }
}

/// Whether a temporary file written by `pid` on `host` (`None`: the older name form, taken as
/// this host's), last modified `age` ago, is a leftover anyone may remove: never this process's
/// own; one of a process that no longer runs on this host at any age; any other (another
/// node's, whose processes this node cannot see) once it is `stale_age` old.
pub(crate) fn temp_is_stale(
    layout: &Layout,
    host: Option<&str>,
    pid: u32,
    age: Duration,
    stale_age: Duration,
) -> bool {
    let local = host.is_none_or(|h| h == layout.host());
    if local && pid == std::process::id() {
        return false;
    }
    (local && !process_alive(pid)) || age >= stale_age
}

/// Walk every root: collect block keys and leaf directories, and remove temporary files that
/// [`temp_is_stale`] calls leftovers.
pub(crate) fn scan(layout: &Layout, stale_age: Duration) -> Result<Scan, PosixError> {
    let now = SystemTime::now();
    let mut out = Scan::default();
    for (ri, root) in layout.roots().iter().enumerate() {
        for top in std::fs::read_dir(root).map_err(|e| io_err(root, e))? {
            let top = top.map_err(|e| io_err(root, e))?;
            let tname = top.file_name();
            let Some(ab) = tname.to_str().and_then(hex2) else {
                continue;
            };
            if !top.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                continue;
            }
            let tpath = top.path();
            for leaf in std::fs::read_dir(&tpath).map_err(|e| io_err(&tpath, e))? {
                let leaf = leaf.map_err(|e| io_err(&tpath, e))?;
                let lname = leaf.file_name();
                let Some(cd) = lname.to_str().and_then(hex2) else {
                    continue;
                };
                if !leaf.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    continue;
                }
                out.dirs.push((ri, u16::from_be_bytes([ab, cd])));
                let lpath = leaf.path();
                let (abs, cds) = (format!("{ab:02x}"), format!("{cd:02x}"));
                for f in std::fs::read_dir(&lpath).map_err(|e| io_err(&lpath, e))? {
                    let f = f.map_err(|e| io_err(&lpath, e))?;
                    let name = f.file_name();
                    let Some(name) = name.to_str() else {
                        continue;
                    };
                    match classify(name, &abs, &cds) {
                        Entry::Block(key) => out.keys.push(key),
                        Entry::Temp { host, pid } => {
                            let age = f
                                .metadata()
                                .and_then(|m| m.modified())
                                .ok()
                                .and_then(|m| now.duration_since(m).ok())
                                .unwrap_or_default();
                            if temp_is_stale(layout, host.as_deref(), pid, age, stale_age) {
                                match std::fs::remove_file(f.path()) {
                                    Ok(()) => out.removed_temps += 1,
                                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                                    Err(e) => return Err(io_err(&f.path(), e)),
                                }
                            }
                        }
                        Entry::Other => {}
                    }
                }
            }
        }
    }
    Ok(out)
}
