//! kvx-policy (work in progress).
