//! The CUDA driver library this process already loaded (the stand-in or a real driver), and
//! symbol lookups in it, for the test helpers ([`crate::control`], [`crate::engine_stream`]).

use std::ffi::{CStr, c_void};

/// The names cudarc loads the driver by (the first ones it tries on Linux).
const LIBRARY_NAMES: [&CStr; 2] = [c"libcuda.so", c"libcuda.so.1"];

/// `f` of the first driver library loaded under one of cudarc's names that `f` accepts; `None`
/// when none is loaded (open a `CudaDevice` first) or `f` accepts none.
///
/// `f` gets a live `dlopen` handle; the library stays loaded afterwards (cudarc holds it), so
/// symbol addresses `f` took from it stay valid.
pub(crate) fn with_driver<T>(f: impl Fn(*mut c_void) -> Option<T>) -> Option<T> {
    LIBRARY_NAMES.iter().find_map(|name| {
        // SAFETY: RTLD_NOLOAD only returns a handle to a library already loaded (it loads
        // nothing, runs no constructor); the name is NUL-terminated.
        let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if lib.is_null() {
            return None;
        }
        let found = f(lib);
        // SAFETY: balances the reference RTLD_NOLOAD took; the library stays loaded (cudarc
        // holds it), so the addresses `f` took stay valid.
        unsafe { libc::dlclose(lib) };
        found
    })
}

/// The address of `name` in the library `lib` (a live handle from [`with_driver`]).
pub(crate) fn symbol(lib: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    // SAFETY: `lib` is a live handle; looking a symbol up calls nothing.
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}
