//! Recycled block files wait for the loads that may still read them (see `crate::spare`).
//!
//! A load opens its block file by name, then reads it. A remove that recycles the file moves
//! it into the spare folder, where a store will overwrite it. A load that opened the file
//! before the move would then read another block's bytes: its checksum fails it, so no wrong
//! data comes back, but a block that was good when the load started is lost. So the store
//! counts its loads in flight per key, and holds a recycled file of a key with loads in flight
//! back from the spares until the last of them has returned.

use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

use kvx_core::BlockKey;
use rustc_hash::FxHashMap;

use crate::job::{BlockJob, FileOp};
use crate::spare::Spares;

/// Loads in flight per key, and the recycled files waiting for them.
#[derive(Default)]
pub(crate) struct Recycling {
    loading: FxHashMap<BlockKey, u32>,
    /// Key, root and spare name of each recycled file held back.
    held: Vec<(BlockKey, usize, CString)>,
}

impl Recycling {
    /// A load job of `key` was handed to the engine.
    pub(crate) fn load_started(&mut self, key: BlockKey) {
        *self.loading.entry(key).or_default() += 1;
    }

    /// A job came back from the engine: a load's reads are over; a remove may have recycled
    /// its file (counted in `recycled` before it can show among the spares).
    pub(crate) fn job_returned(
        &mut self,
        job: &mut BlockJob,
        spares: &Spares,
        recycled: &AtomicU64,
    ) {
        match job.action() {
            FileOp::Load => self.load_ended(job.core.key, spares),
            FileOp::Remove => match job.take_recycle() {
                Some((name, true)) => {
                    recycled.fetch_add(1, Ordering::Relaxed);
                    self.recycled(job.core.key, job.core.root, name, spares);
                }
                Some((_, false)) => spares.release(job.core.root),
                None => {}
            },
            FileOp::Store | FileOp::Probe => {}
        }
    }

    /// A load job of `key` came back from the engine: its reads are over.
    fn load_ended(&mut self, key: BlockKey, spares: &Spares) {
        let Some(n) = self.loading.get_mut(&key) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        self.loading.remove(&key);
        if self.held.is_empty() {
            return;
        }
        let (free, held) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|h| h.0 == key);
        self.held = held;
        for (_, root, name) in free {
            spares.put(root, name);
        }
    }

    /// A remove moved `key`'s file to the spare name `name` of `root`: a spare now, or once
    /// the loads of `key` in flight have returned.
    fn recycled(&mut self, key: BlockKey, root: usize, name: CString, spares: &Spares) {
        if self.loading.contains_key(&key) {
            self.held.push((key, root, name));
        } else {
            spares.put(root, name);
        }
    }
}
