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

/// The producer on `gpu` exports request 1 (device blocks 0..4). The engine hears it is done
/// sending as soon as the copy out of the device is done, with no reader yet; the engine then
/// reuses those device blocks; a reader still gets the exported bytes, from the staging
/// buffers, which come back when it says done. A request of more blocks than the free staging
/// buffers is refused: the engine gets its blocks back at once, and a reader fails.
pub fn gpu_producer_stages_exports_in_host_buffers(gpu: &Gpu) -> Result<(), Failed> {
    let mut arena = DeviceArena::new(&gpu.dev)?;
    for b in 0..10 {
        arena.write_block(EngineBlockId(b), &data(b))?;
    }
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
    // SAFETY: the device memory outlives the runtime (shut down below, before the arena
    // drops); the test writes device blocks only once the engine got them back.
    let memory = unsafe { EngineMemory::cuda(&gpu.dev, arena.layout().clone()) };
    let mut p = OffloadBuilder::new(cfg, memory).build()?;
    let key = |r: u64, i: u32| BlockKey::chain(None, format!("{r}/{i}").as_bytes());
    let exported: Vec<(BlockKey, EngineBlockId)> =
        (0..4).map(|i| (key(1, i), EngineBlockId(i))).collect();
    let too_big: Vec<(BlockKey, EngineBlockId)> =
        (0..9).map(|i| (key(2, i), EngineBlockId(i))).collect();
    if !p.scheduler.export_finished(RequestId(1), 77, &exported)
        || !p.scheduler.export_finished(RequestId(2), 78, &too_big)
    {
        return Err("the scheduler refused an export".into());
    }
    let meta = p.scheduler.build_meta();
    if p.worker.start_step(meta)?.fence().is_some() {
        return Err("an export step waits on a fence".into());
    }
    let mut sent = Vec::new();
    let done = step_until(&mut p, Duration::from_secs(5), |o| {
        sent.extend_from_slice(&o.finished_sending);
        sent.contains(&RequestId(1)) && sent.contains(&RequestId(2))
    })?;
    if !done {
        return Err(format!("finished_sending {sent:?}: not both requests within 5 s").into());
    }
    if p.worker.in_flight() == 0 {
        return Err("request 1's lease ended with no reader".into());
    }
    // The engine reuses the blocks it got back.
    for b in 0..10 {
        arena.write_block(EngineBlockId(b), &[0xEE; BLOCK])?;
    }
    let producers = vec![p.runtime.remote_addr().ok_or("no server address")?];
    let source = |export: u64, blocks: &[(BlockKey, EngineBlockId)]| kvx_offload::RemoteSource {
        namespace: "test".into(),
        export,
        producers: producers.clone(),
        keys: blocks.iter().map(|(k, _)| *k).collect(),
        ttl_ms: 30_000,
        heartbeat_ms: 7_500,
    };
    let reader = Reader::new()?;
    let desc = source(77, &exported).descriptor(0, BLOCK as u64)?;
    reader.handle.register(desc.clone())?;
    for (i, got) in reader.read(&desc)?.into_iter().enumerate() {
        if got? != data(i as u32) {
            return Err(format!("exported block {i}: not the bytes the request had").into());
        }
    }
    let refused = source(78, &too_big).descriptor(0, BLOCK as u64)?;
    reader.handle.register(refused.clone())?;
    if let Some((i, _)) = reader
        .read(&refused)?
        .iter()
        .enumerate()
        .find(|(_, r)| r.is_ok())
    {
        return Err(format!("block {i} of the refused export was read").into());
    }
    reader.handle.done(desc.request)?;
    let end = Instant::now() + Duration::from_secs(2);
    while p.worker.in_flight() > 0 && Instant::now() < end {
        p.worker.get_finished()?;
        std::thread::sleep(Duration::from_millis(1));
    }
    if p.worker.in_flight() > 0 {
        return Err("the staging buffers did not come back after the reader said done".into());
    }
    drop(reader);
    let Offload {
        worker, runtime, ..
    } = p;
    drop(worker);
    runtime.shutdown();
    drop(arena);
    Ok(())
}
