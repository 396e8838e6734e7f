//! `kvx bench cuda [--json]`: the CUDA backend's host<->device copies next to a plain
//! `cuMemcpyHtoD`/`cuMemcpyDtoH` of the same bytes, measured side by side in one run.
//!
//! Without CUDA it prints the reason and exits with status 2.

use clap::Args;
use kvx_core::Direction;
use kvx_cuda::bench::{Case, Rig, Sample, measure};
use kvx_cuda::{BatchMode, CudaBackendConfig, CudaDevice, CudaError};

/// Options of `kvx bench cuda`.
#[derive(Args)]
pub struct CudaArgs {
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// Measured iterations per case and direction (after 3 warm-ups).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Streams per direction an op is spread over (default: the backend's, 8); the "one
    /// stream" reference row keeps 1.
    #[arg(long)]
    copy_streams: Option<usize>,
}

/// Run the benchmark; returns the exit code.
pub fn run(args: CudaArgs) -> i32 {
    let device = match CudaDevice::open(args.device) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kvx bench cuda: {e}");
            return 2;
        }
    };
    let base = CudaBackendConfig {
        copy_streams: args
            .copy_streams
            .unwrap_or(CudaBackendConfig::default().copy_streams),
        ..CudaBackendConfig::default()
    };
    match collect(&device, &base, args.iters) {
        Ok(rows) => {
            if args.json {
                println!("{}", to_json(&device, &base, &rows));
            } else {
                print_table(&device, &base, &rows);
            }
            0
        }
        Err(e) => {
            eprintln!("kvx bench cuda: {e}");
            1
        }
    }
}

/// A measured row; `reference` names what a comparison row shows (not held to a target).
struct Row {
    sample: Sample,
    reference: Option<&'static str>,
    completion: &'static str,
}

fn collect(
    device: &CudaDevice,
    base: &CudaBackendConfig,
    iters: usize,
) -> Result<Vec<Row>, CudaError> {
    let poll = base.clone();
    let blocking = CudaBackendConfig {
        completion_poll: None,
        ..base.clone()
    };
    let one_stream = CudaBackendConfig {
        copy_streams: 1,
        ..base.clone()
    };
    let per_run = CudaBackendConfig {
        batch: BatchMode::Never,
        ..base.clone()
    };
    let mut cases = vec![
        (Case::Contiguous, poll.clone(), None),
        (Case::Scattered, poll.clone(), None),
        // What polling the op's event buys over sleeping in cuEventSynchronize.
        (
            Case::Contiguous,
            blocking,
            Some("reference: completer blocks"),
        ),
        // What spreading an op over several streams (copy engines) buys.
        (Case::Scattered, one_stream, Some("reference: one stream")),
    ];
    if device.batch_copy_available() {
        // The same scattered blocks one copy call per run, to show what batching buys.
        cases.push((
            Case::Scattered,
            per_run,
            Some("reference: one call per run"),
        ));
    }
    let mut out = Vec::new();
    for (case, cfg, reference) in cases {
        let completion = if cfg.completion_poll.is_some() {
            "poll"
        } else {
            "block"
        };
        let mut rig = Rig::new(device, case, cfg)?;
        for dir in [Direction::Load, Direction::Store] {
            out.push(Row {
                sample: measure(&mut rig, dir, iters)?,
                reference,
                completion,
            });
        }
    }
    Ok(out)
}

fn print_table(device: &CudaDevice, base: &CudaBackendConfig, rows: &[Row]) {
    println!(
        "kvx bench cuda: {} (device {}, driver {}, cuMemcpyBatchAsync {}, {} streams per \
         direction)",
        device.name(),
        device.ordinal(),
        device.driver_version(),
        if device.batch_copy_available() {
            "yes"
        } else {
            "no"
        },
        base.copy_streams
    );
    println!(
        "{:<25} {:<4} {:<8} {:<5} {:>9} {:>10} {:>6} {:>7} {:>9}  verdict",
        "case", "dir", "copies", "wait", "kvx GB/s", "plain GB/s", "ratio", "target", "calls/op"
    );
    for r in rows {
        let s = &r.sample;
        println!(
            "{:<25} {:<4} {:<8} {:<5} {:>9.2} {:>10.2} {:>6.2} {:>7.2} {:>9.1}  {}",
            s.case,
            s.dir,
            if s.batched { "batched" } else { "per-run" },
            r.completion,
            s.kvx_gbps,
            s.plain_gbps,
            s.ratio,
            s.target,
            s.calls_per_op,
            verdict(r)
        );
    }
}

fn verdict(r: &Row) -> &'static str {
    if let Some(what) = r.reference {
        what
    } else if r.sample.ratio >= r.sample.target {
        "ok"
    } else {
        "below target"
    }
}

fn to_json(device: &CudaDevice, base: &CudaBackendConfig, rows: &[Row]) -> serde_json::Value {
    serde_json::json!({
        "device": device.name(),
        "copy_streams": base.copy_streams,
        "ordinal": device.ordinal(),
        "driver_version": device.driver_version(),
        "batch_copy_available": device.batch_copy_available(),
        "results": rows.iter().map(|r| (r, &r.sample)).map(|(r, s)| serde_json::json!({
            "case": s.case,
            "dir": s.dir,
            "batched": s.batched,
            "bytes": s.bytes,
            "kvx_gbps": s.kvx_gbps,
            "plain_gbps": s.plain_gbps,
            "ratio": s.ratio,
            "target": s.target,
            "calls_per_op": s.calls_per_op,
            "reference": r.reference.is_some(),
            "completion": r.completion,
            "verdict": verdict(r),
        })).collect::<Vec<_>>(),
    })
}
