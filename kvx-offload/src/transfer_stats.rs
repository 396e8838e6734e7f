//! What the connector moved since its stats were last taken, for an engine's own stats (vLLM's
//! `get_kv_connector_stats`): each half counts what it sees and hands the counts out with
//! [`TransferStats::take`]. A worker half counts the blocks and bytes it copied, its failures
//! and its loads' latencies (the engine sums its workers); the scheduler half counts the
//! blocks no tier had room for.

use std::collections::BTreeMap;
use std::time::Duration;

use kvx_core::Direction;

/// Counts since the last [`TransferStats::take`]. Maps are keyed by tier (`host`, `file`,
/// `remote`), or by (tier, reason) where blocks failed; reasons are kvx-core's
/// [`failure_reason`](kvx_core::metrics::failure_reason)s, `timed_out` being a missed
/// deadline.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct TransferStats {
    /// Blocks copied into engine memory, by the tier they came from.
    pub loaded_blocks: BTreeMap<&'static str, u64>,
    /// Blocks a load did not bring, by tier and reason.
    pub load_failed_blocks: BTreeMap<(&'static str, &'static str), u64>,
    /// Bytes copied into engine memory, by tier.
    pub loaded_bytes: BTreeMap<&'static str, u64>,
    /// Blocks stored, by the tier that took them.
    pub stored_blocks: BTreeMap<&'static str, u64>,
    /// Blocks a tier's store did not take, by tier and reason.
    pub store_failed_blocks: BTreeMap<(&'static str, &'static str), u64>,
    /// Bytes stored, by tier.
    pub stored_bytes: BTreeMap<&'static str, u64>,
    /// Blocks stored in no tier, by reason (see [`crate::StoreSkips`]).
    pub store_skipped_blocks: BTreeMap<&'static str, u64>,
    /// Each load's time from its start to its verdict, in seconds (at most
    /// [`TransferStats::MAX_LATENCIES`] per interval: an engine that never takes its stats
    /// keeps a bounded list).
    pub load_seconds: Vec<f64>,
}

impl TransferStats {
    /// Most load latencies kept between two takes; later ones are not noted.
    pub const MAX_LATENCIES: usize = 4096;

    /// The counts so far; the next ones start from zero.
    pub fn take(&mut self) -> TransferStats {
        std::mem::take(self)
    }

    /// True when nothing was counted.
    pub fn is_empty(&self) -> bool {
        *self == TransferStats::default()
    }

    /// Count a job's blocks on `tier` in direction `dir`: `ok` of them moved (`bytes` in all)
    /// and the reasons of those that were not.
    pub fn record(
        &mut self,
        dir: Direction,
        tier: &'static str,
        ok: u64,
        failed: impl IntoIterator<Item = &'static str>,
        bytes: u64,
    ) {
        let (blocks, bytes_by_tier, failures) = match dir {
            Direction::Load => (
                &mut self.loaded_blocks,
                &mut self.loaded_bytes,
                &mut self.load_failed_blocks,
            ),
            Direction::Store => (
                &mut self.stored_blocks,
                &mut self.stored_bytes,
                &mut self.store_failed_blocks,
            ),
        };
        add(blocks, tier, ok);
        add(bytes_by_tier, tier, bytes);
        for reason in failed {
            add(failures, (tier, reason), 1);
        }
    }

    /// Count `blocks` stored in no tier for `reason`.
    pub fn skipped(&mut self, reason: &'static str, blocks: u64) {
        add(&mut self.store_skipped_blocks, reason, blocks);
    }

    /// Add `other`'s counts (a scheduler half's skips to its worker half's transfers); its
    /// latencies are kept up to [`TransferStats::MAX_LATENCIES`].
    pub fn merge(&mut self, other: TransferStats) {
        for (map, from) in [
            (&mut self.loaded_blocks, other.loaded_blocks),
            (&mut self.loaded_bytes, other.loaded_bytes),
            (&mut self.stored_blocks, other.stored_blocks),
            (&mut self.stored_bytes, other.stored_bytes),
            (&mut self.store_skipped_blocks, other.store_skipped_blocks),
        ] {
            for (k, n) in from {
                add(map, k, n);
            }
        }
        for (map, from) in [
            (&mut self.load_failed_blocks, other.load_failed_blocks),
            (&mut self.store_failed_blocks, other.store_failed_blocks),
        ] {
            for (k, n) in from {
                add(map, k, n);
            }
        }
        let room = Self::MAX_LATENCIES.saturating_sub(self.load_seconds.len());
        self.load_seconds
            .extend(other.load_seconds.into_iter().take(room));
    }

    /// Note one load's latency.
    pub fn load_took(&mut self, took: Duration) {
        if self.load_seconds.len() < Self::MAX_LATENCIES {
            self.load_seconds.push(took.as_secs_f64());
        }
    }
}

fn add<K: Ord>(map: &mut BTreeMap<K, u64>, key: K, n: u64) {
    if n > 0 {
        *map.entry(key).or_default() += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_tier_and_reason_and_take_starts_again() {
        let mut s = TransferStats::default();
        assert!(s.is_empty());
        s.record(
            Direction::Load,
            "file",
            3,
            ["timed_out", "not_found"],
            3 << 20,
        );
        s.record(Direction::Load, "file", 1, ["timed_out"], 1 << 20);
        s.record(Direction::Store, "host", 2, [], 2 << 20);
        s.skipped("no_room", 0);
        s.skipped("no_room", 4);
        s.load_took(Duration::from_millis(250));
        assert_eq!(s.loaded_blocks.get("file"), Some(&4));
        assert_eq!(s.load_failed_blocks.get(&("file", "timed_out")), Some(&2));
        assert_eq!(s.load_failed_blocks.get(&("file", "not_found")), Some(&1));
        assert_eq!(s.loaded_bytes.get("file"), Some(&(4 << 20)));
        assert_eq!(s.stored_blocks.get("host"), Some(&2));
        assert_eq!(s.store_skipped_blocks.get("no_room"), Some(&4));
        assert_eq!(s.load_seconds, vec![0.25]);
        let taken = s.take();
        assert!(s.is_empty(), "take leaves nothing behind");
        assert!(!taken.is_empty());
        assert_eq!(taken.loaded_blocks.get("file"), Some(&4));
    }

    #[test]
    fn latencies_kept_between_takes_are_bounded() {
        let mut s = TransferStats::default();
        for _ in 0..TransferStats::MAX_LATENCIES + 10 {
            s.load_took(Duration::from_millis(1));
        }
        assert_eq!(s.load_seconds.len(), TransferStats::MAX_LATENCIES);
        s.take();
        s.load_took(Duration::from_millis(1));
        assert_eq!(s.load_seconds.len(), 1);
    }

    #[test]
    fn merge_adds_counts_and_keeps_latencies_bounded() {
        let mut a = TransferStats::default();
        a.record(Direction::Load, "file", 2, ["timed_out"], 2 << 20);
        a.load_took(Duration::from_millis(5));
        let mut b = TransferStats::default();
        b.record(
            Direction::Load,
            "file",
            3,
            ["timed_out", "corrupt"],
            3 << 20,
        );
        b.skipped("no_room", 7);
        for _ in 0..TransferStats::MAX_LATENCIES {
            b.load_took(Duration::from_millis(1));
        }
        a.merge(b);
        assert_eq!(a.loaded_blocks.get("file"), Some(&5));
        assert_eq!(a.loaded_bytes.get("file"), Some(&(5 << 20)));
        assert_eq!(a.load_failed_blocks.get(&("file", "timed_out")), Some(&2));
        assert_eq!(a.load_failed_blocks.get(&("file", "corrupt")), Some(&1));
        assert_eq!(a.store_skipped_blocks.get("no_room"), Some(&7));
        assert_eq!(a.load_seconds.len(), TransferStats::MAX_LATENCIES);
        assert_eq!(a.load_seconds[0], 0.005);
    }

    #[test]
    fn a_zero_count_adds_no_entry() {
        let mut s = TransferStats::default();
        s.record(Direction::Load, "host", 0, [], 0);
        s.record(Direction::Store, "file", 0, [], 0);
        s.skipped("no_room", 0);
        assert!(s.is_empty());
    }
}
