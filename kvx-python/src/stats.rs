//! kvx-offload's [`TransferStats`] as the plain dict the connector hands to vLLM's stats
//! (`kvx.vllm.stats.KvxStats`): each count under its name, a count by tier as
//! `{tier: n}`, one by tier and reason as `{tier: {reason: n}}`, and `load_seconds` as a list.

use std::collections::BTreeMap;

use kvx_offload::TransferStats;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `stats` as a dict; counts of zero are left out, so an idle interval gives `{}`.
pub(crate) fn to_dict<'py>(py: Python<'py>, stats: &TransferStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, counts) in [
        ("loaded_blocks", &stats.loaded_blocks),
        ("loaded_bytes", &stats.loaded_bytes),
        ("stored_blocks", &stats.stored_blocks),
        ("stored_bytes", &stats.stored_bytes),
        ("store_skipped_blocks", &stats.store_skipped_blocks),
    ] {
        if !counts.is_empty() {
            d.set_item(name, counts)?;
        }
    }
    for (name, counts) in [
        ("load_failed_blocks", &stats.load_failed_blocks),
        ("store_failed_blocks", &stats.store_failed_blocks),
    ] {
        if !counts.is_empty() {
            d.set_item(name, by_tier(counts))?;
        }
    }
    if !stats.load_seconds.is_empty() {
        d.set_item("load_seconds", &stats.load_seconds)?;
    }
    Ok(d)
}

/// `{(tier, reason): n}` as `{tier: {reason: n}}`.
fn by_tier(
    counts: &BTreeMap<(&'static str, &'static str), u64>,
) -> BTreeMap<&'static str, BTreeMap<&'static str, u64>> {
    let mut out: BTreeMap<_, BTreeMap<_, _>> = BTreeMap::new();
    for ((tier, reason), n) in counts {
        out.entry(*tier).or_default().insert(*reason, *n);
    }
    out
}
