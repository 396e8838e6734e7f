//! The end of a replay: a summary table for people, and one JSON object for scripts.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{Value, json};

use super::args::Settings;
use super::fault::Phase;
use super::stats::{ByReason, RunStats, mean, percentile, sorted};

const GIB: f64 = (1u64 << 30) as f64;

/// What the run was, beside its counters.
pub struct Context {
    /// Where the trace came from.
    pub source: String,
    /// Engine blocks.
    pub engine_blocks: u32,
    /// Where the file tier was, and whether it is left on disk.
    pub file_dir: Option<(String, bool)>,
    /// File tier blocks adopted at start.
    pub adopted: usize,
    /// File tier uses O_DIRECT.
    pub direct: bool,
    /// Ideal LRU hits with the total capacity (host + file).
    pub ideal_hits: u64,
    /// Ideal LRU hits with the capacity of the larger tier (what inclusive tiers can hold).
    pub ideal_inclusive_hits: u64,
    /// Trace lines skipped.
    pub skipped_lines: usize,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn rate(n: u64, d: u64) -> f64 {
    if d == 0 { 0.0 } else { n as f64 / d as f64 }
}

/// The results as one JSON object.
pub fn to_json(s: &Settings, r: &RunStats, c: &Context) -> Value {
    let waits: Vec<f64> = sorted(&r.load_waits.iter().map(|d| ms(*d)).collect::<Vec<_>>());
    let ttft_c = sorted(&r.ttft_cache_ms);
    let ttft_r = sorted(&r.ttft_recompute_ms);
    let model = s.blocks.model_block_bytes as f64;
    let moved = s.blocks.block_bytes as f64;
    let loaded = r.hits() as f64;
    let busy = r.load_busy.as_secs_f64();
    let fields: Vec<(&str, Value)> = vec![
        ("trace", json!(c.source)),
        ("requests", json!(r.requests)),
        ("blocks", json!(r.blocks)),
        ("hit_rate", json!(rate(r.hits(), r.blocks))),
        ("host_hit_rate", json!(rate(r.hit_host, r.blocks))),
        ("file_hit_rate", json!(rate(r.hit_file, r.blocks))),
        ("hit_host_blocks", json!(r.hit_host)),
        ("hit_file_blocks", json!(r.hit_file)),
        ("cross_node_hits", json!(r.cross_node_hits)),
        ("nodes", json!(s.nodes)),
        ("ideal_hit_rate", json!(rate(c.ideal_hits, r.blocks))),
        (
            "ideal_capacity_blocks",
            json!(s.host_blocks + s.file_blocks),
        ),
        (
            "ideal_inclusive_hit_rate",
            json!(rate(c.ideal_inclusive_hits, r.blocks)),
        ),
        ("load_jobs", json!(r.load_jobs)),
        ("load_p50_ms", json!(percentile(&waits, 50.0))),
        ("load_p99_ms", json!(percentile(&waits, 99.0))),
        ("load_max_ms", json!(waits.last().copied().unwrap_or(0.0))),
        ("deadline_ms", json!(s.load_deadline_ms)),
        ("max_request_wait_ms", json!(ms(r.max_request_wait))),
        ("deadline_misses", json!(r.deadline_misses)),
        ("deadline_missed_blocks", json!(r.deadline_missed_blocks)),
        ("load_rejected_blocks", json!(r.load_rejected_blocks)),
        ("load_corrupt_blocks", json!(r.load_corrupt_blocks)),
        (
            "load_host_buffer_gone_blocks",
            json!(r.load_host_buffer_gone),
        ),
        ("recomputed_blocks", json!(r.recomputed)),
        ("missed_blocks", json!(r.missed)),
        ("failed_requests", json!(r.failed_requests)),
        ("failed_request_blocks", json!(r.failed_blocks)),
        ("retries", json!(r.retries)),
        ("verified_blocks", json!(r.verified_blocks)),
        ("verified_bytes", json!(r.verified_bytes)),
        ("stored_host_blocks", json!(r.stored_host)),
        ("stored_file_blocks", json!(r.stored_file)),
        ("store_failed_file_blocks", json!(r.store_failed_file)),
        ("store_timeouts", json!(r.store_timeouts)),
        ("store_dropped_blocks", json!(r.store_dropped)),
        (
            "gib_stored",
            json!((r.stored_host + r.stored_file) as f64 * model / GIB),
        ),
        ("gib_loaded", json!(loaded * model / GIB)),
        (
            "bytes_stored_moved",
            json!((r.stored_host + r.stored_file) * s.blocks.block_bytes),
        ),
        ("bytes_loaded_moved", json!(r.hits() * s.blocks.block_bytes)),
        (
            "load_gib_per_s",
            json!(if busy > 0.0 {
                loaded * moved / GIB / busy
            } else {
                0.0
            }),
        ),
        ("ttft_cache_ms_mean", json!(mean(&ttft_c))),
        ("ttft_cache_ms_p50", json!(percentile(&ttft_c, 50.0))),
        ("ttft_cache_ms_p99", json!(percentile(&ttft_c, 99.0))),
        ("ttft_recompute_ms_mean", json!(mean(&ttft_r))),
        ("ttft_recompute_ms_p50", json!(percentile(&ttft_r, 50.0))),
        ("ttft_recompute_ms_p99", json!(percentile(&ttft_r, 99.0))),
        ("file_hits_before_stall", json!(r.file_hits_by_phase[0])),
        ("file_hits_during_stall", json!(r.file_hits_by_phase[1])),
        (
            "file_hits_after_stall",
            json!(r.file_hits_by_phase[2] + r.file_hits_by_phase[3]),
        ),
        ("file_hits_after_recovery", json!(r.file_hits_by_phase[3])),
        (
            "load_failed_blocks_during_stall",
            json!(r.load_failed_by_phase[1]),
        ),
        (
            "load_failed_blocks_after_recovery",
            json!(r.load_failed_by_phase[3]),
        ),
        ("store_failures_by_reason", r.store_failures.to_json()),
        ("load_failures_by_reason", r.load_failures.to_json()),
        (
            "store_failures_by_phase",
            by_phase(s, &r.store_failures_by_phase),
        ),
        (
            "load_failures_by_phase",
            by_phase(s, &r.load_failures_by_phase),
        ),
        (
            "stalls",
            json!(
                s.stalls
                    .iter()
                    .map(|x| json!({"at_s": x.at.as_secs_f64(), "for_s": x.duration.as_secs_f64()}))
                    .collect::<Vec<_>>()
            ),
        ),
        ("model", json!(s.blocks.model)),
        ("model_block_bytes", json!(s.blocks.model_block_bytes)),
        ("block_bytes", json!(s.blocks.block_bytes)),
        ("host_blocks", json!(s.host_blocks)),
        ("file_blocks", json!(s.file_blocks)),
        ("engine_blocks", json!(c.engine_blocks)),
        ("speedup", json!(s.speedup)),
        ("wall_s", json!(r.wall.as_secs_f64())),
        ("settle_s", json!(r.settle.as_secs_f64())),
        ("late_completions", json!(r.tracker.late_completions)),
        ("timed_out_tasks", json!(r.tracker.timed_out)),
    ];
    Value::Object(
        fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
    )
}

/// With `--fault`: `{"before_stall": {reason: n, ...}, ...}`; without: null.
fn by_phase(s: &Settings, v: &[ByReason; 4]) -> Value {
    if s.stalls.is_empty() {
        return Value::Null;
    }
    Value::Object(
        Phase::ALL
            .iter()
            .map(|p| (p.key().to_string(), v[p.index()].to_json()))
            .collect(),
    )
}

fn gib(bytes: f64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes >= GIB {
        format!("{:.1} GiB", bytes / GIB)
    } else if bytes >= MIB {
        format!("{:.1} MiB", bytes / MIB)
    } else {
        format!("{:.0} KiB", bytes / 1024.0)
    }
}

fn pct(n: u64, d: u64) -> String {
    format!("{:.1} %", 100.0 * rate(n, d))
}

/// The summary table.
pub fn summary(s: &Settings, r: &RunStats, c: &Context) -> String {
    let b = &s.blocks;
    let model = b.model_block_bytes as f64;
    let moved = b.block_bytes as f64;
    let waits: Vec<f64> = sorted(&r.load_waits.iter().map(|d| ms(*d)).collect::<Vec<_>>());
    let ttft_c = sorted(&r.ttft_cache_ms);
    let ttft_r = sorted(&r.ttft_recompute_ms);
    let busy = r.load_busy.as_secs_f64();
    let mut o = String::new();
    let _ = writeln!(o, "kvx replay: {}", c.source);
    if c.skipped_lines > 0 {
        let _ = writeln!(o, "  {} malformed trace lines skipped", c.skipped_lines);
    }
    let _ = writeln!(
        o,
        "  model {}: {} B/token, one 512-token block = {}; moved {} per block (1:{:.0}; \
         capacities and model GiB are full size)",
        b.model,
        b.bytes_per_token,
        gib(model),
        gib(moved),
        b.scale()
    );
    let file = match &c.file_dir {
        Some((dir, kept)) => format!(
            "file {} blocks ({}) in {}{}{}",
            s.file_blocks,
            gib(s.file_blocks as f64 * model),
            dir,
            if *kept { " (kept)" } else { " (removed)" },
            if c.direct { ", O_DIRECT" } else { ", buffered" },
        ),
        None => "no file tier".into(),
    };
    let _ = writeln!(
        o,
        "  tiers: engine {} blocks, host {} blocks ({}), {}",
        c.engine_blocks,
        s.host_blocks,
        gib(s.host_blocks as f64 * model),
        file
    );
    if c.adopted > 0 {
        let _ = writeln!(
            o,
            "  the file tier started with {} blocks from an earlier run (the ideal LRU starts empty)",
            c.adopted
        );
    }
    let _ = writeln!(
        o,
        "  deadlines: load {} ms, store {} ms; on load failure: {:?}; speedup {}",
        s.load_deadline_ms, s.store_deadline_ms, s.policy, s.speedup
    );
    let row = |o: &mut String, k: &str, v: String| {
        let _ = writeln!(o, "  {k:<29} {v}");
    };
    o.push('\n');
    row(
        &mut o,
        "requests",
        format!("{} ({} failed)", r.requests, r.failed_requests),
    );
    row(&mut o, "blocks referenced", r.blocks.to_string());
    row(
        &mut o,
        "block hit rate",
        format!(
            "{}  (host {}, file {})",
            pct(r.hits(), r.blocks),
            pct(r.hit_host, r.blocks),
            pct(r.hit_file, r.blocks)
        ),
    );
    row(
        &mut o,
        "ideal LRU hit rate",
        format!(
            "{}  (one LRU of host + file = {} blocks; {} with {}, the larger tier: \
             kvx's tiers are inclusive)",
            pct(c.ideal_hits, r.blocks),
            s.host_blocks + s.file_blocks,
            pct(c.ideal_inclusive_hits, r.blocks),
            s.host_blocks.max(s.file_blocks)
        ),
    );
    row(
        &mut o,
        "stored",
        format!(
            "{} (host {} blocks, file {} blocks; moved {})",
            gib((r.stored_host + r.stored_file) as f64 * model),
            r.stored_host,
            r.stored_file,
            gib((r.stored_host + r.stored_file) as f64 * moved)
        ),
    );
    row(
        &mut o,
        "loaded",
        format!(
            "{} ({} blocks; moved {})",
            gib(r.hits() as f64 * model),
            r.hits(),
            gib(r.hits() as f64 * moved)
        ),
    );
    row(
        &mut o,
        "load throughput",
        if busy > 0.0 {
            format!(
                "{:.2} GiB/s moved (while a load was in flight: {:.1} s)",
                r.hits() as f64 * moved / GIB / busy,
                busy
            )
        } else {
            "no loads".into()
        },
    );
    row(
        &mut o,
        "load latency p50 / p99",
        format!(
            "{:.2} ms / {:.2} ms (max {:.1} ms, {} loads; deadline {} ms)",
            percentile(&waits, 50.0),
            percentile(&waits, 99.0),
            waits.last().copied().unwrap_or(0.0),
            waits.len(),
            s.load_deadline_ms
        ),
    );
    row(
        &mut o,
        "deadline misses",
        format!(
            "{} loads ({} blocks); {} blocks turned away at once; {} file writes timed out",
            r.deadline_misses, r.deadline_missed_blocks, r.load_rejected_blocks, r.store_timeouts
        ),
    );
    row(&mut o, "blocks recomputed", r.recomputed.to_string());
    row(&mut o, "requests failed", r.failed_requests.to_string());
    row(
        &mut o,
        "TTFT with cache",
        format!(
            "mean {:.0} ms, p50 {:.0} ms, p99 {:.0} ms",
            mean(&ttft_c),
            percentile(&ttft_c, 50.0),
            percentile(&ttft_c, 99.0)
        ),
    );
    row(
        &mut o,
        "TTFT recomputing all",
        format!(
            "mean {:.0} ms, p50 {:.0} ms, p99 {:.0} ms (prefill {} tokens/s)",
            mean(&ttft_r),
            percentile(&ttft_r, 50.0),
            percentile(&ttft_r, 99.0),
            s.prefill_tps
        ),
    );
    row(
        &mut o,
        "verified",
        format!(
            "{} blocks byte-exact ({})",
            r.verified_blocks,
            gib(r.verified_bytes as f64)
        ),
    );
    row(
        &mut o,
        "longest wait on kvx",
        format!(
            "{:.1} ms (first lookup to ready to compute; {} lookups said ask again)",
            ms(r.max_request_wait),
            r.retries
        ),
    );
    if r.load_host_buffer_gone > 0 || r.load_corrupt_blocks > 0 || r.load_other_failed_blocks > 0 {
        row(
            &mut o,
            "other load failures",
            format!(
                "{} blocks whose host buffer was evicted by the same load's promotions, \
                 {} corrupt or gone, {} other",
                r.load_host_buffer_gone, r.load_corrupt_blocks, r.load_other_failed_blocks
            ),
        );
    }
    if r.store_dropped > 0 || r.store_failed_host > 0 || r.store_failed_file > 0 {
        row(
            &mut o,
            "stores not kept",
            format!(
                "{} blocks no host room, {} host failures, {} file failures",
                r.store_dropped, r.store_failed_host, r.store_failed_file
            ),
        );
    }
    row(
        &mut o,
        "store failures by reason",
        r.store_failures.describe(),
    );
    row(
        &mut o,
        "load failures by reason",
        r.load_failures.describe(),
    );
    if !s.stalls.is_empty() {
        let log: Vec<String> = r
            .stall_log
            .iter()
            .map(|(t, what)| format!("{what} at {:.1} s", t.as_secs_f64()))
            .collect();
        row(&mut o, "disk stall", log.join(", "));
        let four = |v: &[u64; 4]| format!("{} / {} / {} / {}", v[0], v[1], v[2], v[3]);
        row(
            &mut o,
            "phases",
            "before the stall / during / after the thaw until the breaker closed / after".into(),
        );
        row(
            &mut o,
            "file hits by phase",
            format!(
                "{} blocks (host: {})",
                four(&r.file_hits_by_phase),
                four(&r.host_hits_by_phase)
            ),
        );
        row(
            &mut o,
            "failed loads by phase",
            format!("{} blocks", four(&r.load_failed_by_phase)),
        );
        for p in Phase::ALL {
            let (st, ld) = (
                &r.store_failures_by_phase[p.index()],
                &r.load_failures_by_phase[p.index()],
            );
            if st.total() + ld.total() > 0 {
                row(
                    &mut o,
                    &format!("  {}", p.key()),
                    format!("stores: {}; loads: {}", st.describe(), ld.describe()),
                );
            }
        }
    }
    row(
        &mut o,
        "wall time",
        format!(
            "{:.1} s (+ {:.2} s to settle)",
            r.wall.as_secs_f64(),
            r.settle.as_secs_f64()
        ),
    );
    o
}
