//! `kvx replay [TRACE]`: a request trace through the real tiers (engine memory in CPU RAM, a
//! host tier, a kvx-posix file tier), driven through kvx-offload's scheduler and worker halves
//! exactly as an engine drives them, with every loaded block verified byte for byte, and the
//! hit rate an ideal LRU cache of the same capacity would get on the same trace beside it.

mod args;
mod cleanup;
mod engine;
mod error;
mod fault;
mod ideal;
mod model;
pub(crate) mod node_dirs;
mod nodes;
mod payload;
mod report;
mod rig;
mod stats;
mod synth;
mod trace;

#[cfg(test)]
mod tests;

use std::io::{IsTerminal, Write};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvx_core::BlockKey;

pub use args::ReplayArgs;
use args::Settings;
use error::ReplayError;
use report::Context;
use rig::Rig;
use stats::RunStats;
use synth::{DEFAULT_SEED, SynthConfig};
use trace::TraceRequest;

/// Run `kvx replay`; returns the exit code (errors are printed as one line on stderr).
pub fn run(args: ReplayArgs) -> i32 {
    match run_inner(&args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvx replay: {e}");
            e.exit_code()
        }
    }
}

/// A loaded trace and where it came from.
struct Loaded {
    requests: Vec<TraceRequest>,
    source: String,
    skipped: usize,
}

fn load(args: &ReplayArgs) -> Result<Loaded, ReplayError> {
    match &args.trace {
        Some(path) => {
            let t = trace::read_trace(path, args.skip_bad_lines, args.limit)?;
            if let Some((line, why)) = t.skipped.first() {
                eprintln!(
                    "kvx replay: skipped {} malformed lines (first: line {line}: {why})",
                    t.skipped.len()
                );
            }
            Ok(Loaded {
                source: format!("{} ({} requests)", path.display(), t.requests.len()),
                skipped: t.skipped.len(),
                requests: t.requests,
            })
        }
        None => {
            let seed = args.seed.unwrap_or(DEFAULT_SEED);
            let mut cfg = SynthConfig {
                seed,
                ..SynthConfig::default()
            };
            if let Some(n) = args.limit {
                cfg.requests = cfg.requests.min(n);
            }
            let requests = synth::generate(&cfg);
            Ok(Loaded {
                source: format!(
                    "embedded default trace (seed {seed:#x}, {} requests, {:.0} req/s)",
                    requests.len(),
                    cfg.rate_per_s
                ),
                skipped: 0,
                requests,
            })
        }
    }
}

fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Engine blocks, and a check that engine memory and the host tier fit in RAM.
fn engine_blocks(s: &Settings, keys: &[Vec<BlockKey>]) -> Result<u32, ReplayError> {
    let largest = keys.iter().map(Vec::len).max().unwrap_or(0);
    let n = match s.engine_blocks {
        Some(n) => n,
        None => (2 * largest).max(1024) as u32,
    };
    if (n as usize) < largest {
        return Err(ReplayError::BadOption(format!(
            "--engine-blocks {n} cannot hold the largest request ({largest} blocks)"
        )));
    }
    let bytes = (n as u64 + rig::pool_buffers(s, n) as u64) * s.blocks.block_bytes;
    if let Some(avail) = mem_available()
        && bytes > avail / 10 * 6
    {
        return Err(ReplayError::BadOption(format!(
            "engine memory and the host tier need {} MiB of RAM at {} KiB per block, more than \
             60% of the {} MiB available; use a smaller --block-bytes, --engine-blocks or host tier",
            bytes >> 20,
            s.blocks.block_bytes >> 10,
            avail >> 20
        )));
    }
    Ok(n)
}

fn progress(s: &Settings, n: usize) -> ProgressBar {
    if !s.progress || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed:>4} [{bar:40}] {pos}/{len} requests  {msg}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// Run a replay of `requests` and return its counters, its context and the rig (to be torn
/// down by the caller, after printing: removing thousands of block files takes a while).
fn execute(
    s: &Settings,
    requests: &[TraceRequest],
    source: String,
    skipped: usize,
) -> Result<(RunStats, Context, Rig), ReplayError> {
    let keys: Vec<Vec<BlockKey>> = requests.iter().map(TraceRequest::keys).collect();
    let n_engine = engine_blocks(s, &keys)?;
    let ideal_hits = ideal::ideal_lru_hits(
        s.host_blocks + s.file_blocks,
        keys.iter().map(Vec::as_slice),
    );
    let ideal_inclusive_hits = ideal::ideal_lru_hits(
        s.host_blocks.max(s.file_blocks),
        keys.iter().map(Vec::as_slice),
    );
    let mut rig = Rig::new(s, n_engine)?;
    let dir = rig
        .file_dir
        .as_ref()
        .map(|d| d.path().display().to_string());
    let adopted = rig.adopted;
    let direct = rig.direct;
    let pb = progress(s, requests.len());
    let result = engine::replay(s, requests, &keys, &mut rig, &pb);
    pb.finish_and_clear();
    let stats = match result {
        Ok(stats) => stats,
        Err(e) => {
            rig.teardown(s.keep);
            return Err(e);
        }
    };
    let kept = s.keep || matches!(rig.file_dir, Some(rig::FileDir::User(_)));
    Ok((
        stats,
        Context {
            source,
            engine_blocks: n_engine,
            file_dir: dir.map(|d| (d, kept)),
            adopted,
            direct,
            ideal_hits,
            ideal_inclusive_hits,
            skipped_lines: skipped,
        },
        rig,
    ))
}

/// Node `i` of a multi-node replay: replay its share of the trace on the shared file tier and
/// print its counters as one JSON line.
fn run_node(mut s: Settings, i: usize, loaded: Loaded) -> Result<(), ReplayError> {
    s.time_origin_ms = loaded.requests.first().map(|r| r.timestamp_ms);
    let mine: Vec<TraceRequest> = loaded
        .requests
        .into_iter()
        .enumerate()
        .filter(|(j, r)| nodes::node_of(s.spread, s.nodes, *j, &r.keys()) == i)
        .map(|(_, r)| r)
        .collect();
    let source = format!("{} (node {i} of {})", loaded.source, s.nodes);
    let (stats, ctx, rig) = execute(&s, &mine, source, loaded.skipped)?;
    let mut v = report::to_json(&s, &stats, &ctx);
    if let Some(m) = v.as_object_mut() {
        m.insert("node".into(), serde_json::json!(i));
    }
    println!("{v}");
    rig.teardown(false);
    Ok(())
}

fn run_inner(args: &ReplayArgs) -> Result<(), ReplayError> {
    let s = args.settings()?;
    let loaded = load(args)?;
    if let Some(path) = &args.emit_trace {
        let mut text = String::new();
        for r in &loaded.requests {
            text.push_str(&r.to_json_line());
            text.push('\n');
        }
        std::fs::write(path, text)
            .map_err(|e| ReplayError::Setup(format!("cannot write {}: {e}", path.display())))?;
        println!(
            "wrote {} requests to {}",
            loaded.requests.len(),
            path.display()
        );
        return Ok(());
    }
    let _metrics = match &args.metrics_addr {
        Some(addr) => {
            let server = kvx::prometheus::PrometheusServer::start(addr)
                .map_err(|e| ReplayError::BadOption(format!("--metrics-addr: {e}")))?;
            eprintln!(
                "kvx replay: metrics at http://{}/metrics",
                server.local_addr()
            );
            Some(server)
        }
        None => None,
    };
    if s.nodes > 1 && s.node.is_none() {
        return nodes::run(args, &s, &loaded.requests);
    }
    if let Some(i) = s.node {
        return run_node(s, i, loaded);
    }
    let (stats, ctx, rig) = execute(&s, &loaded.requests, loaded.source, loaded.skipped)?;
    {
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "{}", report::summary(&s, &stats, &ctx));
        if args.json {
            let _ = writeln!(out, "{}", report::to_json(&s, &stats, &ctx));
        }
        let _ = out.flush();
    }
    rig.teardown(s.keep);
    Ok(())
}
