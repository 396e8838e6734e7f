//! Acceptance tests of kvx-posix on a real FUSE mount (kvx-fusefs) that the tests freeze and
//! thaw, driven through kvx-core's driver with real deadlines, for both I/O engines.
//!
//! FUSE tests print one `skip:` line and are ignored where FUSE cannot be mounted; the disk
//! tests (corrupt blocks on disk, torn writes) always run. Runs one test at a time unless
//! `--test-threads` says otherwise: the deadline checks want the machine's two cores.

mod breaker;
mod corrupt;
mod reorder;
mod rig;
mod step;
mod stuck;
mod torn;

use kvx_posix::IoEngine;
use libtest_mimic::{Arguments, Trial};
use rig::Place;

fn main() {
    if let Ok(spec) = std::env::var(torn::CHILD_ENV) {
        torn::child(&spec);
        return;
    }
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        args.test_threads = Some(1);
    }
    let no_fuse = match kvx_fusefs::fuse_available() {
        Ok(()) => false,
        Err(reason) => {
            println!("skip: FUSE tests ignored: {reason}");
            true
        }
    };
    let fuse = |name: String, f: fn(IoEngine), e: IoEngine| {
        Trial::test(name, move || {
            f(e);
            Ok(())
        })
        .with_ignored_flag(no_fuse)
    };
    let mut trials = Vec::new();
    for e in [IoEngine::Uring, IoEngine::Psync] {
        let n = |what: &str| format!("{what}_{e}");
        trials.push(fuse(n("stuck_mount_load"), stuck::stuck_mount_load, e));
        trials.push(fuse(n("stuck_mount_store"), stuck::stuck_mount_store, e));
        trials.push(fuse(n("stuck_open"), stuck::stuck_open, e));
        trials.push(fuse(
            n("late_completion_quarantine"),
            stuck::late_completion_quarantine,
            e,
        ));
        trials.push(fuse(n("breaker"), breaker::breaker, e));
        trials.push(fuse(
            n("remove_stuck_then_store"),
            reorder::remove_stuck_then_store,
            e,
        ));
        trials.push(fuse(
            n("remove_queued_then_store_recycling"),
            reorder::remove_queued_then_store_recycling,
            e,
        ));
        trials.push(fuse(
            n("engine_step_never_blocks"),
            step::engine_step_never_blocks,
            e,
        ));
        trials.push(fuse(
            n("corrupt_block_fuse"),
            |e| corrupt::corrupt_block(e, Place::Fuse),
            e,
        ));
        trials.push(Trial::test(n("corrupt_block_disk"), move || {
            corrupt::corrupt_block(e, Place::Disk);
            Ok(())
        }));
        trials.push(Trial::test(n("torn_write"), move || {
            torn::torn_write(e);
            Ok(())
        }));
    }
    libtest_mimic::run(&args, trials).exit();
}
