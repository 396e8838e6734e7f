//! `PageStore`, the blocking page store under an engine's host cache (SGLang's HiCache): pages
//! round-trip byte-exact through the file tier into a fresh store, `exists` counts the leading
//! run, a corrupt file fails only its page, a frozen FUSE mount ends a load by its deadline,
//! and calls from several threads each get their own verdicts. A test whose mount cannot be
//! made here prints one `skip:` line and is counted as ignored.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{BLOCK, ENGINE_BLOCKS, Opts, content, keys};
use kvx_core::*;
use kvx_fusefs::{Backing, StallFs, fuse_available};
use kvx_offload::*;
use kvx_policy::BreakerConfig;
use libtest_mimic::{Arguments, Failed, Trial};

fn check(cond: bool, what: &str) -> Result<(), Failed> {
    if cond { Ok(()) } else { Err(what.into()) }
}

/// A store over a fresh arena (the engine's host cache) with a file tier in `dir`.
fn store(dir: &Path, o: &Opts) -> Result<(PageStore, CpuArena), Failed> {
    let arena = CpuArena::contiguous(BLOCK, ENGINE_BLOCKS)?;
    // SAFETY: the arena outlives the store (the tests drop the store first), and the test
    // touches a page only between calls, when no copy of it is out.
    let memory = unsafe { EngineMemory::cpu(arena.layout().clone()) };
    Ok((PageStore::new(o.config(dir), memory, None)?, arena))
}

fn pages(v: std::ops::Range<u32>) -> Vec<EngineBlockId> {
    v.map(EngineBlockId).collect()
}

fn fill(arena: &mut CpuArena, ks: &[BlockKey], at: &[EngineBlockId]) -> Result<(), Failed> {
    for (k, p) in ks.iter().zip(at) {
        arena.write_block(*p, &content(*k))?;
    }
    Ok(())
}

fn holds(arena: &CpuArena, ks: &[BlockKey], at: &[EngineBlockId]) -> bool {
    ks.iter()
        .zip(at)
        .all(|(k, p)| arena.read_block(*p).is_ok_and(|b| b == content(*k)))
}

/// Block files (`*.kvb`) under `dir`, at any depth.
fn block_files(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                block_files(&p)
            } else {
                usize::from(p.extension().is_some_and(|x| x == "kvb"))
            }
        })
        .sum()
}

/// Wait until the file tier has `n` blocks (the write-through follows a store's return).
fn files_written(dir: &Path, n: usize) -> Result<(), Failed> {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let count = block_files(dir);
        if count >= n {
            return Ok(());
        }
        if Instant::now() >= until {
            return Err(format!("{count} of {n} block files written").into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn round_trip_and_exists() -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let o = Opts {
        host_blocks: 4,
        ..Opts::default()
    };
    let ks = keys(1, 8, 0, 0);
    {
        let (s, mut arena) = store(dir.path(), &o)?;
        fill(&mut arena, &ks, &pages(0..8))?;
        let stored = s.store(&ks, &pages(0..8))?;
        check(
            stored == vec![true; 8],
            &format!("every page stored: {stored:?}"),
        )?;
        // A second store of the same keys is already held.
        check(
            s.store(&ks[..2], &pages(20..22))? == vec![true; 2],
            "held keys are stored",
        )?;
        files_written(dir.path(), 8)?;
        check(s.exists(&ks)? == 8, "all 8 exist")?;
        // The host tier (4 blocks) holds the last ones; a load of all 8 mixes both tiers.
        check(s.load(&ks, &pages(8..16))? == vec![true; 8], "load of 8")?;
        check(
            holds(&arena, &ks, &pages(8..16)),
            "loaded bytes equal the stored ones",
        )?;
        drop(s);
    }
    // A fresh store (a new process) finds the files and nothing else.
    let (s, arena) = store(dir.path(), &o)?;
    let other = keys(2, 2, 0, 0);
    let mixed = [ks[0], ks[1], other[0], ks[3]];
    check(s.exists(&mixed)? == 2, "exists counts the leading run")?;
    let got = s.load(&mixed, &pages(30..34))?;
    check(got == vec![true, true, false, false], "a miss ends the run")?;
    check(
        holds(&arena, &ks[..2], &pages(30..32)),
        "file hits byte-exact",
    )?;
    let err = s.load(&ks[..2], &pages(0..1));
    check(
        matches!(&err, Err(OffloadError::Config { field, .. }) if field == "pages"),
        "keys and pages of different lengths are refused",
    )?;
    s.clear()?;
    check(s.exists(&ks)? == 0, "nothing exists after clear")?;
    drop(s);
    Ok(())
}

fn close_writes_what_it_accepted() -> Result<(), Failed> {
    // Every page fits the host tier: the call returns before the files are written, and the
    // close that follows at once still writes them.
    let dir = tempfile::tempdir()?;
    let ks = keys(6, 5, 0, 0);
    let (s, mut arena) = store(dir.path(), &Opts::default())?;
    fill(&mut arena, &ks, &pages(0..5))?;
    check(s.store(&ks, &pages(0..5))? == vec![true; 5], "stored")?;
    s.close();
    check(
        block_files(dir.path()) == 5,
        "the close wrote every accepted page",
    )?;
    check(s.exists(&ks).is_err(), "a closed store refuses calls")?;
    drop(s);
    let (s, _arena) = store(dir.path(), &Opts::default())?;
    check(s.exists(&ks)? == 5, "a fresh store finds them")?;
    drop(s);
    Ok(())
}

fn corrupt_file_fails_its_page() -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let o = Opts::default();
    let ks = keys(3, 6, 0, 0);
    {
        let (s, mut arena) = store(dir.path(), &o)?;
        fill(&mut arena, &ks, &pages(0..6))?;
        check(s.store(&ks, &pages(0..6))? == vec![true; 6], "stored")?;
        files_written(dir.path(), 6)?;
    }
    let path = {
        let r = common::rig(dir.path(), Opts::default());
        r.files.block_path(ks[2])
    };
    let mut bytes = std::fs::read(&path)?;
    let last = bytes.len() - 1;
    bytes[last] ^= 0xFF;
    std::fs::write(&path, bytes)?;
    let (s, arena) = store(dir.path(), &o)?;
    let got = s.load(&ks, &pages(10..16))?;
    check(
        got == vec![true, true, false, true, true, true],
        &format!("only the corrupt page fails: {got:?}"),
    )?;
    check(
        holds(&arena, &ks[..2], &pages(10..12)),
        "the others are exact",
    )?;
    check(
        holds(&arena, &ks[3..], &pages(13..16)),
        "the others are exact",
    )?;
    let stats = s.take_stats();
    check(
        stats.load_failed_blocks.values().sum::<u64>() == 1,
        &format!("one failed block counted: {stats:?}"),
    )?;
    drop(s);
    Ok(())
}

fn frozen_mount_ends_a_load_by_its_deadline() -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let mount = StallFs::mount(dir.path(), Backing::Memory)?;
    let deadline = 250u64;
    let o = Opts {
        load_ms: deadline,
        store_ms: deadline,
        breaker: Some(BreakerConfig {
            failure_threshold: 3,
            window_ms: 10_000,
            cool_down_ms: 300,
            probe_deadline_ms: deadline,
        }),
        ..Opts::default()
    };
    let ks = keys(4, 4, 0, 0);
    {
        let (s, mut arena) = store(mount.path(), &o)?;
        fill(&mut arena, &ks, &pages(0..4))?;
        check(s.store(&ks, &pages(0..4))? == vec![true; 4], "stored")?;
        files_written(mount.path(), 4)?;
    }
    let (s, arena) = store(mount.path(), &o)?;
    mount.freeze();
    let limit = Duration::from_millis(deadline) + TICK + Duration::from_millis(50);
    let mut took = Vec::new();
    for _ in 0..3 {
        let t0 = Instant::now();
        let got = s.load(&ks, &pages(10..14))?;
        took.push(t0.elapsed());
        check(got == vec![false; 4], "nothing loads from a frozen mount")?;
    }
    // A store meanwhile: its bytes land in kvx at once, its file write waits out the freeze.
    let fresh = keys(5, 1, 0, 0);
    let t0 = Instant::now();
    check(
        s.store(&fresh, &pages(20..21))? == vec![true],
        "store while frozen",
    )?;
    took.push(t0.elapsed());
    println!("frozen mount: calls took {took:?} (bound {limit:?})");
    for t in &took {
        check(*t <= limit, &format!("a call took {t:?}, bound {limit:?}"))?;
    }
    mount.thaw();
    // Service resumes once the breaker's cool-down lets a probe through.
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        if s.load(&ks, &pages(30..34))? == vec![true; 4] {
            break;
        }
        check(Instant::now() < until, "loads resume after the thaw")?;
        std::thread::sleep(Duration::from_millis(100));
    }
    check(
        holds(&arena, &ks, &pages(30..34)),
        "byte-exact after the thaw",
    )?;
    drop(s);
    Ok(())
}

fn threads_get_their_own_verdicts() -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let o = Opts {
        host_blocks: 16,
        ..Opts::default()
    };
    let (s, mut arena) = store(dir.path(), &o)?;
    let rounds = 16u64;
    let all: Vec<Vec<BlockKey>> = (0..rounds).map(|r| keys(100 + r, 2, 0, 0)).collect();
    // Thread 0 stores into pages 0..2 round after round (the test wrote every round's
    // content into its own page pair first); thread 1 loads the previous rounds into 40..42.
    for (r, ks) in all.iter().enumerate() {
        let at = 2 * (r as u32 % 16);
        fill(&mut arena, ks, &pages(at..at + 2))?;
    }
    let s = Arc::new(s);
    let storer = {
        let s = s.clone();
        let all = all.clone();
        std::thread::spawn(move || -> Result<(), String> {
            for (r, ks) in all.iter().enumerate().take(16) {
                let at = 2 * r as u32;
                let got = s.store(ks, &pages(at..at + 2)).map_err(|e| e.to_string())?;
                if got != vec![true; 2] {
                    return Err(format!("round {r}: store {got:?}"));
                }
            }
            Ok(())
        })
    };
    let loader = {
        let s = s.clone();
        let all = all.clone();
        std::thread::spawn(move || -> Result<usize, String> {
            let mut hits = 0;
            let until = Instant::now() + Duration::from_secs(20);
            while hits < 16 && Instant::now() < until {
                let r = hits;
                let at = 40 + 2 * (r as u32 % 8);
                let got = s
                    .load(&all[r], &pages(at..at + 2))
                    .map_err(|e| e.to_string())?;
                match got.as_slice() {
                    [true, true] => hits += 1,
                    [false, false] => std::thread::sleep(Duration::from_millis(1)),
                    other => return Err(format!("round {r}: a partial load {other:?}")),
                }
            }
            Ok(hits)
        })
    };
    storer.join().map_err(|_| "storer panicked")??;
    let hits = loader.join().map_err(|_| "loader panicked")??;
    check(hits == 16, &format!("{hits} of 16 rounds loaded"))?;
    // The last pages the loader wrote hold the last round it loaded.
    let r = 15usize;
    let at = 40 + 2 * (r as u32 % 8);
    check(
        holds(&arena, &all[r], &pages(at..at + 2)),
        "loaded bytes exact",
    )?;
    drop(s);
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    let fuse = fuse_available();
    if let Err(why) = &fuse {
        println!("skip: FUSE tests ({why})");
    }
    let trials = vec![
        Trial::test("round_trip_and_exists", round_trip_and_exists),
        Trial::test(
            "close_writes_what_it_accepted",
            close_writes_what_it_accepted,
        ),
        Trial::test("corrupt_file_fails_its_page", corrupt_file_fails_its_page),
        Trial::test(
            "frozen_mount_ends_a_load_by_its_deadline",
            frozen_mount_ends_a_load_by_its_deadline,
        )
        .with_ignored_flag(fuse.is_err()),
        Trial::test(
            "threads_get_their_own_verdicts",
            threads_get_their_own_verdicts,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}
