//! The one error type of this crate.

use crate::lease::ReleaseReason;

/// What was wrong with a policy setting or a lease-table call, and the offending value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// A setting that must be positive was zero; `field` is its path in the config.
    #[error("`{field}` must be greater than zero, got 0")]
    Zero {
        /// Config path of the setting, e.g. `timeouts.load_ms`.
        field: &'static str,
    },
    /// `Auto` with a zero token limit never recomputes anything; `Fail` says that plainly.
    #[error(
        "`load_failure.auto.max_recompute_tokens` must be greater than zero, got 0 \
         (use `fail` to never recompute)"
    )]
    ZeroRecomputeLimit,
    /// The lease heartbeat interval is not shorter than the lease TTL, so a lease would lapse
    /// between two heartbeats.
    #[error(
        "`lease.heartbeat_interval_ms` ({heartbeat_interval_ms}) must be less than \
         `lease.ttl_ms` ({ttl_ms})"
    )]
    HeartbeatNotBelowTtl {
        /// The configured heartbeat interval in milliseconds.
        heartbeat_interval_ms: u64,
        /// The configured TTL in milliseconds.
        ttl_ms: u64,
    },
    /// No lease with this key is in the table (never inserted, or already released).
    #[error("no lease with key {key} in the table (never inserted, or already released)")]
    UnknownLease {
        /// The key, as `Debug` prints it.
        key: String,
    },
    /// A lease with this key is already in the table.
    #[error("a lease with key {key} is already in the table")]
    DuplicateLease {
        /// The key, as `Debug` prints it.
        key: String,
    },
    /// The call found the lease already past its end; it was released for `reason` instead.
    #[error("lease {key} was released ({reason}) before this call took effect")]
    LeaseReleased {
        /// The key, as `Debug` prints it.
        key: String,
        /// Why the lease ended.
        reason: ReleaseReason,
    },
}
