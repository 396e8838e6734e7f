//! TTL leases on the producer side of remote reads.
//!
//! A producer pins a finished request's blocks for remote readers. The lease is created
//! `Pending` (the blocks are not readable yet and nothing expires), starts when the request is
//! ready to be read, is renewed by reader heartbeats, and ends exactly once: when every expected
//! reader said it is done (`Read`), when it lapses without a heartbeat (`Expired`), or when the
//! producer gives up (`Aborted`). After that every call is a no-op that reports the same end.

use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::PolicyError;
use crate::timeouts::add_saturating;

/// Default lease TTL in milliseconds.
pub const DEFAULT_TTL_MS: u64 = 30_000;

/// Settings of a lease.
///
/// When `heartbeat_interval_ms` is missing from a config file it defaults to `ttl_ms / 6`, so a
/// lease survives five lost heartbeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "LeaseConfigSerde")]
pub struct LeaseConfig {
    /// How long a started lease lives without a heartbeat, in milliseconds; default 30 000.
    pub ttl_ms: u64,
    /// How often readers are asked to renew, in milliseconds; default `ttl_ms / 6` (5 000).
    pub heartbeat_interval_ms: u64,
    /// How many readers must say done before the lease is released; default 1.
    pub expected_readers: u32,
}

/// The on-disk form of [`LeaseConfig`], where the heartbeat default depends on the TTL.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseConfigSerde {
    #[serde(default = "default_ttl_ms")]
    ttl_ms: u64,
    #[serde(default)]
    heartbeat_interval_ms: Option<u64>,
    #[serde(default = "default_expected_readers")]
    expected_readers: u32,
}

fn default_ttl_ms() -> u64 {
    DEFAULT_TTL_MS
}

fn default_expected_readers() -> u32 {
    1
}

impl From<LeaseConfigSerde> for LeaseConfig {
    fn from(s: LeaseConfigSerde) -> Self {
        LeaseConfig {
            ttl_ms: s.ttl_ms,
            heartbeat_interval_ms: s
                .heartbeat_interval_ms
                .unwrap_or_else(|| LeaseConfig::heartbeat_for_ttl(s.ttl_ms)),
            expected_readers: s.expected_readers,
        }
    }
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig::with_ttl_ms(DEFAULT_TTL_MS)
    }
}

impl LeaseConfig {
    /// A config with TTL `ttl_ms`, heartbeat every `ttl_ms / 6` and one reader.
    pub fn with_ttl_ms(ttl_ms: u64) -> LeaseConfig {
        LeaseConfig {
            ttl_ms,
            heartbeat_interval_ms: LeaseConfig::heartbeat_for_ttl(ttl_ms),
            expected_readers: 1,
        }
    }

    /// The default heartbeat interval for a TTL: `ttl_ms / 6`, at least 1 ms.
    pub fn heartbeat_for_ttl(ttl_ms: u64) -> u64 {
        (ttl_ms / 6).max(1)
    }

    /// The TTL as a duration.
    pub fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms)
    }

    /// The heartbeat interval as a duration.
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }

    /// Reject a zero TTL, a zero or too long heartbeat interval and zero readers.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.ttl_ms == 0 {
            return Err(PolicyError::Zero {
                field: "lease.ttl_ms",
            });
        }
        if self.heartbeat_interval_ms == 0 {
            return Err(PolicyError::Zero {
                field: "lease.heartbeat_interval_ms",
            });
        }
        if self.heartbeat_interval_ms >= self.ttl_ms {
            return Err(PolicyError::HeartbeatNotBelowTtl {
                heartbeat_interval_ms: self.heartbeat_interval_ms,
                ttl_ms: self.ttl_ms,
            });
        }
        if self.expected_readers == 0 {
            return Err(PolicyError::Zero {
                field: "lease.expected_readers",
            });
        }
        Ok(())
    }
}

/// Why a lease ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReleaseReason {
    /// Every expected reader said it is done.
    Read,
    /// The lease reached its expiry without a heartbeat.
    Expired,
    /// The producer aborted the lease.
    Aborted,
}

impl fmt::Display for ReleaseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReleaseReason::Read => "read by all readers",
            ReleaseReason::Expired => "expired",
            ReleaseReason::Aborted => "aborted",
        })
    }
}

/// Where a lease stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseState {
    /// Created, not yet readable; no expiry runs.
    Pending,
    /// Readable until `expires_at` unless renewed.
    Active {
        /// The instant at which the lease expires.
        expires_at: Instant,
    },
    /// Ended; the blocks may be freed.
    Released(ReleaseReason),
}

/// One lease: a small state machine driven by the caller's clock.
///
/// Every method that takes `now` first applies expiry: at or after the expiry instant the lease
/// is `Expired`, whatever the call was. Methods return `Some(reason)` once the lease has ended.
#[derive(Debug, Clone)]
pub struct Lease {
    ttl: Duration,
    expected_readers: u32,
    readers_done: Vec<u32>,
    state: LeaseState,
}

impl Lease {
    /// A pending lease with the given settings (validated).
    pub fn new(cfg: &LeaseConfig) -> Result<Lease, PolicyError> {
        cfg.validate()?;
        Ok(Lease {
            ttl: cfg.ttl(),
            expected_readers: cfg.expected_readers,
            readers_done: Vec::new(),
            state: LeaseState::Pending,
        })
    }

    /// The current state.
    pub fn state(&self) -> LeaseState {
        self.state
    }

    /// `true` while started and not yet ended (as of the last call; see [`Lease::check`]).
    pub fn is_active(&self) -> bool {
        matches!(self.state, LeaseState::Active { .. })
    }

    /// Why the lease ended, or `None` while it is pending or active.
    pub fn release_reason(&self) -> Option<ReleaseReason> {
        match self.state {
            LeaseState::Released(r) => Some(r),
            _ => None,
        }
    }

    /// When an active lease expires; `None` while pending or after release.
    pub fn expiry(&self) -> Option<Instant> {
        match self.state {
            LeaseState::Active { expires_at } => Some(expires_at),
            _ => None,
        }
    }

    /// How many distinct readers have said done.
    pub fn readers_done(&self) -> u32 {
        self.readers_done.len() as u32
    }

    /// Expire the lease if `now` is at or past its expiry; report the end if it has ended.
    pub fn check(&mut self, now: Instant) -> Option<ReleaseReason> {
        if let LeaseState::Active { expires_at } = self.state {
            if now >= expires_at {
                self.state = LeaseState::Released(ReleaseReason::Expired);
            }
        }
        self.release_reason()
    }

    /// Make a pending lease readable until `now + ttl`; no-op if already started.
    pub fn start(&mut self, now: Instant) -> Option<ReleaseReason> {
        if let Some(r) = self.check(now) {
            return Some(r);
        }
        if self.state == LeaseState::Pending {
            self.state = LeaseState::Active {
                expires_at: add_saturating(now, self.ttl),
            };
        }
        None
    }

    /// Renew an active lease to `now + ttl` (never earlier than it was); ignored while pending.
    pub fn heartbeat(&mut self, now: Instant) -> Option<ReleaseReason> {
        if let Some(r) = self.check(now) {
            return Some(r);
        }
        if let LeaseState::Active { expires_at } = self.state {
            self.state = LeaseState::Active {
                expires_at: expires_at.max(add_saturating(now, self.ttl)),
            };
        }
        None
    }

    /// Record that reader `reader` is done; releases with `Read` once every expected reader
    /// is. A reader saying done twice counts once.
    pub fn reader_done(&mut self, reader: u32, now: Instant) -> Option<ReleaseReason> {
        if let Some(r) = self.check(now) {
            return Some(r);
        }
        if !self.readers_done.contains(&reader) {
            self.readers_done.push(reader);
        }
        if self.readers_done.len() as u64 >= u64::from(self.expected_readers) {
            self.state = LeaseState::Released(ReleaseReason::Read);
            self.readers_done = Vec::new();
        }
        self.release_reason()
    }

    /// End the lease now; returns `Aborted`, or the earlier reason if it had already ended.
    pub fn abort(&mut self) -> ReleaseReason {
        match self.state {
            LeaseState::Released(r) => r,
            _ => {
                self.state = LeaseState::Released(ReleaseReason::Aborted);
                self.readers_done = Vec::new();
                ReleaseReason::Aborted
            }
        }
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn pending_lease_never_expires() {
        let t0 = Instant::now();
        let mut l = Lease::new(&cfg(1_000, 1)).unwrap();
        assert_eq!(l.state(), LeaseState::Pending);
        assert_eq!(l.expiry(), None);
        assert_eq!(l.check(ms(t0, 1_000_000)), None);
        assert_eq!(l.heartbeat(ms(t0, 1_000_000)), None);
        assert_eq!(
            l.state(),
            LeaseState::Pending,
            "heartbeat must not start it"
        );
        assert!(!l.is_active());
    }

    #[test]
    fn started_lease_expires_exactly_at_ttl() {
        let t0 = Instant::now();
        let mut l = Lease::new(&cfg(1_000, 1)).unwrap();
        assert_eq!(l.start(ms(t0, 10)), None);
        assert_eq!(l.expiry(), Some(ms(t0, 1_010)));
        assert_eq!(l.check(ms(t0, 1_009)), None);
        assert!(l.is_active());
        assert_eq!(l.check(ms(t0, 1_010)), Some(ReleaseReason::Expired));
        assert_eq!(l.state(), LeaseState::Released(ReleaseReason::Expired));
        assert_eq!(l.expiry(), None);
    }

    #[test]
    fn heartbeat_extends_and_start_twice_does_not() {
        let t0 = Instant::now();
        let mut l = Lease::new(&cfg(1_000, 1)).unwrap();
        l.start(t0);
        assert_eq!(l.start(ms(t0, 500)), None);
        assert_eq!(l.expiry(), Some(ms(t0, 1_000)), "second start is a no-op");
        assert_eq!(l.heartbeat(ms(t0, 900)), None);
        assert_eq!(l.expiry(), Some(ms(t0, 1_900)));
        // An out-of-order (older) heartbeat never shortens the lease.
        assert_eq!(l.heartbeat(ms(t0, 800)), None);
        assert_eq!(l.expiry(), Some(ms(t0, 1_900)));
        assert_eq!(
            l.check(ms(t0, 1_500)),
            None,
            "would have expired at 1000 without it"
        );
        assert_eq!(l.check(ms(t0, 1_900)), Some(ReleaseReason::Expired));
    }

    #[test]
    fn late_heartbeat_cannot_revive_and_calls_after_release_report_the_original() {
        let t0 = Instant::now();
        let mut l = Lease::new(&cfg(1_000, 1)).unwrap();
        l.start(t0);
        // Heartbeat arrives at the expiry instant without an intervening check: too late.
        assert_eq!(l.heartbeat(ms(t0, 1_000)), Some(ReleaseReason::Expired));
        assert_eq!(l.heartbeat(ms(t0, 1_001)), Some(ReleaseReason::Expired));
        assert_eq!(l.expiry(), None);
        assert_eq!(l.start(ms(t0, 1_002)), Some(ReleaseReason::Expired));
        assert_eq!(
            l.reader_done(0, ms(t0, 1_003)),
            Some(ReleaseReason::Expired)
        );
        assert_eq!(l.abort(), ReleaseReason::Expired);
        assert_eq!(l.state(), LeaseState::Released(ReleaseReason::Expired));
    }

    #[test]
    fn released_after_all_readers_and_duplicates_count_once() {
        let t0 = Instant::now();
        let mut l = Lease::new(&cfg(1_000, 3)).unwrap();
        l.start(t0);
        assert_eq!(l.reader_done(0, ms(t0, 1)), None);
        assert_eq!(
            l.reader_done(0, ms(t0, 2)),
            None,
            "duplicate must not count"
        );
        assert_eq!(l.readers_done(), 1);
        assert_eq!(l.reader_done(2, ms(t0, 3)), None);
        assert_eq!(l.readers_done(), 2);
        assert!(l.is_active());
        assert_eq!(l.reader_done(1, ms(t0, 4)), Some(ReleaseReason::Read));
        assert_eq!(l.state(), LeaseState::Released(ReleaseReason::Read));
        // No-ops after release, including expiry and abort.
        assert_eq!(l.check(ms(t0, 5_000)), Some(ReleaseReason::Read));
        assert_eq!(l.heartbeat(ms(t0, 5_000)), Some(ReleaseReason::Read));
        assert_eq!(l.abort(), ReleaseReason::Read);
    }

    #[test]
    fn abort_releases_from_pending_and_active() {
        let t0 = Instant::now();
        let mut pending = Lease::new(&cfg(1_000, 1)).unwrap();
        assert_eq!(pending.abort(), ReleaseReason::Aborted);
        assert_eq!(pending.start(t0), Some(ReleaseReason::Aborted));
        assert_eq!(pending.expiry(), None);

        let mut active = Lease::new(&cfg(1_000, 2)).unwrap();
        active.start(t0);
        active.reader_done(7, ms(t0, 1));
        assert_eq!(active.abort(), ReleaseReason::Aborted);
        assert_eq!(active.check(ms(t0, 2_000)), Some(ReleaseReason::Aborted));
        assert_eq!(
            active.reader_done(8, ms(t0, 3)),
            Some(ReleaseReason::Aborted)
        );
    }

    #[test]
    fn config_defaults_and_validation() {
        let d = LeaseConfig::default();
        assert_eq!(
            (d.ttl_ms, d.heartbeat_interval_ms, d.expected_readers),
            (30_000, 5_000, 1)
        );
        assert_eq!(d.validate(), Ok(()));
        // Missing heartbeat follows the TTL; an explicit one is kept.
        let c: LeaseConfig = toml::from_str("ttl_ms = 60000").unwrap();
        assert_eq!(c.heartbeat_interval_ms, 10_000);
        let c: LeaseConfig = serde_json::from_str(
            r#"{"ttl_ms": 600, "heartbeat_interval_ms": 50, "expected_readers": 4}"#,
        )
        .unwrap();
        assert_eq!(
            c,
            LeaseConfig {
                ttl_ms: 600,
                heartbeat_interval_ms: 50,
                expected_readers: 4
            }
        );

        assert_eq!(
            LeaseConfig { ttl_ms: 0, ..d }.validate(),
            Err(PolicyError::Zero {
                field: "lease.ttl_ms"
            })
        );
        assert_eq!(
            LeaseConfig {
                heartbeat_interval_ms: 30_000,
                ..d
            }
            .validate(),
            Err(PolicyError::HeartbeatNotBelowTtl {
                heartbeat_interval_ms: 30_000,
                ttl_ms: 30_000
            })
        );
        assert_eq!(
            LeaseConfig {
                heartbeat_interval_ms: 0,
                ..d
            }
            .validate(),
            Err(PolicyError::Zero {
                field: "lease.heartbeat_interval_ms"
            })
        );
        assert_eq!(
            LeaseConfig {
                expected_readers: 0,
                ..d
            }
            .validate(),
            Err(PolicyError::Zero {
                field: "lease.expected_readers"
            })
        );
        assert!(
            Lease::new(&LeaseConfig {
                expected_readers: 0,
                ..d
            })
            .is_err()
        );
        assert!(
            toml::from_str::<LeaseConfig>("ttl = 5").is_err(),
            "unknown field"
        );
    }
}
