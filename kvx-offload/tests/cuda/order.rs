//! Stores and loads ordered after the engine's forward on the device, as vLLM's asynchronous
//! scheduling needs: the engine's CPU starts step N+1 (and kvx's copies of what step N
//! computed) while step N's forward is still pending on the engine's stream. The "forward" is
//! a host function that keeps the engine's stream busy, then the write of the block's final
//! bytes (`EngineStream`), so the trials run on a GPU as on the stand-in.

use std::time::{Duration, Instant};

use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_cuda_standin::engine_stream::EngineStream;
use libtest_mimic::Failed;

use crate::common::{BLOCK, BT, EngineBlocks, Opts, Rig, content};
use crate::engine::{DeviceArena, Gpu, cuda_rig};

/// How long the forward keeps the engine's stream busy before it writes the block.
const FORWARD: Duration = Duration::from_millis(300);
/// The bound of a call that must not wait: one tick and 50 ms.
const NO_WAIT: Duration = Duration::from_millis(51);
const T: Duration = Duration::from_secs(10);

/// `Err(Failed)` with a message unless `cond`.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+).into());
        }
    };
}

/// The engine's forward on `engine`: busy for [`FORWARD`], then `data` lands in block `b`.
fn forward(
    engine: &EngineStream,
    arena: &DeviceArena,
    b: EngineBlockId,
    data: &[u8],
) -> Result<Instant, Failed> {
    let mut writes = Vec::new();
    let mut pos = 0;
    for (addr, len) in arena.layout().segments(b)? {
        writes.push((addr as u64, &data[pos..pos + len]));
        pos += len;
    }
    let launched = Instant::now();
    engine.forward(FORWARD, &writes)?;
    Ok(launched)
}

/// The next step as the engine runs it: kvx ordered after the engine's stream first (which
/// must not wait, while the forward launched at `launched` is still pending), then the step.
fn ordered_step(
    r: &mut Rig<DeviceArena>,
    engine: &EngineStream,
    launched: Instant,
) -> Result<(), Failed> {
    let t = Instant::now();
    // SAFETY: `engine` is a live stream of the engine memory's device (its primary context).
    unsafe { r.w().order_after_engine_stream(engine.raw()) }?;
    let took = t.elapsed();
    println!("order_after_engine_stream took {took:?}");
    ensure!(took < NO_WAIT, "the ordering call waited {took:?}");
    ensure!(
        launched.elapsed() < FORWARD,
        "the forward may be over already ({:?}): the trial proves nothing",
        launched.elapsed()
    );
    r.step();
    Ok(())
}

/// What a block holds, in words, for a failure message.
fn which(got: &[u8], named: &[(&str, &[u8])]) -> String {
    named
        .iter()
        .find(|(_, bytes)| got == *bytes)
        .map_or("unexpected bytes".into(), |(name, _)| (*name).into())
}

/// Step N saves block 3, which step N's forward computes; step N+1 starts (ordered after the
/// engine's stream) while that forward is still pending and releases the store. The stored
/// bytes, loaded back into block 9, are the forward's, not the block's earlier bytes.
pub fn store_after_a_pending_forward(gpu: &Gpu) -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let mut r = cuda_rig(dir.path(), Opts::default(), gpu)?;
    let engine = EngineStream::open(gpu.dev.ordinal())?;
    let key = BlockKey::chain(None, b"computed by a pending forward");
    let (early, computed) = (vec![0x11; BLOCK], content(key));
    r.arena.write_block(EngineBlockId(3), &early)?;
    r.save(1, &[key], &[3]);
    r.step();
    let launched = forward(&engine, &r.arena, EngineBlockId(3), &computed)?;
    ordered_step(&mut r, &engine, launched)?;
    r.finish(1);
    ensure!(r.settle(T), "the store did not settle");
    println!("stored {:?} after the forward's launch", launched.elapsed());
    engine.synchronize()?;
    ensure!(
        r.arena.read_block(EngineBlockId(3))? == computed,
        "the forward did not write block 3"
    );
    ensure!(
        r.load(2, &[key], &[9]) == Some(u64::from(BT)),
        "the stored block is not found"
    );
    let loaded = r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(2)));
    ensure!(
        loaded && r.out.invalid_blocks.is_empty(),
        "the load did not finish cleanly: {:?}",
        r.out
    );
    let got = r.arena.read_block(EngineBlockId(9))?;
    ensure!(
        got == computed,
        "the store copied block 3 before the forward wrote it: it stored {}",
        which(&got, &[("the bytes from before the forward", &early)])
    );
    Ok(())
}

/// A load into block 9 starts (ordered after the engine's stream) while the previous step's
/// forward, still pending, writes block 9 (its earlier owner's last step, which asynchronous
/// scheduling lets overlap): the load lands after that write, and is reported after it.
pub fn load_after_a_pending_forward(gpu: &Gpu) -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let mut r = cuda_rig(dir.path(), Opts::default(), gpu)?;
    let engine = EngineStream::open(gpu.dev.ordinal())?;
    let key = BlockKey::chain(None, b"offloaded earlier");
    ensure!(r.offload(1, &[key], &[3], T), "the store did not settle");
    ensure!(
        r.load(2, &[key], &[9]) == Some(u64::from(BT)),
        "the stored block is not found"
    );
    let stale = vec![0x5A; BLOCK];
    let launched = forward(&engine, &r.arena, EngineBlockId(9), &stale)?;
    ordered_step(&mut r, &engine, launched)?;
    let loaded = r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(2)));
    let reported = launched.elapsed();
    ensure!(
        loaded && r.out.invalid_blocks.is_empty(),
        "the load did not finish cleanly: {:?}",
        r.out
    );
    println!("load reported {reported:?} after the forward's launch");
    engine.synchronize()?;
    let got = r.arena.read_block(EngineBlockId(9))?;
    ensure!(
        got == content(key),
        "the load landed before the forward's write: block 9 holds {}",
        which(&got, &[("the forward's bytes", &stale)])
    );
    ensure!(
        reported >= FORWARD,
        "the load was reported {reported:?} after the launch, before the forward ended"
    );
    Ok(())
}
