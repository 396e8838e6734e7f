//! The producer dies, stops, or the network between the two sides is cut, mid-read.

use std::time::{Duration, Instant};

use kvx_core::{BlockError, EngineBlockId, TaskState};

use super::netns::{self, Pair};
use super::peer::{Consumer, Peer, pattern};
use super::timing::{ALLOWANCE, TICK};

const BLOCK: usize = 256 * 1024;
const BLOCKS: u32 = 48;

fn paced_producer(pace_ms: u64) -> Peer {
    Peer::producer(&[
        ("KVX_BLOCKS", BLOCKS.to_string()),
        ("KVX_BLOCK_BYTES", BLOCK.to_string()),
        ("KVX_PACE_MS", pace_ms.to_string()),
    ])
}

/// SIGKILL during a large read: the task ends by its deadline, the unread blocks invalid, the
/// blocks that did arrive intact.
pub fn producer_killed_mid_read() {
    let mut p = paced_producer(25);
    let desc = p.export(1, 0, BLOCKS, 30_000, 1);
    p.ready(1);
    let mut c = Consumer::new(0, BLOCK, BLOCKS, None, true);
    c.handle.register(desc.clone()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(4);
    let killer = {
        let pid = p.child.id() as i32;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(400));
            // SAFETY: kill(2) on the producer child's pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        })
    };
    let report = c.load(&desc.blocks, deadline);
    let ended = Instant::now();
    killer.join().unwrap();
    println!(
        "producer_killed_mid_read: the report reached the caller {:?} past the deadline ({:?} before it; bound {:?} past)",
        ended.saturating_duration_since(deadline),
        deadline.saturating_duration_since(ended),
        TICK + ALLOWANCE
    );
    assert!(
        ended <= deadline + TICK + ALLOWANCE,
        "ended {:?} past the deadline",
        ended - deadline
    );
    assert_eq!(
        report.state,
        TaskState::Failed(kvx_core::FailReason::Blocks),
        "the kill came mid-read"
    );
    let failed = report.failed_engine_blocks();
    assert!(
        !failed.is_empty() && failed.len() < BLOCKS as usize,
        "{} of {BLOCKS} failed",
        failed.len()
    );
    for b in &report.blocks {
        let engine = b.engine.unwrap();
        match &b.result {
            Ok(()) => {
                let got = c.arena.read_block(engine).unwrap();
                assert!(
                    got.iter()
                        .enumerate()
                        .all(|(j, x)| *x == pattern(engine.0, j)),
                    "{engine} corrupt"
                );
            }
            Err(BlockError::Io(_)) => {
                assert!(
                    c.arena.read_block(engine).unwrap().iter().all(|x| *x == 0),
                    "{engine} written"
                );
            }
            Err(e) => panic!("{engine}: unexpected error {e}"),
        }
    }
    // The verdict kvx-policy turns into "recompute from the first block that did not arrive".
    let outcomes: Vec<kvx_policy::BlockOutcome> = report
        .blocks
        .iter()
        .map(|b| match b.result {
            Ok(()) => kvx_policy::BlockOutcome::loaded(b.engine.unwrap()),
            Err(_) => kvx_policy::BlockOutcome::failed(b.engine.unwrap()),
        })
        .collect();
    let decision =
        kvx_policy::LoadFailurePolicy::Recompute.decide(&outcomes, 16, 16 * u64::from(BLOCKS));
    let first_bad = report
        .blocks
        .iter()
        .position(|b| b.result.is_err())
        .unwrap();
    match decision {
        kvx_policy::LoadDecision::Recompute { valid_tokens, .. } => {
            assert_eq!(valid_tokens, 16 * first_bad as u64)
        }
        other => panic!("expected a recompute decision, got {other:?}"),
    }
    assert!(c.handle.done(desc.request).is_err(), "the producer is gone");
}

/// SIGSTOP mid-read: the task times out at its deadline without hanging; after SIGCONT the
/// producer's lease bookkeeping is intact and the request can be read and released normally.
pub fn stalled_producer() {
    let mut p = paced_producer(25);
    let desc = p.export(1, 0, BLOCKS, 30_000, 1);
    p.ready(1);
    let mut c = Consumer::new(0, BLOCK, BLOCKS, None, true);
    c.handle.register(desc.clone()).unwrap();
    let deadline = Instant::now() + Duration::from_millis(1200);
    let stopper = {
        let pid = p.child.id() as i32;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: kill(2) on the producer child's pid.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
        })
    };
    let report = c.load(&desc.blocks, deadline);
    let ended = Instant::now();
    stopper.join().unwrap();
    println!(
        "stalled_producer: the report reached the caller {:?} past the deadline ({:?} before it; bound {:?} past)",
        ended.saturating_duration_since(deadline),
        deadline.saturating_duration_since(ended),
        TICK + ALLOWANCE
    );
    assert!(
        ended <= deadline + TICK + ALLOWANCE,
        "ended {:?} past the deadline",
        ended - deadline
    );
    assert_eq!(report.state, TaskState::TimedOut);
    assert!(
        report
            .blocks
            .iter()
            .all(|b| b.result == Err(BlockError::TimedOut))
    );
    // The consumer's staging buffers come back once the importer returns the op.
    let t0 = Instant::now();
    while !c.pool.is_whole() && t0.elapsed() < Duration::from_secs(3) {
        drop(c.driver.get_finished());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        c.pool.is_whole(),
        "{} staging buffers still out",
        c.pool.lent()
    );
    std::thread::sleep(Duration::from_millis(300));
    p.signal(libc::SIGCONT);
    // The abandoned connection's read ends (its pin drops); the lease is still active.
    let t0 = Instant::now();
    let mut s = p.status(1);
    while !s.contains("pins=0") && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
        s = p.status(1);
    }
    assert!(
        s.starts_with(
            "status active exported=1 active=1 draining=0 pins=0 read=0 expired=0 aborted=0"
        ),
        "{s}"
    );
    assert!(
        p.try_wait_for("released", Duration::from_millis(100))
            .is_none()
    );
    // A new read of the same request works end to end, and done releases it exactly once.
    let mut c2 = Consumer::new(0, BLOCK, BLOCKS, None, true);
    c2.handle.register(desc.clone()).unwrap();
    let report = c2.load(&desc.blocks, Instant::now() + Duration::from_secs(10));
    assert!(report.is_ok(), "{:?}", report.state);
    let last = c2.arena.read_block(EngineBlockId(BLOCKS - 1)).unwrap();
    assert!(
        last.iter()
            .enumerate()
            .all(|(j, x)| *x == pattern(BLOCKS - 1, j))
    );
    c2.handle.done(desc.request).unwrap();
    assert_eq!(
        p.wait_for("released", Duration::from_secs(2)),
        "released 1 Read"
    );
    let s = p.status(1);
    assert!(
        s.starts_with(
            "status gone exported=0 active=0 draining=0 pins=0 read=1 expired=0 aborted=0"
        ),
        "{s}"
    );
}

/// Producer and consumer in two namespaces; the veth link goes down mid-transfer.
pub fn partition_netns() {
    let pair = Pair::create().unwrap_or_else(|e| panic!("setting up namespaces: {e}"));
    let mut p = Peer::spawn(
        "producer",
        &[
            ("KVX_BLOCKS", BLOCKS.to_string()),
            ("KVX_BLOCK_BYTES", BLOCK.to_string()),
            ("KVX_PACE_MS", "25".into()),
            ("KVX_LISTEN", format!("{}:7411", netns::ADDR_A)),
        ],
        &Pair::exec(&pair.a),
    );
    let l = p.wait_for("listening", Duration::from_secs(10));
    assert!(l.contains(netns::ADDR_A), "{l}");
    let desc = p.export(1, 0, BLOCKS, 30_000, 1);
    p.ready(1);
    let deadline_ms = 1500u64;
    let mut consumer = Peer::spawn(
        "consumer",
        &[
            ("KVX_DESC", desc.to_json()),
            ("KVX_DEADLINE_MS", deadline_ms.to_string()),
        ],
        &Pair::exec(&pair.b),
    );
    consumer.wait_for("started", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(400));
    pair.cut().unwrap();
    let report = consumer.wait_for("report", Duration::from_millis(deadline_ms + 5000));
    let field = |name: &str| -> u64 {
        report
            .split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {report}"))
    };
    assert!(report.contains("state=TimedOut"), "{report}");
    assert_eq!(field("failed="), u64::from(BLOCKS), "{report}");
    let margin = (TICK + ALLOWANCE).as_millis() as u64;
    println!(
        "partition_netns: elapsed_ms={} for a {deadline_ms} ms deadline (bound +{margin} ms)",
        field("elapsed_ms=")
    );
    assert!(field("elapsed_ms=") <= deadline_ms + margin, "{report}");
    assert!(report.contains("err=timed out"), "{report}");
    drop(consumer);
    drop(p);
    drop(pair);
    assert!(
        netns::ip(&[
            "netns",
            "pids",
            &format!("kvx5a{}", std::process::id() % 100_000)
        ])
        .is_err(),
        "namespace removed"
    );
}
