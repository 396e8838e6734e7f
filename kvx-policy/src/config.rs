//! The whole policy configuration, as read from a TOML or JSON file.

use serde::{Deserialize, Serialize};

use crate::breaker::BreakerConfig;
use crate::error::PolicyError;
use crate::lease::LeaseConfig;
use crate::load_failure::LoadFailurePolicy;
use crate::timeouts::TimeoutConfig;

/// Every policy setting; each section and each field may be left out and takes its default.
///
/// ```toml
/// load_failure = { auto = { max_recompute_tokens = 2048 } }
///
/// [timeouts]
/// load_ms = 5000
///
/// [lease]
/// ttl_ms = 60000          # heartbeat_interval_ms defaults to ttl_ms / 6
/// expected_readers = 2
///
/// [breaker]
/// failure_threshold = 5
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Default deadline per direction.
    pub timeouts: TimeoutConfig,
    /// What to do when blocks fail to load; default `recompute`.
    pub load_failure: LoadFailurePolicy,
    /// Producer-side TTL leases for remote reads.
    pub lease: LeaseConfig,
    /// Health breaker per backend target.
    pub breaker: BreakerConfig,
}

impl PolicyConfig {
    /// Check every section; the error names the first bad setting and its value.
    pub fn validate(&self) -> Result<(), PolicyError> {
        self.timeouts.validate()?;
        self.load_failure.validate()?;
        self.lease.validate()?;
        self.breaker.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL_TOML: &str = r#"
load_failure = { auto = { max_recompute_tokens = 2048 } }

[timeouts]
load_ms = 5000

[lease]
ttl_ms = 60000
expected_readers = 2

[breaker]
failure_threshold = 5
"#;

    #[test]
    fn empty_toml_and_json_give_all_defaults() {
        let t: PolicyConfig = toml::from_str("").unwrap();
        let j: PolicyConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(t, PolicyConfig::default());
        assert_eq!(j, PolicyConfig::default());
        assert_eq!(t.load_failure, LoadFailurePolicy::Recompute);
        assert_eq!(
            t.timeouts,
            TimeoutConfig {
                load_ms: 10_000,
                store_ms: 30_000
            }
        );
        assert_eq!(t.lease.heartbeat_interval_ms, 5_000);
        assert_eq!(t.breaker.failure_threshold, 3);
        assert_eq!(t.validate(), Ok(()));
    }

    #[test]
    fn partial_toml_overrides_only_what_it_names() {
        let c: PolicyConfig = toml::from_str(FULL_TOML).unwrap();
        assert_eq!(
            c.load_failure,
            LoadFailurePolicy::Auto {
                max_recompute_tokens: 2048
            }
        );
        assert_eq!(
            c.timeouts,
            TimeoutConfig {
                load_ms: 5_000,
                store_ms: 30_000
            }
        );
        assert_eq!(
            c.lease,
            LeaseConfig {
                ttl_ms: 60_000,
                heartbeat_interval_ms: 10_000,
                expected_readers: 2
            }
        );
        assert_eq!(
            c.breaker,
            BreakerConfig {
                failure_threshold: 5,
                ..BreakerConfig::default()
            }
        );
        assert_eq!(c.validate(), Ok(()));
        let c: PolicyConfig = toml::from_str(r#"load_failure = "fail""#).unwrap();
        assert_eq!(c.load_failure, LoadFailurePolicy::Fail);
        // Serializing and reading back gives the same config, in both formats.
        let again: PolicyConfig = toml::from_str(&toml::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);
        let again: PolicyConfig =
            serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn json_with_every_section() {
        let c: PolicyConfig = serde_json::from_str(
            r#"{"timeouts": {"store_ms": 9000},
                "load_failure": {"auto": {"max_recompute_tokens": 512}},
                "lease": {"ttl_ms": 1200, "heartbeat_interval_ms": 100},
                "breaker": {"cool_down_ms": 250, "probe_deadline_ms": 50}}"#,
        )
        .unwrap();
        assert_eq!(
            c.timeouts,
            TimeoutConfig {
                load_ms: 10_000,
                store_ms: 9_000
            }
        );
        assert_eq!(
            c.load_failure,
            LoadFailurePolicy::Auto {
                max_recompute_tokens: 512
            }
        );
        assert_eq!(
            c.lease,
            LeaseConfig {
                ttl_ms: 1_200,
                heartbeat_interval_ms: 100,
                expected_readers: 1
            }
        );
        assert_eq!(
            (c.breaker.cool_down_ms, c.breaker.probe_deadline_ms),
            (250, 50)
        );
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn unknown_keys_are_rejected() {
        assert!(toml::from_str::<PolicyConfig>("[timeout]\nload_ms = 1").is_err());
        assert!(toml::from_str::<PolicyConfig>("[lease]\nttl = 1").is_err());
        assert!(serde_json::from_str::<PolicyConfig>(r#"{"breaker": {"threshold": 1}}"#).is_err());
    }

    #[test]
    fn validate_reports_each_bad_section_with_its_value() {
        let cases: [(&str, PolicyError, &str); 6] = [
            (
                "[timeouts]\nstore_ms = 0",
                PolicyError::Zero {
                    field: "timeouts.store_ms",
                },
                "timeouts.store_ms",
            ),
            (
                "load_failure = { auto = { max_recompute_tokens = 0 } }",
                PolicyError::ZeroRecomputeLimit,
                "max_recompute_tokens",
            ),
            (
                "[lease]\nttl_ms = 0",
                PolicyError::Zero {
                    field: "lease.ttl_ms",
                },
                "lease.ttl_ms",
            ),
            (
                "[lease]\nttl_ms = 1000\nheartbeat_interval_ms = 1500",
                PolicyError::HeartbeatNotBelowTtl {
                    heartbeat_interval_ms: 1_500,
                    ttl_ms: 1_000,
                },
                "(1500)",
            ),
            (
                "[lease]\nexpected_readers = 0",
                PolicyError::Zero {
                    field: "lease.expected_readers",
                },
                "expected_readers",
            ),
            (
                "[breaker]\nwindow_ms = 0",
                PolicyError::Zero {
                    field: "breaker.window_ms",
                },
                "breaker.window_ms",
            ),
        ];
        for (text, want, in_message) in cases {
            let c: PolicyConfig = toml::from_str(text).unwrap();
            let err = c.validate().unwrap_err();
            assert_eq!(err, want, "{text}");
            assert!(err.to_string().contains(in_message), "{err}");
        }
    }
}
