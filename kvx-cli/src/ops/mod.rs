//! Operator commands on a block store directory: `kvx verify` and `kvx gc`. Both walk the
//! store with a deadline on every file operation (a frozen mount ends the run with a clear
//! error instead of a hang), show a progress bar on a terminal, and with `--json` print one
//! JSON object as the last line.
//!
//! The work runs in a child process ([`child`]), so that the command ends even when a syscall
//! is stuck in a frozen mount.
//!
//! Exit codes: see [`EXIT_CODES`].

pub mod child;
pub mod gc;
pub mod shards;
pub mod verify;

use std::io::IsTerminal;
use std::path::Path;
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvx_posix::maintenance::{MaintenanceError, Phase, Progress};

/// The exit codes, for `--help`.
pub const EXIT_CODES: &str = "Exit codes: 0 all well; 1 problems found (verify) or quota not \
    reached (gc); 2 bad arguments (also: DIR holds no block store); 3 the run could not finish (a directory cannot be listed, or \
    a file operation passed its deadline: the mount may be frozen).";

/// The exit code of a run that could not finish.
pub const EXIT_UNFINISHED: i32 = 3;

/// The exit code of bad arguments, a directory holding no block store among them.
pub const EXIT_BAD_ARGS: i32 = 2;

/// True when `dir` looks like a block store's root: empty (a store not written yet), or
/// holding its `ab/` directories or its spare folder.
fn is_store_root(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.is_empty()
        || names.iter().any(|n| {
            n == ".kvx-spare"
                || (n.len() == 2 && n.bytes().all(|b| b.is_ascii_hexdigit()))
                || kvx_posix::shard::Shard::parse(n).is_some()
        })
}

/// When `dir` holds no block store: the message that says so, naming the stores found one or
/// two levels below it. Called only after a walk of `dir` found nothing (so the mount answers).
pub fn no_store(cmd: &str, dir: &Path) -> Option<String> {
    if is_store_root(dir) {
        return None;
    }
    let subdirs = |d: &Path| -> Vec<std::path::PathBuf> {
        std::fs::read_dir(d)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.is_dir())
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut below: Vec<String> = subdirs(dir)
        .into_iter()
        .flat_map(|d| {
            let mut v = subdirs(&d);
            v.insert(0, d);
            v
        })
        .filter(|d| is_store_root(d) && std::fs::read_dir(d).is_ok_and(|mut r| r.next().is_some()))
        .map(|d| d.display().to_string())
        .collect();
    below.sort();
    let hint = if below.is_empty() {
        "give the store's root directory (the one holding ab/<key>.kvb)".to_string()
    } else {
        format!(
            "block stores below it: {}; run kvx {cmd} on each",
            below.join(", ")
        )
    };
    Some(format!(
        "kvx {cmd}: {} holds no block store (no ab/ directories of block files); {hint}",
        dir.display()
    ))
}

/// Options both commands take.
#[derive(Args, Debug, Clone)]
pub struct FileOpArgs {
    /// Deadline of each file operation in milliseconds: past it the run stops with an error
    /// saying the mount may be frozen.
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    pub deadline_ms: u64,
    /// Age after which a temporary file (`*.kvb.tmp`) is a crash leftover: 90s, 10m, 2h.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub stale_after: Duration,
    /// Print one JSON object as the last line.
    #[arg(long)]
    pub json: bool,
}

impl FileOpArgs {
    /// The per-operation deadline.
    pub fn deadline(&self) -> Duration {
        Duration::from_millis(self.deadline_ms)
    }
}

/// Parse `600`, `90s`, `10m`, `2h`, `1d`, `500ms` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("not a duration: {s:?} (use e.g. 90s, 10m, 2h)"))?;
    let secs = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "" | "s" => 1,
        "m" | "min" => 60,
        "h" => 3600,
        "d" => 86400,
        u => {
            return Err(format!(
                "unknown duration unit {u:?} in {s:?} (use ms, s, m, h or d)"
            ));
        }
    };
    n.checked_mul(secs)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("duration {s:?} is too long"))
}

/// A progress bar on stderr when it is a terminal (hidden otherwise), following the phases
/// of a maintenance run.
pub struct Bar {
    pb: ProgressBar,
    phase: Option<Phase>,
    verb: &'static str,
}

impl Bar {
    /// A bar for a run that says `verb` (`checking`, `removing`) in its item phase.
    pub fn new(verb: &'static str) -> Bar {
        let pb = if std::io::stderr().is_terminal() {
            ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        Bar {
            pb,
            phase: None,
            verb,
        }
    }

    /// Show `p`.
    pub fn update(&mut self, p: Progress) {
        if self.phase != Some(p.phase) {
            self.phase = Some(p.phase);
            let template = match p.phase {
                Phase::Walk => "{elapsed:>4} {spinner} listing: {pos} directories".to_string(),
                _ => format!(
                    "{{elapsed:>4}} [{{bar:40}}] {{pos}}/{{len}} files {}",
                    self.verb
                ),
            };
            if let Ok(style) = ProgressStyle::with_template(&template) {
                self.pb.set_style(style.progress_chars("=> "));
            }
            self.pb.reset();
        }
        if let Some(total) = p.total {
            self.pb.set_length(total);
        }
        self.pb.set_position(p.done);
    }

    /// Remove the bar from the terminal.
    pub fn finish(&self) {
        self.pb.finish_and_clear();
    }
}

/// Print why `cmd` on `root` could not finish (stderr, and a JSON object with `--json`) and
/// return [`EXIT_UNFINISHED`]. A thread stuck on a frozen mount is left behind, never joined.
pub fn unfinished(cmd: &str, root: &Path, e: &MaintenanceError, json: bool) -> i32 {
    eprintln!("kvx {cmd}: {e}");
    if json {
        let frozen = matches!(e, MaintenanceError::Frozen { .. });
        println!(
            "{}",
            serde_json::json!({
                "command": cmd,
                "root": root.display().to_string(),
                "error": e.to_string(),
                "frozen": frozen,
                "exit_code": EXIT_UNFINISHED,
            })
        );
    }
    EXIT_UNFINISHED
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_posix::maintenance::{DEFAULT_DEADLINE, DEFAULT_STALE_AFTER};

    #[test]
    fn durations_parse_and_defaults_match_the_library() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("10m"), Ok(DEFAULT_STALE_AFTER));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("600"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("10 parsecs").unwrap_err().contains("unit"));
        assert!(
            parse_duration("soon")
                .unwrap_err()
                .contains("not a duration")
        );
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            ops: FileOpArgs,
        }
        let cli = <Cli as clap::Parser>::parse_from(["x"]);
        assert_eq!(cli.ops.deadline(), DEFAULT_DEADLINE);
        assert_eq!(cli.ops.stale_after, DEFAULT_STALE_AFTER);
    }
}
