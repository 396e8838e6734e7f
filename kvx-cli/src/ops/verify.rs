//! `kvx verify DIR`: check every block of a store as a load would; report each problem by path
//! and reason; with `--repair`, remove corrupt blocks and stale temporary files.

use std::path::PathBuf;

use clap::Args;
use kvx_posix::maintenance::{Action, Finding, Removal, VerifyOptions, VerifyReport, verify};
use serde_json::json;

use super::child::in_child;
use super::{Bar, EXIT_BAD_ARGS, FileOpArgs, no_store, shards, unfinished};

/// Options of `kvx verify`.
#[derive(Args, Debug, Clone)]
pub struct VerifyArgs {
    /// The store's root directory (the one holding `ab/<key>.kvb`, or the shard directories
    /// `shard-tp<t>of<T>-pp<p>of<P>/` of a tensor- or pipeline-parallel engine: each is checked,
    /// and blocks some shard lacks are reported).
    pub dir: PathBuf,
    /// Remove corrupt blocks, foreign `.kvb` files and stale temporary files (never a block of
    /// a newer format version, never a file that is not kvx's).
    #[arg(long)]
    pub repair: bool,
    #[command(flatten)]
    pub ops: FileOpArgs,
}

fn action_word(a: &Action) -> String {
    match a {
        Action::Reported => "reported".into(),
        Action::Removed => "removed".into(),
        Action::AlreadyGone => "already gone".into(),
        Action::Changed => "replaced since read, left alone".into(),
        Action::RemoveFailed(e) => format!("remove failed: {e}"),
    }
}

fn finding_json(f: &Finding) -> serde_json::Value {
    json!({
        "path": f.path.display().to_string(),
        "kind": f.kind.label(),
        "problem": f.kind.is_problem(),
        "reason": f.reason,
        "action": action_word(&f.action),
    })
}

/// The exit code for `report`: 1 when it found problems (even if `--repair` removed them).
fn exit_code(report: &VerifyReport) -> i32 {
    i32::from(report.problems() > 0)
}

/// Run `kvx verify` (in a child process, see [`in_child`]); returns the process exit code.
pub fn run(args: VerifyArgs) -> i32 {
    in_child("verify", || run_here(args))
}

fn run_here(args: VerifyArgs) -> i32 {
    let opts = VerifyOptions {
        deadline: args.ops.deadline(),
        stale_after: args.ops.stale_after,
        repair: args.repair,
    };
    let mut bar = Bar::new("checked");
    let result = verify(&args.dir, &opts, &mut |p| bar.update(p));
    bar.finish();
    let mut report = match result {
        Ok(r) => r,
        Err(e) => return unfinished("verify", &args.dir, &e, args.ops.json),
    };
    let sharded = match verify_shards(&args, &opts, &mut report) {
        Ok(s) => s,
        Err(e) => return unfinished("verify", &args.dir, &e, args.ops.json),
    };
    if report.blocks_checked == 0
        && report.findings.is_empty()
        && let Some(msg) = no_store("verify", &args.dir)
    {
        eprintln!("{msg}");
        return EXIT_BAD_ARGS;
    }
    for (path, reason, action) in &sharded.incomplete {
        println!("{}: {reason} [{action}]", path.display());
    }
    for f in &report.findings {
        println!(
            "{}: {} [{}]",
            f.path.display(),
            f.reason,
            action_word(&f.action)
        );
    }
    let problems = report.problems();
    let removed = report
        .findings
        .iter()
        .filter(|f| f.action == Action::Removed)
        .count();
    println!(
        "verified {}: {} blocks checked, {} ok ({} bytes); {} problems{}; {} notes; {} temporary \
         files in flight",
        args.dir.display(),
        report.blocks_checked,
        report.blocks_ok,
        report.bytes_ok,
        problems,
        if args.repair {
            format!(" ({removed} removed, {} left)", report.unresolved())
        } else {
            String::new()
        },
        report.findings.len() - problems,
        report.temps_in_flight,
    );
    if !sharded.dirs.is_empty() {
        println!(
            "sharded: {} shard directories; {} incomplete blocks (a shard missing) {}; {} \
             incomplete blocks younger than the stale age (stores in flight)",
            sharded.dirs.len(),
            sharded.stale,
            if args.repair { "removed" } else { "found" },
            sharded.young,
        );
    }
    let code = exit_code(&report).max(i32::from(sharded.stale > 0));
    if args.ops.json {
        let findings: Vec<_> = report.findings.iter().map(finding_json).collect();
        println!(
            "{}",
            json!({
                "command": "verify",
                "root": args.dir.display().to_string(),
                "repair": args.repair,
                "blocks_checked": report.blocks_checked,
                "blocks_ok": report.blocks_ok,
                "bytes_ok": report.bytes_ok,
                "temps_in_flight": report.temps_in_flight,
                "vanished": report.vanished,
                "problems": problems,
                "removed": removed,
                "unresolved": report.unresolved(),
                "findings": findings,
                "shard_dirs": sharded.dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>(),
                "incomplete_blocks": sharded.stale,
                "incomplete_in_flight": sharded.young,
                "exit_code": code,
            })
        );
    }
    code
}

/// What `verify` found about a sharded store (nothing for a store of one worker).
#[derive(Default)]
struct ShardedFindings {
    /// The shard directories, each verified as a store.
    dirs: Vec<PathBuf>,
    /// Shard files of incomplete blocks older than the stale age: path, reason, action.
    incomplete: Vec<(PathBuf, String, String)>,
    /// Incomplete blocks older than the stale age (problems).
    stale: usize,
    /// Incomplete blocks younger than it (a store of the block may be in flight).
    young: usize,
}

/// Verify every shard directory under `args.dir` into `report`, and find the blocks some
/// shard lacks (see [`super::shards`]); `--repair` removes the shards of stale incomplete ones.
fn verify_shards(
    args: &VerifyArgs,
    opts: &VerifyOptions,
    report: &mut VerifyReport,
) -> Result<ShardedFindings, kvx_posix::maintenance::MaintenanceError> {
    let dirs = shards::shard_dirs(&args.dir, opts.deadline)?;
    let mut out = ShardedFindings {
        dirs: dirs.iter().map(|d| d.1.clone()).collect(),
        ..ShardedFindings::default()
    };
    if dirs.is_empty() {
        return Ok(out);
    }
    for (_, dir) in &dirs {
        let r = verify(dir, opts, &mut |_| {})?;
        report.blocks_checked += r.blocks_checked;
        report.blocks_ok += r.blocks_ok;
        report.bytes_ok += r.bytes_ok;
        report.temps_in_flight += r.temps_in_flight;
        report.vanished += r.vanished;
        report.findings.extend(r.findings);
    }
    let mut worker = kvx_posix::maintenance::Worker::spawn(opts.deadline)?;
    let now = std::time::SystemTime::now();
    for b in shards::blocks(&dirs, &mut worker, &mut |_| {})? {
        if b.complete() {
            continue;
        }
        if b.age(now) < opts.stale_after {
            out.young += 1;
            continue;
        }
        out.stale += 1;
        let reason = format!(
            "incomplete block: {} of {} shards (tensor {} x pipeline {}) hold it; no engine can load it",
            b.files.len(),
            b.layout.0 * b.layout.1,
            b.layout.0,
            b.layout.1
        );
        let actions: Vec<(PathBuf, String)> = if args.repair {
            shards::remove(&mut worker, &b, false)?
                .into_iter()
                .map(|(p, r)| {
                    let a = match r {
                        Ok(Some(Removal::Removed)) => "removed".to_string(),
                        Ok(Some(Removal::AlreadyGone)) => "already gone".into(),
                        Ok(_) => "replaced since read, left alone".into(),
                        Err(e) => format!("remove failed: {e}"),
                    };
                    (p, a)
                })
                .collect()
        } else {
            b.files
                .iter()
                .map(|f| (f.path.clone(), "reported".into()))
                .collect()
        };
        for (p, a) in actions {
            out.incomplete.push((p, reason.clone(), a));
        }
    }
    Ok(out)
}
