//! `kvx verify DIR`: check every block of a store as a load would; report each problem by path
//! and reason; with `--repair`, remove corrupt blocks and stale temporary files.

use std::path::PathBuf;

use clap::Args;
use kvx_posix::maintenance::{Action, Finding, VerifyOptions, VerifyReport, verify};
use serde_json::json;

use super::child::in_child;
use super::{Bar, EXIT_BAD_ARGS, FileOpArgs, no_store, unfinished};

/// Options of `kvx verify`.
#[derive(Args, Debug, Clone)]
pub struct VerifyArgs {
    /// The store's root directory (the one holding `ab/<key>.kvb`).
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
    let report = match result {
        Ok(r) => r,
        Err(e) => return unfinished("verify", &args.dir, &e, args.ops.json),
    };
    if report.blocks_checked == 0
        && report.findings.is_empty()
        && let Some(msg) = no_store("verify", &args.dir)
    {
        eprintln!("{msg}");
        return EXIT_BAD_ARGS;
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
    let code = exit_code(&report);
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
                "exit_code": code,
            })
        );
    }
    code
}
