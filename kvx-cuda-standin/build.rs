//! Names the stand-in `libcuda.so` inside the library (its ELF soname): once a process loaded
//! it by path (a Python test with ctypes, say), the dynamic loader answers a later
//! `dlopen("libcuda.so")` — cudarc's — with it, without `LD_LIBRARY_PATH`.

fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so");
    }
}
