//! GPU trials through the kvx-core driver: deadline + quarantine behind a long copy, and the
//! preemption fence over an in-flight store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{
    BlockKey, Buf, Direction, DriverBuilder, DriverConfig, EngineBlockId, OpBlock, RequestId,
    TaskSpec, TaskState,
};
use kvx_cuda::{CudaBackend, CudaBackendConfig};
use libtest_mimic::Failed;
use rand::RngCore;

use crate::MIB;
use crate::fixture::{Engine, Gpu, ensure, fresh_rng, poison_byte, random_block};

/// A task queued behind a long copy times out on time; its buffers stay quarantined (not in the
/// pool, not in the report) until the copy really completed, then return; the late bytes land.
pub fn deadline_quarantine_on_long_copy(dev: &Gpu) -> Result<(), Failed> {
    let mut rng = fresh_rng("deadline_quarantine");
    let ((block, blocker_n), late_n) = (dev.long_copy((2 * MIB, 3072)), 8u32);
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
        // One driver tick (1 ms, kvx-core's TICK) plus the 50 ms allowance of these machines.
        reported <= deadline + Duration::from_millis(1 + 50),
        "TimedOut came {:?} after the deadline",
        reported - deadline
    );
    ensure!(
        report.blocks.iter().all(|b| b.buf.is_none()),
        "a timed-out op's buffers came back while its copy may still run"
    );
    ensure!(
        backend_now.in_flight >= 1,
        "inconclusive: the blocker already finished {:?} after submission",
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
    // The driver cancelled the late op: the backend marks it abandoned, it stays a zombie.
    let marked_by = Instant::now() + Duration::from_secs(1);
    while stats.snapshot().abandoned_ops == 0 && Instant::now() < marked_by {
        std::thread::sleep(Duration::from_millis(1));
    }
    let s = stats.snapshot();
    ensure!(
        s.abandoned_ops == 1 && s.zombies == 1 && s.late_completions == 0,
        "expected one abandoned op held as a zombie, backend says {s:?}"
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
    let s = stats.snapshot();
    ensure!(
        s.late_completions == 1 && s.zombies == 0,
        "the abandoned op's late completion was not counted: {s:?}"
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

/// Preempting a request with a long store in flight (1 GiB on a GPU, slowed copies on the
/// stand-in) gives a fence that holds only once the
/// copy physically completed; the store still finishes (flushed), byte-exact.
pub fn preempt_fence_flushes_inflight_store(dev: &Gpu) -> Result<(), Failed> {
    let mut rng = fresh_rng("preempt_fence");
    let (block, n) = dev.long_copy((2 * MIB, 512));
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
        "fence held within 1 ms of a long store"
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
