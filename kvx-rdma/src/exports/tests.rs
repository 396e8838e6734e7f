//! Fake-time tests of the export table: leases, reads in progress, the release fence.

use std::time::Duration;

use super::*;

fn ms(t0: Instant, n: u64) -> Instant {
    t0 + Duration::from_millis(n)
}

fn blocks(n: u32) -> Vec<(BlockKey, EngineBlockId)> {
    (0..n)
        .map(|i| (BlockKey(u128::from(i) + 100), EngineBlockId(i)))
        .collect()
}

fn cfg(ttl: u64, readers: u32) -> LeaseConfig {
    LeaseConfig {
        expected_readers: readers,
        ..LeaseConfig::with_ttl_ms(ttl)
    }
}

#[test]
fn lease_expires_without_reader_fake_time() {
    let t0 = Instant::now();
    let mut t = ExportTable::new(8, 4096);
    t.export(RequestId(1), &blocks(4), &cfg(30_000, 1)).unwrap();
    // Pending: nothing expires however long nobody reads.
    assert_eq!(t.poll_released(ms(t0, 3_600_000)), None);
    assert_eq!(
        t.begin_read(RequestId(1), 0, 0, 4096, t0).unwrap_err().0,
        ErrorCode::NotReady
    );
    t.ready(RequestId(1), ms(t0, 1_000)).unwrap();
    assert_eq!(t.next_timeout(), Some(ms(t0, 31_000)));
    assert_eq!(t.poll_released(ms(t0, 30_999)), None);
    let r = t.poll_released(ms(t0, 31_000)).unwrap();
    assert_eq!(r.request, RequestId(1));
    assert_eq!(r.reason, ReleaseReason::Expired);
    assert_eq!(
        r.blocks,
        vec![
            EngineBlockId(0),
            EngineBlockId(1),
            EngineBlockId(2),
            EngineBlockId(3)
        ]
    );
    assert_eq!(t.poll_released(ms(t0, 40_000)), None, "released once");
    let s = t.stats();
    assert_eq!((s.exported, s.released_expired, s.pins), (0, 1, 0));
    assert_eq!(t.next_timeout(), None);
}

#[test]
fn heartbeat_keeps_lease_fake_time() {
    let t0 = Instant::now();
    let mut t = ExportTable::new(8, 4096);
    t.export(RequestId(1), &blocks(1), &cfg(1_000, 1)).unwrap();
    t.ready(RequestId(1), t0).unwrap();
    for i in 1..=10 {
        t.heartbeat(RequestId(1), ms(t0, i * 500)).unwrap();
    }
    assert_eq!(t.poll_released(ms(t0, 5_900)), None);
    assert!(
        t.begin_read(RequestId(1), 0, 0, 4096, ms(t0, 5_900))
            .is_ok()
    );
    t.end_read(RequestId(1));
    t.reader_done(RequestId(1), 0, ms(t0, 5_950)).unwrap();
    assert_eq!(
        t.poll_released(ms(t0, 5_950)).map(|r| r.reason),
        Some(ReleaseReason::Read)
    );
}

#[test]
fn release_waits_for_reads_in_progress() {
    let t0 = Instant::now();
    let mut t = ExportTable::new(8, 4096);
    t.export(RequestId(2), &blocks(2), &cfg(1_000, 1)).unwrap();
    t.ready(RequestId(2), t0).unwrap();
    t.begin_read(RequestId(2), 1, 0, 4096, ms(t0, 10)).unwrap();
    // Expiry stops new reads at once...
    let (code, msg) = t
        .begin_read(RequestId(2), 0, 0, 4096, ms(t0, 1_000))
        .unwrap_err();
    assert_eq!(code, ErrorCode::LeaseEnded);
    assert!(msg.contains("expired"), "{msg}");
    // ...but the engine hears of it only when the copy in progress is over.
    assert_eq!(t.poll_released(ms(t0, 2_000)), None);
    assert_eq!(t.stats().draining, 1);
    t.end_read(RequestId(2));
    assert_eq!(
        t.poll_released(ms(t0, 2_000)).map(|r| r.reason),
        Some(ReleaseReason::Expired)
    );
    // Later reads and heartbeats say why, not just "unknown".
    let (code, msg) = t.heartbeat(RequestId(2), ms(t0, 3_000)).unwrap_err();
    assert_eq!(code, ErrorCode::LeaseEnded);
    assert!(msg.contains("expired"));
}

#[test]
fn tp_ratio_readers_fake_time() {
    let t0 = Instant::now();
    let mut t = ExportTable::new(8, 64);
    t.export(RequestId(3), &blocks(1), &cfg(10_000, 4)).unwrap();
    t.ready(RequestId(3), t0).unwrap();
    for reader in 0..3 {
        t.reader_done(RequestId(3), reader, ms(t0, 1)).unwrap();
        t.reader_done(RequestId(3), reader, ms(t0, 2)).unwrap();
        assert_eq!(t.poll_released(ms(t0, 3)), None, "after reader {reader}");
    }
    t.reader_done(RequestId(3), 3, ms(t0, 4)).unwrap();
    assert_eq!(
        t.poll_released(ms(t0, 5)).map(|r| r.reason),
        Some(ReleaseReason::Read)
    );
}

#[test]
fn read_deadline_follows_the_lease_fake_time() {
    let t0 = Instant::now();
    let mut t = ExportTable::new(8, 4096);
    t.export(RequestId(5), &blocks(1), &cfg(1_000, 1)).unwrap();
    let e0 = t.epoch();
    assert_eq!(t.read_deadline(RequestId(5)), None, "pending: not readable");
    t.ready(RequestId(5), t0).unwrap();
    assert_ne!(t.epoch(), e0, "a lease start moves the epoch");
    assert_eq!(t.read_deadline(RequestId(5)), Some(ms(t0, 1_000)));
    t.heartbeat(RequestId(5), ms(t0, 600)).unwrap();
    assert_eq!(t.read_deadline(RequestId(5)), Some(ms(t0, 1_600)));
    t.begin_read(RequestId(5), 0, 0, 4096, ms(t0, 700)).unwrap();
    let e1 = t.epoch();
    t.tick(ms(t0, 1_600));
    assert_ne!(t.epoch(), e1, "a lease end moves the epoch");
    assert_eq!(
        t.read_deadline(RequestId(5)),
        None,
        "ended while a read drains: cut it"
    );
    assert_eq!(t.read_deadline(RequestId(6)), None);
}

#[test]
fn bounds_unknown_and_abort() {
    let t0 = Instant::now();
    let mut t = ExportTable::new(8, 100);
    assert!(matches!(
        t.export(
            RequestId(4),
            &[(BlockKey(1), EngineBlockId(8))],
            &cfg(1_000, 1)
        ),
        Err(RdmaError::BlockOutOfRange { .. })
    ));
    t.export(RequestId(4), &blocks(2), &cfg(1_000, 1)).unwrap();
    assert!(matches!(
        t.export(RequestId(4), &blocks(2), &cfg(1_000, 1)),
        Err(RdmaError::AlreadyExported(_))
    ));
    t.ready(RequestId(4), t0).unwrap();
    let oob = |t: &mut ExportTable, b, o, l| t.begin_read(RequestId(4), b, o, l, t0).unwrap_err().0;
    assert_eq!(oob(&mut t, 2, 0, 1), ErrorCode::OutOfBounds);
    assert_eq!(oob(&mut t, 0, 50, 51), ErrorCode::OutOfBounds);
    assert_eq!(oob(&mut t, 0, u64::MAX, 2), ErrorCode::OutOfBounds);
    assert_eq!(oob(&mut t, 0, 0, 0), ErrorCode::OutOfBounds);
    assert_eq!(
        t.begin_read(RequestId(9), 0, 0, 1, t0).unwrap_err().0,
        ErrorCode::UnknownRequest
    );
    assert_eq!(t.stats().pins, 0, "refused reads pin nothing");
    t.abort(RequestId(4)).unwrap();
    assert_eq!(
        t.poll_released(t0).map(|r| r.reason),
        Some(ReleaseReason::Aborted)
    );
    assert!(matches!(
        t.ready(RequestId(4), t0),
        Err(RdmaError::UnknownRequest(_))
    ));
}

/// A refused request: a reader hears its lease ended, not that it is unknown (it would wait
/// for an export that never comes); a live export under the same id is left alone.
#[test]
fn a_refused_request_reads_as_ended() {
    let t0 = Instant::now();
    let mut t = ExportTable::new(8, 4096);
    assert_eq!(
        t.heartbeat(RequestId(5), t0).unwrap_err().0,
        ErrorCode::UnknownRequest
    );
    t.refuse(RequestId(5));
    assert_eq!(
        t.heartbeat(RequestId(5), t0).unwrap_err().0,
        ErrorCode::LeaseEnded
    );
    assert_eq!(
        t.begin_read(RequestId(5), 0, 0, 4096, t0).unwrap_err().0,
        ErrorCode::LeaseEnded
    );
    t.export(RequestId(6), &blocks(1), &cfg(30_000, 1)).unwrap();
    t.ready(RequestId(6), t0).unwrap();
    t.refuse(RequestId(6));
    assert!(
        t.begin_read(RequestId(6), 0, 0, 4096, t0).is_ok(),
        "a live export stays"
    );
}
