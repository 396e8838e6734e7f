//! Sharded stores: an engine with tensor- or pipeline-parallel workers keeps one file per block
//! per shard, in one directory per shard under each root (`root/shard-tp<t>of<T>-pp<p>of<P>/`,
//! see `kvx_posix::shard`), every shard's file named by the logical block's key. A logical block
//! is usable only while every shard of its layout holds its file.
//!
//! `kvx verify` checks each shard directory as a store and reports incomplete blocks (a shard
//! missing) older than the stale age as problems (`--repair` removes the shards left); younger
//! ones may be a store in flight. `kvx gc` removes whole logical blocks: incomplete ones older
//! than the stale age first, then the least recently used (a block's newest shard mtime) until
//! the quota holds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use kvx_core::BlockKey;
use kvx_posix::Shard;
use kvx_posix::maintenance::{
    FileEntry, Kind, MaintenanceError, Progress, Removal, Worker, remove_if_unchanged, walk,
};

/// One logical block of a sharded store: its shard files found.
#[derive(Debug, Clone)]
pub struct ShardedBlock {
    /// The parallel layout (tensor size, pipeline size).
    pub layout: (u32, u32),
    /// The block's key.
    pub key: BlockKey,
    /// The shard files found (at most one per shard).
    pub files: Vec<FileEntry>,
}

impl ShardedBlock {
    /// True when every shard of the layout holds the block.
    pub fn complete(&self) -> bool {
        self.files.len() as u32 == self.layout.0 * self.layout.1
    }

    /// Bytes of all its shard files.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.len).sum()
    }

    /// Its last use: the newest mtime of its shards.
    pub fn modified(&self) -> SystemTime {
        self.files
            .iter()
            .map(|f| f.modified)
            .max()
            .unwrap_or(SystemTime::UNIX_EPOCH)
    }

    /// Time since its last use.
    pub fn age(&self, now: SystemTime) -> Duration {
        now.duration_since(self.modified()).unwrap_or_default()
    }
}

/// The shard directories under `root` (empty for a store of one worker), listed on a
/// [`Worker`] within `deadline` (a frozen mount ends the run with an error, never a hang).
pub fn shard_dirs(
    root: &Path,
    deadline: Duration,
) -> Result<Vec<(Shard, PathBuf)>, MaintenanceError> {
    let mut worker = Worker::spawn(deadline)?;
    let owned = root.to_path_buf();
    worker
        .run("list", root, move || kvx_posix::shard::shard_dirs(&owned))?
        .map_err(|source| MaintenanceError::Io {
            op: "list",
            path: root.to_path_buf(),
            source,
        })
}

/// Every logical block of the shard directories `dirs`, grouped by layout and key.
pub fn blocks(
    dirs: &[(Shard, PathBuf)],
    worker: &mut Worker,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<ShardedBlock>, MaintenanceError> {
    let mut by: BTreeMap<((u32, u32), BlockKey), Vec<FileEntry>> = BTreeMap::new();
    for (s, dir) in dirs {
        for e in walk(dir, worker, progress)? {
            if let Kind::Block(key) = e.kind
                && e.id.is_some()
            {
                by.entry((s.layout(), key)).or_default().push(e);
            }
        }
    }
    Ok(by
        .into_iter()
        .map(|((layout, key), files)| ShardedBlock { layout, key, files })
        .collect())
}

/// What became of one shard file: `None` in a dry run, `Err` with the error of a failed removal.
pub type Outcome = Result<Option<Removal>, String>;

/// Remove a block's shard files (each only if unchanged since the walk; nothing in a dry run):
/// the outcome of each, `Err` with the error for a removal that failed.
pub fn remove(
    worker: &mut Worker,
    b: &ShardedBlock,
    dry_run: bool,
) -> Result<Vec<(PathBuf, Outcome)>, MaintenanceError> {
    let mut out = Vec::new();
    for f in &b.files {
        let Some(id) = f.id.filter(|_| !dry_run) else {
            out.push((f.path.clone(), Ok(None)));
            continue;
        };
        let (path, modified) = (f.path.clone(), f.modified);
        let r = worker.run("remove", &f.path, move || {
            remove_if_unchanged(&path, id, Some(modified))
        })?;
        out.push((f.path.clone(), r.map(Some).map_err(|e| e.to_string())));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_group_shards_and_see_a_missing_one() {
        let d = tempfile::tempdir().unwrap();
        let keys = [BlockKey(0xab << 120 | 1), BlockKey(0xcd << 120 | 2)];
        for s in Shard::all(2, 1) {
            for (i, k) in keys.iter().enumerate() {
                if s.tp_rank == 1 && i == 1 {
                    continue; // rank 1 never wrote the second block
                }
                let hex = k.to_hex();
                let dir = d.path().join(s.dir_name()).join(&hex[..2]);
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(dir.join(format!("{hex}.kvb")), [0u8; 10]).unwrap();
            }
        }
        let dirs = shard_dirs(d.path(), Duration::from_secs(5)).unwrap();
        assert_eq!(dirs.len(), 2);
        let mut w = Worker::spawn(Duration::from_secs(5)).unwrap();
        let found = blocks(&dirs, &mut w, &mut |_| {}).unwrap();
        assert_eq!(found.len(), 2);
        assert!(found[0].complete() && found[0].bytes() == 20);
        assert!(!found[1].complete());
        let gone = remove(&mut w, &found[1], false).unwrap();
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].1, Ok(Some(Removal::Removed)));
        assert_eq!(blocks(&dirs, &mut w, &mut |_| {}).unwrap().len(), 1);
    }
}
