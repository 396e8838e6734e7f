//! The builder: a file tier whose evicted blocks lose their files, a store reopened on the same
//! directory, and settings refused at construction.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvx_core::*;
use kvx_offload::*;

const T: Duration = Duration::from_secs(10);

fn seq(n: u32, from: u32) -> Vec<u32> {
    (from..from + n).collect()
}

#[test]
fn evicted_file_blocks_lose_their_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = rig(
        dir.path(),
        Opts {
            host_blocks: 4,
            file_blocks: 4,
            ..Opts::default()
        },
    );
    let old = keys(20, 0, 20, 4);
    assert!(r.offload(1, &old, &seq(4, 0), T));
    let paths: Vec<_> = old.iter().map(|k| r.files.block_path(*k)).collect();
    assert!(
        paths.iter().all(|p| p.exists()),
        "the first blocks are on disk"
    );
    // Four new blocks: the full file tier evicts the four old ones.
    let new = keys(21, 0, 21, 4);
    assert!(r.offload(2, &new, &seq(4, 4), T));
    for k in &old {
        assert!(
            !r.sched.manager().is_stored(Tier::File, *k),
            "{k} left the index"
        );
    }
    let end = Instant::now() + T;
    while paths.iter().any(|p| p.exists()) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    for (k, p) in old.iter().zip(&paths) {
        assert!(
            !p.exists(),
            "the file of evicted {k} is still there: {}",
            p.display()
        );
        assert!(!r.files.contains(*k));
    }
    for k in &new {
        assert!(r.files.block_path(*k).exists(), "{k} is on disk");
    }
}

#[test]
fn a_reopened_store_adopts_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(30, 5, 0, 0);
    {
        let mut r = rig(dir.path(), Opts::default());
        assert_eq!(r.runtime.as_ref().unwrap().adopted_blocks(), 0);
        assert!(r.offload(1, &ks, &seq(5, 0), T));
    }
    // A new process: the builder again, on the same directory.
    let mut r = rig(dir.path(), Opts::default());
    assert_eq!(r.runtime.as_ref().unwrap().adopted_blocks(), 5);
    assert_eq!(
        r.sched.manager().lookup(&ks),
        Lookup::Hit(vec![Tier::File; 5])
    );
    r.scribble(&seq(5, 40));
    assert_eq!(r.load(7, &ks, &seq(5, 40)), Some(5 * BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(7))));
    assert!(r.out.invalid_blocks.is_empty(), "{:?}", r.out.decisions);
    assert!(
        r.holds(&ks, &seq(5, 40)),
        "the adopted blocks load byte-exact"
    );
    r.finish(7);
    assert!(r.settle(T));
}

#[test]
fn a_pool_that_cannot_hold_a_block_is_refused() {
    let driver = DriverBuilder::new(DriverConfig::default()).spawn().unwrap();
    let routes = TierRoutes {
        engine: BackendId(0),
        file: None,
    };
    let cfg = WorkerConfig {
        block_tokens: BT,
        block_bytes: BLOCK,
        timeouts: Default::default(),
        policy: Default::default(),
        preempt_wait: DEFAULT_PREEMPT_WAIT,
    };
    let small = BufferPool::new(4, BLOCK / 2, DEFAULT_ALIGN).unwrap();
    match WorkerSide::new(driver.handle(), routes, small, None, cfg.clone()) {
        Err(OffloadError::Config { field, reason }) => {
            assert_eq!(field, "pool");
            assert!(reason.contains(&BLOCK.to_string()), "{reason}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a pool of half blocks was accepted"),
    }
    let fits = BufferPool::new(4, BLOCK, DEFAULT_ALIGN).unwrap();
    assert!(WorkerSide::new(driver.handle(), routes, fits, None, cfg).is_ok());
}

#[test]
fn the_builder_refuses_a_bad_config_before_starting_anything() {
    let dir = tempfile::tempdir().unwrap();
    let arena = CpuArena::contiguous(BLOCK, 4).unwrap();
    let mut cfg = Opts::default().config(dir.path());
    cfg.file.as_mut().unwrap().blocks = 0;
    // SAFETY: the build fails before any backend could run an op.
    let memory = unsafe { EngineMemory::cpu(arena.layout().clone()) };
    match OffloadBuilder::new(cfg, memory).build() {
        Err(OffloadError::Config { field, .. }) => assert_eq!(field, "file.blocks"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a zero-block file tier was accepted"),
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "no store was opened"
    );
}

/// The README's embedding example is the crate's doc example (which `cargo test` runs).
#[test]
fn readme_embedding_example_is_the_doc_example() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("../README.md")).unwrap();
    let section = &readme[readme
        .find("## Embedding kvx-offload")
        .expect("the section")..];
    let start = section.find("```rust\n").expect("a rust block") + "```rust\n".len();
    let from_readme = &section[start..start + section[start..].find("```").unwrap()];
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let mut in_block = false;
    let mut from_lib = String::new();
    for line in lib.lines().filter_map(|l| l.strip_prefix("//!")) {
        let line = line.strip_prefix(' ').unwrap_or(line);
        if line.starts_with("```") {
            if in_block {
                break;
            }
            in_block = true;
            continue;
        }
        if in_block && !line.starts_with("# ") {
            from_lib.push_str(line);
            from_lib.push('\n');
        }
    }
    assert_eq!(from_readme, from_lib);
}

#[test]
fn a_toml_config_builds_the_file_tier_it_names() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "block_tokens = 16\nhost_blocks = 2\n\n[file]\nroots = [{:?}]\nblocks = 8\nio_engine = \"psync\"\nqueue_depth = 4\n",
        dir.path()
    );
    let cfg = OffloadConfig::from_toml(&text).unwrap();
    let mut arena = CpuArena::contiguous(4096, 4).unwrap();
    // SAFETY: the arena outlives the runtime (shut down below); blocks are touched only when
    // no op on them is out.
    let memory = unsafe { EngineMemory::cpu(arena.layout().clone()) };
    let Offload {
        scheduler: mut sched,
        mut worker,
        runtime,
    } = OffloadBuilder::new(cfg, memory).build().unwrap();
    let files = runtime.files().expect("a file tier").clone();
    assert_eq!(files.capabilities().io_engine, kvx_posix::IoEngine::Psync);
    arena.write_block(EngineBlockId(1), &[7; 4096]).unwrap();
    let key = BlockKey::chain(None, b"toml");
    sched.save_blocks(RequestId(1), &[(key, EngineBlockId(1))]);
    sched.request_finished(RequestId(1));
    assert!(
        worker
            .start_step(sched.build_meta())
            .unwrap()
            .fence()
            .is_none()
    );
    let out = worker.drain(T).unwrap();
    sched.update_from_worker(&out);
    assert!(files.contains(key), "written through to the file tier");
    assert!(files.block_path(key).starts_with(dir.path()));
    drop(worker);
    runtime.shutdown();
}
