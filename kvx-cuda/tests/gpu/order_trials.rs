//! The ordering point after the engine's stream (`EngineOrder`): a store or a load submitted
//! while the engine's "forward" is still pending on the engine's stream copies only after it,
//! on every copy stream an op is spread over, and the ordering call does not wait for it.

use std::time::{Duration, Instant};

use kvx_core::{Backend, Buf, Direction, EngineBlockId, OpId};
use kvx_cuda::{CudaBackend, CudaBackendConfig};
use kvx_cuda_standin::engine_stream::EngineStream;
use libtest_mimic::Failed;

use crate::fixture::{Engine, Gpu, ensure, finish, fresh_rng, op, random_block};

/// How long the engine's forward keeps its stream busy before it writes the blocks.
const FORWARD: Duration = Duration::from_millis(300);
/// The bound of a call that must not wait: one tick and 50 ms.
const NO_WAIT: Duration = Duration::from_millis(51);
/// Bytes per block, and blocks of the engine.
const BLOCK: usize = 16 << 10;
const BLOCKS: u32 = 512;
/// Blocks of each op: every other block, so each is a run of its own and the op is spread
/// over all 8 streams of its direction (32 runs per stream at least).
const OP_BLOCKS: u32 = 256;

/// Order the backend after `engine`'s queued work; the call must return at once while the
/// forward launched at `launched` is still pending.
fn order_now(
    order: &kvx_cuda::EngineOrder,
    engine: &EngineStream,
    launched: Instant,
) -> Result<(), Failed> {
    let t = Instant::now();
    // SAFETY: `engine` is a live stream of the backend's device's primary context.
    unsafe { order.order_after(engine.raw()) }?;
    let took = t.elapsed();
    println!("order_after took {took:?}");
    ensure!(
        took < NO_WAIT,
        "order_after waited {took:?} on the engine's stream"
    );
    ensure!(
        launched.elapsed() < FORWARD,
        "the forward may be over already ({:?}): the trial proves nothing",
        launched.elapsed()
    );
    Ok(())
}

/// The engine writes blocks in a slow forward on its own stream; a store of them submitted
/// after `order_after` reads the forward's bytes, not the earlier ones; a load into other
/// blocks the next forward also writes lands after that forward, so the loaded bytes stay.
pub fn order_after_engine_stream(gpu: &Gpu) -> Result<(), Failed> {
    let mut rng = fresh_rng("order_after_engine_stream");
    let engine = Engine::cross(gpu, BLOCK, BLOCKS)?;
    let total = BLOCK * BLOCKS as usize;
    let early = random_block(&mut rng, total);
    engine.mem.write(0, &early)?;
    // SAFETY: `engine` outlives the backend (dropped first, at the end of this function); it
    // is read only after the ops and the engine's stream finished.
    let mut backend =
        unsafe { CudaBackend::new(gpu, engine.layout.clone(), CudaBackendConfig::default())? };
    let order = backend.engine_order()?;
    ensure!(order.streams() == 16, "{} streams ordered", order.streams());
    let pool = backend.pinned_pool(OP_BLOCKS as usize, BLOCK)?;
    let stream = EngineStream::open(gpu.ordinal())?;

    // Store: the forward writes the even blocks' final bytes after FORWARD.
    let forward_bytes = random_block(&mut rng, total);
    let launched = Instant::now();
    stream.forward(FORWARD, &[(engine.mem.ptr(), &forward_bytes)])?;
    order_now(&order, &stream, launched)?;
    let evens: Vec<EngineBlockId> = (0..OP_BLOCKS).map(|i| EngineBlockId(2 * i)).collect();
    let bufs = evens
        .iter()
        .map(|&b| Ok((b, Buf::Owned(pool.take().ok_or("pool")?))))
        .collect::<Result<Vec<_>, Failed>>()?;
    backend
        .submit(op(1, Direction::Store, bufs))
        .map_err(|e| format!("store refused: {}", e.kind))?;
    let stored = finish(&mut backend, &[OpId(1)])?;
    let store_done = launched.elapsed();
    ensure!(
        backend.stats().runs == u64::from(OP_BLOCKS),
        "the store was not spread over every stream: {:?}",
        backend.stats()
    );
    let mut loaded_bytes = Vec::new();
    let mut back = Vec::new();
    for (b, r) in stored[0].op.blocks.iter().zip(&stored[0].results) {
        ensure!(r.is_ok(), "store of {:?} failed: {r:?}", b.engine);
        let e = b.engine.ok_or("no engine block")?.0 as usize;
        let got = b.buf.as_slice();
        ensure!(
            got == &forward_bytes[e * BLOCK..(e + 1) * BLOCK],
            "block {e} was stored before the forward wrote it ({store_done:?} after the launch): {}",
            if got == &early[e * BLOCK..(e + 1) * BLOCK] {
                "it holds the bytes from before the forward"
            } else {
                "it holds neither the earlier nor the forward's bytes"
            }
        );
        loaded_bytes.push(got.to_vec());
    }
    ensure!(
        store_done >= FORWARD,
        "the store ended {store_done:?} after the launch"
    );
    println!("the store ended {store_done:?} after the forward's launch");

    // Load: the stored bytes go into the odd blocks, which the next forward writes (stale).
    for (i, c) in stored.into_iter().flat_map(|c| c.op.blocks).enumerate() {
        back.push((EngineBlockId(2 * i as u32 + 1), c.buf));
    }
    let stale = random_block(&mut rng, total);
    let launched = Instant::now();
    stream.forward(FORWARD, &[(engine.mem.ptr(), &stale)])?;
    order_now(&order, &stream, launched)?;
    backend
        .submit(op(2, Direction::Load, back))
        .map_err(|e| format!("load refused: {}", e.kind))?;
    let done = finish(&mut backend, &[OpId(2)])?;
    let load_done = launched.elapsed();
    ensure!(
        done[0].results.iter().all(|r| r.is_ok()),
        "{:?}",
        done[0].results
    );
    drop(done);
    stream.synchronize()?;
    let snap = engine.snapshot()?;
    for (i, want) in loaded_bytes.iter().enumerate() {
        let b = EngineBlockId(2 * i as u32 + 1);
        let got = engine.block_of(&snap, b);
        ensure!(
            &got == want,
            "block {} holds {} ({load_done:?} after the launch): the load landed before it",
            b.0,
            if got[..] == stale[b.0 as usize * BLOCK..(b.0 as usize + 1) * BLOCK] {
                "the forward's stale bytes"
            } else {
                "unexpected bytes"
            }
        );
    }
    ensure!(
        load_done >= FORWARD,
        "the load ended {load_done:?} after the launch"
    );
    println!("the load ended {load_done:?} after the forward's launch");
    drop(backend);
    ensure!(pool.is_whole(), "buffers did not come back");
    Ok(())
}
