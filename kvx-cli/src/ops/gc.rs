//! `kvx gc DIR --max-bytes N`: remove the least recently used blocks (oldest mtime first: a
//! store writes the file, a load touches it) until the store's block bytes are at most N, and
//! stale temporary files. Runs at once on one or many nodes do no harm.

use std::path::PathBuf;
use std::time::SystemTime;

use clap::Args;
use kvx_posix::maintenance::{Collected, GcOptions, GcReport, Removal, gc};
use serde_json::json;

use super::child::in_child;
use super::{Bar, EXIT_BAD_ARGS, FileOpArgs, no_store, unfinished};
use crate::size::parse_size;

/// Options of `kvx gc`.
#[derive(Args, Debug, Clone)]
pub struct GcArgs {
    /// The store's root directory (the one holding `ab/<key>.kvb`).
    pub dir: PathBuf,
    /// Quota: block bytes (sum of block file lengths) to keep at most, e.g. 500GiB, 2TiB.
    #[arg(long, value_parser = parse_size)]
    pub max_bytes: u64,
    /// Only report what would be removed.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub ops: FileOpArgs,
}

fn outcome_word(o: Option<Removal>) -> &'static str {
    match o {
        None => "would remove",
        Some(Removal::Removed) => "removed",
        Some(Removal::AlreadyGone) => "already gone",
        Some(Removal::Changed) => "kept",
    }
}

fn age_s(c: &Collected, now: SystemTime) -> u64 {
    now.duration_since(c.modified).unwrap_or_default().as_secs()
}

fn collected_json(c: &Collected, now: SystemTime) -> serde_json::Value {
    json!({
        "path": c.path.display().to_string(),
        "bytes": c.bytes,
        "age_s": age_s(c, now),
        "outcome": outcome_word(c.outcome),
    })
}

/// The exit code for `report`: 1 when the quota is not reached or a removal failed.
fn exit_code(report: &GcReport, max: u64) -> i32 {
    i32::from(report.bytes_after > max || !report.failed.is_empty())
}

/// Run `kvx gc` (in a child process, see [`in_child`]); returns the process exit code.
pub fn run(args: GcArgs) -> i32 {
    in_child("gc", || run_here(args))
}

fn run_here(args: GcArgs) -> i32 {
    let max = args.max_bytes;
    let opts = GcOptions {
        max_bytes: max,
        deadline: args.ops.deadline(),
        stale_after: args.ops.stale_after,
        dry_run: args.dry_run,
    };
    let mut bar = Bar::new("removed");
    let result = gc(&args.dir, &opts, &mut |p| bar.update(p));
    bar.finish();
    let report = match result {
        Ok(r) => r,
        Err(e) => return unfinished("gc", &args.dir, &e, args.ops.json),
    };
    if report.blocks_before == 0
        && report.temps.is_empty()
        && let Some(msg) = no_store("gc", &args.dir)
    {
        eprintln!("{msg}");
        return EXIT_BAD_ARGS;
    }
    let now = SystemTime::now();
    for c in report.blocks.iter().chain(&report.temps) {
        println!(
            "{} {} ({} bytes, last used {} s ago)",
            outcome_word(c.outcome),
            c.path.display(),
            c.bytes,
            age_s(c, now)
        );
    }
    for (path, e) in &report.failed {
        println!("could not remove {}: {e}", path.display());
    }
    let freed: u64 = report.blocks.iter().map(|c| c.bytes).sum();
    println!(
        "gc {}{}: block bytes {} -> {} (quota {max}); {} of {} blocks ({freed} bytes) and {} \
         stale temporary files {}; {} blocks kept (used since the walk); {} removals failed",
        args.dir.display(),
        if args.dry_run { " (dry run)" } else { "" },
        report.bytes_before,
        report.bytes_after,
        report.blocks.len(),
        report.blocks_before,
        report.temps.len(),
        if args.dry_run { "would go" } else { "gone" },
        report.kept_changed,
        report.failed.len(),
    );
    let code = exit_code(&report, max);
    if args.ops.json {
        let failed: Vec<_> = report
            .failed
            .iter()
            .map(|(p, e)| json!({"path": p.display().to_string(), "error": e}))
            .collect();
        println!(
            "{}",
            json!({
                "command": "gc",
                "root": args.dir.display().to_string(),
                "max_bytes": max,
                "dry_run": args.dry_run,
                "bytes_before": report.bytes_before,
                "bytes_after": report.bytes_after,
                "blocks_before": report.blocks_before,
                "blocks_after": report.blocks_after,
                "removed_blocks": report.blocks.len(),
                "removed_bytes": freed,
                "removed": report.blocks.iter().map(|c| collected_json(c, now)).collect::<Vec<_>>(),
                "temps_removed": report.temps.iter().map(|c| collected_json(c, now)).collect::<Vec<_>>(),
                "kept_changed": report.kept_changed,
                "failed": failed,
                "exit_code": code,
            })
        );
    }
    code
}
