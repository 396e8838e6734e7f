//! The real-time margins of these tests: one driver tick plus a stated allowance.

use std::time::Duration;

/// The driver's timer granularity.
pub const TICK: Duration = kvx_core::TICK;

/// What a 2-core machine shared with other builds adds on top: thread wake-ups, the line
/// protocol to the producer process, scheduling.
pub const ALLOWANCE: Duration = Duration::from_millis(50);
