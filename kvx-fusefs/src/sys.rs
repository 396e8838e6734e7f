//! The few system calls std does not wrap: `umount2` and `statvfs`.

use std::ffi::CString;
use std::io;
use std::mem::MaybeUninit;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::backing::StatFs;

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// `umount2(path, flags)`.
pub(crate) fn umount2(path: &Path, flags: libc::c_int) -> io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: `c` is a NUL-terminated string that lives across the call; umount2 only reads it.
    let rc = unsafe { libc::umount2(c.as_ptr(), flags) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `statvfs(path)`, as the numbers FUSE statfs wants.
pub(crate) fn statvfs(path: &Path) -> io::Result<StatFs> {
    let c = c_path(path)?;
    let mut out = MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a live NUL-terminated string; `out` is a writable statvfs that the call
    // fills completely when it returns 0, and we read it only then.
    let st = unsafe {
        if libc::statvfs(c.as_ptr(), out.as_mut_ptr()) != 0 {
            return Err(io::Error::last_os_error());
        }
        out.assume_init()
    };
    let u32_of = |v: libc::c_ulong| u32::try_from(v).unwrap_or(u32::MAX);
    Ok(StatFs {
        blocks: st.f_blocks,
        bfree: st.f_bfree,
        bavail: st.f_bavail,
        files: st.f_files,
        ffree: st.f_ffree,
        bsize: u32_of(st.f_bsize),
        namelen: u32_of(st.f_namemax),
        frsize: u32_of(st.f_frsize),
    })
}
