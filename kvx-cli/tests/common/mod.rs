//! Helpers shared by the kvx-cli integration tests that run the built binary.

use std::process::Output;

use serde_json::Value;

/// The last stdout line of `out` as JSON, after checking that the run succeeded.
pub fn last_json(out: &Output) -> Value {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}: {stderr}",
        out.status.code()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().expect("a JSON line")).expect("JSON")
}
