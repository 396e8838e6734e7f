//! `kvx bench remote [--block-size 1MiB] [--blocks N] [--json]`: a kvx-rdma producer and
//! consumer over loopback TCP in this process, next to a plain socket copy of the same bytes
//! over the same loopback, measured in the same run. Each round reads the blocks as a decode
//! engine's remote load reads them (kvx-offload's split), unless `--task-blocks`/`--depth`
//! say otherwise.

use std::time::Duration;

use clap::Args;
use kvx_rdma::bench::{LoopbackRig, raw_tcp_hot_copy};

/// Options of `kvx bench remote`.
#[derive(Args)]
pub struct RemoteArgs {
    /// Bytes per block (suffixes KiB, MiB, GiB; default 1MiB).
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    block_size: u64,
    /// Blocks exported (each round reads them all).
    #[arg(long, default_value_t = 256)]
    blocks: u32,
    /// Blocks per task (one load task = one deadline). Default: as kvx-offload splits a
    /// decode's remote load of `--blocks` blocks (at least 16, at most 8 tasks; 32 for 256).
    #[arg(long)]
    task_blocks: Option<usize>,
    /// Load tasks in flight at once (each on its own connection; the raw copy then uses as
    /// many connections). Default: as kvx-offload reads a load, all of a round's tasks at
    /// once, at most 8.
    #[arg(long)]
    depth: Option<usize>,
    /// Timed rounds over all blocks (each after an untimed one). A round of 256 MiB takes
    /// 45-60 ms on a 2-core machine; with 16-block tasks one at a time, 15 runs of 3 rounds
    /// gave ratios of 0.80x to 1.28x, 8 runs of 10 rounds 0.84x to 0.94x.
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Prefill → decode through kvx-offload's two sides (export, lease, remote load, done)
    /// instead of kvx-rdma alone: one request of `--blocks` blocks per round.
    #[arg(long)]
    through_connector: bool,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// A block size of at most 1 GiB (one reply frame).
fn parse_size(s: &str) -> Result<u64, String> {
    let v = crate::size::parse_size(s)?;
    if v > 1 << 30 {
        return Err(format!("size {s:?} must be between 1 byte and 1 GiB"));
    }
    Ok(v)
}

fn gib_s(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / (1u64 << 30) as f64
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Run the benchmark; returns the exit code.
pub fn run(args: RemoteArgs) -> i32 {
    let result = if args.through_connector {
        measure_pd(&args)
    } else {
        measure(&args)
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvx bench remote: {e}");
            1
        }
    }
}

/// Blocks per task and tasks in flight: as given, else as kvx-offload reads a remote load of
/// `blocks` blocks (its split, every task at once up to its limit).
fn shape(blocks: u32, task_blocks: Option<usize>, depth: Option<usize>) -> (usize, usize) {
    let task_blocks =
        task_blocks.unwrap_or_else(|| kvx_offload::remote_task_blocks(blocks as usize));
    let depth = depth.unwrap_or_else(|| {
        (blocks as usize)
            .div_ceil(task_blocks.max(1))
            .clamp(1, kvx_offload::REMOTE_TASKS)
    });
    (task_blocks, depth)
}

fn measure(args: &RemoteArgs) -> Result<(), String> {
    let (task_blocks, depth) = shape(args.blocks, args.task_blocks, args.depth);
    if args.blocks == 0 || task_blocks == 0 || args.rounds == 0 || depth == 0 {
        return Err("--blocks, --task-blocks, --depth and --rounds must be positive".into());
    }
    let bs = args.block_size as usize;
    let rig = LoopbackRig::new(bs, args.blocks, task_blocks, depth).map_err(|e| e.to_string())?;
    let n = rig.blocks();
    let tasks_per_round = n.div_ceil(task_blocks);
    // Keep `depth` tasks in flight: submit the next before waiting for the oldest.
    let round = |lat: &mut Vec<Duration>| -> Result<(), String> {
        let mut pending = std::collections::VecDeque::new();
        for t in 0..tasks_per_round {
            let first = t * task_blocks;
            let k = task_blocks.min(n - first);
            if pending.len() == depth {
                lat.push(rig.wait_task(pending.pop_front().ok_or("no task")?)?);
            }
            pending.push_back(rig.submit_task(first, k)?);
        }
        while let Some(t) = pending.pop_front() {
            lat.push(rig.wait_task(t)?);
        }
        Ok(())
    };
    let total = (n * bs) as u64 * args.rounds as u64;
    // Interleave: kvx round, raw copy of the same bytes, and so on, so drift hits both. Each
    // path is warmed up by one untimed pass right before its timed one (its connections, its
    // threads, the caches): kvx by a round, the raw copy by a pass on its connections. Idle
    // for the 100+ ms the other copies take, kvx's first round after read about 20% slower.
    // Both keep their threads and connections for the whole run.
    let mut raw_copy = rig
        .raw_tcp_copy(depth)
        .map_err(|e| format!("raw TCP copy: {e}"))?;
    let mut raw_tasks = rig
        .raw_tcp_tasks(task_blocks, depth)
        .map_err(|e| format!("raw TCP tasks: {e}"))?;
    let mut lat = Vec::new();
    let (mut kvx_t, mut raw_t, mut hot_t) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let mut tasks_t = Duration::ZERO;
    for _ in 0..args.rounds {
        round(&mut Vec::new())?;
        let t0 = std::time::Instant::now();
        round(&mut lat)?;
        kvx_t += t0.elapsed();
        raw_t += raw_copy
            .measure()
            .map_err(|e| format!("raw TCP copy: {e}"))?;
        tasks_t += raw_tasks
            .measure()
            .map_err(|e| format!("raw TCP tasks: {e}"))?;
        hot_t += raw_tcp_hot_copy((n * bs) as u64, bs).map_err(|e| format!("raw TCP copy: {e}"))?;
    }
    lat.sort();
    let read = gib_s(total, kvx_t);
    let raw = gib_s(total, raw_t);
    let hot = gib_s(total, hot_t);
    let tasks = gib_s(total, tasks_t);
    let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    if args.json {
        let v = serde_json::json!({
            "bench": "remote",
            "transport": "tcp",
            "addr": rig.addr().to_string(),
            "block_size": args.block_size,
            "blocks": n,
            "task_blocks": task_blocks,
            "depth": depth,
            "rounds": args.rounds,
            "bytes": total,
            "read_gib_s": read,
            "raw_tcp_gib_s": raw,
            "raw_tcp_connections": raw_copy.connections(),
            "ratio": read / raw,
            "raw_tcp_hot_gib_s": hot,
            "ratio_vs_hot": read / hot,
            "raw_tcp_tasks_gib_s": tasks,
            "ratio_vs_tasks": read / tasks,
            "tasks_vs_raw": tasks / raw,
            "task_p50_ms": ms(p50),
            "task_p99_ms": ms(p99),
            "tasks": lat.len(),
        });
        println!("{v}");
    } else {
        println!(
            "kvx bench remote: tcp loopback {}, {n} blocks of {} B, {} blocks/task, {} tasks in \
             flight, {} rounds ({} MiB)",
            rig.addr(),
            args.block_size,
            task_blocks,
            depth,
            args.rounds,
            total >> 20
        );
        println!("  kvx-rdma read   {read:8.2} GiB/s");
        println!(
            "  raw tcp copy    {raw:8.2} GiB/s   (same bytes from engine memory into {} \
             rotating buffers over {} connection(s), same loopback, same run)",
            raw_copy.destinations(),
            raw_copy.connections()
        );
        println!("  ratio           {:8.2}x", read / raw);
        println!(
            "  (reference: cache-hot {} B buffer to buffer {hot:.2} GiB/s, ratio {:.2}x)",
            args.block_size,
            read / hot
        );
        println!(
            "  (reference: the raw copy in request/response tasks of {} blocks, {} in flight, \
             {tasks:.2} GiB/s = {:.2}x the raw copy; kvx {:.2}x of it)",
            task_blocks,
            raw_tasks.connections(),
            tasks / raw,
            read / tasks
        );
        println!(
            "  task latency    p50 {:.2} ms, p99 {:.2} ms over {} tasks",
            ms(p50),
            ms(p99),
            lat.len()
        );
    }
    Ok(())
}

fn measure_pd(args: &RemoteArgs) -> Result<(), String> {
    if args.blocks == 0 || args.rounds == 0 {
        return Err("--blocks and --rounds must be positive".into());
    }
    let r = super::remote_pd::measure(args.block_size as usize, args.blocks, args.rounds)?;
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    if args.json {
        let v = serde_json::json!({
            "bench": "remote",
            "mode": "prefill-decode",
            "transport": "tcp",
            "block_size": args.block_size,
            "blocks": args.blocks,
            "rounds": args.rounds,
            "bytes": r.bytes,
            "blocks_per_s": r.blocks_s,
            "load_gib_s": r.gib_s,
            "raw_tcp_hot_gib_s": r.raw_gib_s,
            "ratio_vs_hot": r.gib_s / r.raw_gib_s,
            "start_step_p50_us": us(r.start_step_p50),
            "get_finished_p50_us": us(r.poll_p50),
            "release_p50_us": us(r.release_p50),
        });
        println!("{v}");
    } else {
        println!(
            "kvx bench remote --through-connector: prefill → decode over tcp loopback, one \
             request of {} blocks of {} B per round, {} rounds ({} MiB)",
            args.blocks,
            args.block_size,
            args.rounds,
            r.bytes >> 20
        );
        println!(
            "  remote load     {:8.2} GiB/s, {:.0} blocks/s (start_step to finished_recving)",
            r.gib_s, r.blocks_s
        );
        println!(
            "  raw tcp copy    {:8.2} GiB/s   (cache-hot buffer to buffer, same bytes, same run; \
             ratio {:.2}x)",
            r.raw_gib_s,
            r.gib_s / r.raw_gib_s
        );
        println!(
            "  step cost       start_step {:.0} µs, get_finished {:.1} µs (p50); producer \
             release after done {:.0} µs (p50)",
            us(r.start_step_p50),
            us(r.poll_p50),
            us(r.release_p50)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// By default a round reads as kvx-offload reads a decode's remote load of `--blocks`
    /// blocks; what is given is kept.
    #[test]
    fn the_default_shape_is_the_engines_split_of_a_load() {
        assert_eq!(shape(256, None, None), (32, 8));
        assert_eq!(shape(64, None, None), (16, 4));
        assert_eq!(shape(10, None, None), (16, 1));
        assert_eq!(shape(4096, None, None), (512, 8));
        assert_eq!(shape(256, Some(16), None), (16, 8));
        assert_eq!(shape(256, Some(16), Some(1)), (16, 1));
        assert_eq!(shape(256, None, Some(2)), (32, 2));
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("0").is_err());
        assert!(parse_size("3 parsecs").is_err());
        assert!(parse_size("2GiB").is_err());
    }
}
