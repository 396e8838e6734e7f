//! `kvx bench posix --deadline-ms 2000` on a FUSE mount that freezes mid-store or mid-load, for
//! both engines: the report (how many ops timed out) is printed within the bench's stated bound
//! of the freeze — the ops' deadline, after which the phase starts nothing more (at most
//! [`STARVED`] more when it is out of buffers) and a round whose stores timed out loads
//! nothing, plus one tick and the 50 ms allowance — and the process exits promptly once the
//! mount thaws. Ignored, with one `skip:` line, where FUSE cannot be mounted.
//!
//! Rerun alone: `cargo test -p kvx-cli --test bench_posix`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvx_core::TICK;
use kvx_fusefs::{Backing, StallFs};
use kvx_posix::bench::STARVED;
use libtest_mimic::{Arguments, Failed, Trial};

const DEADLINE_MS: u64 = 2000;
/// The stated allowance on top of a tick for scheduling on these 2-core machines.
const ALLOWANCE: Duration = Duration::from_millis(50);
/// Generous bound for "exits promptly" after the thaw (never a performance assertion).
const SOON: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum When {
    MidStore,
    MidLoad,
}

impl When {
    /// The report's bound, from the freeze: every op in flight times out by its deadline; the
    /// frozen phase then starts nothing more (or, out of buffers, waits [`STARVED`] for one),
    /// and no phase runs after it (frozen mid-store, the round loads nothing).
    fn report_within(self) -> Duration {
        Duration::from_millis(DEADLINE_MS) + STARVED + TICK + ALLOWANCE
    }
}

fn any_file_under(dir: &Path) -> bool {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "kvb") {
                return true;
            }
        }
    }
    false
}

fn frozen_bench(engine: &str, when: When) -> Result<(), Failed> {
    let at = tempfile::tempdir()?;
    let mount = StallFs::mount(at.path(), Backing::Memory)?;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvx"))
        .args(["bench", "posix", "--dir"])
        .arg(mount.path())
        .args([
            "--block-size",
            "64KiB",
            "--blocks",
            "3000",
            "--queue-depth",
            "8",
        ])
        .args([
            "--engine",
            engine,
            "--deadline-ms",
            &DEADLINE_MS.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // Every line of both streams, with when it arrived.
    let (tx, rx) = mpsc::channel::<(Instant, String)>();
    let out = child.stdout.take().ok_or("no stdout")?;
    let err = child.stderr.take().ok_or("no stderr")?;
    for stream in [
        Box::new(out) as Box<dyn std::io::Read + Send>,
        Box::new(err) as Box<dyn std::io::Read + Send>,
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let _ = tx.send((Instant::now(), line));
            }
        });
    }
    drop(tx);
    let mut lines = Vec::new();
    let start = Instant::now();
    let frozen_at = loop {
        if start.elapsed() > SOON {
            mount.thaw();
            let _ = child.kill();
            return Err(format!("never reached the {when:?} point: {lines:?}").into());
        }
        while let Ok(l) = rx.try_recv() {
            lines.push(l.1);
        }
        let ready = match when {
            When::MidStore => any_file_under(mount.path()),
            When::MidLoad => lines.iter().any(|l| l.contains("loading them")),
        };
        if ready {
            mount.freeze();
            break Instant::now();
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    // The report: the line that counts the ops that timed out.
    let mut report_at = None;
    while report_at.is_none() {
        match rx.recv_timeout(when.report_within() + SOON) {
            Ok((t, l)) => {
                if l.contains("timed out") && report_at.is_none() {
                    report_at = Some(t);
                }
                lines.push(l);
            }
            Err(_) => break,
        }
    }
    let report_after = report_at.map(|t| t.saturating_duration_since(frozen_at));
    mount.thaw();
    let thawed = Instant::now();
    let mut status = None;
    while thawed.elapsed() < SOON {
        if let Some(s) = child.try_wait()? {
            status = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if status.is_none() {
        let _ = child.kill();
    }
    let exited_after = thawed.elapsed();
    while let Ok(l) = rx.try_recv() {
        lines.push(l.1);
    }
    let report_after =
        report_after.ok_or_else(|| format!("{engine} {when:?}: no report line: {lines:#?}"))?;
    if report_after > when.report_within() {
        return Err(format!(
            "{engine} {when:?}: report {report_after:?} after the freeze (bound {:?}): {lines:#?}",
            when.report_within()
        )
        .into());
    }
    let status = status
        .ok_or_else(|| format!("{engine} {when:?}: still running {SOON:?} after the thaw"))?;
    if status.code() != Some(1) {
        return Err(format!("{engine} {when:?}: exit {status:?}, want 1: {lines:#?}").into());
    }
    let phase = if when == When::MidStore {
        "store:"
    } else {
        "load:"
    };
    let timed_out = lines
        .iter()
        .find(|l| l.starts_with(phase))
        .and_then(|l| l.split(", ").find(|p| p.ends_with("timed out")))
        .and_then(|p| p.split(' ').next())
        .and_then(|n| n.parse::<u64>().ok())
        .ok_or_else(|| format!("{engine} {when:?}: no {phase} line: {lines:#?}"))?;
    if timed_out == 0 {
        return Err(format!("{engine} {when:?}: no op timed out: {lines:#?}").into());
    }
    if when == When::MidStore
        && !lines
            .iter()
            .any(|l| l.starts_with("load: 0 ok, 0 timed out, 0 failed, 0 refused"))
    {
        return Err(
            format!("{engine} {when:?}: stores timed out, yet loads ran: {lines:#?}").into(),
        );
    }
    println!(
        "{engine} {when:?}: report {report_after:?} after the freeze (bound {:?}; {timed_out} timed out), exit {exited_after:?} after the thaw",
        when.report_within()
    );
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    let no_fuse = match kvx_fusefs::fuse_available() {
        Ok(()) => false,
        Err(why) => {
            println!("skip: bench posix on a frozen mount: {why}");
            true
        }
    };
    let mut trials = Vec::new();
    for engine in ["uring", "psync"] {
        for when in [When::MidStore, When::MidLoad] {
            trials.push(
                Trial::test(
                    format!("frozen_{when:?}_{engine}").to_lowercase(),
                    move || frozen_bench(engine, when),
                )
                .with_ignored_flag(no_fuse),
            );
        }
    }
    libtest_mimic::run(&args, trials).exit();
}
