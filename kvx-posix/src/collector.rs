//! The collector of a shared mount: keeps each root under a byte quota by removing the least
//! recently used blocks, and removes other nodes' crash leftovers.
//!
//! Recency is the block file's mtime: a store sets it when it renames the block into place, and
//! every successful load sets it to now on the touch lane ([`crate::SharedMount::touch_on_load`]),
//! so the order is the same on every node that looks. Any node may run a collector, several at
//! once: each walks the roots, sorts the blocks by mtime and removes the oldest until the root
//! is under its quota. Two collectors pick the same oldest blocks; a remove of a file that is
//! already gone is a success. (Two collectors that finish their walks far apart may together
//! remove a little more than needed; never a block newer than one they both kept.)
//!
//! Block removes go through the engine's maintenance lane (a header read first: a block of
//! another format version is never deleted, so a root holding such blocks stays over its quota
//! by their size, and [`CollectReport::removed`] counts them as queued), a few at a time, so they never take a load's or a
//! store's place and never crowd out the lane's probes. The walk itself (readdir and stat) runs
//! on the collector's own thread: a stuck mount stalls that thread only.
//!
//! Each pass that walks every root to the end publishes what it saw ([`Listing`],
//! [`PosixHandle::listing`]): the blocks present, less those it queued for removal. A node's
//! index entry taken before the walk began and absent from it was removed by another node
//! meanwhile; the node's scheduler forgets it, so its lookups never claim a block that a load
//! would then not find.
//!
//! A block removed while another node reads it: the reader opened the file before the unlink
//! and reads the old inode to the end (local file systems, and NFS within one client thanks to
//! its silly rename), or opens after it and gets a miss. Across NFS clients a reader may get
//! `ESTALE` instead (GlusterFS: `ESTALE`, or `ENOENT` from a read of the open file), which the
//! load takes as a miss too; it never gets a mix of two files, because every load verifies
//! the header and the payload checksum.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use kvx_core::BlockKey;
use rustc_hash::FxHashSet;

use crate::error::PosixError;
use crate::io::MAINTENANCE_DEPTH;
use crate::paths::Entry;
pub use crate::shared_mount::listing::Listing;
use crate::store::handle::PosixHandle;
use crate::store::index::{remove_stale_temp, visit_leaves};

/// Settings of a collector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectorConfig {
    /// Most bytes of block files each root may hold (headers included).
    pub quota_bytes: u64,
    /// Time between two passes of [`Collector::spawn`]; default 5 s.
    pub interval: Duration,
    /// A temporary file of another node (or of a dead process of this one) older than this is a
    /// leftover and removed; default 10 min.
    pub stale_temp_age: Duration,
}

impl CollectorConfig {
    /// A collector keeping each root under `quota_bytes`, with the default interval and age.
    pub fn new(quota_bytes: u64) -> CollectorConfig {
        CollectorConfig {
            quota_bytes,
            interval: Duration::from_secs(5),
            stale_temp_age: Duration::from_secs(600),
        }
    }

    /// Check the settings; the error names the bad field.
    pub fn validate(&self) -> Result<(), PosixError> {
        if self.interval.is_zero() {
            return Err(PosixError::BadConfig(
                "collector.interval must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// What one pass found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CollectReport {
    /// Block files found.
    pub blocks: usize,
    /// Their bytes, before the pass.
    pub bytes: u64,
    /// Blocks queued for removal (oldest first).
    pub removed: Vec<BlockKey>,
    /// Bytes of those blocks.
    pub removed_bytes: u64,
    /// Stale temporary files removed.
    pub removed_temps: usize,
}

#[derive(Clone)]
struct Found {
    key: BlockKey,
    bytes: u64,
    mtime: SystemTime,
}

impl PosixHandle {
    /// One collector pass over every root (see [`crate::collector`]): remove stale temporary
    /// files, then queue removes of the least recently used blocks until each root is under
    /// `cfg.quota_bytes`. Blocks on the walk; returns once every remove is queued. `stop` ends
    /// the pass early.
    pub fn collect(
        &self,
        cfg: &CollectorConfig,
        stop: &AtomicBool,
    ) -> Result<CollectReport, PosixError> {
        cfg.validate()?;
        let layout = &self.state.layout;
        let started = Instant::now();
        let now = SystemTime::now();
        let mut report = CollectReport::default();
        let mut found: Vec<Vec<Found>> = vec![Vec::new(); layout.roots().len()];
        visit_leaves(
            layout,
            |_, _| {},
            |root, f, entry| {
                let Ok(meta) = f.metadata() else {
                    return Ok(()); // gone meanwhile
                };
                let mtime = meta.modified().unwrap_or(now);
                match entry {
                    Entry::Block(key) => found[root].push(Found {
                        key,
                        bytes: meta.len(),
                        mtime,
                    }),
                    Entry::Temp { host, pid } => {
                        report.removed_temps += remove_stale_temp(
                            f,
                            host.as_deref(),
                            pid,
                            Some(mtime),
                            layout,
                            now,
                            cfg.stale_temp_age,
                        )?;
                    }
                    Entry::Other => {}
                }
                Ok(())
            },
        )?;
        let mut present: FxHashSet<BlockKey> = FxHashSet::default();
        for mut blocks in found {
            let mut total: u64 = blocks.iter().map(|f| f.bytes).sum();
            report.blocks += blocks.len();
            report.bytes += total;
            blocks.sort_by_key(|f| f.mtime);
            let mut kept = blocks.into_iter();
            for f in kept.by_ref() {
                if total <= cfg.quota_bytes || stop.load(Ordering::Acquire) {
                    present.insert(f.key);
                    break;
                }
                self.wait_for_lane(stop);
                self.remove(f.key);
                total = total.saturating_sub(f.bytes);
                report.removed_bytes += f.bytes;
                report.removed.push(f.key);
            }
            present.extend(kept.map(|f| f.key));
        }
        self.publish_listing(started, present);
        Ok(report)
    }

    /// Keep `keys`, what the walk that began at `started` found, as the newest listing.
    fn publish_listing(&self, started: Instant, keys: FxHashSet<BlockKey>) {
        let mut slot = kvx_core::sync::lock(&self.state.listing);
        let pass = slot.as_ref().map_or(0, |l| l.pass) + 1;
        *slot = Some(Arc::new(Listing {
            pass,
            started,
            keys: Arc::new(keys),
        }));
    }

    /// The newest complete listing of the mount a collector pass on this store made (`None`
    /// before the first).
    pub fn listing(&self) -> Option<Arc<Listing>> {
        kvx_core::sync::lock(&self.state.listing).clone()
    }

    /// Wait until the maintenance lane has room for another remove without delaying probes.
    fn wait_for_lane(&self, stop: &AtomicBool) {
        while self.state.io_engine.snapshot().maintenance >= MAINTENANCE_DEPTH
            && !stop.load(Ordering::Acquire)
        {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// A collector running passes on a thread of its own until dropped.
#[must_use = "a collector stops when dropped"]
pub struct Collector {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Collector {
    /// Run a pass every `cfg.interval` on a new thread.
    pub fn spawn(handle: PosixHandle, cfg: CollectorConfig) -> Result<Collector, PosixError> {
        cfg.validate()?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvx-posix-collector".into())
            .spawn(move || {
                while !s.load(Ordering::Acquire) {
                    let started = Instant::now();
                    match handle.collect(&cfg, &s) {
                        Ok(r) if !r.removed.is_empty() || r.removed_temps > 0 => {
                            tracing::info!(
                                removed = r.removed.len(),
                                bytes = r.removed_bytes,
                                temps = r.removed_temps,
                                "posix: collector pass"
                            );
                        }
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "posix: collector pass failed"),
                    }
                    while !s.load(Ordering::Acquire) && started.elapsed() < cfg.interval {
                        std::thread::sleep(Duration::from_millis(10).min(cfg.interval));
                    }
                }
            })
            .map_err(|e| PosixError::Engine {
                engine: "collector",
                msg: format!("cannot start the collector thread: {e}"),
            })?;
        Ok(Collector {
            stop,
            thread: Some(thread),
        })
    }

    /// Stop after the current pass (does not wait for it).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.stop();
        // A pass stuck in the walk of a frozen mount would hang a join: detach it.
        if let Some(t) = self.thread.take()
            && t.is_finished()
        {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{HEADER_LEN, encode_header};
    use crate::{PosixConfig, PosixStore};
    use std::path::PathBuf;

    fn set_mtime(path: &std::path::Path, secs_ago: u64) {
        let t = SystemTime::now() - Duration::from_secs(secs_ago);
        let f = std::fs::File::options().write(true).open(path).unwrap();
        f.set_modified(t).unwrap();
    }

    fn write_block(h: &PosixHandle, key: BlockKey, secs_ago: u64) -> PathBuf {
        let payload = vec![key.0 as u8; 4096];
        let mut file = vec![0u8; HEADER_LEN];
        encode_header(&mut file, key, &payload, 1);
        file.extend_from_slice(&payload);
        let p = h.block_path(key);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, file).unwrap();
        set_mtime(&p, secs_ago);
        p
    }

    fn wait_gone(p: &std::path::Path) -> bool {
        let end = Instant::now() + Duration::from_secs(10);
        while p.exists() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(2));
        }
        !p.exists()
    }

    #[test]
    fn oldest_blocks_go_first_until_under_quota() {
        let dir = tempfile::tempdir().unwrap();
        let store = PosixStore::open(PosixConfig::new(dir.path())).unwrap();
        let h = store.handle();
        // Keys 1..=4, key 1 the least recently used.
        let paths: Vec<PathBuf> = (1..=4u128)
            .map(|i| write_block(&h, BlockKey(i << 100 | i), 100 - i as u64 * 10))
            .collect();
        let size = std::fs::metadata(&paths[0]).unwrap().len();
        let stop = AtomicBool::new(false);
        let r = h.collect(&CollectorConfig::new(2 * size), &stop).unwrap();
        assert_eq!(r.blocks, 4);
        assert_eq!(
            r.removed,
            vec![BlockKey(1 << 100 | 1), BlockKey(2 << 100 | 2)]
        );
        assert!(wait_gone(&paths[0]) && wait_gone(&paths[1]));
        assert!(paths[2].exists() && paths[3].exists());
        // A second collector on the same state finds nothing to do; a remove of a file that
        // is already gone would have been a success anyway.
        let again = h.collect(&CollectorConfig::new(2 * size), &stop).unwrap();
        assert!(again.removed.is_empty());
        assert_eq!(again.bytes, 2 * size);
    }

    #[test]
    fn a_pass_publishes_the_blocks_it_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = PosixStore::open(PosixConfig::new(dir.path())).unwrap();
        let h = store.handle();
        assert!(h.listing().is_none(), "no pass yet");
        let keys: Vec<BlockKey> = (1..=4u128).map(|i| BlockKey(i << 100 | i)).collect();
        let paths: Vec<PathBuf> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| write_block(&h, *k, 100 - i as u64 * 10))
            .collect();
        let size = std::fs::metadata(&paths[0]).unwrap().len();
        let stop = AtomicBool::new(false);
        let before = Instant::now();
        h.collect(&CollectorConfig::new(2 * size), &stop).unwrap();
        let first = h.listing().expect("a complete pass publishes a listing");
        assert_eq!(first.pass, 1);
        assert!(first.started >= before && first.started <= Instant::now());
        let mut kept: Vec<BlockKey> = first.keys.iter().copied().collect();
        kept.sort();
        assert_eq!(
            kept,
            keys[2..].to_vec(),
            "the two it removed are not listed"
        );
        // Another node removes a block: the next pass no longer lists it.
        assert!(wait_gone(&paths[0]) && wait_gone(&paths[1]));
        std::fs::remove_file(&paths[2]).unwrap();
        h.collect(&CollectorConfig::new(2 * size), &stop).unwrap();
        let second = h.listing().unwrap();
        assert_eq!(second.pass, 2);
        assert!(second.started >= first.started);
        assert_eq!(second.keys.len(), 1);
        assert!(second.keys.contains(&keys[3]));
    }

    #[test]
    fn stale_temporaries_of_any_node_go_by_age() {
        let dir = tempfile::tempdir().unwrap();
        let store = PosixStore::open(PosixConfig::new(dir.path())).unwrap();
        let h = store.handle();
        let key = BlockKey(0xabcd << 112 | 5);
        let leaf = h.block_path(key).parent().unwrap().to_path_buf();
        std::fs::create_dir_all(&leaf).unwrap();
        let hex = key.to_hex();
        let me = std::process::id();
        let host = crate::paths::host_tag();
        let make = |name: String, secs_ago: u64| {
            let p = leaf.join(name);
            std::fs::write(&p, b"partial").unwrap();
            set_mtime(&p, secs_ago);
            p
        };
        let old_foreign = make(format!("{hex}.otherhost-{me}-1.kvb.tmp"), 700);
        let new_foreign = make(format!("{hex}.otherhost-{me}-2.kvb.tmp"), 5);
        let old_form_old = make(format!("{hex}.{me}-3.kvb.tmp"), 700);
        let mine_old = make(format!("{hex}.{host}-{me}-4.kvb.tmp"), 700);
        let foreign_file = make(format!("{hex}.notes"), 700);
        let stop = AtomicBool::new(false);
        let r = h.collect(&CollectorConfig::new(u64::MAX), &stop).unwrap();
        assert_eq!(r.removed_temps, 1, "only the old one of another node");
        assert!(!old_foreign.exists());
        assert!(new_foreign.exists(), "another node may still be writing it");
        assert!(
            old_form_old.exists(),
            "this (live) process's, in the old form"
        );
        assert!(mine_old.exists(), "this process's own");
        assert!(foreign_file.exists(), "not a kvx name: left alone");
    }
}
