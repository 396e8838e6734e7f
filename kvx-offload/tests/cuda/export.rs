//! A GPU engine as the producer of prefill/decode disaggregation: a finished request's device
//! blocks are copied into pinned host buffers that the server reads from, so the engine gets
//! its blocks back when the copy is done, before any reader came.

use std::time::{Duration, Instant};

use kvx_core::{
    BlockKey, Buf, BufferPool, DEFAULT_ALIGN, Direction, DriverBuilder, DriverConfig,
    EngineBlockId, OpBlock, RequestId, TaskSpec,
};
use kvx_offload::{EngineMemory, Offload, OffloadBuilder, OffloadConfig, RemoteTierConfig};
use kvx_rdma::{Importer, ImporterConfig, ImporterHandle, RemoteDescriptor};
use libtest_mimic::Failed;

use crate::common::{BLOCK, EngineBlocks};
use crate::engine::{DeviceArena, Gpu};

/// Staging buffers of the producer: one request of 4 blocks fits, one of 9 does not.
const STAGING: usize = 8;

fn port() -> Result<u16, Failed> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Step the producer until `f` holds for its output, at most `within`.
fn step_until(
    kvx: &mut Offload,
    within: Duration,
    mut f: impl FnMut(&kvx_offload::WorkerOutput) -> bool,
) -> Result<bool, Failed> {
    let end = Instant::now() + within;
    while Instant::now() < end {
        let out = kvx.worker.get_finished()?;
        kvx.scheduler.update_from_worker(&out);
        if f(&out) {
            return Ok(true);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(false)
}

/// Step until the worker reports `request` finished sending (at most 5 s); whether it did.
fn reported_sent(kvx: &mut Offload, request: u64) -> Result<bool, Failed> {
    let mut sent = Vec::new();
    step_until(kvx, Duration::from_secs(5), |o| {
        sent.extend_from_slice(&o.finished_sending);
        sent.contains(&RequestId(request))
    })
}

/// A reader of the producer's exports: kvx-rdma's importer in a driver of its own.
struct Reader {
    driver: kvx_core::Driver,
    handle: ImporterHandle,
    rdma: kvx_core::BackendId,
    pool: BufferPool,
}

impl Reader {
    fn new() -> Result<Reader, Failed> {
        let importer = Importer::new(ImporterConfig {
            heartbeats: false,
            ..ImporterConfig::default()
        })?;
        let handle = importer.handle();
        let mut b = DriverBuilder::new(DriverConfig::default());
        let rdma = b.backend(Box::new(importer));
        Ok(Reader {
            driver: b.spawn()?,
            handle,
            rdma,
            pool: BufferPool::new(16, BLOCK, DEFAULT_ALIGN)?,
        })
    }

    /// Read every block `desc` names; each block's bytes, or its error.
    fn read(&self, desc: &RemoteDescriptor) -> Result<Vec<Result<Vec<u8>, String>>, Failed> {
        let blocks = desc
            .blocks
            .iter()
            .map(|key| {
                Ok(OpBlock {
                    key: *key,
                    engine: None,
                    buf: Buf::Owned(self.pool.take().ok_or("reader pool exhausted")?),
                })
            })
            .collect::<Result<Vec<_>, Failed>>()?;
        let deadline = Instant::now() + Duration::from_secs(5);
        let task = self.driver.submit(TaskSpec {
            request: RequestId(900),
            dir: Direction::Load,
            route: vec![self.rdma],
            blocks,
            deadline,
            deferred: false,
        })?;
        let report = self
            .driver
            .wait_report(task, deadline + Duration::from_secs(1))
            .ok_or("the read never ended")?;
        Ok(report
            .blocks
            .into_iter()
            .map(|b| match (b.result, b.buf) {
                (Ok(()), Some(buf)) => Ok(buf.as_slice().to_vec()),
                (Ok(()), None) => Err("no buffer came back".into()),
                (Err(e), _) => Err(format!("{e:?}")),
            })
            .collect())
    }
}

fn data(b: u32) -> Vec<u8> {
    (0..BLOCK).map(|i| (i as u32 * 13 + b * 7) as u8).collect()
}

/// A producer over `arena` on `gpu` with [`STAGING`] staging buffers.
fn producer(gpu: &Gpu, arena: &DeviceArena) -> Result<Offload, Failed> {
    let listen = format!("127.0.0.1:{}", port()?).parse()?;
    let cfg = OffloadConfig {
        host_blocks: 8,
        remote: Some(RemoteTierConfig {
            listen: Some(listen),
            lease_ttl_ms: 30_000,
            heartbeat_ms: 7_500,
            export_blocks: STAGING,
            ..RemoteTierConfig::default()
        }),
        ..OffloadConfig::default()
    };
    // SAFETY: the device memory outlives the runtime (each test shuts it down before its
    // arena drops); the tests write device blocks only once the engine got them back.
    let memory = unsafe { EngineMemory::cuda(&gpu.dev, arena.layout().clone()) };
    Ok(OffloadBuilder::new(cfg, memory).build()?)
}

/// The key of block `i` of request `r`.
fn key(r: u64, i: u32) -> BlockKey {
    BlockKey::chain(None, format!("{r}/{i}").as_bytes())
}

/// Request `r`'s blocks: keys, and device blocks `0..n`.
fn request_blocks(r: u64, n: u32) -> Vec<(BlockKey, EngineBlockId)> {
    (0..n).map(|i| (key(r, i), EngineBlockId(i))).collect()
}

/// The source a consumer gets for export `export` of `blocks` from `p`.
fn source(
    p: &Offload,
    export: u64,
    blocks: &[(BlockKey, EngineBlockId)],
) -> Result<RemoteDescriptor, Failed> {
    let src = kvx_offload::RemoteSource {
        namespace: "test".into(),
        export,
        producers: vec![p.runtime.remote_addr().ok_or("no server address")?],
        keys: blocks.iter().map(|(k, _)| *k).collect(),
        ttl_ms: 30_000,
        heartbeat_ms: 7_500,
    };
    Ok(src.descriptor(0, BLOCK as u64)?)
}

/// A request's blocks: keys, and the device blocks holding them.
type Blocks = [(BlockKey, EngineBlockId)];

/// Export the requests `(request, export id, blocks)` in one step of `p`.
fn export(p: &mut Offload, exports: &[(u64, u64, &Blocks)]) -> Result<(), Failed> {
    for (r, e, blocks) in exports {
        if !p.scheduler.export_finished(RequestId(*r), *e, blocks) {
            return Err(format!("the scheduler refused export {e}").into());
        }
    }
    let meta = p.scheduler.build_meta();
    if p.worker.start_step(meta)?.fence().is_some() {
        return Err("an export step waits on a fence".into());
    }
    Ok(())
}

/// Step `p` until its worker went back to nothing in flight, at most 2 s.
fn until_nothing_in_flight(p: &mut Offload) -> Result<bool, Failed> {
    let end = Instant::now() + Duration::from_secs(2);
    while p.worker.in_flight() > 0 && Instant::now() < end {
        p.worker.get_finished()?;
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(p.worker.in_flight() == 0)
}

/// A reader of `p`'s export `export` of `blocks` gets none of them, and hears that its lease
/// ended (so it does not wait for the export to come).
fn refused(p: &Offload, export: u64, blocks: &Blocks, what: &str) -> Result<(), Failed> {
    let reader = Reader::new()?;
    let desc = source(p, export, blocks)?;
    reader.handle.register(desc.clone())?;
    for (i, r) in reader.read(&desc)?.iter().enumerate() {
        match r {
            Ok(_) => return Err(format!("{what}: block {i} was read").into()),
            Err(e) if !e.contains("LeaseEnded") => {
                return Err(format!("{what}: block {i}: {e}, not that its lease ended").into());
            }
            Err(_) => {}
        }
    }
    Ok(())
}

fn close(p: Offload, arena: DeviceArena) {
    let Offload {
        worker, runtime, ..
    } = p;
    drop(worker);
    runtime.shutdown();
    drop(arena);
}

/// The producer on `gpu` exports request 1 (device blocks 0..4). The engine hears it is done
/// sending once the copy out of the device is done (on the stand-in, whose copies are slowed
/// to 300 ms here, not before), with no reader yet; the engine then reuses those device
/// blocks; a reader still gets the exported bytes, from the staging buffers, which come back
/// when it says done. A request of more blocks than the free staging buffers is refused: the
/// engine gets its blocks back at once, and a reader fails.
pub fn gpu_producer_stages_exports_in_host_buffers(gpu: &Gpu) -> Result<(), Failed> {
    let mut arena = DeviceArena::new(&gpu.dev)?;
    for b in 0..10 {
        arena.write_block(EngineBlockId(b), &data(b))?;
    }
    let mut p = producer(gpu, &arena)?;
    let copy = Duration::from_millis(300);
    if let Some(s) = &gpu.standin {
        s.set_copy_delay(gpu.dev.ordinal(), copy);
    }
    let (exported, too_big) = (request_blocks(1, 4), request_blocks(2, STAGING as u32 + 1));
    let started = Instant::now();
    export(&mut p, &[(1, 77, &exported), (2, 78, &too_big)])?;
    let mut sent = Vec::new();
    let mut first_sent = None;
    let done = step_until(&mut p, Duration::from_secs(5), |o| {
        sent.extend_from_slice(&o.finished_sending);
        if first_sent.is_none() && sent.contains(&RequestId(1)) {
            first_sent = Some(started.elapsed());
        }
        sent.contains(&RequestId(1)) && sent.contains(&RequestId(2))
    })?;
    if !done {
        return Err(format!("finished_sending {sent:?}: not both requests within 5 s").into());
    }
    if gpu.standin.is_some() && first_sent.is_some_and(|t| t < copy) {
        return Err(format!(
            "request 1 was reported sent {first_sent:?} after its export started, before its \
             {copy:?} copy out of the device was done"
        )
        .into());
    }
    if let Some(s) = &gpu.standin {
        s.set_copy_delay(gpu.dev.ordinal(), Duration::ZERO);
    }
    if p.worker.in_flight() == 0 {
        return Err("request 1's lease ended with no reader".into());
    }
    // The engine reuses the blocks it got back.
    for b in 0..10 {
        arena.write_block(EngineBlockId(b), &[0xEE; BLOCK])?;
    }
    let reader = Reader::new()?;
    let desc = source(&p, 77, &exported)?;
    reader.handle.register(desc.clone())?;
    for (i, got) in reader.read(&desc)?.into_iter().enumerate() {
        if got? != data(i as u32) {
            return Err(format!("exported block {i}: not the bytes the request had").into());
        }
    }
    refused(
        &p,
        78,
        &too_big,
        "the export too big for the staging buffers",
    )?;
    reader.handle.done(desc.request)?;
    if !until_nothing_in_flight(&mut p)? {
        return Err("the staging buffers did not come back after the reader said done".into());
    }
    drop(reader);
    close(p, arena);
    Ok(())
}

/// The copy out of the device fails (the stand-in fails every copy): the export is refused,
/// the engine gets its blocks back, the staging buffers come back, and a reader fails.
pub fn gpu_producer_copy_failure_refuses_the_export(gpu: &Gpu) -> Result<(), Failed> {
    let s = gpu
        .standin
        .as_ref()
        .ok_or("needs the stand-in's fault knob")?;
    let arena = DeviceArena::new(&gpu.dev)?;
    let mut p = producer(gpu, &arena)?;
    s.fail_after_copies(gpu.dev.ordinal(), Some(0));
    let blocks = request_blocks(3, 2);
    export(&mut p, &[(3, 79, &blocks)])?;
    let reported = reported_sent(&mut p, 3)?;
    s.fail_after_copies(gpu.dev.ordinal(), None);
    if !reported {
        return Err("the request whose copy failed was never reported sent".into());
    }
    if !until_nothing_in_flight(&mut p)? {
        return Err("the failed export still holds staging buffers".into());
    }
    refused(&p, 79, &blocks, "the export whose copy failed")?;
    close(p, arena);
    Ok(())
}

/// A reset while one export's copy is in flight (the stand-in's copies slowed to 300 ms) and
/// another export is held: the first comes back in the reset's `delayed_free` (it was never
/// reported), the held one's lease ends (a reader hears so), the reset's fence holds once the
/// copy returned, and every staging buffer comes back.
pub fn gpu_producer_reset_during_a_copy(gpu: &Gpu) -> Result<(), Failed> {
    let s = gpu
        .standin
        .as_ref()
        .ok_or("needs the stand-in's slow copies")?;
    let arena = DeviceArena::new(&gpu.dev)?;
    let mut p = producer(gpu, &arena)?;
    let held = request_blocks(1, 2);
    export(&mut p, &[(1, 77, &held)])?;
    if !reported_sent(&mut p, 1)? {
        return Err("the first export's copy never finished".into());
    }
    s.set_copy_delay(gpu.dev.ordinal(), Duration::from_millis(300));
    export(&mut p, &[(2, 78, &request_blocks(2, 2))])?;
    let reset = p.worker.reset()?;
    s.set_copy_delay(gpu.dev.ordinal(), Duration::ZERO);
    if reset.fence.is_ready() {
        return Err("the reset's fence held while the copy out of the device was in flight".into());
    }
    if reset.delayed_free != vec![RequestId(2)] {
        return Err(format!(
            "delayed_free {:?}: the request whose copy was in flight, and only it",
            reset.delayed_free
        )
        .into());
    }
    if !reset.fence.wait(Instant::now() + Duration::from_secs(2)) {
        return Err("the reset's fence did not hold once the copy returned".into());
    }
    if !until_nothing_in_flight(&mut p)? {
        return Err("staging buffers still held after the reset".into());
    }
    refused(&p, 77, &held, "the export held at the reset")?;
    close(p, arena);
    Ok(())
}
