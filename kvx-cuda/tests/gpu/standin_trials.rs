//! Trials that need the stand-in's knobs (a driver that misbehaves on purpose); on a real GPU
//! they print a skip line.

use std::time::{Duration, Instant};

use kvx_core::{Backend, BlockError, Buf, Direction, EngineBlockId, OpId, WaitOutcome};
use kvx_cuda::{BatchMode, CudaBackend, CudaBackendConfig, CudaDevice, CudaError};
use libtest_mimic::Failed;

use crate::backend_trials::round_trip;
use crate::fixture::{Engine, Gpu, ensure, finish, fresh_rng, op, random_block};

/// A driver without `cuMemcpyBatchAsync` (before CUDA 12.8): the device says so, `Auto`
/// batching falls back to one call per run, and a round trip is still byte-exact.
pub fn driver_without_batch_copy(gpu: &Gpu) -> Result<(), Failed> {
    let standin = gpu.standin.ok_or("needs the stand-in")?;
    standin.set_batch_copy(false);
    let reopened = CudaDevice::open(gpu.ordinal());
    standin.set_batch_copy(true);
    let dev = reopened?;
    ensure!(
        !dev.batch_copy_available(),
        "the device reports a batch copy the driver does not have"
    );
    let engine = Engine::cross(&dev, 16 << 10, 256)?;
    round_trip(&dev, "no_batch_driver", engine, BatchMode::Auto, 100)
}

/// A sticky error (the context fails after a few copies): the op in flight comes back with
/// every block failed and its buffers, the next one fails too, and nothing hangs.
pub fn sticky_error_fails_ops_not_the_process(gpu: &Gpu) -> Result<(), Failed> {
    let standin = gpu.standin.ok_or("needs the stand-in")?;
    let mut rng = fresh_rng("sticky_error");
    let bb = 16 << 10;
    let engine = Engine::per_layer(gpu, 2, bb / 2, 64)?;
    let cfg = CudaBackendConfig {
        batch: BatchMode::Never,
        ..CudaBackendConfig::default()
    };
    // SAFETY: `engine` outlives the backend (dropped first, at the end of this function) and is
    // not touched while ops run.
    let mut backend = unsafe { CudaBackend::new(gpu, engine.layout.clone(), cfg)? };
    let pool = backend.pinned_pool(16, bb)?;
    let block = |i: u32, rng: &mut rand::rngs::SmallRng| -> Result<(EngineBlockId, Buf), Failed> {
        let mut buf = pool.take().ok_or("pool")?;
        buf.as_mut_slice().copy_from_slice(&random_block(rng, bb));
        Ok((EngineBlockId(i * 3), Buf::Owned(buf)))
    };
    standin.fail_after_copies(gpu.ordinal(), Some(3));
    let first = (0..8)
        .map(|i| block(i, &mut rng))
        .collect::<Result<_, _>>()?;
    backend
        .submit(op(1, Direction::Load, first))
        .map_err(|e| format!("refused: {}", e.kind))?;
    let c = finish(&mut backend, &[OpId(1)])?;
    ensure!(
        c[0].results
            .iter()
            .all(|r| matches!(r, Err(BlockError::Io(m)) if m.contains("ILLEGAL_ADDRESS"))),
        "blocks of an op hit by a sticky error must fail naming it: {:?}",
        c[0].results
    );
    ensure!(backend.stats().failed_ops == 1, "{:?}", backend.stats());
    drop(c);
    let second = (8..10)
        .map(|i| block(i, &mut rng))
        .collect::<Result<_, _>>()?;
    match backend.submit(op(2, Direction::Load, second)) {
        Err(e) => ensure!(
            e.kind.to_string().contains("ILLEGAL_ADDRESS"),
            "refused for another reason: {}",
            e.kind
        ),
        Ok(()) => {
            let outcome = backend.wait(&[OpId(2)], Instant::now() + Duration::from_secs(10));
            ensure!(outcome == WaitOutcome::Completed, "the next op hung");
            let mut out = Vec::new();
            backend.poll(&mut out);
            ensure!(
                out.len() == 1 && out[0].results.iter().all(|r| r.is_err()),
                "the next op on the failed context succeeded: {:?}",
                out.first().map(|c| &c.results)
            );
        }
    }
    drop(backend);
    ensure!(
        pool.is_whole(),
        "buffers of the failed ops did not come back"
    );
    Ok(())
}

/// A pool is pinned in chunks of the configured size; a chunk the driver refuses fails the
/// pool with an error naming the chunk size; a copy run that spans two chunks is cut at the
/// boundary (the stand-in refuses a copy crossing registrations), and lands byte-exact.
pub fn pinned_pool_in_chunks(gpu: &Gpu) -> Result<(), Failed> {
    let standin = gpu.standin.ok_or("needs the stand-in")?;
    let mut rng = fresh_rng("pinned_chunks");
    let bb = 64 << 10;
    standin.set_register_limit(gpu.ordinal(), Some(256 << 10));
    let refused = gpu.pinned_pool_in_chunks(16, bb, 1 << 20);
    match refused {
        Err(e @ CudaError::PinFailed { .. }) => ensure!(
            e.to_string().contains("1048576-byte chunk") && e.to_string().contains("OUT_OF_MEMORY"),
            "the error does not name the chunk size and the driver's answer: {e}"
        ),
        other => return Err(format!("pinning past the limit gave {other:?}").into()),
    }
    let engine = Engine::cross(gpu, bb, 64)?;
    let cfg = CudaBackendConfig {
        pin_chunk_bytes: 128 << 10,
        ..CudaBackendConfig::default()
    };
    // SAFETY: `engine` outlives the backend (dropped first) and is read only after the op.
    let mut backend = unsafe { CudaBackend::new(gpu, engine.layout.clone(), cfg)? };
    let pool = backend.pinned_pool(16, bb)?;
    ensure!(pool.pinned_chunks() == 8, "{} chunks", pool.pinned_chunks());
    let mut bufs: Vec<_> = std::iter::from_fn(|| pool.take()).collect();
    bufs.sort_by_key(|b| b.as_ptr() as usize);
    let data: Vec<Vec<u8>> = (0..16).map(|_| random_block(&mut rng, bb)).collect();
    let items = bufs
        .into_iter()
        .zip(&data)
        .enumerate()
        .map(|(i, (mut b, d))| {
            b.as_mut_slice().copy_from_slice(d);
            (EngineBlockId(i as u32), Buf::Owned(b))
        })
        .collect();
    backend
        .submit(op(1, Direction::Load, items))
        .map_err(|e| format!("refused: {}", e.kind))?;
    let c = finish(&mut backend, &[OpId(1)])?;
    ensure!(
        c[0].results.iter().all(|r| r.is_ok()),
        "a load across pin chunks failed: {:?}",
        c[0].results.iter().find(|r| r.is_err())
    );
    ensure!(
        backend.stats().runs == 8,
        "16 adjacent blocks in 8 chunks must be 8 runs: {:?}",
        backend.stats()
    );
    drop(c);
    let snap = engine.snapshot()?;
    for (i, d) in data.iter().enumerate() {
        ensure!(
            &engine.block_of(&snap, EngineBlockId(i as u32)) == d,
            "block {i} differs"
        );
    }
    Ok(())
}
