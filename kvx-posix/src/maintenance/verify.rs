//! `verify`: check every block file of a store the way a load would (header, key, length,
//! checksum), report what is wrong by path and reason, and on request remove corrupt blocks and
//! stale temporary files.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use kvx_core::BlockKey;

use super::files::{self, FileId, Removal};
use super::walk::{FileEntry, Kind, walk};
use super::{DEFAULT_DEADLINE, DEFAULT_STALE_AFTER, MaintenanceError, Phase, Progress, Worker};
use crate::error::PosixError;
use crate::format::{VERSION, check_header, check_payload};

/// What `verify` does.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// Deadline of each file operation.
    pub deadline: Duration,
    /// A temporary file older than this is a crash leftover.
    pub stale_after: Duration,
    /// Remove corrupt blocks, misnamed block files and stale temporary files.
    pub repair: bool,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            deadline: DEFAULT_DEADLINE,
            stale_after: DEFAULT_STALE_AFTER,
            repair: false,
        }
    }
}

/// What is wrong with (or notable about) one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FindingKind {
    /// The payload's checksum does not match the header's.
    ChecksumMismatch,
    /// The file is shorter than its header, or than the payload its header announces.
    Truncated,
    /// A `.kvb` file that is not a kvx block: wrong magic, or a name no block has here.
    Foreign,
    /// The header's own checksum does not match.
    HeaderCorrupt,
    /// The header holds another key than the file name.
    WrongKey,
    /// A temporary file older than the stale age: a writer died.
    StaleTemp,
    /// The file could not be read (the error is in the reason); left alone.
    Unreadable,
    /// A block of a newer format version: left alone, not a problem.
    NewerFormat,
    /// A block of an older format version this build does not read: left alone, not a problem.
    OlderFormat,
    /// A file that is not kvx's: left alone, not a problem.
    UnknownFile,
}

impl FindingKind {
    /// Whether this counts as a problem (makes `verify` fail).
    pub fn is_problem(self) -> bool {
        !matches!(
            self,
            FindingKind::NewerFormat | FindingKind::OlderFormat | FindingKind::UnknownFile
        )
    }

    /// Whether `--repair` removes the file.
    pub fn is_removable(self) -> bool {
        self.is_problem() && self != FindingKind::Unreadable
    }

    /// A short name for reports (`checksum_mismatch`, `truncated`, ...).
    pub fn label(self) -> &'static str {
        match self {
            FindingKind::ChecksumMismatch => "checksum_mismatch",
            FindingKind::Truncated => "truncated",
            FindingKind::Foreign => "foreign",
            FindingKind::HeaderCorrupt => "header_corrupt",
            FindingKind::WrongKey => "wrong_key",
            FindingKind::StaleTemp => "stale_temp",
            FindingKind::Unreadable => "unreadable",
            FindingKind::NewerFormat => "newer_format",
            FindingKind::OlderFormat => "older_format",
            FindingKind::UnknownFile => "unknown_file",
        }
    }
}

/// What `verify` did about a finding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Reported only (no `repair`, or a finding that is never removed).
    Reported,
    /// Reported and removed.
    Removed,
    /// Already gone when the removal came.
    AlreadyGone,
    /// Replaced or rewritten since it was read: left alone.
    Changed,
    /// The removal failed with this error.
    RemoveFailed(String),
}

/// One file `verify` reports.
#[derive(Debug, Clone)]
pub struct Finding {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub kind: FindingKind,
    /// Why, in words.
    pub reason: String,
    /// What was done.
    pub action: Action,
}

/// The outcome of a `verify` run.
#[derive(Debug, Clone, Default)]
#[must_use = "the problems verify found"]
pub struct VerifyReport {
    /// Block files checked (whatever the outcome, vanished ones included).
    pub blocks_checked: u64,
    /// Blocks that passed every check.
    pub blocks_ok: u64,
    /// Bytes of the blocks that passed.
    pub bytes_ok: u64,
    /// Temporary files younger than the stale age (writes in flight), left alone.
    pub temps_in_flight: u64,
    /// Block files removed, replaced, rewritten or renamed by someone else between the walk
    /// and the end of their check (a live store evicting, overwriting or recycling them, or
    /// touching them on a load): not checked.
    pub vanished: u64,
    /// Every problem and note, in walk order.
    pub findings: Vec<Finding>,
}

impl VerifyReport {
    /// Findings that are problems.
    pub fn problems(&self) -> usize {
        self.findings.iter().filter(|f| f.kind.is_problem()).count()
    }

    /// Problems still on disk after the run (not removed, not already gone).
    pub fn unresolved(&self) -> usize {
        self.findings
            .iter()
            .filter(|f| {
                f.kind.is_problem() && !matches!(f.action, Action::Removed | Action::AlreadyGone)
            })
            .count()
    }
}

/// Check every file of the store at `root` (one root of a `PosixStore`). Fails only when the
/// tree cannot be walked or a file operation passes its deadline; problems in files are in the
/// report.
pub fn verify(
    root: &Path,
    opts: &VerifyOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<VerifyReport, MaintenanceError> {
    let mut worker = Worker::spawn(opts.deadline)?;
    let entries = walk(root, &mut worker, progress)?;
    let now = SystemTime::now();
    let total = entries.len() as u64;
    let mut report = VerifyReport::default();
    for (i, e) in entries.into_iter().enumerate() {
        let found = match e.kind {
            Kind::Block(key) => {
                report.blocks_checked += 1;
                match check_block(&mut worker, &e.path, key)? {
                    Checked::Ok { len } => {
                        report.blocks_ok += 1;
                        report.bytes_ok += len;
                        None
                    }
                    Checked::Gone => {
                        report.vanished += 1;
                        None
                    }
                    Checked::Bad { kind, reason, id } => Some((kind, reason, id)),
                }
            }
            Kind::Temp if e.age(now) >= opts.stale_after => {
                let reason = format!(
                    "stale temporary file: last written {} s ago (stale after {} s)",
                    e.age(now).as_secs(),
                    opts.stale_after.as_secs()
                );
                Some((FindingKind::StaleTemp, reason, e.id))
            }
            Kind::Temp => {
                report.temps_in_flight += 1;
                None
            }
            Kind::Misnamed => Some((
                FindingKind::Foreign,
                "foreign file: a .kvb name that is no block's name in this directory".into(),
                e.id,
            )),
            Kind::Unknown => Some((
                FindingKind::UnknownFile,
                "not a kvx file, left alone".into(),
                e.id,
            )),
        };
        if let Some((kind, reason, id)) = found {
            let action = act(&mut worker, opts.repair, &e, kind, id)?;
            report.findings.push(Finding {
                path: e.path,
                kind,
                reason,
                action,
            });
        }
        progress(Progress {
            phase: Phase::Check,
            done: i as u64 + 1,
            total: Some(total),
        });
    }
    Ok(report)
}

enum Checked {
    Ok {
        len: u64,
    },
    Gone,
    Bad {
        kind: FindingKind,
        reason: String,
        id: Option<FileId>,
    },
}

/// Read `path` through the worker and check it as a load of `key` would.
fn check_block(
    worker: &mut Worker,
    path: &Path,
    key: BlockKey,
) -> Result<Checked, MaintenanceError> {
    let owned = path.to_path_buf();
    let bytes = match worker.run("read", path, move || files::read_block(&owned))? {
        Ok(b) => b,
        // Removed (or, on NFS, replaced) by someone else since the walk: nothing to check.
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.raw_os_error() == Some(libc::ESTALE) =>
        {
            return Ok(Checked::Gone);
        }
        Err(e) => {
            return Ok(Checked::Bad {
                kind: FindingKind::Unreadable,
                reason: format!("cannot read: {e}"),
                id: None,
            });
        }
    };
    if bytes.changed {
        // Moved or rewritten under the read: what was read may mix two blocks.
        return Ok(Checked::Gone);
    }
    let id = Some(bytes.stat.id);
    let file_len = usize::try_from(bytes.stat.len).unwrap_or(usize::MAX);
    let checked = check_header(
        path,
        &bytes.header,
        bytes.header.len(),
        key,
        file_len,
        bytes.payload.len(),
        usize::MAX,
    )
    .and_then(|len| check_payload(path, &bytes.header, &bytes.payload[..len]).map(|()| len));
    Ok(match checked {
        Ok(len) => Checked::Ok { len: len as u64 },
        Err(e) => Checked::Bad {
            kind: kind_of_error(&e),
            reason: reason(path, &e),
            id,
        },
    })
}

fn kind_of_error(e: &PosixError) -> FindingKind {
    match e {
        PosixError::PayloadChecksum { .. } => FindingKind::ChecksumMismatch,
        PosixError::ShortHeader { .. } | PosixError::ShortPayload { .. } => FindingKind::Truncated,
        PosixError::WrongMagic { .. } => FindingKind::Foreign,
        PosixError::HeaderChecksum { .. } => FindingKind::HeaderCorrupt,
        PosixError::WrongKey { .. } => FindingKind::WrongKey,
        PosixError::NotReadable { found, .. } if *found > VERSION => FindingKind::NewerFormat,
        PosixError::NotReadable { .. } => FindingKind::OlderFormat,
        _ => FindingKind::Unreadable,
    }
}

/// The error's words without the path it starts with, plus what kind of problem it is.
fn reason(path: &Path, e: &PosixError) -> String {
    let full = e.to_string();
    let prefix = format!("{}: ", path.display());
    let words = full.strip_prefix(&prefix).unwrap_or(&full);
    match kind_of_error(e) {
        FindingKind::ChecksumMismatch => format!("checksum mismatch: {words}"),
        FindingKind::Truncated => format!("truncated: {words}"),
        FindingKind::Foreign => format!("foreign file, not a kvx block: {words}"),
        FindingKind::NewerFormat | FindingKind::OlderFormat => {
            format!("{words} (this build reads {VERSION}): left alone")
        }
        _ => words.to_string(),
    }
}

fn act(
    worker: &mut Worker,
    repair: bool,
    e: &FileEntry,
    kind: FindingKind,
    id: Option<FileId>,
) -> Result<Action, MaintenanceError> {
    let Some(id) = id.filter(|_| repair && kind.is_removable()) else {
        return Ok(Action::Reported);
    };
    // A file is removed only if nobody wrote to it since the walk (a live store may have
    // recycled a corrupt block's file into a new, good block meanwhile).
    let modified = Some(e.modified);
    let path = e.path.clone();
    Ok(
        match worker.run("remove", &e.path, move || {
            files::remove_if_unchanged(&path, id, modified)
        })? {
            Ok(Removal::Removed) => Action::Removed,
            Ok(Removal::AlreadyGone) => Action::AlreadyGone,
            Ok(Removal::Changed) => Action::Changed,
            Err(err) => Action::RemoveFailed(err.to_string()),
        },
    )
}
