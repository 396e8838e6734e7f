//! What can go wrong in `kvx replay`, and the exit code each error maps to.

use std::path::PathBuf;

/// Exit code of bad input: an unreadable, empty or malformed trace, or bad flags.
pub const EXIT_BAD_INPUT: i32 = 2;
/// Exit code of a failed run: setup failed, a block came back wrong, accounting broke.
pub const EXIT_FAILED: i32 = 1;

/// An error of the replay, printed as one line.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The trace file cannot be read.
    #[error("cannot read trace {path}: {source}")]
    TraceRead {
        /// The trace file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The trace holds no request.
    #[error("trace {path} has no requests")]
    TraceEmpty {
        /// The trace file.
        path: PathBuf,
    },
    /// A line of the trace is not a valid request.
    #[error("{path}:{line}: {reason}")]
    TraceLine {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A flag has a value that cannot work.
    #[error("invalid option: {0}")]
    BadOption(String),
    /// The tiers or the engine could not be set up.
    #[error("setup failed: {0}")]
    Setup(String),
    /// `--fault stall-disk` needs FUSE and it is not usable here.
    #[error("--fault stall-disk needs a FUSE mount, which is not usable here: {0}")]
    NoFuse(String),
    /// A block that a load reported as done does not hold the bytes that were stored.
    #[error(
        "{request}: block {index} (key {key}) loaded from the {tier} tier differs from what was stored"
    )]
    Mismatch {
        /// The request.
        request: u64,
        /// Index of the block in the request.
        index: usize,
        /// Its key.
        key: String,
        /// The tier it came from.
        tier: String,
    },
    /// The engine model and the connector disagree about what happened.
    #[error("accounting error: {0}")]
    Accounting(String),
    /// The connector or the driver failed.
    #[error("connector error: {0}")]
    Offload(#[from] kvx_offload::OffloadError),
}

impl ReplayError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            ReplayError::TraceRead { .. }
            | ReplayError::TraceEmpty { .. }
            | ReplayError::TraceLine { .. }
            | ReplayError::BadOption(_) => EXIT_BAD_INPUT,
            _ => EXIT_FAILED,
        }
    }
}
