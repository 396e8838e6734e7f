//! `kvx info`: version and build contents.

/// Print what this binary contains; exit code 0.
pub fn run() -> i32 {
    println!("kvx {}", env!("CARGO_PKG_VERSION"));
    println!("core: tracker, CPU backend, driver");
    0
}
