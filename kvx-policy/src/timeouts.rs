//! Default deadlines per transfer direction.
//!
//! Loads sit on the engine's critical path (a request waits for them before it can run), so
//! their default is short: 10 s. Stores only hold blocks back from reuse, so they get 30 s, the
//! same as UCM's `timeout_ms`.

use std::time::{Duration, Instant};

use kvx_core::Direction;
use serde::{Deserialize, Serialize};

use crate::error::PolicyError;

/// Default load timeout in milliseconds.
pub const DEFAULT_LOAD_MS: u64 = 10_000;
/// Default store timeout in milliseconds.
pub const DEFAULT_STORE_MS: u64 = 30_000;

fn default_load_ms() -> u64 {
    DEFAULT_LOAD_MS
}

fn default_store_ms() -> u64 {
    DEFAULT_STORE_MS
}

/// One default timeout per direction; a task may override it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutConfig {
    /// Timeout of a load (into engine memory) in milliseconds; default 10 000 (10 s).
    #[serde(default = "default_load_ms")]
    pub load_ms: u64,
    /// Timeout of a store (out of engine memory) in milliseconds; default 30 000 (30 s).
    #[serde(default = "default_store_ms")]
    pub store_ms: u64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        TimeoutConfig {
            load_ms: DEFAULT_LOAD_MS,
            store_ms: DEFAULT_STORE_MS,
        }
    }
}

impl TimeoutConfig {
    /// The default timeout of `dir`.
    pub fn timeout(&self, dir: Direction) -> Duration {
        Duration::from_millis(match dir {
            Direction::Load => self.load_ms,
            Direction::Store => self.store_ms,
        })
    }

    /// Absolute deadline of a task in `dir` submitted at `now`; `override_ms` replaces the
    /// default (`Some(0)` means already due).
    pub fn deadline(&self, dir: Direction, now: Instant, override_ms: Option<u64>) -> Instant {
        let d = override_ms.map_or_else(|| self.timeout(dir), Duration::from_millis);
        add_saturating(now, d)
    }

    /// Check that neither default timeout is zero.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.load_ms == 0 {
            return Err(PolicyError::Zero {
                field: "timeouts.load_ms",
            });
        }
        if self.store_ms == 0 {
            return Err(PolicyError::Zero {
                field: "timeouts.store_ms",
            });
        }
        Ok(())
    }
}

/// `now + d`, or the latest instant this platform can represent near that if it overflows.
pub(crate) fn add_saturating(now: Instant, d: Duration) -> Instant {
    if let Some(t) = now.checked_add(d) {
        return t;
    }
    // Overflow only happens for absurd durations; back off until it fits (at most ~64 steps).
    let mut d = d;
    loop {
        d /= 2;
        if let Some(t) = now.checked_add(d) {
            return t;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_uses_the_direction_default_or_the_override() {
        let now = Instant::now();
        let t = TimeoutConfig {
            load_ms: 1_500,
            store_ms: 4_000,
        };
        assert_eq!(
            t.deadline(Direction::Load, now, None),
            now + Duration::from_millis(1_500)
        );
        assert_eq!(
            t.deadline(Direction::Store, now, None),
            now + Duration::from_millis(4_000)
        );
        assert_eq!(
            t.deadline(Direction::Store, now, Some(250)),
            now + Duration::from_millis(250)
        );
        assert_eq!(t.deadline(Direction::Load, now, Some(0)), now);
        // An absurd override does not panic and lands in the future.
        assert!(t.deadline(Direction::Load, now, Some(u64::MAX)) > now);
    }

    #[test]
    fn defaults_and_zero_rejection() {
        let t = TimeoutConfig::default();
        assert_eq!((t.load_ms, t.store_ms), (10_000, 30_000));
        assert_eq!(t.validate(), Ok(()));
        let bad = TimeoutConfig { load_ms: 0, ..t };
        assert_eq!(
            bad.validate(),
            Err(PolicyError::Zero {
                field: "timeouts.load_ms"
            })
        );
        let bad = TimeoutConfig { store_ms: 0, ..t };
        assert_eq!(
            bad.validate(),
            Err(PolicyError::Zero {
                field: "timeouts.store_ms"
            })
        );
    }

    #[test]
    fn partial_toml_and_json_fill_each_missing_field() {
        let t: TimeoutConfig = toml::from_str("store_ms = 5").unwrap();
        assert_eq!(
            t,
            TimeoutConfig {
                load_ms: 10_000,
                store_ms: 5
            }
        );
        let t: TimeoutConfig = serde_json::from_str(r#"{"load_ms": 7}"#).unwrap();
        assert_eq!(
            t,
            TimeoutConfig {
                load_ms: 7,
                store_ms: 30_000
            }
        );
        assert!(toml::from_str::<TimeoutConfig>("load_msec = 5").is_err());
    }
}
