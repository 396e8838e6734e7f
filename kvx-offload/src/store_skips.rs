//! Blocks a store put in no tier, counted by reason: the connector's stats, and kvx-core's
//! `kvx_store_skipped_blocks_total` counter.

use std::collections::BTreeMap;

use kvx_core::BlockError;
use kvx_core::metrics::{failure_reason, record_store_skipped};

/// Counts of blocks stored in no tier, by reason.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StoreSkips(BTreeMap<&'static str, u64>);

impl StoreSkips {
    /// The reason of a block no tier had room for (every block pinned by a load or being
    /// stored).
    pub const NO_ROOM: &'static str = "no_room";

    /// Count `blocks` more blocks skipped for `reason`.
    pub fn record(&mut self, reason: &'static str, blocks: usize) {
        if blocks == 0 {
            return;
        }
        *self.0.entry(reason).or_default() += blocks as u64;
        record_store_skipped(reason, blocks as u64);
    }

    /// Count one block whose last store failed with `error` (for its
    /// [`failure_reason`]).
    pub fn record_failure(&mut self, error: &BlockError) {
        self.record(failure_reason(error), 1);
    }

    /// Blocks skipped for `reason` so far.
    pub fn get(&self, reason: &str) -> u64 {
        self.0.get(reason).copied().unwrap_or(0)
    }

    /// Every reason counted so far, with its blocks.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        self.0.iter().map(|(r, n)| (*r, *n))
    }
}
