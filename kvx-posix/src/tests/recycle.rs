//! A removed block file is recycled as a spare only once no load of its block is in flight.

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use kvx_core::*;

use super::rig_with_spares;
use crate::IoEngine;
use crate::testing::Late;
use crate::testing::{SOON, key, wait_until};

both_engines!(recycled_file_waits_for_the_loads_of_its_block);

/// With the read of a load of `k` held, `k` is removed: its file moves into the spare folder
/// but is no spare yet (a store writing into it could change the bytes under the load). The
/// load then returns `k`'s bytes, the file becomes a spare, and after the older spare the
/// next store writes into that very file.
fn recycled_file_waits_for_the_loads_of_its_block(engine: IoEngine) {
    const HOLD: Duration = Duration::from_millis(600);
    let r = rig_with_spares(engine, 2, |c| c.spare_block_bytes = 8192);
    let spare_dir = r.spare_dir();
    let in_spare_dir = || std::fs::read_dir(&spare_dir).expect("spare folder").count();
    let (k, absent, a, b) = (key(1), key(2), key(3), key(4));
    assert!(r.store(k, 0x5A, SOON).is_ok());
    assert_eq!(r.files.spare_files_ready(), vec![1]);
    let inode = std::fs::metadata(r.files.block_path(k))
        .expect("k's file")
        .ino();

    r.faults.late(Late::Read, 1, HOLD);
    let load = r.submit(
        Direction::Load,
        vec![r.empty_block(k)],
        Instant::now() + SOON,
    );
    assert!(
        wait_until(SOON, || r.faults.held() == 1),
        "the read is held"
    );
    r.files.remove(k);
    assert!(
        wait_until(SOON, || r.engine().maintenance == 0),
        "the remove ran"
    );
    // One more op through the driver: the poll that ends it takes the remove in too.
    let miss = r.load_one(absent, SOON);
    assert_eq!(miss.blocks[0].result, Err(BlockError::NotFound));
    drop(miss);
    assert!(!r.files.block_path(k).exists());
    assert_eq!(in_spare_dir(), 2, "moved into the spare folder");
    assert_eq!(
        r.files.spare_files_ready(),
        vec![1],
        "{engine}: no spare while a load of its block is in flight"
    );

    let rep = r.report(load);
    assert!(rep.is_ok(), "{engine}: {:?}", rep.blocks[0].result);
    let data = rep.blocks[0].buf.as_ref().expect("buffer").as_slice();
    assert!(data.iter().all(|x| *x == 0x5A), "the load got k's bytes");
    drop(rep);
    assert_eq!(
        r.files.spare_files_ready(),
        vec![2],
        "a spare once it returned"
    );

    assert!(r.store(a, 0x11, SOON).is_ok());
    assert!(r.store(b, 0x22, SOON).is_ok());
    assert_eq!(r.files.spare_files_ready(), vec![0]);
    let b_inode = std::fs::metadata(r.files.block_path(b))
        .expect("b's file")
        .ino();
    assert_eq!(
        b_inode, inode,
        "{engine}: b was written into k's recycled file"
    );
    for (kk, fill) in [(a, 0x11), (b, 0x22)] {
        let rep = r.load_one(kk, SOON);
        let data = rep.blocks[0].buf.as_ref().expect("buffer").as_slice();
        assert!(
            rep.is_ok() && data.iter().all(|x| *x == fill),
            "{engine}: {kk}"
        );
    }
}
