//! Startup check of each root: create it, find out whether its filesystem takes O_DIRECT, and
//! whether it is a local block file system, whose I/O can be issued inline.

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

/// `statfs` magic numbers of local block file systems (and tmpfs): an io_uring op on them that
/// would block is refused by the kernel and handed to its workers, never blocking the
/// submitting thread, and a read past the end of a file returns short (no statx needed).
const LOCAL_FS_MAGIC: [i64; 5] = [
    0xEF53,      // ext2, ext3, ext4
    0x5846_5342, // XFS
    0x9123_683E, // Btrfs
    0xF2F5_2010, // F2FS
    0x0102_1994, // tmpfs
];

/// Whether `root` is on a local block file system (see [`LOCAL_FS_MAGIC`]). FUSE, NFS, CIFS,
/// Ceph, Lustre, GPFS and anything unknown answer false: their ops always go through the
/// kernel's workers, so a stuck mount never blocks the ring thread.
pub(crate) fn is_local_fs(root: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(root.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs is a plain C struct of integers (all-zero is a valid value), written by
    // the kernel into our own stack variable; `c` is a NUL-terminated path we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    #[allow(clippy::unnecessary_cast)] // f_type's type differs between targets
    let magic = st.f_type as i64;
    r == 0 && LOCAL_FS_MAGIC.contains(&magic)
}

/// Create `root` if needed and return whether an aligned O_DIRECT write works there. A
/// filesystem that refuses O_DIRECT (tmpfs answers EINVAL) gets `false` and one warning.
pub(crate) fn takes_direct(root: &Path, want_direct: bool) -> Result<bool, PosixError> {
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
