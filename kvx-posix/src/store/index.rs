//! The in-memory index of blocks present, and the startup scan that rebuilds it.

use std::path::Path;
use std::sync::RwLock;
use std::time::{Duration, SystemTime};

use kvx_core::BlockKey;
use rustc_hash::FxHashSet;

use crate::error::PosixError;
use crate::paths::{Entry, Layout, classify};
use kvx_core::sync::{read, write};

/// Keys of the blocks the store holds.
#[derive(Debug, Default)]
pub(crate) struct Index {
    keys: RwLock<FxHashSet<BlockKey>>,
}

impl Index {
    /// How many of `keys`, from the first, are present.
    pub(crate) fn lookup(&self, keys: &[BlockKey]) -> usize {
        let k = read(&self.keys);
        keys.iter().take_while(|key| k.contains(key)).count()
    }

    /// Whether `key` is present.
    pub(crate) fn contains(&self, key: BlockKey) -> bool {
        read(&self.keys).contains(&key)
    }

    /// Blocks present.
    pub(crate) fn len(&self) -> usize {
        read(&self.keys).len()
    }

    /// True when no block is present.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Record `key` as present.
    pub(crate) fn insert(&self, key: BlockKey) {
        write(&self.keys).insert(key);
    }

    /// Forget `key`; true if it was present.
    pub(crate) fn remove(&self, key: BlockKey) -> bool {
        write(&self.keys).remove(&key)
    }

    /// Record many keys.
    pub(crate) fn extend(&self, keys: impl IntoIterator<Item = BlockKey>) {
        write(&self.keys).extend(keys);
    }

    /// Every key (for tests and tools).
    pub(crate) fn keys(&self) -> Vec<BlockKey> {
        read(&self.keys).iter().copied().collect()
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
    let mut removed_temps = 0;
    visit_leaves(
        layout,
        |root, prefix| out.dirs.push((root, prefix)),
        |_, f, entry| {
            match entry {
                Entry::Block(key) => out.keys.push(key),
                Entry::Temp { host, pid } => {
                    let modified = f.metadata().and_then(|m| m.modified()).ok();
                    removed_temps += remove_stale_temp(
                        f,
                        host.as_deref(),
                        pid,
                        modified,
                        layout,
                        now,
                        stale_age,
                    )?;
                }
                Entry::Other => {}
            }
            Ok(())
        },
    )?;
    out.removed_temps = removed_temps;
    Ok(out)
}

/// Visit every root's fan-out directories (`root/ab/`, two lowercase hex digits) and the files
/// in them, classified by name: `on_leaf(root index, fan-out byte)` for each directory, then
/// `on_file` for each file. Directories inside a fan-out directory (the older two-level layout)
/// are not visited: a warning names the first one.
pub(crate) fn visit_leaves(
    layout: &Layout,
    mut on_leaf: impl FnMut(usize, u16),
    mut on_file: impl FnMut(usize, &std::fs::DirEntry, Entry) -> Result<(), PosixError>,
) -> Result<(), PosixError> {
    let mut warned = false;
    for (ri, root) in layout.roots().iter().enumerate() {
        for (ab, lpath) in hex_subdirs(root, true)? {
            on_leaf(ri, u16::from(ab));
            let abs = format!("{ab:02x}");
            let files = match std::fs::read_dir(&lpath) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                r => r.map_err(|e| io_err(&lpath, e))?,
            };
            for f in files {
                let f = f.map_err(|e| io_err(&lpath, e))?;
                let name = f.file_name();
                let Some(name) = name.to_str() else {
                    continue;
                };
                if !warned && hex2(name).is_some() && f.file_type().is_ok_and(|t| t.is_dir()) {
                    warned = true;
                    tracing::warn!(dir = ?f.path(),
                        "posix: blocks of the older two-level layout are not used; `kvx verify --repair` removes them");
                }
                on_file(ri, &f, classify(name, &abs))?;
            }
        }
    }
    Ok(())
}

/// The fan-out subdirectories of `dir` with their values; a `dir` that is gone is empty
/// unless it `must_exist` (a root).
fn hex_subdirs(dir: &Path, must_exist: bool) -> Result<Vec<(u8, std::path::PathBuf)>, PosixError> {
    let entries = match std::fs::read_dir(dir) {
        Err(e) if !must_exist && e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        r => r.map_err(|e| io_err(dir, e))?,
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e.map_err(|e| io_err(dir, e))?;
        let name = e.file_name();
        let Some(v) = name.to_str().and_then(hex2) else {
            continue;
        };
        if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            out.push((v, e.path()));
        }
    }
    Ok(out)
}

/// Remove the temporary file `f` (written by `pid` on `host`, last modified `modified`) if
/// [`temp_is_stale`] calls it a leftover at `now` with `stale_age`; 1 if removed (a file
/// already gone counts as not removed), else 0.
pub(crate) fn remove_stale_temp(
    f: &std::fs::DirEntry,
    host: Option<&str>,
    pid: u32,
    modified: Option<SystemTime>,
    layout: &Layout,
    now: SystemTime,
    stale_age: Duration,
) -> Result<usize, PosixError> {
    let age = modified
        .and_then(|m| now.duration_since(m).ok())
        .unwrap_or_default();
    if !temp_is_stale(layout, host, pid, age, stale_age) {
        return Ok(0);
    }
    match std::fs::remove_file(f.path()) {
        Ok(()) => Ok(1),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(io_err(&f.path(), e)),
    }
}
