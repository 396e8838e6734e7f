//! The verify lane: the payload checksums of finished uring loads, on threads of their own.
//!
//! One ring thread issues every op of its ring, so a checksum there (or on the caller's thread,
//! which starts the next ops) holds up the next ops: at 3 GiB/s a 1 MiB load's crc32c is about
//! 65 µs, and checking them one after another kept a 32-deep queue ~20 % short of the disk.
//! The engine hands a finished load whose payload is still unchecked to this lane instead of to
//! the store; a lane thread checks it (a mismatch fails that block as corrupt) and then hands it
//! to the store, waking it like any finished job. The lane's threads hold the job board weakly:
//! they end when the store (and so the board and the lane's sender) goes away.

use std::sync::Weak;

use crossbeam_channel::{Receiver, Sender};

use super::JobBoard;
use crate::job::BlockJob;

/// See the module docs.
pub(crate) struct VerifyLane {
    tx: Sender<Box<BlockJob>>,
}

impl VerifyLane {
    /// Start `threads` verify threads handing checked jobs to `board`.
    pub(crate) fn start(threads: usize, board: Weak<JobBoard>) -> std::io::Result<VerifyLane> {
        let (tx, rx) = crossbeam_channel::unbounded::<Box<BlockJob>>();
        for i in 0..threads.max(1) {
            let rx: Receiver<Box<BlockJob>> = rx.clone();
            let board = board.clone();
            std::thread::Builder::new()
                .name(format!("kvx-posix-verify-{i}"))
                .spawn(move || {
                    for mut job in rx {
                        job.verify_payload();
                        match board.upgrade() {
                            Some(b) => b.post(std::iter::once(job)),
                            None => return,
                        }
                    }
                })?;
        }
        Ok(VerifyLane { tx })
    }

    /// Queue `job` for its checksum; never blocks. `Err` gives it back when the lane is gone.
    pub(crate) fn send(&self, job: Box<BlockJob>) -> Result<(), Box<BlockJob>> {
        self.tx.send(job).map_err(|e| e.into_inner())
    }
}
