//! The connector's settings: vLLM's `kv_connector_extra_config`, as JSON, read by serde into
//! kvx-offload's [`OffloadConfig`] (its keys, its defaults, its checks; the table is in
//! kvx-python/README.md). The settings the connector takes from vLLM are refused there.

use kvx_offload::OffloadConfig;
use kvx_policy::LoadFailurePolicy;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::Value;

/// Keys of [`OffloadConfig`] the connector sets from vLLM, and why a user may not.
const FROM_VLLM: [(&str, &str); 2] = [
    (
        "block_tokens",
        "the connector sets it to vLLM's KV block size",
    ),
    (
        "load_failure",
        "the connector reports the exact failed blocks and vLLM's kv_load_failure_policy \
         decides what happens to the request",
    ),
];

fn bad(reason: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("kv_connector_extra_config: {reason}"))
}

/// The connector's config: `extra` (a JSON object) with `block_tokens` from vLLM and the load
/// failures reported block by block; every file-tier root must be an existing directory, and
/// the tier not shared. It stats the roots: call it with the GIL released.
pub fn connector_config(extra: &str, block_tokens: u32) -> PyResult<OffloadConfig> {
    let mut value: Value = serde_json::from_str(extra).map_err(bad)?;
    let Some(keys) = value.as_object_mut() else {
        return Err(bad(format!("expected a JSON object, got {extra}")));
    };
    for (key, why) in FROM_VLLM {
        if keys.contains_key(key) {
            return Err(bad(format!("{key}: not a setting here: {why}")));
        }
    }
    keys.insert("block_tokens".into(), block_tokens.into());
    let fail = serde_json::to_value(LoadFailurePolicy::Fail).map_err(bad)?;
    keys.insert("load_failure".into(), fail);
    let cfg = OffloadConfig::from_json_value(value).map_err(bad)?;
    if let Some(f) = &cfg.file {
        if f.shared.is_some() {
            return Err(bad(
                "file.shared: the vLLM connector takes no shared mount yet (its scheduler \
                 process has no store to probe the mount with)",
            ));
        }
        for root in &f.roots {
            if !root.is_dir() {
                return Err(bad(format!(
                    "file.roots: {} does not exist or is not a directory",
                    root.display()
                )));
            }
        }
    }
    Ok(cfg)
}

/// The connector's config for `extra` (JSON) and vLLM's `block_tokens`, as JSON with every key
/// (defaults filled in); a bad or unknown key is a `ValueError` naming it. The GIL is free
/// while the file-tier roots are checked (a stuck mount holds only this call).
#[pyfunction]
pub fn parse_config(py: Python<'_>, extra: &str, block_tokens: u32) -> PyResult<String> {
    py.detach(|| connector_config(extra, block_tokens).map(|c| c.to_json()))
}

/// kvx-offload's `OffloadConfig` read from `text` (JSON) and written back with every key
/// (defaults filled in): what serde makes of a config, without the connector's own rules.
#[pyfunction]
pub fn offload_config(text: &str) -> PyResult<String> {
    OffloadConfig::from_json(text)
        .map(|c| c.to_json())
        .map_err(|e| PyValueError::new_err(e.to_string()))
}
