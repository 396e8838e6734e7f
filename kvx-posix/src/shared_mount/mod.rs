//! Many nodes on one shared mount: the probe cache (what a probe of a key missing from the
//! index found), the touch lane (a loaded block's mtime, the recency signal) and the collector
//! (each root kept under a quota by removing the least recently used blocks).

pub(crate) mod probe_cache;
pub(crate) mod touch;
