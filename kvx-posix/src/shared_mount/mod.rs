//! Many nodes on one shared mount, the parts the store uses: the probe cache (what a probe of a
//! key missing from the index found), the touch lane (a loaded block's mtime, the recency
//! signal) and the listing (what the last collector pass saw). The collector itself, which
//! keeps each root under a quota by removing the least recently used blocks through the store,
//! is [`crate::collector`].

pub(crate) mod listing;
pub(crate) mod probe_cache;
pub(crate) mod touch;
