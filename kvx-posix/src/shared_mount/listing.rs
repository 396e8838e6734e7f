//! What a collector pass saw on the mount, as the store's handle keeps it for the node's
//! scheduler (see [`crate::collector`]).

use std::sync::Arc;
use std::time::Instant;

use kvx_core::BlockKey;
use rustc_hash::FxHashSet;

/// What one collector pass saw on the mount.
#[derive(Debug, Clone)]
pub struct Listing {
    /// The pass's number on this handle, from 1: a newer listing has a larger one.
    pub pass: u64,
    /// When the walk began: a block a node took into its index before this, absent from
    /// `keys`, was gone from the mount.
    pub started: Instant,
    /// Blocks the walk found, less those the pass queued for removal.
    pub keys: Arc<FxHashSet<BlockKey>>,
}
