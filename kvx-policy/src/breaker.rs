//! Health breaker for one backend target (a mount, a peer).
//!
//! After repeated failures (timeouts count) the breaker opens and new ops are turned away at
//! once, so the engine recomputes at full speed instead of waiting a deadline per block. After a
//! cool-down one probe op is let through; if it succeeds in time the breaker closes, otherwise it
//! opens for another cool-down.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::PolicyError;
use crate::timeouts::add_saturating;

fn default_failure_threshold() -> u32 {
    3
}

fn default_window_ms() -> u64 {
    10_000
}

fn default_cool_down_ms() -> u64 {
    1_000
}

fn default_probe_deadline_ms() -> u64 {
    1_000
}

/// Settings of a health breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive failures within `window_ms` that open the breaker; default 3.
    #[serde(default = "default_failure_threshold")]
    pub failure_threshold: u32,
    /// Span in milliseconds that those failures must fall within; default 10 000.
    #[serde(default = "default_window_ms")]
    pub window_ms: u64,
    /// How long an open breaker rejects everything before probing, in milliseconds; default 1 000.
    #[serde(default = "default_cool_down_ms")]
    pub cool_down_ms: u64,
    /// Latest a probe may succeed, in milliseconds, for the breaker to close; default 1 000.
    #[serde(default = "default_probe_deadline_ms")]
    pub probe_deadline_ms: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: default_failure_threshold(),
            window_ms: default_window_ms(),
            cool_down_ms: default_cool_down_ms(),
            probe_deadline_ms: default_probe_deadline_ms(),
        }
    }
}

impl BreakerConfig {
    /// Reject any zero setting.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let fields = [
            (
                "breaker.failure_threshold",
                u64::from(self.failure_threshold),
            ),
            ("breaker.window_ms", self.window_ms),
            ("breaker.cool_down_ms", self.cool_down_ms),
            ("breaker.probe_deadline_ms", self.probe_deadline_ms),
        ];
        match fields.iter().find(|(_, v)| *v == 0) {
            Some(&(field, _)) => Err(PolicyError::Zero { field }),
            None => Ok(()),
        }
    }
}

/// Where a breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Healthy: every op is allowed.
    Closed,
    /// Unhealthy: ops are rejected until `until`, then one probe is let through.
    Open {
        /// End of the cool-down.
        until: Instant,
    },
    /// One probe is in flight; everything else is rejected until it reports.
    HalfOpen {
        /// When the probe was admitted.
        probe_started: Instant,
    },
}

/// The answer to "may I start an op on this target now?".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Admission {
    /// Go ahead (the breaker is closed).
    Allowed,
    /// Go ahead: this op is the probe; report its outcome with its latency.
    Probe,
    /// Fail the op at once without touching the target.
    Rejected,
}

/// A circuit breaker driven by the caller's clock.
///
/// While half-open, any reported outcome is taken as the probe's. A probe that has been out
/// longer than `probe_deadline_ms` counts as failed at the next `admit`, so a probe that never
/// reports cannot wedge the breaker half-open.
#[derive(Debug, Clone)]
pub struct Breaker {
    cfg: BreakerConfig,
    state: BreakerState,
    /// Times of the current run of consecutive failures while closed (at most the threshold).
    failures: VecDeque<Instant>,
}

impl Breaker {
    /// A closed breaker with the given settings (validated).
    pub fn new(cfg: BreakerConfig) -> Result<Breaker, PolicyError> {
        cfg.validate()?;
        Ok(Breaker {
            cfg,
            state: BreakerState::Closed,
            failures: VecDeque::new(),
        })
    }

    /// The settings.
    pub fn config(&self) -> &BreakerConfig {
        &self.cfg
    }

    /// The current state.
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// `true` unless closed: open or half-open, ordinary ops are turned away.
    pub fn is_open(&self) -> bool {
        self.state != BreakerState::Closed
    }

    /// Consecutive failures counted toward opening (those within the window of the latest).
    pub fn consecutive_failures(&self) -> u32 {
        self.failures.len() as u32
    }

    /// May an op start on this target at `now`?
    pub fn admit(&mut self, now: Instant) -> Admission {
        if let BreakerState::HalfOpen { probe_started } = self.state {
            let probe_due = add_saturating(probe_started, self.probe_deadline());
            if now > probe_due {
                // The probe is too late to close the breaker whatever it returns.
                self.state = BreakerState::Open {
                    until: add_saturating(probe_due, self.cool_down()),
                };
            }
        }
        match self.state {
            BreakerState::Closed => Admission::Allowed,
            BreakerState::Open { until } if now >= until => {
                self.state = BreakerState::HalfOpen { probe_started: now };
                Admission::Probe
            }
            BreakerState::Open { .. } | BreakerState::HalfOpen { .. } => Admission::Rejected,
        }
    }

    /// An op on this target succeeded after `latency`.
    ///
    /// Closed: resets the failure count. Half-open: closes if `latency` is within the probe
    /// deadline, otherwise re-opens. Open: ignored (a late result of an op admitted earlier).
    pub fn record_success(&mut self, now: Instant, latency: Duration) {
        match self.state {
            BreakerState::Closed => self.failures.clear(),
            BreakerState::HalfOpen { .. } if latency <= self.probe_deadline() => {
                self.state = BreakerState::Closed;
                self.failures.clear();
            }
            BreakerState::HalfOpen { .. } => self.open(now),
            BreakerState::Open { .. } => {}
        }
    }

    /// An op on this target failed or timed out.
    ///
    /// Closed: opens after `failure_threshold` consecutive failures within `window_ms`.
    /// Half-open: re-opens. Open: ignored.
    pub fn record_failure(&mut self, now: Instant) {
        match self.state {
            BreakerState::Closed => {
                let window = Duration::from_millis(self.cfg.window_ms);
                while let Some(&first) = self.failures.front() {
                    if now.saturating_duration_since(first) > window
                        || self.failures.len() >= self.cfg.failure_threshold as usize
                    {
                        self.failures.pop_front();
                    } else {
                        break;
                    }
                }
                self.failures.push_back(now);
                if self.failures.len() >= self.cfg.failure_threshold as usize {
                    self.open(now);
                }
            }
            BreakerState::HalfOpen { .. } => self.open(now),
            BreakerState::Open { .. } => {}
        }
    }

    fn open(&mut self, now: Instant) {
        self.state = BreakerState::Open {
            until: add_saturating(now, self.cool_down()),
        };
        self.failures.clear();
    }

    fn cool_down(&self) -> Duration {
        Duration::from_millis(self.cfg.cool_down_ms)
    }

    fn probe_deadline(&self) -> Duration {
        Duration::from_millis(self.cfg.probe_deadline_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(base: Instant, n: u64) -> Instant {
        base + Duration::from_millis(n)
    }

    fn breaker() -> Breaker {
        // threshold 3, window 10 s, cool-down 1 s, probe deadline 1 s.
        Breaker::new(BreakerConfig::default()).unwrap()
    }

    fn open_at(b: &mut Breaker, t0: Instant) {
        for i in 0..3 {
            assert_eq!(b.admit(ms(t0, i)), Admission::Allowed);
            b.record_failure(ms(t0, i));
        }
        assert_eq!(
            b.state(),
            BreakerState::Open {
                until: ms(t0, 1_002)
            }
        );
    }

    #[test]
    fn full_cycle_closed_open_half_open_closed() {
        let t0 = Instant::now();
        let mut b = breaker();
        b.record_failure(ms(t0, 0));
        b.record_failure(ms(t0, 1));
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.consecutive_failures(), 2);
        b.record_failure(ms(t0, 2));
        assert_eq!(
            b.state(),
            BreakerState::Open {
                until: ms(t0, 1_002)
            }
        );
        assert!(b.is_open());
        assert_eq!(b.admit(ms(t0, 500)), Admission::Rejected);
        assert_eq!(b.admit(ms(t0, 1_001)), Admission::Rejected);
        assert_eq!(b.admit(ms(t0, 1_002)), Admission::Probe);
        assert_eq!(
            b.state(),
            BreakerState::HalfOpen {
                probe_started: ms(t0, 1_002)
            }
        );
        b.record_success(ms(t0, 1_500), Duration::from_millis(1_000));
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "latency == deadline closes"
        );
        assert!(!b.is_open());
        assert_eq!(b.consecutive_failures(), 0);
        assert_eq!(b.admit(ms(t0, 1_501)), Admission::Allowed);
    }

    #[test]
    fn rejected_while_probe_in_flight() {
        let t0 = Instant::now();
        let mut b = breaker();
        open_at(&mut b, t0);
        assert_eq!(b.admit(ms(t0, 2_000)), Admission::Probe);
        assert_eq!(b.admit(ms(t0, 2_000)), Admission::Rejected);
        assert_eq!(b.admit(ms(t0, 2_500)), Admission::Rejected);
        assert_eq!(
            b.admit(ms(t0, 3_000)),
            Admission::Rejected,
            "at the probe deadline still out"
        );
        assert!(matches!(b.state(), BreakerState::HalfOpen { .. }));
    }

    #[test]
    fn probe_failure_reopens_for_another_cool_down() {
        let t0 = Instant::now();
        let mut b = breaker();
        open_at(&mut b, t0);
        assert_eq!(b.admit(ms(t0, 1_100)), Admission::Probe);
        b.record_failure(ms(t0, 1_200));
        assert_eq!(
            b.state(),
            BreakerState::Open {
                until: ms(t0, 2_200)
            }
        );
        assert_eq!(b.admit(ms(t0, 2_199)), Admission::Rejected);
        assert_eq!(b.admit(ms(t0, 2_200)), Admission::Probe);
    }

    #[test]
    fn slow_probe_success_reopens() {
        let t0 = Instant::now();
        let mut b = breaker();
        open_at(&mut b, t0);
        assert_eq!(b.admit(ms(t0, 1_100)), Admission::Probe);
        b.record_success(ms(t0, 2_101), Duration::from_millis(1_001));
        assert_eq!(
            b.state(),
            BreakerState::Open {
                until: ms(t0, 3_101)
            }
        );
        assert_eq!(b.admit(ms(t0, 3_000)), Admission::Rejected);
    }

    #[test]
    fn probe_that_never_reports_counts_as_failed_after_its_deadline() {
        let t0 = Instant::now();
        let mut b = breaker();
        open_at(&mut b, t0);
        assert_eq!(b.admit(ms(t0, 1_100)), Admission::Probe);
        // Probe due at 2_100; past it the breaker re-opens until 2_100 + 1_000.
        assert_eq!(b.admit(ms(t0, 2_101)), Admission::Rejected);
        assert_eq!(
            b.state(),
            BreakerState::Open {
                until: ms(t0, 3_100)
            }
        );
        assert_eq!(b.admit(ms(t0, 3_100)), Admission::Probe);
        // A late result arriving while open is ignored.
        let mut open = breaker();
        open_at(&mut open, t0);
        open.record_success(ms(t0, 10), Duration::from_millis(1));
        assert_eq!(
            open.state(),
            BreakerState::Open {
                until: ms(t0, 1_002)
            }
        );
    }

    #[test]
    fn failures_outside_the_window_do_not_open() {
        let t0 = Instant::now();
        let mut b = breaker();
        b.record_failure(ms(t0, 0));
        b.record_failure(ms(t0, 6_000));
        b.record_failure(ms(t0, 12_000)); // 0 is 12 s back: outside the 10 s window.
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.consecutive_failures(), 2);
        // 6_000, 12_000 and 16_000 span exactly the window: opens.
        b.record_failure(ms(t0, 16_000));
        assert_eq!(
            b.state(),
            BreakerState::Open {
                until: ms(t0, 17_000)
            }
        );
    }

    #[test]
    fn success_while_closed_resets_the_count() {
        let t0 = Instant::now();
        let mut b = breaker();
        b.record_failure(ms(t0, 0));
        b.record_failure(ms(t0, 1));
        b.record_success(ms(t0, 2), Duration::from_millis(5_000));
        assert_eq!(b.consecutive_failures(), 0);
        b.record_failure(ms(t0, 3));
        b.record_failure(ms(t0, 4));
        assert_eq!(b.state(), BreakerState::Closed);
        b.record_failure(ms(t0, 5));
        assert!(b.is_open());
    }

    #[test]
    fn config_defaults_and_each_zero_is_rejected() {
        let d = BreakerConfig::default();
        assert_eq!(
            (
                d.failure_threshold,
                d.window_ms,
                d.cool_down_ms,
                d.probe_deadline_ms
            ),
            (3, 10_000, 1_000, 1_000)
        );
        assert_eq!(d.validate(), Ok(()));
        let cases = [
            (
                BreakerConfig {
                    failure_threshold: 0,
                    ..d
                },
                "breaker.failure_threshold",
            ),
            (BreakerConfig { window_ms: 0, ..d }, "breaker.window_ms"),
            (
                BreakerConfig {
                    cool_down_ms: 0,
                    ..d
                },
                "breaker.cool_down_ms",
            ),
            (
                BreakerConfig {
                    probe_deadline_ms: 0,
                    ..d
                },
                "breaker.probe_deadline_ms",
            ),
        ];
        for (c, field) in cases {
            assert_eq!(c.validate(), Err(PolicyError::Zero { field }));
            assert!(Breaker::new(c).is_err());
        }
        let c: BreakerConfig = toml::from_str("failure_threshold = 5").unwrap();
        assert_eq!(
            c,
            BreakerConfig {
                failure_threshold: 5,
                ..d
            }
        );
    }
}
