//! Run a maintenance command in a child process of this binary, so that the command can end
//! on a frozen mount.
//!
//! A thread stuck in a syscall on a frozen FUSE or NFS mount cannot be interrupted, and a
//! process cannot exit while one of its threads is stuck: its parent waits until the mount
//! answers. So `kvx verify` and `kvx gc` do their work in a child (the same binary and
//! arguments, marked by [`CHILD_ENV`]) whose stdout they forward; the child's last line is
//! [`EXIT_MARK`] and its exit code. When the child gives up on a frozen mount it prints its
//! error and that line; this process then exits at once with the code, leaving the stuck child
//! behind to end when the mount answers or is aborted.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use super::EXIT_UNFINISHED;

/// Set in the child's environment: run the command here, then print [`EXIT_MARK`].
pub const CHILD_ENV: &str = "KVX_OPS_CHILD";
/// Start of the child's last stdout line; the exit code follows.
pub const EXIT_MARK: &str = "\u{1}kvx-exit ";

/// Run `work` in a child process (or here, when this is the child) and return its exit code.
pub fn in_child(cmd: &str, work: impl FnOnce() -> i32) -> i32 {
    if std::env::var_os(CHILD_ENV).is_some() {
        let code = work();
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{EXIT_MARK}{code}");
        let _ = out.flush();
        return code;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("kvx {cmd}: cannot find this program to run its worker process: {e}");
            return EXIT_UNFINISHED;
        }
    };
    let child = Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env(CHILD_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvx {cmd}: cannot start its worker process: {e}");
            return EXIT_UNFINISHED;
        }
    };
    let Some(stdout) = child.stdout.take() else {
        return EXIT_UNFINISHED;
    };
    let mut lines = BufReader::new(stdout);
    let mut out = std::io::stdout().lock();
    let mut line = Vec::new();
    loop {
        line.clear();
        match lines.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if let Some(code) = line.strip_prefix(EXIT_MARK.as_bytes()) {
            let _ = out.flush();
            // Do not wait for the child: it may be stuck on the mount.
            return std::str::from_utf8(code)
                .ok()
                .and_then(|c| c.trim().parse().ok())
                .unwrap_or(EXIT_UNFINISHED);
        }
        // A closed stdout (`| head`) is no reason to stop reading.
        let _ = out.write_all(&line);
    }
    let _ = out.flush();
    let status = child.wait();
    eprintln!("kvx {cmd}: the worker process ended without a result ({status:?})");
    EXIT_UNFINISHED
}
