//! `kvx gc DIR --max-bytes N`: remove the least recently used blocks (oldest mtime first: a
//! store writes the file, a load touches it) until the store's block bytes are at most N, and
//! stale temporary files. Runs at once on one or many nodes do no harm.

use std::path::PathBuf;
use std::time::SystemTime;

use clap::Args;
use kvx_posix::maintenance::{
    Collected, GcOptions, GcReport, MaintenanceError, Progress, Removal, Worker, gc, walk,
};
use serde_json::json;

use super::child::in_child;
use super::{Bar, EXIT_BAD_ARGS, FileOpArgs, no_store, shards, unfinished};
use crate::size::parse_size;

/// Options of `kvx gc`.
#[derive(Args, Debug, Clone)]
pub struct GcArgs {
    /// The store's root directory (the one holding `ab/<key>.kvb`, or the shard directories
    /// of a tensor- or pipeline-parallel engine, whose blocks go whole: every shard together).
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
    let result = match shards::shard_dirs(&args.dir, opts.deadline) {
        Ok(dirs) if !dirs.is_empty() => gc_sharded(&args.dir, &dirs, &opts, &mut |p| bar.update(p)),
        Ok(_) => gc(&args.dir, &opts, &mut |p| bar.update(p)),
        Err(e) => Err(e),
    };
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

/// `gc` of a root holding shard directories (see [`super::shards`]): blocks go whole, all their
/// shard files together; incomplete blocks older than the stale age first (no engine can load
/// them), then the least recently used (newest shard mtime) until the quota holds. Block files
/// directly under the root (a one-worker engine's) count as blocks of one shard. Stale
/// temporary files go from every directory. Counts in the report are files.
fn gc_sharded(
    root: &std::path::Path,
    dirs: &[(kvx_posix::Shard, PathBuf)],
    opts: &GcOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<GcReport, MaintenanceError> {
    let mut worker = Worker::spawn(opts.deadline)?;
    let mut blocks = shards::blocks(dirs, &mut worker, progress)?;
    for e in walk(root, &mut worker, progress)? {
        if let kvx_posix::maintenance::Kind::Block(key) = e.kind
            && e.id.is_some()
        {
            blocks.push(shards::ShardedBlock {
                layout: (1, 1),
                key,
                files: vec![e],
            });
        }
    }
    let now = SystemTime::now();
    let stale_incomplete =
        |b: &shards::ShardedBlock| !b.complete() && b.age(now) >= opts.stale_after;
    // Stale incomplete blocks first, then oldest first; equal times by key.
    blocks.sort_by_key(|b| (!stale_incomplete(b), b.modified(), b.key));
    let files: u64 = blocks.iter().map(|b| b.files.len() as u64).sum();
    let bytes: u64 = blocks.iter().map(|b| b.bytes()).sum();
    let mut report = GcReport {
        blocks_before: files,
        bytes_before: bytes,
        blocks_after: files,
        bytes_after: bytes,
        ..GcReport::default()
    };
    for b in &blocks {
        if report.bytes_after <= opts.max_bytes && !stale_incomplete(b) {
            break;
        }
        for ((path, outcome), f) in shards::remove(&mut worker, b, opts.dry_run)?
            .into_iter()
            .zip(&b.files)
        {
            match outcome {
                Ok(Some(Removal::Changed)) => report.kept_changed += 1,
                Ok(o) => {
                    report.blocks_after -= 1;
                    report.bytes_after -= f.len;
                    report.blocks.push(Collected {
                        path,
                        bytes: f.len,
                        modified: f.modified,
                        outcome: o,
                    });
                }
                Err(e) => report.failed.push((path, e)),
            }
        }
    }
    // Stale temporary files: a quota nothing exceeds removes only those.
    let temps_only = GcOptions {
        max_bytes: u64::MAX,
        ..opts.clone()
    };
    for dir in std::iter::once(root).chain(dirs.iter().map(|d| d.1.as_path())) {
        let r = gc(dir, &temps_only, &mut |_| {})?;
        report.temps.extend(r.temps);
        report.failed.extend(r.failed);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kvx_core::BlockKey;
    use kvx_posix::Shard;

    use super::*;

    fn put(root: &std::path::Path, s: Shard, key: BlockKey, age_s: u64) -> PathBuf {
        let hex = key.to_hex();
        let dir = root.join(s.dir_name()).join(&hex[..2]);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("{hex}.kvb"));
        std::fs::write(&p, [0u8; 100]).unwrap();
        let f = std::fs::File::options().write(true).open(&p).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(age_s))
            .unwrap();
        p
    }

    #[test]
    fn sharded_gc_removes_whole_blocks_incomplete_ones_first() {
        let d = tempfile::tempdir().unwrap();
        let [s0, s1] = [
            Shard::new(0, 2, 0, 1).unwrap(),
            Shard::new(1, 2, 0, 1).unwrap(),
        ];
        let (old, new, half) = (BlockKey(1 << 120), BlockKey(2 << 120), BlockKey(3 << 120));
        let old_files = [put(d.path(), s0, old, 500), put(d.path(), s1, old, 400)];
        let new_files = [put(d.path(), s0, new, 10), put(d.path(), s1, new, 10)];
        let half_file = put(d.path(), s0, half, 100);
        let dirs = shards::shard_dirs(d.path(), Duration::from_secs(5)).unwrap();
        let mut opts = GcOptions::new(250);
        opts.stale_after = Duration::from_secs(60);
        let r = gc_sharded(d.path(), &dirs, &opts, &mut |_| {}).unwrap();
        assert_eq!((r.blocks_before, r.bytes_before), (5, 500));
        // The incomplete block goes (stale), then the older complete block, both its shards:
        // 200 bytes are left, under the quota of 250.
        assert_eq!((r.blocks_after, r.bytes_after), (2, 200));
        assert!(!half_file.exists());
        assert!(old_files.iter().all(|p| !p.exists()));
        assert!(new_files.iter().all(|p| p.exists()));
        // A young incomplete block may be a store in flight: kept even over the quota.
        put(d.path(), s1, half, 0);
        std::fs::remove_file(&new_files[1]).unwrap();
        let r = gc_sharded(d.path(), &dirs, &GcOptions::new(1000), &mut |_| {}).unwrap();
        assert_eq!(r.blocks.len(), 0);
    }
}
