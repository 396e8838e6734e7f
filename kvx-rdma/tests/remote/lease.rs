//! Producer leases seen from outside: expiry, heartbeats, reads after release, N readers.

use std::time::{Duration, Instant};

use kvx_core::{BlockError, TaskState};

use super::peer::{Consumer, Peer, REUSED, pattern};
use super::timing::{ALLOWANCE, TICK};

const BLOCK: usize = 64 * 1024;

/// No reader ever comes: the producer releases at the TTL with reason "expired".
pub fn lease_expires_without_reader_real_time() {
    let mut p = Peer::producer(&[]);
    p.export(1, 0, 4, 300, 1);
    // A pending lease does not run down: nothing for twice the TTL before `ready`.
    assert!(
        p.try_wait_for("released", Duration::from_millis(600))
            .is_none()
    );
    let ttl = Duration::from_millis(300);
    p.ready(1);
    let line = p.wait_for("released 1", Duration::from_secs(5));
    assert_eq!(line, "released 1 Expired");
    // Timed in the producer's clock, from `ready` to the engine loop polling the release.
    let after = p.release_timing(1).0.expect("ready was timed");
    println!(
        "lease_expires_without_reader: released {after:?} after ready (bound {:?})",
        ttl + TICK + ALLOWANCE
    );
    assert!(
        after >= ttl,
        "released {after:?} after ready; TTL is {ttl:?}"
    );
    assert!(
        after <= ttl + TICK + ALLOWANCE,
        "released late: {after:?} after ready"
    );
    let s = p.status(1);
    assert!(
        s.starts_with("status gone exported=0 active=0 draining=0 pins=0 read=0 expired=1"),
        "{s}"
    );
}

/// The reader waits three TTLs before reading, heartbeating: the lease holds, the read works.
pub fn heartbeat_keeps_lease() {
    let mut p = Peer::producer(&[]);
    let desc = p.export(1, 0, 8, 600, 1);
    p.ready(1);
    // A control request, same TTL, whose reader never registers: it does expire meanwhile.
    p.export(2, 8, 1, 600, 1);
    p.ready(2);
    let mut c = Consumer::new(0, BLOCK, 8, None, true);
    c.handle.register(desc.clone()).unwrap();
    // More than three TTLs in the queue; heartbeats every TTL/6 keep the lease.
    std::thread::sleep(Duration::from_millis(2000));
    assert_eq!(
        p.wait_for("released", Duration::from_secs(2)),
        "released 2 Expired"
    );
    assert!(
        p.status(1).starts_with("status active"),
        "lease 1 must still be active"
    );
    assert_eq!(c.handle.lease_lost(desc.request), None);
    let report = c.load(&desc.blocks, Instant::now() + Duration::from_secs(5));
    assert_eq!(
        report.state,
        TaskState::Done,
        "{:?}",
        report.blocks.iter().map(|b| &b.result).collect::<Vec<_>>()
    );
    for i in 0..8u32 {
        let got = c.arena.read_block(kvx_core::EngineBlockId(i)).unwrap();
        assert!(
            got.iter().enumerate().all(|(j, b)| *b == pattern(i, j)),
            "block {i} bytes differ"
        );
    }
    c.handle.done(desc.request).unwrap();
    assert_eq!(
        p.wait_for("released", Duration::from_secs(2)),
        "released 1 Read"
    );
}

/// A read after the lease expired fails as invalid blocks and never sees the freed bytes.
pub fn read_after_expiry_fails() {
    let mut p = Peer::producer(&[]);
    let desc = p.export(1, 0, 4, 250, 1);
    p.ready(1);
    // The producer overwrites the blocks with REUSED before it prints the release.
    assert_eq!(
        p.wait_for("released", Duration::from_secs(3)),
        "released 1 Expired"
    );
    let mut c = Consumer::new(0, BLOCK, 4, None, false);
    c.handle.register(desc.clone()).unwrap();
    let report = c.load(&desc.blocks, Instant::now() + Duration::from_secs(3));
    assert_eq!(
        report.state,
        TaskState::Failed(kvx_core::FailReason::Blocks)
    );
    assert_eq!(
        report.failed_engine_blocks().len(),
        4,
        "every block must be invalid"
    );
    for b in &report.blocks {
        match &b.result {
            Err(BlockError::Remote(m)) => {
                assert!(m.contains("LeaseEnded") && m.contains("expired"), "{m}")
            }
            other => panic!("expected a lease error, got {other:?}"),
        }
        let buf = b.buf.as_ref().expect("buffers come back");
        assert!(
            !buf.as_slice().contains(&REUSED),
            "freed bytes reached the consumer"
        );
    }
    for i in 0..4u32 {
        let got = c.arena.read_block(kvx_core::EngineBlockId(i)).unwrap();
        assert!(got.iter().all(|b| *b == 0), "engine block {i} was written");
    }
    // A heartbeating reader that registers late learns that the lease is gone.
    let late = Consumer::new(1, BLOCK, 1, None, true);
    late.handle.register(desc.clone()).unwrap();
    let t0 = Instant::now();
    while late.handle.lease_lost(desc.request).is_none() && t0.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let lost = late
        .handle
        .lease_lost(desc.request)
        .expect("lease loss reported");
    assert!(lost.contains("expired"), "{lost}");
}

/// With 4 expected readers the lease ends only after the fourth done, or at expiry.
pub fn tp_ratio_readers() {
    let mut p = Peer::producer(&[]);
    let desc = p.export(1, 0, 4, 10_000, 4);
    p.ready(1);
    for reader in 0..4u32 {
        let mut c = Consumer::new(reader, BLOCK, 4, None, true);
        c.handle.register(desc.clone()).unwrap();
        let report = c.load(&desc.blocks, Instant::now() + Duration::from_secs(5));
        assert!(report.is_ok(), "reader {reader}: {:?}", report.state);
        c.handle.done(desc.request).unwrap();
        if reader == 0 {
            // The same reader saying done again counts once.
            c.handle.register(desc.clone()).unwrap();
            c.handle.done(desc.request).unwrap();
        }
        if reader < 3 {
            assert!(
                p.try_wait_for("released", Duration::from_millis(100))
                    .is_none(),
                "released after reader {reader}"
            );
            assert!(
                p.status(1).starts_with("status active"),
                "after reader {reader}"
            );
        }
    }
    assert_eq!(
        p.wait_for("released", Duration::from_secs(2)),
        "released 1 Read"
    );

    // Two of four readers done, then nobody: released at expiry.
    let desc = p.export(2, 4, 2, 400, 4);
    p.ready(2);
    for reader in 0..2u32 {
        let c = Consumer::new(reader, BLOCK, 2, None, false);
        c.handle.register(desc.clone()).unwrap();
        c.handle.done(desc.request).unwrap();
    }
    assert!(p.status(2).starts_with("status active"));
    assert_eq!(
        p.wait_for("released", Duration::from_secs(3)),
        "released 2 Expired"
    );
    let s = p.status(2);
    assert!(s.contains("read=1 expired=1"), "{s}");
}
