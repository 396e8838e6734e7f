//! Shared helpers for the kvx criterion benchmarks.
