//! `kvx bench <target>`: one module per backend.

use clap::Subcommand;

/// Which backend to benchmark.
#[derive(Subcommand)]
pub enum BenchTarget {}

/// Run a benchmark; returns the process exit code.
pub fn run(target: BenchTarget) -> i32 {
    match target {}
}
