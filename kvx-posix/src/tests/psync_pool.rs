//! psync's pool stays at its target when a written-off worker comes back while its replacement
//! is still starting.

use std::time::{Duration, Instant};

use kvx_core::*;

use super::rig;
use crate::IoEngine;
use crate::testing::{SOON, key, wait_until};

/// Queue depth 1. A store hangs in its open (the engine frozen) past its 100 ms deadline, so
/// its worker is written off and a replacement counted; the replacement's thread is held back
/// from starting. The mount thaws, the written-off worker comes back inside that window, finds
/// the pool at target and exits; then the replacement starts. The pool ends at exactly one
/// live worker and one thread, and serves the next store and load. (Counting the replacement
/// only once its thread ran let the returning worker rejoin as well: two live workers, for
/// good.)
/// Lets psync's replacement workers start when dropped.
struct LetGo<'a>(&'a crate::testing::Rig);

impl Drop for LetGo<'_> {
    fn drop(&mut self) {
        self.0.faults.hold_replacements(false);
    }
}

#[test]
fn a_worker_back_while_its_replacement_starts_leaves_the_pool_at_target() {
    let r = rig(IoEngine::Psync, 4, |c| c.queue_depth = 1);
    assert_eq!((r.engine().workers, r.engine().target), (1, 1));
    r.faults.hold_replacements(true);
    // Let the replacements go whatever happens, or a failed assert leaves the driver blocked
    // and the rig's drop waiting for it (dropped before the rig: declared after it).
    let _let_go = LetGo(&r);
    r.faults.freeze();
    let t = r.submit(
        Direction::Store,
        vec![r.block(key(1), 1)],
        Instant::now() + Duration::from_millis(100),
    );
    assert!(
        wait_until(SOON, || r.faults.held() == 1),
        "the store's open is held"
    );
    assert!(
        wait_until(SOON, || r.engine().written_off == 1),
        "the worker is written off at the deadline"
    );
    assert_eq!(
        r.engine().workers,
        1,
        "the replacement counts as live before its thread starts"
    );

    r.faults.thaw();
    assert!(
        wait_until(SOON, || {
            let e = r.engine();
            e.written_off == 0 && e.threads == 1
        }),
        "the written-off worker came back and left: {:?}",
        r.engine()
    );
    r.faults.hold_replacements(false);
    let rep = r.report(t);
    assert!(!rep.is_ok(), "the store ended at its deadline");
    drop(rep);
    assert!(r.drained(), "{:?}", r.engine());
    // The replacement's thread is up and the only one.
    assert!(r.store(key(2), 2, SOON).is_ok(), "{:?}", r.engine());
    assert!(r.load_one(key(2), SOON).is_ok());
    let e = r.engine();
    assert_eq!(
        (e.workers, e.threads),
        (1, 1),
        "one live worker, one thread: {e:?}"
    );
}
