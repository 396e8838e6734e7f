//! A spare file taken by a store that never opens it goes back to the spares.

use std::time::{Duration, Instant};

use kvx_core::*;

use super::rig_with_spares;
use crate::IoEngine;
use crate::testing::{SOON, key, wait_until};

both_engines!(a_store_that_never_opens_its_spare_gives_it_back);

/// Queue depth 1, one queued job at most, the engine frozen: store `a` takes the first spare
/// and hangs in its open; `b`, with a deadline shorter than the freeze, takes the second and
/// waits in the queue; `c` is refused (the queue is full) before it takes one. Once thawed,
/// `a` is stored and `b` ends at its deadline before opening anything: `b`'s spare is a spare
/// again, and the next three stores write into exactly the three files left in the spare
/// folder, none creating a file of its own.
fn a_store_that_never_opens_its_spare_gives_it_back(engine: IoEngine) {
    const FREEZE: Duration = Duration::from_millis(400);
    let r = rig_with_spares(engine, 4, |c| {
        c.queue_depth = 1;
        c.max_queued = 1;
    });
    let spare_dir = r.spare_dir();
    let spare_names = || {
        let mut v: Vec<_> = std::fs::read_dir(&spare_dir)
            .expect("spare folder")
            .map(|e| e.expect("entry").file_name())
            .collect();
        v.sort();
        v
    };

    r.faults.freeze();
    let a = r.submit(
        Direction::Store,
        vec![r.block(key(1), 0x11)],
        Instant::now() + SOON,
    );
    assert!(
        wait_until(SOON, || r.faults.held() == 1),
        "a's open is held"
    );
    let b = r.submit(
        Direction::Store,
        vec![r.block(key(2), 0x22)],
        Instant::now() + FREEZE / 4,
    );
    assert!(
        wait_until(SOON, || r.engine().queued == 1),
        "b waits in the queue"
    );
    let c = r.store(key(3), 0x33, SOON);
    assert!(
        matches!(c.blocks[0].result, Err(BlockError::Unavailable(_))),
        "{engine}: c is refused: {:?}",
        c.blocks[0].result
    );
    drop(c);
    assert_eq!(
        r.files.spare_files_ready(),
        vec![2],
        "{engine}: a and b took one spare each, the refused c none"
    );

    std::thread::sleep(FREEZE);
    r.faults.thaw();
    assert!(r.report(a).is_ok(), "{engine}: a is stored");
    let b = r.report(b);
    assert!(
        matches!(
            b.blocks[0].result,
            Err(BlockError::TimedOut | BlockError::Cancelled)
        ),
        "{engine}: b ends at its deadline: {:?}",
        b.blocks[0].result
    );
    drop(b);
    assert!(r.drained(), "{engine}: the engine drained");
    // One more op through the driver: the poll that ends it takes b's return in too.
    let miss = r.load_one(key(9), SOON);
    assert_eq!(miss.blocks[0].result, Err(BlockError::NotFound));
    drop(miss);
    assert_eq!(
        r.files.spare_files_ready(),
        vec![3],
        "{engine}: b's spare is back too"
    );
    let left = spare_names();
    assert_eq!(left.len(), 3, "{engine}: {left:?}");

    for (i, k) in [4u64, 5, 6].into_iter().enumerate() {
        assert!(r.store(key(k), 0x40 + i as u8, SOON).is_ok(), "{engine}");
    }
    assert_eq!(r.files.spare_files_ready(), vec![0], "{engine}");
    assert!(
        spare_names().is_empty(),
        "{engine}: the three stores wrote into the three spares left: {:?}",
        spare_names()
    );
    for k in [1u64, 4, 5, 6] {
        assert!(r.files.block_path(key(k)).exists(), "{engine}: block {k}");
    }
}
