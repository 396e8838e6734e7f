//! Walk a store's tree (`root/ab/<file>`) and sort what is there: blocks, temporary files,
//! misnamed `.kvb` files (the blocks of the older two-level layout `root/ab/cd/` among them:
//! no store reads them), and files that are not kvx's.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use kvx_core::BlockKey;

use super::files::{self, FileId, Stat};
use super::{MaintenanceError, Phase, Progress, Worker};
use crate::paths::{BLOCK_SUFFIX, Entry, TEMP_SUFFIX, classify};
use crate::store::index::hex2;

/// What a file in a leaf directory is, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `<32 hex>.kvb` in the directory its key prefix names.
    Block(BlockKey),
    /// `*.kvb.tmp`: a block being written, or the leftover of a writer that died.
    Temp,
    /// A `.kvb` name that is not a block's name in this directory (or a block of the older
    /// two-level layout): no store ever reads it.
    Misnamed,
    /// Not a kvx name: left alone.
    Unknown,
}

/// One file found by the walk.
#[derive(Debug, Clone)]
pub struct FileEntry {
    /// Its path.
    pub path: PathBuf,
    /// What its name says it is.
    pub kind: Kind,
    /// Which file the path named (`None` when `lstat` failed).
    pub id: Option<FileId>,
    /// Its length in bytes.
    pub len: u64,
    /// Its modification time: for a block, when it was stored or last loaded.
    pub modified: SystemTime,
}

impl FileEntry {
    /// Time since the last modification (zero for a time in the future).
    pub fn age(&self, now: SystemTime) -> Duration {
        now.duration_since(self.modified).unwrap_or_default()
    }
}

/// Classify `name`, found in fan-out directory `ab` (`None`: in a directory of the older
/// two-level layout, where no block is read). Any `*.kvb.tmp` is a temporary file, whatever the
/// writer's tag (`<pid>-<seq>` or `<host>-<pid>-<seq>`).
pub fn kind_of(name: &str, ab: Option<&str>) -> Kind {
    if name.ends_with(TEMP_SUFFIX) {
        return Kind::Temp;
    }
    let entry = ab.map_or(Entry::Other, |ab| classify(name, ab));
    match entry {
        Entry::Block(key) if name == format!("{}{BLOCK_SUFFIX}", key.to_hex()) => Kind::Block(key),
        _ if name.ends_with(BLOCK_SUFFIX) => Kind::Misnamed,
        _ => Kind::Unknown,
    }
}

/// Every file in the fan-out directories (`ab`, two lowercase hex digits) under `root`, and in
/// the directories of the older layout inside them (`ab/cd`), listed through `worker`. Files
/// and directories outside that layout are not visited.
pub fn walk(
    root: &Path,
    worker: &mut Worker,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<FileEntry>, MaintenanceError> {
    let mut out = Vec::new();
    let mut dirs = 0u64;
    let tops = list(worker, "list", root, files::list_subdirs)?;
    for ab in tops.iter().filter(|n| hex2(n).is_some()) {
        let top = root.join(ab);
        let mut leaves = vec![(top.clone(), Some(ab.as_str()))];
        match list(worker, "list", &top, files::list_subdirs) {
            Err(MaintenanceError::Io { source, .. }) if gone(&source) => continue,
            r => leaves.extend(
                r?.into_iter()
                    .filter(|cd| hex2(cd).is_some())
                    .map(|cd| (top.join(cd), None)),
            ),
        }
        for (leaf, ab) in leaves {
            let found = match list(worker, "list and stat", &leaf, files::list_files) {
                Err(MaintenanceError::Io { source, .. }) if gone(&source) => continue,
                r => r?,
            };
            for (path, stat) in found {
                let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                let kind = kind_of(name, ab);
                out.push(entry(path, kind, stat));
            }
            dirs += 1;
            progress(Progress {
                phase: Phase::Walk,
                done: dirs,
                total: None,
            });
        }
    }
    Ok(out)
}

fn gone(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound
}

fn entry(path: PathBuf, kind: Kind, stat: Option<Stat>) -> FileEntry {
    FileEntry {
        path,
        kind,
        id: stat.map(|s| s.id),
        len: stat.map_or(0, |s| s.len),
        modified: stat.map_or(SystemTime::UNIX_EPOCH, |s| s.modified),
    }
}

fn list<T: Send + 'static>(
    worker: &mut Worker,
    op: &'static str,
    dir: &Path,
    f: fn(&Path) -> std::io::Result<T>,
) -> Result<T, MaintenanceError> {
    let owned = dir.to_path_buf();
    worker
        .run(op, dir, move || f(&owned))?
        .map_err(|source| MaintenanceError::Io {
            op,
            path: dir.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_sorted_by_kind() {
        let key = BlockKey(0xabcd_0000_0000_0000_0000_0000_0000_1234u128);
        let hex = key.to_hex();
        assert_eq!(kind_of(&format!("{hex}.kvb"), Some("ab")), Kind::Block(key));
        assert_eq!(kind_of(&format!("{hex}.kvb"), Some("ac")), Kind::Misnamed);
        // A block of the older two-level layout is read by no store.
        assert_eq!(kind_of(&format!("{hex}.kvb"), None), Kind::Misnamed);
        let upper = hex.to_uppercase();
        assert_eq!(kind_of(&format!("{upper}.kvb"), Some("ab")), Kind::Misnamed);
        assert_eq!(kind_of("junk.kvb", Some("ab")), Kind::Misnamed);
        for t in [
            format!("{hex}.123-4.kvb.tmp"),
            format!("{hex}.node-7-123-4.kvb.tmp"),
            "anything.kvb.tmp".to_string(),
        ] {
            assert_eq!(kind_of(&t, Some("ab")), Kind::Temp, "{t}");
        }
        assert_eq!(kind_of("notes.txt", Some("ab")), Kind::Unknown);
    }
}
