//! GPU tests of the CUDA backend (libtest-mimic harness).
//!
//! Where CUDA is unavailable every GPU trial prints `skip: <trial>: <reason>` and counts as
//! ignored; set `KVX_CUDA_REQUIRE_GPU=1` (as `scripts/gpu-check.sh` does) to make them fail
//! instead. The no-CUDA trial runs everywhere.

#[path = "gpu/fixture.rs"]
mod fixture;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fixture::{Engine, ensure, finish, fresh_rng, op, pick_blocks, poison_byte, random_block};
use kvx_core::{
    Backend, BlockError, BlockKey, Buf, BufferPool, DEFAULT_ALIGN, Direction, DriverBuilder,
    DriverConfig, EngineBlockId, OpBlock, OpId, RequestId, TaskSpec, TaskState, WaitOutcome,
};
use kvx_cuda::{
    BatchMode, CudaBackend, CudaBackendConfig, CudaDevice, CudaError, PAGE_SIZE, cuda_available,
};
use libtest_mimic::{Arguments, Failed, Trial};
use rand::RngCore;

const MIB: usize = 1 << 20;

type GpuTest = fn(&CudaDevice) -> Result<(), Failed>;

fn main() {
    let args = Arguments::from_args();
    let require = std::env::var("KVX_CUDA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let gpu_tests: Vec<(&'static str, GpuTest)> = vec![
        (
            "round_trip_cross_layer_1000_blocks_batched",
            round_trip_cross_layer,
        ),
        ("round_trip_per_layer_batched", round_trip_per_layer),
        (
            "round_trip_per_layer_odd_sizes_per_run_copies",
            round_trip_odd_per_run,
        ),
        ("invalid_blocks_fail_alone", invalid_blocks_fail_alone),
        ("wait_really_waits", wait_really_waits),
        (
            "deadline_quarantine_on_long_copy",
            deadline_quarantine_on_long_copy,
        ),
        (
            "preempt_fence_flushes_inflight_store",
            preempt_fence_flushes_inflight_store,
        ),
    ];
    let mut trials = vec![Trial::test(
        "open_without_cuda_is_an_error_not_a_panic",
        no_cuda_is_an_error,
    )];
    match CudaDevice::open(0) {
        Ok(dev) => {
            println!(
                "kvx-cuda GPU tests on {} (driver {}, cuMemcpyBatchAsync {})",
                dev.name(),
                dev.driver_version(),
                if dev.batch_copy_available() {
                    "available"
                } else {
                    "absent: per-run copies"
                }
            );
            for (name, f) in gpu_tests {
                let d = dev.clone();
                trials.push(Trial::test(name, move || f(&d)));
            }
        }
        Err(e) if e.is_unavailable() && !require => {
            for (name, _) in gpu_tests {
                println!("skip: {name}: {e}");
                trials.push(Trial::test(name, || Ok(())).with_ignored_flag(true));
            }
        }
        Err(e) => {
            for (name, _) in gpu_tests {
                let msg =
                    format!("a GPU is required (KVX_CUDA_REQUIRE_GPU=1) but CUDA is unusable: {e}");
                trials.push(Trial::test(name, move || Err(msg.into())));
            }
        }
    }
    libtest_mimic::run(&args, trials).exit();
}

/// Runs everywhere: without libcuda, `open` is `NoCuda` (no panic); with it, a missing device
/// ordinal is `NoDevice`.
fn no_cuda_is_an_error() -> Result<(), Failed> {
    let opened = std::panic::catch_unwind(|| CudaDevice::open(0));
    let Ok(opened) = opened else {
        return Err("CudaDevice::open panicked".into());
    };
    match opened {
        Err(e) if !cuda_available() => {
            ensure!(
                matches!(e, CudaError::NoCuda { .. }),
                "without libcuda, open must say NoCuda, got: {e}"
            );
            ensure!(
                e.is_unavailable() && e.to_string().starts_with("no CUDA"),
                "unclear message: {e}"
            );
        }
        Err(e) => ensure!(
            e.is_unavailable() || matches!(e, CudaError::Driver { .. }),
            "unexpected error with libcuda present: {e}"
        ),
        Ok(dev) => {
            ensure!(
                cuda_available(),
                "opened a device although the library probe failed"
            );
            match CudaDevice::open(4096) {
                Err(CudaError::NoDevice { ordinal: 4096, .. }) => {}
                other => {
                    return Err(format!("device 4096 should be NoDevice, got {other:?}").into());
                }
            }
            println!(
                "CUDA present ({}); the no-library branch is covered by a unit test",
                dev.name()
            );
        }
    }
    Ok(())
}

fn round_trip_cross_layer(dev: &CudaDevice) -> Result<(), Failed> {
    round_trip(
        dev,
        "cross_layer",
        Engine::cross(dev, 64 << 10, 2048)?,
        BatchMode::Auto,
        1000,
    )
}

fn round_trip_per_layer(dev: &CudaDevice) -> Result<(), Failed> {
    // 3 layers x K/V, 8 KiB segments: a 48 KiB block is 6 segments.
    round_trip(
        dev,
        "per_layer",
        Engine::per_layer(dev, 6, 8 << 10, 1024)?,
        BatchMode::Auto,
        600,
    )
}

fn round_trip_odd_per_run(dev: &CudaDevice) -> Result<(), Failed> {
    // Segments of 5000 bytes (unaligned device addresses), buffers larger than blocks.
    round_trip(
        dev,
        "odd_per_run",
        Engine::per_layer(dev, 3, 5000, 512)?,
        BatchMode::Never,
        300,
    )
}

/// Load random data into a poisoned engine, check every byte, then store it into poisoned
/// buffers and check every byte again.
fn round_trip(
    dev: &CudaDevice,
    name: &str,
    engine: Engine,
    batch: BatchMode,
    want: usize,
) -> Result<(), Failed> {
    let mut rng = fresh_rng(name);
    let bb = engine.layout.block_bytes();
    let cfg = CudaBackendConfig {
        batch,
        ..CudaBackendConfig::default()
    };
    // SAFETY: `engine` outlives the backend (dropped at the end of this function, after it) and
    // is read only after the ops on it completed.
    let mut backend = unsafe { CudaBackend::new(dev, engine.layout.clone(), cfg)? };
    let blocks = pick_blocks(&mut rng, engine.layout.num_blocks(), want);
    let pool = backend.pinned_pool(blocks.len(), bb.next_multiple_of(PAGE_SIZE))?;
    let poison = poison_byte(&mut rng);
    engine.mem.fill(poison)?;
    let data: HashMap<EngineBlockId, Vec<u8>> = blocks
        .iter()
        .map(|&b| (b, random_block(&mut rng, bb)))
        .collect();

    // Load, as three ops in flight at once.
    let mut items = Vec::new();
    for b in &blocks {
        let mut buf = pool.take().ok_or("pinned pool exhausted")?;
        buf.as_mut_slice()[..bb].copy_from_slice(&data[b]);
        buf.set_len(bb);
        items.push((*b, Buf::Owned(buf)));
    }
    let before = backend.stats();
    let third = items.len().div_ceil(3);
    let mut ids = Vec::new();
    let mut chunks = Vec::new();
    while !items.is_empty() {
        chunks.push(items.drain(..third.min(items.len())).collect::<Vec<_>>());
    }
    for (k, chunk) in chunks.into_iter().enumerate() {
        let id = 100 + k as u64;
        backend
            .submit(op(id, Direction::Load, chunk))
            .map_err(|e| format!("load refused: {}", e.kind))?;
        ids.push(OpId(id));
    }
    let mut bufs = Vec::new();
    for c in finish(&mut backend, &ids)? {
        for (r, b) in c.results.iter().zip(c.op.blocks) {
            ensure!(r.is_ok(), "{name}: load of {:?} failed: {r:?}", b.engine);
            bufs.push((b.engine.ok_or("lost engine id")?, b.buf));
        }
    }
    let after = backend.stats();
    let (ops, calls, runs) = (
        after.ops - before.ops,
        after.api_calls - before.api_calls,
        after.runs - before.runs,
    );
    let pieces = (blocks.len() * engine.layout.regions().len()) as u64;
    println!(
        "{name}: {} blocks, {pieces} segments -> {runs} runs, {calls} copy calls for {ops} ops (batching {})",
        blocks.len(),
        backend.batching()
    );
    ensure!(
        runs <= pieces,
        "{name}: more runs ({runs}) than segments ({pieces})"
    );
    ensure!(
        after.batch_fallbacks == 0,
        "{name}: cuMemcpyBatchAsync failed and was redone run by run: {:?}",
        after.last_batch_error
    );
    if backend.batching() {
        ensure!(
            calls <= ops,
            "{name}: {calls} copy calls for {ops} batched ops"
        );
    } else {
        ensure!(calls == runs, "{name}: {calls} copy calls for {runs} runs");
    }
    let snap = engine.snapshot()?;
    let poisoned = vec![poison; bb];
    for b in 0..engine.layout.num_blocks() {
        let b = EngineBlockId(b);
        let got = engine.block_of(&snap, b);
        match data.get(&b) {
            Some(want) => ensure!(
                &got == want,
                "{name}: engine block {b} differs from what was loaded"
            ),
            None => ensure!(
                got == poisoned,
                "{name}: engine block {b} was not in the op but changed"
            ),
        }
    }

    // Store into poisoned buffers, as two ops, in a new order.
    let poison2 = poison_byte(&mut rng);
    let mut items: Vec<(EngineBlockId, Buf)> = bufs
        .into_iter()
        .map(|(e, buf)| {
            let Buf::Owned(mut p) = buf else {
                unreachable!("loads came back with owned buffers")
            };
            let cap = p.capacity();
            p.set_len(cap);
            p.as_mut_slice().fill(poison2);
            (e, Buf::Owned(p))
        })
        .collect();
    items.reverse();
    let half = items.len() / 2;
    let second = items.split_off(half);
    backend
        .submit(op(200, Direction::Store, items))
        .map_err(|e| format!("store refused: {}", e.kind))?;
    backend
        .submit(op(201, Direction::Store, second))
        .map_err(|e| format!("store refused: {}", e.kind))?;
    let mut stored = 0;
    for c in finish(&mut backend, &[OpId(200), OpId(201)])? {
        for (r, b) in c.results.iter().zip(&c.op.blocks) {
            let e = b.engine.ok_or("lost engine id")?;
            ensure!(r.is_ok(), "{name}: store of {e} failed: {r:?}");
            ensure!(
                b.buf.len() == bb,
                "{name}: stored buffer length {} != block {bb}",
                b.buf.len()
            );
            ensure!(
                b.buf.as_slice() == data[&e].as_slice(),
                "{name}: stored bytes of {e} differ"
            );
            stored += 1;
        }
    }
    ensure!(
        stored == blocks.len(),
        "{name}: stored {stored} of {} blocks",
        blocks.len()
    );
    drop(backend);
    ensure!(
        pool.is_whole(),
        "{name}: pinned buffers missing after the backend closed"
    );
    Ok(())
}

/// Unpinned buffers, duplicates, out-of-range blocks and shared store destinations fail per
/// block; the valid block of the same op still lands.
fn invalid_blocks_fail_alone(dev: &CudaDevice) -> Result<(), Failed> {
    let mut rng = fresh_rng("invalid_blocks");
    let bb = 64 << 10;
    let engine = Engine::cross(dev, bb, 16)?;
    // SAFETY: as in `round_trip`.
    let mut backend =
        unsafe { CudaBackend::new(dev, engine.layout.clone(), CudaBackendConfig::default())? };
    let pinned = backend.pinned_pool(4, bb)?;
    let plain = BufferPool::new(1, bb, DEFAULT_ALIGN)?;
    let poison = poison_byte(&mut rng);
    engine.mem.fill(poison)?;
    let good = random_block(&mut rng, bb);
    let mut ok_buf = pinned.take().ok_or("pool")?;
    ok_buf.as_mut_slice().copy_from_slice(&good);
    let load = op(
        1,
        Direction::Load,
        vec![
            (EngineBlockId(0), Buf::Owned(plain.take().ok_or("pool")?)),
            (EngineBlockId(1), Buf::Owned(ok_buf)),
            (EngineBlockId(1), Buf::Owned(pinned.take().ok_or("pool")?)),
            (EngineBlockId(99), Buf::Owned(pinned.take().ok_or("pool")?)),
        ],
    );
    backend
        .submit(load)
        .map_err(|e| format!("refused: {}", e.kind))?;
    let c = finish(&mut backend, &[OpId(1)])?
        .pop()
        .ok_or("no completion")?;
    let invalid = |r: &Result<(), BlockError>, what: &str| matches!(r, Err(BlockError::Invalid(m)) if m.contains(what));
    ensure!(
        invalid(&c.results[0], "not pinned"),
        "unpinned buffer: {:?}",
        c.results[0]
    );
    ensure!(c.results[1].is_ok(), "valid block: {:?}", c.results[1]);
    ensure!(
        invalid(&c.results[2], "twice"),
        "duplicate block: {:?}",
        c.results[2]
    );
    ensure!(
        invalid(&c.results[3], "outside"),
        "out-of-range block: {:?}",
        c.results[3]
    );
    let snap = engine.snapshot()?;
    ensure!(
        engine.block_of(&snap, EngineBlockId(1)) == good,
        "valid block did not land"
    );
    ensure!(
        engine
            .block_of(&snap, EngineBlockId(0))
            .iter()
            .all(|&x| x == poison),
        "refused block was written"
    );
    // A store needs an owned destination.
    drop(c);
    let shared = Arc::new(pinned.take().ok_or("pool")?);
    let store = op(
        2,
        Direction::Store,
        vec![(EngineBlockId(2), Buf::Shared(shared))],
    );
    backend
        .submit(store)
        .map_err(|e| format!("refused: {}", e.kind))?;
    let c = finish(&mut backend, &[OpId(2)])?
        .pop()
        .ok_or("no completion")?;
    ensure!(
        invalid(&c.results[0], "owned"),
        "shared store destination: {:?}",
        c.results[0]
    );
    Ok(())
}

/// A 4 GiB load is not done within a 1 ms wait budget; a second wait sees it complete.
fn wait_really_waits(dev: &CudaDevice) -> Result<(), Failed> {
    let mut rng = fresh_rng("wait_really_waits");
    let (block, n) = (2 * MIB, 2048u32);
    let engine = Engine::cross(dev, block, n)?;
    // SAFETY: as in `round_trip`.
    let mut backend =
        unsafe { CudaBackend::new(dev, engine.layout.clone(), CudaBackendConfig::default())? };
    let pool = backend.pinned_pool(1, block)?;
    let mut src = pool.take().ok_or("pool")?;
    rng.fill_bytes(src.as_mut_slice());
    let src = Arc::new(src);
    let blocks = (0..n)
        .map(|i| (EngineBlockId(i), Buf::Shared(src.clone())))
        .collect();
    backend
        .submit(op(1, Direction::Load, blocks))
        .map_err(|e| format!("refused: {}", e.kind))?;
    let until = Instant::now() + Duration::from_millis(1);
    let outcome = backend.wait(&[OpId(1)], until);
    ensure!(
        outcome == WaitOutcome::TimedOut,
        "a 4 GiB copy was reported complete within a 1 ms wait"
    );
    ensure!(
        Instant::now() >= until,
        "wait returned TimedOut before its budget passed"
    );
    let mut out = Vec::new();
    backend.poll(&mut out);
    ensure!(
        out.is_empty(),
        "poll returned the op before its event completed"
    );
    ensure!(backend.stats().in_flight == 1, "op not counted in flight");
    let t = Instant::now();
    let c = finish(&mut backend, &[OpId(1)])?;
    println!(
        "wait_really_waits: the rest of the 4 GiB load took {:?}",
        t.elapsed()
    );
    ensure!(
        c[0].results.iter().all(|r| r.is_ok()),
        "load failed: {:?}",
        c[0].results.iter().find(|r| r.is_err())
    );
    for b in [0, n / 2, n - 1] {
        let mut got = vec![0u8; block];
        engine.mem.read(b as usize * block, &mut got)?;
        ensure!(
            got.as_slice() == src.as_slice(),
            "block {b} differs after wait said Completed"
        );
    }
    Ok(())
}

/// A task queued behind a long copy times out on time; its buffers stay quarantined (not in the
/// pool, not in the report) until the copy really completed, then return; the late bytes land.
fn deadline_quarantine_on_long_copy(dev: &CudaDevice) -> Result<(), Failed> {
    let mut rng = fresh_rng("deadline_quarantine");
    let (block, blocker_n, late_n) = (2 * MIB, 3072u32, 8u32);
    let engine = Engine::cross(dev, block, blocker_n + late_n)?;
    // SAFETY: as in `round_trip`; the driver (which owns the backend) is dropped before `engine`.
    let mut backend =
        unsafe { CudaBackend::new(dev, engine.layout.clone(), CudaBackendConfig::default())? };
    let stats = backend.stats_handle();
    let src_pool = backend.pinned_pool(1, block)?;
    let pool = backend.pinned_pool(late_n as usize, block)?;
    let mut src = src_pool.take().ok_or("pool")?;
    rng.fill_bytes(src.as_mut_slice());
    let src = Arc::new(src);
    let poison = poison_byte(&mut rng);
    engine.mem.fill(poison)?;
    let data: Vec<Vec<u8>> = (0..late_n).map(|_| random_block(&mut rng, block)).collect();
    let mut late_blocks = Vec::new();
    let mut indices = Vec::new();
    for (i, d) in data.iter().enumerate() {
        let mut buf = pool.take().ok_or("pool")?;
        buf.as_mut_slice().copy_from_slice(d);
        indices.push(buf.index());
        let e = EngineBlockId(blocker_n + i as u32);
        late_blocks.push(OpBlock {
            key: BlockKey(u128::from(e.0)),
            engine: Some(e),
            buf: Buf::Owned(buf),
        });
    }
    let mut b = DriverBuilder::new(DriverConfig::default());
    let gpu = b.backend(Box::new(backend));
    let driver = b.spawn()?;
    let blocker = driver.submit(TaskSpec {
        request: RequestId(1),
        dir: Direction::Load,
        route: vec![gpu],
        blocks: (0..blocker_n)
            .map(|i| OpBlock {
                key: BlockKey(u128::from(i)),
                engine: Some(EngineBlockId(i)),
                buf: Buf::Shared(src.clone()),
            })
            .collect(),
        deadline: Instant::now() + Duration::from_secs(120),
        deferred: false,
    })?;
    // Let the blocker reach the stream first, so the late task queues behind it.
    let queued_by = Instant::now() + Duration::from_secs(10);
    while stats.snapshot().in_flight == 0 {
        ensure!(
            Instant::now() < queued_by,
            "the blocker was never submitted to the backend"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    let deadline = Instant::now() + Duration::from_millis(20);
    let late = driver.submit(TaskSpec {
        request: RequestId(2),
        dir: Direction::Load,
        route: vec![gpu],
        blocks: late_blocks,
        deadline,
        deferred: false,
    })?;
    let report = driver
        .wait_report(late, deadline + Duration::from_secs(10))
        .ok_or("no report for the late task")?;
    let reported = Instant::now();
    let (tracker, _) = driver.stats()?;
    let backend_now = stats.snapshot();
    ensure!(
        report.state == TaskState::TimedOut,
        "late task ended {:?}, expected TimedOut",
        report.state
    );
    ensure!(
        reported <= deadline + Duration::from_millis(500),
        "TimedOut came {:?} after the deadline",
        reported - deadline
    );
    ensure!(
        report.blocks.iter().all(|b| b.buf.is_none()),
        "a timed-out op's buffers came back while its copy may still run"
    );
    ensure!(
        backend_now.in_flight >= 1,
        "inconclusive: the 6 GiB blocker already finished {:?} after submission",
        reported.elapsed()
    );
    ensure!(
        tracker.zombie_ops == 1 && tracker.zombie_bytes >= u64::from(late_n) * block as u64,
        "expected one zombie op holding the late buffers, tracker says {tracker:?}"
    );
    ensure!(
        indices.iter().all(|&i| pool.is_lent(i)),
        "quarantined buffers are back in the pool early"
    );
    let br = driver
        .wait_report(blocker, Instant::now() + Duration::from_secs(120))
        .ok_or("no blocker report")?;
    ensure!(br.state == TaskState::Done, "blocker ended {:?}", br.state);
    let stop = Instant::now() + Duration::from_secs(60);
    loop {
        let (s, _) = driver.stats()?;
        if s.zombie_ops == 0 {
            ensure!(
                s.late_completions >= 1,
                "the zombie's completion was not counted late: {s:?}"
            );
            break;
        }
        ensure!(Instant::now() < stop, "zombie op never drained: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    ensure!(
        pool.is_whole(),
        "quarantined buffers did not return after the copy completed"
    );
    drop(br);
    drop(driver);
    let snap = engine.snapshot()?;
    for (i, d) in data.iter().enumerate() {
        let e = EngineBlockId(blocker_n + i as u32);
        ensure!(
            &engine.block_of(&snap, e) == d,
            "late block {e} did not land intact"
        );
    }
    for i in [0, blocker_n - 1] {
        ensure!(
            engine.block_of(&snap, EngineBlockId(i)) == src.as_slice(),
            "blocker block {i} differs"
        );
    }
    Ok(())
}

/// Preempting a request with a 1 GiB store in flight gives a fence that holds only once the
/// copy physically completed; the store still finishes (flushed), byte-exact.
fn preempt_fence_flushes_inflight_store(dev: &CudaDevice) -> Result<(), Failed> {
    let mut rng = fresh_rng("preempt_fence");
    let (block, n) = (2 * MIB, 512u32);
    let engine = Engine::cross(dev, block, n)?;
    let base = random_block(&mut rng, block);
    let pattern = |i: u32| {
        let mut v = base.clone();
        v[..8].copy_from_slice(&u64::from(i).to_le_bytes());
        v
    };
    for i in 0..n {
        engine.write_block(EngineBlockId(i), &pattern(i))?;
    }
    // SAFETY: as in `deadline_quarantine_on_long_copy`.
    let mut backend =
        unsafe { CudaBackend::new(dev, engine.layout.clone(), CudaBackendConfig::default())? };
    let stats = backend.stats_handle();
    let pool = backend.pinned_pool(n as usize, block)?;
    let poison = poison_byte(&mut rng);
    let mut blocks = Vec::new();
    for i in 0..n {
        let mut buf = pool.take().ok_or("pool")?;
        buf.as_mut_slice().fill(poison);
        blocks.push(OpBlock {
            key: BlockKey(u128::from(i)),
            engine: Some(EngineBlockId(i)),
            buf: Buf::Owned(buf),
        });
    }
    let mut b = DriverBuilder::new(DriverConfig::default());
    let gpu = b.backend(Box::new(backend));
    let driver = b.spawn()?;
    let store = driver.submit(TaskSpec {
        request: RequestId(7),
        dir: Direction::Store,
        route: vec![gpu],
        blocks,
        deadline: Instant::now() + Duration::from_secs(60),
        deferred: false,
    })?;
    let fence = driver.preempt(RequestId(7))?;
    ensure!(
        !fence.wait(Instant::now() + Duration::from_millis(1)),
        "fence held within 1 ms of a 1 GiB store"
    );
    ensure!(
        fence.wait(Instant::now() + Duration::from_secs(60)),
        "fence never held"
    );
    let s = stats.snapshot();
    ensure!(
        s.completed_ops >= 1 && s.in_flight == 0,
        "fence held before the store's event completed: {s:?}"
    );
    let report = driver
        .wait_report(store, Instant::now() + Duration::from_secs(60))
        .ok_or("no store report")?;
    ensure!(
        report.state == TaskState::Done,
        "flushed store ended {:?}",
        report.state
    );
    for br in &report.blocks {
        let e = br.engine.ok_or("lost engine id")?;
        let buf = br.buf.as_ref().ok_or("store buffer not returned")?;
        ensure!(
            buf.as_slice() == pattern(e.0).as_slice(),
            "stored bytes of {e} differ"
        );
    }
    drop(report);
    drop(driver);
    ensure!(pool.is_whole(), "pinned buffers missing");
    Ok(())
}
