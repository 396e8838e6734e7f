//! The `kvx` command. One module per subcommand; `main` only parses and dispatches.

mod bench;
mod info;
mod ops;
mod replay;
mod size;

use clap::{Parser, Subcommand};

/// Counts allocations per thread, for `kvx bench core`; otherwise the system allocator.
#[global_allocator]
static ALLOCATOR: bench::counting_alloc::CountingAlloc = bench::counting_alloc::CountingAlloc;

/// kvx: move LLM KV-cache blocks on a deadline.
#[derive(Parser)]
#[command(name = "kvx", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the version and what this build of kvx contains.
    Info,
    /// Benchmark a backend against the physical path, measured side by side in one run.
    Bench {
        #[command(subcommand)]
        target: bench::BenchTarget,
    },
    /// Replay a request trace (Mooncake format; an embedded default without one) through the
    /// real tiers, and compare the hit rate with an ideal LRU cache of the same capacity.
    Replay(Box<replay::ReplayArgs>),
    /// Check every block of a store directory (header, key, length, checksum); report problems
    /// by path and reason; `--repair` removes corrupt blocks and stale temporary files.
    #[command(after_help = ops::EXIT_CODES)]
    Verify(ops::verify::VerifyArgs),
    /// Remove the least recently used blocks (oldest mtime) of a store directory until its
    /// block bytes are at most `--max-bytes`, and stale temporary files.
    #[command(after_help = ops::EXIT_CODES)]
    Gc(ops::gc::GcArgs),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Command::Info => info::run(),
        Command::Bench { target } => bench::run(target),
        Command::Replay(args) => replay::run(*args),
        Command::Verify(args) => ops::verify::run(args),
        Command::Gc(args) => ops::gc::run(args),
    };
    std::process::exit(code);
}
