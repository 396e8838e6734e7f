//! Can FUSE be used here? Checked for real, with a probe mount.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::{Backing, StallFs};

/// `Ok` when a [`StallFs`] can be mounted on this machine, else the reason it cannot (for a
/// test's `skip: <reason>` line): `/dev/fuse` missing, not root, or a probe mount that fails.
pub fn fuse_available() -> Result<(), String> {
    if !Path::new("/dev/fuse").exists() {
        return Err("/dev/fuse does not exist".into());
    }
    // Effective uid: the owner of a file this process just created.
    let dir = tempfile::tempdir().map_err(|e| format!("cannot create a temp dir: {e}"))?;
    let uid = fs::metadata(dir.path())
        .map_err(|e| format!("cannot stat {}: {e}", dir.path().display()))?
        .uid();
    if uid != 0 {
        return Err(format!("not root (euid {uid}); mounting FUSE needs root"));
    }
    let mount = StallFs::mount(dir.path(), Backing::Memory)
        .map_err(|e| format!("probe mount failed: {e}"))?;
    let probe = mount.path().join("probe");
    let round_trip = fs::write(&probe, b"kvx").and_then(|()| fs::read(&probe));
    let torn_down = mount.abort();
    match round_trip {
        Ok(bytes) if bytes == b"kvx" => {}
        Ok(bytes) => {
            return Err(format!(
                "probe mount read back {bytes:?} instead of \"kvx\""
            ));
        }
        Err(e) => return Err(format!("probe mount I/O failed: {e}")),
    }
    torn_down.map_err(|e| format!("probe unmount failed: {e}"))
}
