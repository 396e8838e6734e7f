//! Many leases, with their expiries kept in a min-heap.
//!
//! The heap holds at most one timer per live lease. A heartbeat does not touch the heap: when
//! a timer comes due for a lease that was renewed meanwhile, it is pushed again at the new
//! expiry. Timers of released leases are dropped lazily as they surface, the heap is rebuilt
//! when stale timers outnumber live leases, and it is cleared when the table empties.

use std::cmp::{Ordering, Reverse};
use std::collections::hash_map::Entry;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fmt::Debug;
use std::hash::Hash;
use std::time::Instant;

use crate::error::PolicyError;
use crate::lease::{Lease, LeaseConfig, ReleaseReason};

/// A heap entry: expiry of the lease inserted as number `seq`.
#[derive(Debug)]
struct Timer<K> {
    at: Instant,
    seq: u64,
    key: K,
}

impl<K> PartialEq for Timer<K> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl<K> Eq for Timer<K> {}

impl<K> PartialOrd for Timer<K> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<K> Ord for Timer<K> {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

#[derive(Debug)]
struct Slot {
    lease: Lease,
    /// Distinguishes this lease from an earlier one under the same key.
    seq: u64,
    /// Whether a heap timer for this lease exists.
    timer_armed: bool,
}

/// Leases keyed by `K`; released leases leave the table and are reported once by
/// [`LeaseTable::poll_released`].
#[derive(Debug)]
pub struct LeaseTable<K: Hash + Eq + Clone> {
    leases: HashMap<K, Slot>,
    timers: BinaryHeap<Reverse<Timer<K>>>,
    released: VecDeque<(K, ReleaseReason)>,
    next_seq: u64,
}

impl<K: Hash + Eq + Clone> Default for LeaseTable<K> {
    fn default() -> Self {
        LeaseTable {
            leases: HashMap::new(),
            timers: BinaryHeap::new(),
            released: VecDeque::new(),
            next_seq: 0,
        }
    }
}

impl<K: Hash + Eq + Clone + Debug> LeaseTable<K> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a pending lease under `key` (errors on an invalid config or a key already present).
    pub fn insert(&mut self, key: K, cfg: &LeaseConfig) -> Result<(), PolicyError> {
        let lease = Lease::new(cfg)?;
        match self.leases.entry(key) {
            Entry::Occupied(e) => Err(PolicyError::DuplicateLease {
                key: format!("{:?}", e.key()),
            }),
            Entry::Vacant(v) => {
                v.insert(Slot {
                    lease,
                    seq: self.next_seq,
                    timer_armed: false,
                });
                self.next_seq += 1;
                Ok(())
            }
        }
    }

    /// Start the lease under `key` at `now`; no-op if it was already started.
    pub fn start(&mut self, key: &K, now: Instant) -> Result<(), PolicyError> {
        self.apply(key, |l| l.start(now))?;
        self.arm(key);
        Ok(())
    }

    /// Renew the lease under `key` to `now + ttl` (ignored while pending).
    ///
    /// Errors if the key is unknown or already released, or if the lease had already expired
    /// at `now` (it is then released as `Expired`).
    pub fn heartbeat(&mut self, key: &K, now: Instant) -> Result<(), PolicyError> {
        self.apply(key, |l| l.heartbeat(now))
    }

    /// Record that reader `reader` is done with the lease under `key`.
    ///
    /// Releases it as `Read` once every expected reader is done; errors like
    /// [`LeaseTable::heartbeat`] if the lease is unknown or had already expired.
    pub fn reader_done(&mut self, key: &K, reader: u32, now: Instant) -> Result<(), PolicyError> {
        match self.apply(key, |l| l.reader_done(reader, now)) {
            Err(PolicyError::LeaseReleased {
                reason: ReleaseReason::Read,
                ..
            }) => Ok(()),
            other => other,
        }
    }

    /// Abort the lease under `key`; errors if it is unknown.
    pub fn abort(&mut self, key: &K) -> Result<(), PolicyError> {
        match self.apply(key, |l| Some(l.abort())) {
            Err(PolicyError::LeaseReleased {
                reason: ReleaseReason::Aborted,
                ..
            }) => Ok(()),
            other => other,
        }
    }

    /// When [`LeaseTable::handle_timeout`] should next be called; `None` if no lease can expire.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        while let Some(Reverse(top)) = self.timers.peek() {
            let at = top.at;
            match self.leases.get(&top.key) {
                Some(slot) if slot.seq == top.seq => match slot.lease.expiry() {
                    Some(exp) if exp <= at => return Some(at),
                    Some(_) => self.rearm_top(),
                    None => self.drop_top(),
                },
                _ => {
                    self.timers.pop();
                }
            }
        }
        None
    }

    /// Expire every lease whose expiry is at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(Reverse(top)) = self.timers.peek() {
            if top.at > now {
                break;
            }
            let Some(Reverse(timer)) = self.timers.pop() else {
                break;
            };
            let Some(slot) = self.leases.get_mut(&timer.key) else {
                continue;
            };
            if slot.seq != timer.seq {
                continue;
            }
            slot.timer_armed = false;
            if let Some(reason) = slot.lease.check(now) {
                self.leases.remove(&timer.key);
                self.released.push_back((timer.key, reason));
            } else if let Some(exp) = slot.lease.expiry() {
                slot.timer_armed = true;
                self.timers.push(Reverse(Timer {
                    at: exp,
                    seq: timer.seq,
                    key: timer.key,
                }));
            }
        }
        self.tidy();
    }

    /// The next released lease and why it ended; each comes out once.
    pub fn poll_released(&mut self) -> Option<(K, ReleaseReason)> {
        self.released.pop_front()
    }

    /// The lease under `key`, if it is in the table.
    pub fn get(&self, key: &K) -> Option<&Lease> {
        self.leases.get(key).map(|s| &s.lease)
    }

    /// `true` if the lease under `key` is in the table and started.
    pub fn is_active(&self, key: &K) -> bool {
        self.get(key).is_some_and(Lease::is_active)
    }

    /// Number of leases in the table (pending or active).
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// `true` if no lease is in the table.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// Number of timers in the heap, stale ones included.
    pub fn timer_count(&self) -> usize {
        self.timers.len()
    }

    /// Run `f` on the lease under `key`; if it ended, move it to the released queue and report
    /// why as an error.
    fn apply(
        &mut self,
        key: &K,
        f: impl FnOnce(&mut Lease) -> Option<ReleaseReason>,
    ) -> Result<(), PolicyError> {
        let Some(slot) = self.leases.get_mut(key) else {
            return Err(PolicyError::UnknownLease {
                key: format!("{key:?}"),
            });
        };
        let Some(reason) = f(&mut slot.lease) else {
            return Ok(());
        };
        let (k, _) = self
            .leases
            .remove_entry(key)
            .expect("slot was just looked up");
        self.released.push_back((k, reason));
        self.tidy();
        Err(PolicyError::LeaseReleased {
            key: format!("{key:?}"),
            reason,
        })
    }

    /// Push a timer for the lease under `key` if it is active and has none.
    fn arm(&mut self, key: &K) {
        let Some(slot) = self.leases.get_mut(key) else {
            return;
        };
        if let (false, Some(at)) = (slot.timer_armed, slot.lease.expiry()) {
            slot.timer_armed = true;
            self.timers.push(Reverse(Timer {
                at,
                seq: slot.seq,
                key: key.clone(),
            }));
        }
    }

    /// Pop the top timer (of a live, renewed lease) and push it again at the real expiry.
    fn rearm_top(&mut self) {
        if let Some(Reverse(mut t)) = self.timers.pop() {
            if let Some(exp) = self.leases.get(&t.key).and_then(|s| s.lease.expiry()) {
                t.at = exp;
                self.timers.push(Reverse(t));
            }
        }
    }

    /// Pop the top timer of a lease that no longer has an expiry.
    fn drop_top(&mut self) {
        if let Some(Reverse(t)) = self.timers.pop() {
            if let Some(slot) = self.leases.get_mut(&t.key) {
                slot.timer_armed = false;
            }
        }
    }

    /// Keep stale timers bounded: none when the table is empty, at most about one per lease.
    fn tidy(&mut self) {
        if self.leases.is_empty() {
            self.timers.clear();
        } else if self.timers.len() > 2 * self.leases.len() + 16 {
            let leases = &self.leases;
            self.timers
                .retain(|Reverse(t)| leases.get(&t.key).is_some_and(|s| s.seq == t.seq));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kvx_core::RequestId;

    use super::*;

    fn ms(base: Instant, n: u64) -> Instant {
        base + Duration::from_millis(n)
    }

    fn cfg(ttl_ms: u64, readers: u32) -> LeaseConfig {
        LeaseConfig {
            expected_readers: readers,
            ..LeaseConfig::with_ttl_ms(ttl_ms)
        }
    }

    fn drain<K: Hash + Eq + Clone + Debug>(t: &mut LeaseTable<K>) -> Vec<(K, ReleaseReason)> {
        std::iter::from_fn(|| t.poll_released()).collect()
    }

    #[test]
    fn expiry_heartbeat_and_poll_timeout_through_the_table() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new();
        t.insert(RequestId(1), &cfg(1_000, 1)).unwrap();
        t.insert(RequestId(2), &cfg(2_000, 1)).unwrap();
        assert_eq!(t.poll_timeout(), None, "pending leases arm no timer");
        assert!(!t.is_active(&RequestId(1)));
        t.start(&RequestId(1), t0).unwrap();
        t.start(&RequestId(2), t0).unwrap();
        assert!(t.is_active(&RequestId(1)));
        assert_eq!(t.poll_timeout(), Some(ms(t0, 1_000)));

        // Renew lease 1 to 1_500: the next timeout moves to it, then to lease 2.
        t.heartbeat(&RequestId(1), ms(t0, 500)).unwrap();
        assert_eq!(t.poll_timeout(), Some(ms(t0, 1_500)));
        assert_eq!(t.timer_count(), 2, "one timer per live lease");
        t.handle_timeout(ms(t0, 1_499));
        assert_eq!(t.poll_released(), None);
        t.handle_timeout(ms(t0, 1_500));
        assert_eq!(drain(&mut t), vec![(RequestId(1), ReleaseReason::Expired)]);
        assert_eq!(t.poll_timeout(), Some(ms(t0, 2_000)));
        t.handle_timeout(ms(t0, 2_000));
        assert_eq!(drain(&mut t), vec![(RequestId(2), ReleaseReason::Expired)]);
        assert_eq!((t.len(), t.timer_count()), (0, 0));
        assert_eq!(t.poll_timeout(), None);
    }

    #[test]
    fn heap_is_empty_after_every_lease_is_released_any_way() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new();
        for i in 0..50u64 {
            t.insert(i, &cfg(1_000, 2)).unwrap();
            t.start(&i, ms(t0, i)).unwrap();
        }
        assert_eq!((t.len(), t.timer_count()), (50, 50));
        // 0..20 read by both readers (one duplicate), 20..35 aborted, the rest expire.
        for i in 0..20u64 {
            t.reader_done(&i, 0, ms(t0, 100)).unwrap();
            t.reader_done(&i, 0, ms(t0, 101)).unwrap();
            assert!(t.is_active(&i), "duplicate reader must not release {i}");
            t.reader_done(&i, 1, ms(t0, 102)).unwrap();
            assert!(!t.is_active(&i));
        }
        for i in 20..35u64 {
            t.abort(&i).unwrap();
        }
        assert_eq!(t.len(), 15);
        assert!(t.timer_count() >= 15);
        t.handle_timeout(ms(t0, 10_000));
        let out = drain(&mut t);
        assert_eq!(out.len(), 50);
        let count = |r| out.iter().filter(|(_, x)| *x == r).count();
        assert_eq!(count(ReleaseReason::Read), 20);
        assert_eq!(count(ReleaseReason::Aborted), 15);
        assert_eq!(count(ReleaseReason::Expired), 15);
        assert_eq!(t.len(), 0);
        assert!(t.is_empty());
        assert_eq!(t.timer_count(), 0);
        assert_eq!(t.poll_timeout(), None);
        assert_eq!(t.poll_released(), None, "each release comes out once");
    }

    #[test]
    fn released_or_unknown_keys_are_errors_and_heap_empties_without_a_timeout() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new();
        t.insert("a", &cfg(1_000, 1)).unwrap();
        assert_eq!(
            t.insert("a", &cfg(1_000, 1)),
            Err(PolicyError::DuplicateLease {
                key: "\"a\"".into()
            })
        );
        assert!(matches!(
            t.insert("bad", &cfg(0, 1)),
            Err(PolicyError::Zero {
                field: "lease.ttl_ms"
            })
        ));
        t.start(&"a", t0).unwrap();
        assert_eq!(t.timer_count(), 1);
        t.reader_done(&"a", 9, ms(t0, 10)).unwrap();
        // Released by the reader: it left the table and its timer is gone with the last lease.
        assert_eq!((t.len(), t.timer_count()), (0, 0));
        assert_eq!(drain(&mut t), vec![("a", ReleaseReason::Read)]);
        assert_eq!(
            t.heartbeat(&"a", ms(t0, 20)),
            Err(PolicyError::UnknownLease {
                key: "\"a\"".into()
            })
        );
        assert!(matches!(
            t.abort(&"a"),
            Err(PolicyError::UnknownLease { .. })
        ));
        assert!(matches!(
            t.start(&"zz", t0),
            Err(PolicyError::UnknownLease { .. })
        ));
        // A key can be reused after release.
        t.insert("a", &cfg(1_000, 1)).unwrap();
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn late_heartbeat_reports_the_expiry_and_releases_once() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new();
        t.insert(7u32, &cfg(1_000, 1)).unwrap();
        t.start(&7, t0).unwrap();
        // No handle_timeout ran; the heartbeat at expiry is too late.
        assert_eq!(
            t.heartbeat(&7, ms(t0, 1_000)),
            Err(PolicyError::LeaseReleased {
                key: "7".into(),
                reason: ReleaseReason::Expired
            })
        );
        assert_eq!((t.len(), t.timer_count()), (0, 0));
        t.handle_timeout(ms(t0, 5_000));
        assert_eq!(drain(&mut t), vec![(7, ReleaseReason::Expired)]);
    }

    #[test]
    fn stale_timers_stay_bounded_while_other_leases_live() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new();
        t.insert(u64::MAX, &cfg(1_000_000, 1)).unwrap();
        t.start(&u64::MAX, t0).unwrap();
        for i in 0..1_000u64 {
            t.insert(i, &cfg(1_000, 1)).unwrap();
            t.start(&i, t0).unwrap();
            t.abort(&i).unwrap();
            // Heartbeats on the long lease never add timers.
            t.heartbeat(&u64::MAX, ms(t0, i)).unwrap();
        }
        assert_eq!(t.len(), 1);
        assert!(t.timer_count() <= 2 * t.len() + 17, "{}", t.timer_count());
        assert_eq!(t.poll_timeout(), Some(ms(t0, 999 + 1_000_000)));
        assert_eq!(t.timer_count(), 1);
    }
}
