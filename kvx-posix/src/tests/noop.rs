//! The noop engine through a whole store: what a store and a load report when no file is
//! touched.

use kvx_core::*;

use super::BLOCK;
use crate::testing::{Rig, RigShape, SOON, key};

#[test]
fn a_store_succeeds_and_its_load_misses_without_touching_a_file() {
    let shape = RigShape {
        noop: true,
        ..RigShape::new(4, BLOCK)
    };
    let r = Rig::in_temp_dir(shape, |_| {});
    assert_eq!(r.engine().target, r.engine().workers, "no worker is stuck");
    let k = key(1);

    let stored = r.store(k, 0x5A, SOON);
    assert!(
        stored.is_ok(),
        "the store reports success: {:?}",
        stored.state
    );
    assert_eq!(r.files.lookup(&[k]), 1, "the stored block enters the index");
    assert!(!r.files.block_path(k).exists(), "no block file was written");
    let entries = std::fs::read_dir(r.root.as_path())
        .expect("read the root")
        .count();
    assert_eq!(entries, 0, "nothing was created under the root");

    let loaded = r.load_one(k, SOON);
    assert!(
        !loaded.is_ok(),
        "a load through the noop engine finds nothing"
    );
    assert_eq!(loaded.blocks[0].result, Err(BlockError::NotFound));
    assert!(
        loaded.blocks[0].buf.is_some(),
        "the load's buffer comes back with its report"
    );
    assert_eq!(r.files.lookup(&[k]), 0, "the missing block left the index");

    let s = r.files.stats();
    assert_eq!((s.stored, s.loaded, s.in_flight), (1, 0, 0), "{s:?}");
    assert!(r.drained(), "nothing is left in flight");
}
