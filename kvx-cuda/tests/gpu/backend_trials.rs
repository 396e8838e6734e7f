//! GPU trials that drive the backend directly: byte-exact round trips, per-block refusals,
//! and `wait` semantics.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{
    Backend, BlockError, Buf, BufferPool, DEFAULT_ALIGN, Direction, EngineBlockId, OpId,
    WaitOutcome,
};
use kvx_cuda::{BatchMode, CudaBackend, CudaBackendConfig, CudaDevice, PAGE_SIZE};

use libtest_mimic::Failed;
use rand::RngCore;

use crate::MIB;
use crate::fixture::{
    Engine, Gpu, ensure, finish, fresh_rng, op, pick_blocks, poison_byte, random_block,
};

pub fn round_trip_cross_layer(dev: &Gpu) -> Result<(), Failed> {
    round_trip(
        dev,
        "cross_layer",
        Engine::cross(dev, 64 << 10, 2048)?,
        BatchMode::Auto,
        1000,
    )
}

pub fn round_trip_per_layer(dev: &Gpu) -> Result<(), Failed> {
    // 3 layers x K/V, 8 KiB segments: a 48 KiB block is 6 segments.
    round_trip(
        dev,
        "per_layer",
        Engine::per_layer(dev, 6, 8 << 10, 1024)?,
        BatchMode::Auto,
        600,
    )
}

pub fn round_trip_odd_per_run(dev: &Gpu) -> Result<(), Failed> {
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
pub fn round_trip(
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
    let streams = cfg.copy_streams as u64;
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
        // One batched call per stream an op's runs were spread over.
        ensure!(
            calls <= ops * streams && calls < runs,
            "{name}: {calls} copy calls for {ops} batched ops of {runs} runs over {streams} streams"
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
pub fn invalid_blocks_fail_alone(dev: &Gpu) -> Result<(), Failed> {
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

/// A long load (4 GiB on a GPU, slowed copies on the stand-in) is not done within a 1 ms wait
/// budget; a second wait sees it complete.
pub fn wait_really_waits(dev: &Gpu) -> Result<(), Failed> {
    let mut rng = fresh_rng("wait_really_waits");
    let (block, n) = dev.long_copy((2 * MIB, 2048));
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
        "a long copy was reported complete within a 1 ms wait"
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
        "wait_really_waits: the rest of the {} MiB load took {:?}",
        block * n as usize / MIB,
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
