//! `gc`: bring a store's block bytes under a quota by removing the least recently used blocks
//! (oldest mtime first: a store writes the file, a load touches it), and remove stale temporary
//! files. Several runs at once, on one node or many, do no harm: a file already gone counts as
//! freed, and a block stored or loaded since the walk is left alone.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::files::{self, Removal};
use super::walk::{FileEntry, Kind, walk};
use super::{DEFAULT_DEADLINE, DEFAULT_STALE_AFTER, MaintenanceError, Phase, Progress, Worker};

/// What `gc` does.
#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Block bytes (sum of block file lengths) to bring the store under.
    pub max_bytes: u64,
    /// Deadline of each file operation.
    pub deadline: Duration,
    /// A temporary file older than this is a crash leftover and is removed.
    pub stale_after: Duration,
    /// Only report what would be removed.
    pub dry_run: bool,
}

impl GcOptions {
    /// Options for a quota of `max_bytes`, the other settings at their defaults.
    pub fn new(max_bytes: u64) -> GcOptions {
        GcOptions {
            max_bytes,
            deadline: DEFAULT_DEADLINE,
            stale_after: DEFAULT_STALE_AFTER,
            dry_run: false,
        }
    }
}

/// One file `gc` removed (or, in a dry run, would remove).
#[derive(Debug, Clone)]
pub struct Collected {
    /// The file.
    pub path: PathBuf,
    /// Its length.
    pub bytes: u64,
    /// Its mtime when walked.
    pub modified: SystemTime,
    /// What happened (`None` in a dry run).
    pub outcome: Option<Removal>,
}

/// The outcome of a `gc` run.
#[derive(Debug, Clone, Default)]
pub struct GcReport {
    /// Block files found by the walk.
    pub blocks_before: u64,
    /// Their bytes.
    pub bytes_before: u64,
    /// Block files left (as far as this run knows: other nodes may write meanwhile).
    pub blocks_after: u64,
    /// Their bytes.
    pub bytes_after: u64,
    /// Blocks removed (or already gone), oldest first; in a dry run, those that would be.
    pub blocks: Vec<Collected>,
    /// Stale temporary files removed (or that would be).
    pub temps: Vec<Collected>,
    /// Blocks stored or loaded since the walk (or replaced): kept.
    pub kept_changed: u64,
    /// Removals that failed: path and error.
    pub failed: Vec<(PathBuf, String)>,
}

/// Collect the store at `root` (one root of a `PosixStore`) down to `opts.max_bytes`.
pub fn gc(
    root: &Path,
    opts: &GcOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<GcReport, MaintenanceError> {
    let mut worker = Worker::spawn(opts.deadline)?;
    let entries = walk(root, &mut worker, progress)?;
    let now = SystemTime::now();
    let mut blocks: Vec<FileEntry> = Vec::new();
    let mut stale: Vec<FileEntry> = Vec::new();
    for e in entries {
        match e.kind {
            Kind::Block(_) if e.id.is_some() => blocks.push(e),
            Kind::Temp if e.id.is_some() && e.age(now) >= opts.stale_after => stale.push(e),
            _ => {}
        }
    }
    // Oldest first; equal times by path, so concurrent runs pick the same order.
    blocks.sort_by(|a, b| (a.modified, &a.path).cmp(&(b.modified, &b.path)));
    let mut report = GcReport {
        blocks_before: blocks.len() as u64,
        bytes_before: blocks.iter().map(|b| b.len).sum(),
        ..GcReport::default()
    };
    report.blocks_after = report.blocks_before;
    report.bytes_after = report.bytes_before;
    // Progress counts the blocks that must go if none changed meanwhile.
    let over = report.bytes_before.saturating_sub(opts.max_bytes);
    let mut planned = 0u64;
    let victims = blocks
        .iter()
        .take_while(|b| {
            let more = planned < over;
            planned += b.len;
            more
        })
        .count();
    let total = (victims + stale.len()) as u64;
    let mut done = 0u64;
    let mut tick = |done: &mut u64| {
        *done += 1;
        progress(Progress {
            phase: Phase::Remove,
            done: *done,
            total: Some(total.max(*done)),
        });
    };
    // Oldest first until the quota holds; a block that changed since the walk is kept and the
    // next oldest goes instead.
    for b in &blocks {
        if report.bytes_after <= opts.max_bytes {
            break;
        }
        match collect(&mut worker, opts.dry_run, b, &mut report.failed)? {
            Step::Kept => report.kept_changed += 1,
            Step::Failed => {}
            Step::Freed(outcome) => {
                report.blocks_after -= 1;
                report.bytes_after -= b.len;
                report.blocks.push(collected(b, outcome));
            }
        }
        tick(&mut done);
    }
    for t in &stale {
        if let Step::Freed(outcome) = collect(&mut worker, opts.dry_run, t, &mut report.failed)? {
            report.temps.push(collected(t, outcome));
        }
        tick(&mut done);
    }
    Ok(report)
}

fn collected(e: &FileEntry, outcome: Option<Removal>) -> Collected {
    Collected {
        path: e.path.clone(),
        bytes: e.len,
        modified: e.modified,
        outcome,
    }
}

/// What became of one file `gc` wanted gone.
enum Step {
    /// Gone (removed now or already), or would be in a dry run (`None`).
    Freed(Option<Removal>),
    /// Stored, loaded or replaced since the walk: kept.
    Kept,
    /// The removal failed (recorded in the report); the file stays.
    Failed,
}

/// Remove `e` if unchanged since the walk (nothing in a dry run).
fn collect(
    worker: &mut Worker,
    dry_run: bool,
    e: &FileEntry,
    failed: &mut Vec<(PathBuf, String)>,
) -> Result<Step, MaintenanceError> {
    let Some(id) = e.id.filter(|_| !dry_run) else {
        return Ok(Step::Freed(None));
    };
    let (path, modified) = (e.path.clone(), e.modified);
    let r = worker.run("remove", &e.path, move || {
        files::remove_if_unchanged(&path, id, Some(modified))
    })?;
    Ok(match r {
        Ok(Removal::Changed) => Step::Kept,
        Ok(r) => Step::Freed(Some(r)),
        Err(err) => {
            failed.push((e.path.clone(), err.to_string()));
            Step::Failed
        }
    })
}
