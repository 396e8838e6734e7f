//! Startup check of each root: create it, and find out whether its filesystem takes O_DIRECT.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use kvx_core::AlignedBuf;

use crate::error::PosixError;
use crate::format::HEADER_LEN;

fn root_err(path: &Path, source: std::io::Error) -> PosixError {
    PosixError::Root {
        path: path.to_path_buf(),
        source,
    }
}

/// Create `root` if needed and return whether an aligned O_DIRECT write works there. A
/// filesystem that refuses O_DIRECT (tmpfs answers EINVAL) gets `false` and one warning.
pub(crate) fn probe_root(root: &Path, want_direct: bool) -> Result<bool, PosixError> {
    std::fs::create_dir_all(root).map_err(|e| root_err(root, e))?;
    let probe = root.join(format!(".kvx-probe-{}", std::process::id()));
    let mut buf = AlignedBuf::new(HEADER_LEN, HEADER_LEN)
        .map_err(|e| root_err(root, std::io::Error::other(e.to_string())))?;
    buf.as_mut_slice().fill(0x5a);
    let attempt = |direct: bool| -> std::io::Result<()> {
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create(true).truncate(true);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        let mut f = o.open(&probe)?;
        f.write_all(buf.as_slice())
    };
    let direct = if want_direct {
        match attempt(true) {
            Ok(()) => true,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(root = %root.display(),
                    "posix: the filesystem refuses O_DIRECT (EINVAL); using buffered I/O");
                false
            }
            Err(e) => {
                let _ = std::fs::remove_file(&probe);
                return Err(root_err(root, e));
            }
        }
    } else {
        false
    };
    if !direct {
        attempt(false).map_err(|e| root_err(root, e))?;
    }
    std::fs::remove_file(&probe).map_err(|e| root_err(root, e))?;
    Ok(direct)
}
