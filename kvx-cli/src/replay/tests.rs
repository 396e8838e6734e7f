//! In-process replays: a few hundred requests through the real tiers (a host arena, the host
//! tier, a kvx-posix file tier in a temp dir), checking that the accounting adds up.

use clap::Parser;

use super::args::ReplayArgs;
use super::stats::RunStats;
use super::synth::{self, SynthConfig};
use super::{execute, report};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: ReplayArgs,
}

fn replay(flags: &[&str], requests: usize) -> (RunStats, report::Context, serde_json::Value) {
    let cli = Cli::parse_from(std::iter::once("kvx").chain(flags.iter().copied()));
    let mut s = cli.args.settings().expect("settings");
    s.progress = false;
    let trace = synth::generate(&SynthConfig {
        requests,
        ..SynthConfig::default()
    });
    let (stats, ctx, rig) = execute(&s, &trace, "test".into(), 0).expect("replay");
    let dir = rig.file_dir.as_ref().map(|d| d.path().to_owned());
    assert!(
        rig.teardown(false).is_none(),
        "the fresh file tier is removed"
    );
    assert!(dir.is_none_or(|d| !d.exists()));
    let json = report::to_json(&s, &stats, &ctx);
    (stats, ctx, json)
}

fn assert_adds_up(r: &RunStats, requests: u64) {
    assert_eq!(r.requests, requests);
    assert_eq!(r.ended, requests, "every request ended");
    assert_eq!(
        r.sending_reports, r.delayed_frees,
        "every request whose freeing was delayed reported finished once"
    );
    assert_eq!(
        r.hits() + r.missed + r.recomputed + r.failed_blocks,
        r.blocks,
        "every block was used, computed, recomputed or failed"
    );
    assert!(
        r.verified_blocks >= r.hits(),
        "every used block was verified"
    );
    assert_eq!(r.verified_bytes, r.verified_blocks * 4096);
    assert_eq!(r.load_waits.len() as u64, r.load_jobs);
    assert_eq!(r.ttft_cache_ms.len() as u64, requests - r.failed_requests);
}

#[test]
fn short_replay_through_both_tiers_adds_up() {
    // A small host tier so that the file tier serves hits too; 4 KiB blocks keep it quick.
    let (r, ctx, json) = replay(
        &[
            "--host-blocks",
            "96",
            "--file-blocks",
            "4000",
            "--block-bytes",
            "4K",
            "--speedup",
            "20",
        ],
        300,
    );
    assert_adds_up(&r, 300);
    assert!(r.hit_host > 0 && r.hit_file > 0, "both tiers served: {r:?}");
    assert!(r.stored_file > 0 && r.stored_host > 0);
    assert_eq!(
        r.failed_requests, 0,
        "recompute policy never fails a request"
    );
    assert!(ctx.ideal_hits > 0 && ctx.ideal_hits <= r.blocks);
    for field in [
        "requests",
        "hit_rate",
        "ideal_hit_rate",
        "load_p99_ms",
        "deadline_misses",
        "recomputed_blocks",
        "failed_requests",
    ] {
        assert!(json.get(field).is_some(), "JSON has {field}");
    }
    assert_eq!(json["requests"], 300);
}

#[test]
fn host_tier_only() {
    let (r, ctx, _) = replay(
        &[
            "--host-blocks",
            "2000",
            "--file-gib",
            "0",
            "--block-bytes",
            "4K",
            "--speedup",
            "20",
        ],
        200,
    );
    assert_adds_up(&r, 200);
    assert_eq!(r.hit_file, 0);
    assert_eq!(r.stored_file, 0);
    assert!(r.hit_host > 0);
    assert!(ctx.file_dir.is_none());
    assert!(r.posix.is_none());
}
