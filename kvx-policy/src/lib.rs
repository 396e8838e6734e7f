//! Pure policy decisions for kvx: what to do when blocks fail to load, default deadlines, TTL
//! leases for remote readers, and a health breaker per backend target.
//!
//! Nothing here does I/O, spawns threads or reads a clock: time comes in as `now` arguments,
//! so every decision is a deterministic value the caller acts on.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvx_core::EngineBlockId;
//! use kvx_policy::{Admission, BlockOutcome, Breaker, LoadDecision, PolicyConfig};
//!
//! let cfg: PolicyConfig = serde_json::from_str(
//!     r#"{"load_failure": {"auto": {"max_recompute_tokens": 64}}}"#,
//! ).unwrap();
//! cfg.validate().unwrap();
//!
//! // Block 1 of 3 failed: keep the first 16 tokens, recompute blocks 1 and 2.
//! let outcomes = [
//!     BlockOutcome::loaded(EngineBlockId(7)),
//!     BlockOutcome::failed(EngineBlockId(8)),
//!     BlockOutcome::loaded(EngineBlockId(9)),
//! ];
//! let decision = cfg.load_failure.decide(&outcomes, 16, 48);
//! assert!(matches!(decision, LoadDecision::Recompute { valid_tokens: 16, .. }));
//! assert_eq!(decision.invalid_blocks(), &[EngineBlockId(8), EngineBlockId(9)]);
//!
//! // Three failures open the breaker; new ops are rejected at once.
//! let t0 = Instant::now();
//! let mut breaker = Breaker::new(cfg.breaker).unwrap();
//! for i in 0..3 {
//!     breaker.record_failure(t0 + Duration::from_millis(i));
//! }
//! assert_eq!(breaker.admit(t0 + Duration::from_millis(10)), Admission::Rejected);
//! ```
#![warn(missing_docs)]

mod breaker;
mod config;
mod error;
mod lease;
mod lease_table;
mod load_failure;
mod timeouts;

pub use breaker::{Admission, Breaker, BreakerConfig, BreakerState};
pub use config::PolicyConfig;
pub use error::PolicyError;
pub use lease::{DEFAULT_TTL_MS, Lease, LeaseConfig, LeaseState, ReleaseReason};
pub use lease_table::LeaseTable;
pub use load_failure::{BlockOutcome, LoadDecision, LoadFailurePolicy};
pub use timeouts::{DEFAULT_LOAD_MS, DEFAULT_STORE_MS, TimeoutConfig};
