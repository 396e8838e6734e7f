//! The probe table of a store on a shared mount: what probes of keys missing from the index
//! found, for how long that answer holds, and which probes are still in flight.
//!
//! A lookup never waits for a probe. It starts one (a header read on the engine's maintenance
//! lane) and answers [`ProbeAnswer::Pending`]; asked again, it gives the cached answer. A probe
//! not back within the deadline is a failure of its root's breaker and its key answers
//! [`ProbeAnswer::Absent`] for the cache time; an open breaker answers `Absent` at once. The
//! table holds at most `probe_entries` keys: when full (expired answers purged first), a new key
//! answers `Absent` without a probe. At most [`MAX_OUTSTANDING`] probes are in the engine at
//! once, so a burst of lookups never queues probes long enough to miss their deadline on a
//! healthy mount (which would open the breaker); past that a new key answers `Pending` while a
//! probe is still within its deadline, and `Absent` once every outstanding probe is overdue (a
//! stuck lane).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvx_core::{BlockError, BlockKey};
use rustc_hash::FxHashMap;

use crate::config::SharedMount;
use crate::health::Health;
use kvx_core::sync::lock;

/// What a probe of the shared mount says about a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a probe answer says whether the block is on the mount"]
pub enum ProbeAnswer {
    /// The block is on the mount (its header names this key and format version).
    Present,
    /// The block is not there, the mount did not answer in time, or its breaker is open.
    Absent,
    /// A probe is in flight: ask again later.
    Pending,
}

#[derive(Debug, Clone, Copy)]
enum Slot {
    Pending { since: Instant, root: usize },
    Known { present: bool, until: Instant },
}

/// Most probes submitted to the engine and not yet back (timed out or not).
pub(crate) const MAX_OUTSTANDING: usize = 16;

#[derive(Default)]
struct Table {
    slots: FxHashMap<BlockKey, Slot>,
    /// Probes in flight, oldest first (some may have been answered already).
    pending: VecDeque<(Instant, BlockKey)>,
    /// Slots in the `Pending` state (probes within their deadline).
    pending_slots: usize,
    /// Probes submitted and not back from the engine yet (overdue ones included).
    outstanding: usize,
}

/// See the module docs.
pub(crate) struct ProbeTable {
    cfg: SharedMount,
    table: Mutex<Table>,
}

/// What [`ProbeTable::begin`] decided.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Begin {
    /// The answer is known.
    Answer(ProbeAnswer),
    /// Start a probe now (the table records it as in flight).
    Start,
}

impl ProbeTable {
    pub(crate) fn new(cfg: SharedMount) -> ProbeTable {
        ProbeTable {
            cfg,
            table: Mutex::new(Table::default()),
        }
    }

    /// Probes past their deadline become `Absent` and a failure of their root.
    fn expire(&self, t: &mut Table, now: Instant, health: &Health) {
        while let Some(&(since, key)) = t.pending.front() {
            if now.saturating_duration_since(since) < self.cfg.probe_deadline {
                break;
            }
            t.pending.pop_front();
            if let Some(Slot::Pending { since: s, root }) = t.slots.get(&key).copied()
                && s == since
            {
                tracing::warn!(%key, root, "posix: a probe of the shared mount timed out");
                health.failure(root, now);
                t.pending_slots -= 1;
                t.slots.insert(
                    key,
                    Slot::Known {
                        present: false,
                        until: now + self.cfg.probe_ttl,
                    },
                );
            }
        }
    }

    /// The answer for `key` on `root`, or `Start` when a probe must be started (the caller
    /// then calls [`ProbeTable::started`] or [`ProbeTable::refused`]).
    pub(crate) fn begin(&self, key: BlockKey, root: usize, now: Instant, health: &Health) -> Begin {
        let mut t = lock(&self.table);
        self.expire(&mut t, now, health);
        match t.slots.get(&key) {
            Some(Slot::Pending { .. }) => return Begin::Answer(ProbeAnswer::Pending),
            Some(Slot::Known { present, until }) if *until > now => {
                return Begin::Answer(if *present {
                    ProbeAnswer::Present
                } else {
                    ProbeAnswer::Absent
                });
            }
            _ => {}
        }
        if t.outstanding >= MAX_OUTSTANDING {
            return Begin::Answer(if t.pending_slots > 0 {
                ProbeAnswer::Pending
            } else {
                ProbeAnswer::Absent
            });
        }
        if health.admit(root, now) == kvx_policy::Admission::Rejected {
            return Begin::Answer(ProbeAnswer::Absent);
        }
        if t.slots.len() >= self.cfg.probe_entries {
            t.slots
                .retain(|_, s| !matches!(s, Slot::Known { until, .. } if *until <= now));
            if t.slots.len() >= self.cfg.probe_entries {
                return Begin::Answer(ProbeAnswer::Absent);
            }
        }
        t.slots.insert(key, Slot::Pending { since: now, root });
        t.pending.push_back((now, key));
        t.pending_slots += 1;
        t.outstanding += 1;
        Begin::Start
    }

    /// The engine refused the probe of `key`: forget it.
    pub(crate) fn refused(&self, key: BlockKey) {
        let mut t = lock(&self.table);
        if matches!(t.slots.get(&key), Some(Slot::Pending { .. })) {
            t.slots.remove(&key);
            t.pending_slots -= 1;
        }
        t.outstanding = t.outstanding.saturating_sub(1);
    }

    /// A probe of `key` came back with `result` at `now`.
    pub(crate) fn answered(
        &self,
        key: BlockKey,
        result: &Result<(), BlockError>,
        now: Instant,
        health: &Health,
    ) {
        let present = result.is_ok();
        let mut t = lock(&self.table);
        t.outstanding = t.outstanding.saturating_sub(1);
        if let Some(Slot::Pending { since, root }) = t.slots.get(&key).copied() {
            t.pending_slots -= 1;
            // In time (a late one was already counted a failure by `expire`).
            match result {
                Err(BlockError::Io(e)) => {
                    tracing::warn!(%key, error = %e, "posix: a probe of the shared mount failed");
                    health.failure(root, now);
                }
                _ => health.success(root, now, now.saturating_duration_since(since)),
            }
        }
        t.slots.insert(
            key,
            Slot::Known {
                present,
                until: now + self.cfg.probe_ttl,
            },
        );
        self.expire(&mut t, now, health);
    }

    /// A load found `key` gone (or bad): drop a cached `Present`.
    pub(crate) fn forget(&self, key: BlockKey) {
        let mut t = lock(&self.table);
        if matches!(t.slots.get(&key), Some(Slot::Known { .. })) {
            t.slots.remove(&key);
        }
    }

    /// Keys remembered (answers and probes in flight).
    pub(crate) fn len(&self) -> usize {
        lock(&self.table).slots.len()
    }

    /// The probe deadline.
    pub(crate) fn deadline(&self) -> Duration {
        self.cfg.probe_deadline
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_policy::{BreakerConfig, BreakerState};

    fn table(entries: usize) -> (ProbeTable, Health) {
        let cfg = SharedMount {
            probe_deadline: Duration::from_millis(100),
            probe_ttl: Duration::from_millis(50),
            probe_entries: entries,
            touch_on_load: false,
            ..SharedMount::default()
        };
        let health = Health::new(&["/r".into()], BreakerConfig::default()).unwrap();
        (ProbeTable::new(cfg), health)
    }

    #[test]
    fn answers_are_cached_for_the_ttl_then_probed_again() {
        let (t, h) = table(8);
        let (k, t0) = (BlockKey(1), Instant::now());
        assert_eq!(t.begin(k, 0, t0, &h), Begin::Start);
        assert_eq!(t.begin(k, 0, t0, &h), Begin::Answer(ProbeAnswer::Pending));
        t.answered(k, &Ok(()), t0 + Duration::from_millis(1), &h);
        let at = t0 + Duration::from_millis(40);
        assert_eq!(t.begin(k, 0, at, &h), Begin::Answer(ProbeAnswer::Present));
        // Past the TTL the answer is probed again.
        assert_eq!(
            t.begin(k, 0, t0 + Duration::from_millis(60), &h),
            Begin::Start
        );
        t.answered(
            k,
            &Err(BlockError::NotFound),
            t0 + Duration::from_millis(61),
            &h,
        );
        let at = t0 + Duration::from_millis(70);
        assert_eq!(t.begin(k, 0, at, &h), Begin::Answer(ProbeAnswer::Absent));
        // A load that found the block gone drops a cached answer.
        t.forget(k);
        assert_eq!(t.begin(k, 0, at, &h), Begin::Start);
    }

    #[test]
    fn probes_past_the_deadline_are_misses_and_open_the_breaker() {
        let (t, h) = table(8);
        let t0 = Instant::now();
        for i in 0..3 {
            assert_eq!(t.begin(BlockKey(i), 0, t0, &h), Begin::Start);
        }
        let late = t0 + Duration::from_millis(100);
        // The first look after the deadline turns all three into misses and failures.
        assert_eq!(
            t.begin(BlockKey(0), 0, late, &h),
            Begin::Answer(ProbeAnswer::Absent)
        );
        assert!(matches!(h.state(0), Some(BreakerState::Open { .. })));
        // While it is open a new key is a miss without a probe.
        assert_eq!(
            t.begin(BlockKey(9), 0, late, &h),
            Begin::Answer(ProbeAnswer::Absent)
        );
        // A late answer is still recorded (the block is there), without a success.
        t.answered(BlockKey(1), &Ok(()), late, &h);
        assert_eq!(
            t.begin(BlockKey(1), 0, late, &h),
            Begin::Answer(ProbeAnswer::Present)
        );
        assert!(matches!(h.state(0), Some(BreakerState::Open { .. })));
    }

    #[test]
    fn probes_in_the_engine_are_bounded() {
        let (t, _) = table(64);
        let h = Health::new(
            &["/r".into()],
            BreakerConfig {
                failure_threshold: 1000,
                ..BreakerConfig::default()
            },
        )
        .unwrap();
        let t0 = Instant::now();
        for i in 0..MAX_OUTSTANDING as u128 {
            assert_eq!(t.begin(BlockKey(i), 0, t0, &h), Begin::Start);
        }
        let extra = BlockKey(1000);
        assert_eq!(
            t.begin(extra, 0, t0, &h),
            Begin::Answer(ProbeAnswer::Pending),
            "busy lane: ask again later"
        );
        // Once every outstanding probe is overdue (a stuck lane), a new key is a miss.
        let late = t0 + Duration::from_millis(100);
        assert_eq!(
            t.begin(extra, 0, late, &h),
            Begin::Answer(ProbeAnswer::Absent)
        );
        // One coming back makes room for a new probe.
        t.answered(BlockKey(0), &Err(BlockError::NotFound), late, &h);
        assert_eq!(t.begin(extra, 0, late, &h), Begin::Start);
    }

    #[test]
    fn the_table_is_bounded() {
        let (t, h) = table(2);
        let t0 = Instant::now();
        assert_eq!(t.begin(BlockKey(1), 0, t0, &h), Begin::Start);
        assert_eq!(t.begin(BlockKey(2), 0, t0, &h), Begin::Start);
        assert_eq!(
            t.begin(BlockKey(3), 0, t0, &h),
            Begin::Answer(ProbeAnswer::Absent),
            "full: a new key is a miss without a probe"
        );
        assert_eq!(t.len(), 2);
        t.answered(BlockKey(1), &Ok(()), t0, &h);
        t.answered(BlockKey(2), &Ok(()), t0, &h);
        // Once answers expire they make room.
        let later = t0 + Duration::from_millis(60);
        assert_eq!(t.begin(BlockKey(3), 0, later, &h), Begin::Start);
        assert!(t.len() <= 2);
    }
}
