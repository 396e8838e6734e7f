//! Errors of kvx-offload.

use kvx_core::{CoreError, RequestId};

use crate::tier::Tier;

/// What went wrong in kvx-offload.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum OffloadError {
    /// A tier cannot make room: too many of its blocks are pinned or being stored.
    #[error("{tier:?} tier has no room: {needed} blocks needed, only {evictable} evictable")]
    NoRoom {
        /// The tier.
        tier: Tier,
        /// Blocks that had to be evicted.
        needed: usize,
        /// Blocks that could be.
        evictable: usize,
    },
    /// A request the connector does not know.
    #[error("{0} is unknown to the connector")]
    UnknownRequest(RequestId),
    /// Engine blocks and keys do not match up.
    #[error("{request}: {keys} block keys but {blocks} engine blocks")]
    BlockCountMismatch {
        /// The request.
        request: RequestId,
        /// Keys given.
        keys: usize,
        /// Engine blocks given.
        blocks: usize,
    },
    /// Bad configuration: `field` names the setting (dotted for nested ones, e.g. `file.blocks`).
    #[error("invalid offload config: {field}: {reason}")]
    Config {
        /// The setting.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Engine blocks were given for a known request that has no lookup waiting for them (its
    /// last lookup found nothing, or was already allocated).
    #[error("{0}: engine blocks given but no lookup is waiting for them")]
    NoPendingLookup(RequestId),
    /// Setting up a tier failed (opening the file store, starting the driver, allocating).
    #[error("cannot set up the {what}: {reason}")]
    Setup {
        /// What was being set up.
        what: &'static str,
        /// Why it failed.
        reason: String,
    },
    /// The kvx-core driver failed.
    #[error(transparent)]
    Core(#[from] CoreError),
}

impl OffloadError {
    /// A [`OffloadError::Config`] error for `field`.
    pub fn config(field: impl Into<String>, reason: impl std::fmt::Display) -> OffloadError {
        OffloadError::Config {
            field: field.into(),
            reason: reason.to_string(),
        }
    }
}
