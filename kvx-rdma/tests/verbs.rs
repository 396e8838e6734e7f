//! The verbs transport (feature `verbs`). Without an RDMA device only the no-device path runs;
//! the rest print one skip line and are counted as ignored.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_policy::LeaseConfig;
use kvx_rdma::verbs::{self, VerbsConfig};
use kvx_rdma::*;
use libtest_mimic::{Arguments, Failed, Trial};

fn no_device_is_a_clear_error() -> Result<(), Failed> {
    let arena = CpuArena::contiguous(4096, 4).unwrap();
    // SAFETY: the arena outlives the exporter (both dropped at the end of this function).
    let exporter = unsafe { Exporter::new(arena.layout().clone()) }.unwrap();
    let cfg = VerbsConfig::default();
    match verbs::probe(&cfg) {
        Err(RdmaError::NoRdmaDevice(why)) => {
            assert!(!why.is_empty());
            let server = VerbsServer::start(exporter, ServerConfig::default(), cfg.clone());
            assert!(
                matches!(server, Err(RdmaError::NoRdmaDevice(_))),
                "server: {:?}",
                server.err()
            );
            let t = VerbsTransport::new(TcpClientConfig::default(), cfg);
            let err = t.err().expect("no transport without a device");
            assert!(err.to_string().starts_with("no RDMA device"), "{err}");
            Ok(())
        }
        Err(other) => Err(format!("expected NoRdmaDevice or a device, got {other}").into()),
        Ok(()) => {
            // A device exists: opening both sides must work.
            VerbsServer::start(exporter, ServerConfig::default(), cfg.clone())
                .map_err(|e| format!("server: {e}"))?;
            VerbsTransport::new(TcpClientConfig::default(), cfg)
                .map_err(|e| format!("transport: {e}"))?;
            Ok(())
        }
    }
}

/// Producer and consumer in this process over the device's loopback.
struct Rig {
    driver: Driver,
    handle: ImporterHandle,
    rdma: BackendId,
    pool: BufferPool,
    desc: RemoteDescriptor,
    exporter: Exporter,
    _server: VerbsServer,
    _arena: CpuArena,
}

fn rig(block: usize, blocks: u32, ttl_ms: u64) -> Rig {
    let mut arena = CpuArena::per_layer(2, block / 2, blocks).unwrap();
    for b in 0..blocks {
        arena
            .write_block(EngineBlockId(b), &vec![(b % 251) as u8; block])
            .unwrap();
    }
    // SAFETY: the arena is the last field of the rig, dropped after the server and exporter.
    let exporter = unsafe { Exporter::new(arena.layout().clone()) }.unwrap();
    let server = VerbsServer::start(
        exporter.clone(),
        ServerConfig::default(),
        VerbsConfig::default(),
    )
    .unwrap();
    let lease = LeaseConfig::with_ttl_ms(ttl_ms);
    let list: Vec<_> = (0..blocks)
        .map(|b| (BlockKey(u128::from(b) + 1), EngineBlockId(b)))
        .collect();
    exporter.export(RequestId(1), &list, &lease).unwrap();
    exporter.ready(RequestId(1)).unwrap();
    let desc = server.descriptor(&exporter, RequestId(1)).unwrap();
    let cfg = ImporterConfig::default();
    let transport = Arc::new(VerbsTransport::new(cfg.tcp(), VerbsConfig::default()).unwrap());
    let importer = Importer::with_transports(cfg, vec![transport]).unwrap();
    let handle = importer.handle();
    handle.register(desc.clone()).unwrap();
    let mut b = DriverBuilder::new(DriverConfig::default());
    let rdma = b.backend(Box::new(importer));
    let driver = b.spawn().unwrap();
    let pool = BufferPool::new(blocks as usize, block, DEFAULT_ALIGN).unwrap();
    Rig {
        driver,
        handle,
        rdma,
        pool,
        desc,
        exporter,
        _server: server,
        _arena: arena,
    }
}

impl Rig {
    fn load(&self, deadline: Instant) -> TaskReport {
        let blocks = self
            .desc
            .blocks
            .iter()
            .map(|k| OpBlock {
                key: *k,
                engine: None,
                buf: Buf::Owned(self.pool.take().unwrap()),
            })
            .collect();
        let t = self
            .driver
            .submit(TaskSpec {
                request: RequestId(9),
                dir: Direction::Load,
                route: vec![self.rdma],
                blocks,
                deadline,
                deferred: false,
            })
            .unwrap();
        self.driver
            .wait_report(t, deadline + Duration::from_secs(5))
            .expect("report")
    }
}

fn verbs_loopback_read() -> Result<(), Failed> {
    let r = rig(64 << 10, 16, 30_000);
    let report = r.load(Instant::now() + Duration::from_secs(5));
    assert!(
        report.is_ok(),
        "{:?}",
        report.blocks.iter().map(|b| &b.result).collect::<Vec<_>>()
    );
    for (i, b) in report.blocks.iter().enumerate() {
        assert!(
            b.buf
                .as_ref()
                .unwrap()
                .as_slice()
                .iter()
                .all(|x| *x == (i % 251) as u8)
        );
    }
    r.handle.done(RequestId(1)).unwrap();
    assert_eq!(
        r.exporter.poll_released().map(|x| x.reason),
        Some(kvx_policy::ReleaseReason::Read)
    );
    Ok(())
}

fn verbs_read_after_release_fails() -> Result<(), Failed> {
    let r = rig(64 << 10, 4, 200);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        r.exporter.poll_released().map(|x| x.reason),
        Some(kvx_policy::ReleaseReason::Expired)
    );
    let report = r.load(Instant::now() + Duration::from_secs(3));
    assert_eq!(
        report.failed_engine_blocks().len(),
        0,
        "no engine blocks on an [rdma] route"
    );
    assert!(
        report
            .blocks
            .iter()
            .all(|b| matches!(&b.result, Err(BlockError::Remote(m)) if m.contains("LeaseEnded")))
    );
    Ok(())
}

fn verbs_deadline_flushes_before_buffers_return() -> Result<(), Failed> {
    let r = rig(4 << 20, 64, 30_000);
    let deadline = Instant::now() + Duration::from_micros(300);
    let report = r.load(deadline);
    // One driver tick (1 ms, kvx-core's TICK) plus the 50 ms allowance of these machines.
    assert!(Instant::now() <= deadline + Duration::from_millis(1 + 50));
    drop(report);
    let t0 = Instant::now();
    while !r.pool.is_whole() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        r.pool.is_whole(),
        "buffers must come back once the QP flushed"
    );
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    let available = verbs::probe(&VerbsConfig::default());
    if let Err(e) = &available {
        println!("skip: verbs data-path tests: {e}");
    }
    let skip = available.is_err();
    let trials = vec![
        Trial::test("verbs_no_rdma_device", no_device_is_a_clear_error),
        Trial::test("verbs_loopback_read", verbs_loopback_read).with_ignored_flag(skip),
        Trial::test(
            "verbs_read_after_release_fails",
            verbs_read_after_release_fails,
        )
        .with_ignored_flag(skip),
        Trial::test(
            "verbs_deadline_flushes_before_buffers_return",
            verbs_deadline_flushes_before_buffers_return,
        )
        .with_ignored_flag(skip),
    ];
    libtest_mimic::run(&args, trials).exit();
}
