//! A thread that runs blocking file operations for the caller, who waits for each one only
//! until its deadline.
//!
//! A syscall stuck on a frozen mount (FUSE, NFS) cannot be cancelled and its thread cannot be
//! joined: when an operation passes its deadline the caller gets
//! [`MaintenanceError::Frozen`], the thread is left behind (detached, never joined) and every
//! later operation fails at once with the same error.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, bounded, unbounded};

use super::MaintenanceError;

type Job = Box<dyn FnOnce() + Send>;

/// Runs file operations on a worker thread with a deadline on each.
#[derive(Debug)]
#[must_use = "a worker thread ends when dropped"]
pub struct Worker {
    jobs: Sender<Job>,
    deadline: Duration,
    stuck: Option<(&'static str, PathBuf)>,
}

impl Worker {
    /// Start the worker thread; every operation gets `deadline`.
    pub fn spawn(deadline: Duration) -> Result<Worker, MaintenanceError> {
        let (jobs, rx) = unbounded::<Job>();
        std::thread::Builder::new()
            .name("kvx-maint-io".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .map_err(MaintenanceError::Thread)?;
        Ok(Worker {
            jobs,
            deadline,
            stuck: None,
        })
    }

    /// The deadline of each operation.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Run `f` (operation `op` on `path`) on the worker thread and wait for it until the
    /// deadline. The outer error is the deadline (or an earlier stuck operation); the inner
    /// result is the operation's own.
    pub fn run<T: Send + 'static>(
        &mut self,
        op: &'static str,
        path: &Path,
        f: impl FnOnce() -> io::Result<T> + Send + 'static,
    ) -> Result<io::Result<T>, MaintenanceError> {
        if let Some((op, path)) = &self.stuck {
            return Err(self.frozen(op, path));
        }
        let (tx, rx) = bounded(1);
        let start = Instant::now();
        let job: Job = Box::new(move || {
            let _ = tx.send(f());
        });
        if self.jobs.send(job).is_err() {
            return Err(MaintenanceError::Io {
                op,
                path: path.to_path_buf(),
                source: io::Error::other("the I/O thread is gone"),
            });
        }
        match rx.recv_deadline(start + self.deadline) {
            Ok(r) => Ok(r),
            Err(_) => {
                self.stuck = Some((op, path.to_path_buf()));
                Err(self.frozen(op, path))
            }
        }
    }

    fn frozen(&self, op: &'static str, path: &Path) -> MaintenanceError {
        MaintenanceError::Frozen {
            op,
            path: path.to_path_buf(),
            ms: self.deadline.as_millis() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_in_time_and_gives_up_at_the_deadline() {
        let mut w = Worker::spawn(Duration::from_millis(100)).unwrap();
        assert_eq!(
            w.run("add", Path::new("x"), || Ok(2 + 2)).unwrap().unwrap(),
            4
        );
        let (release, wait) = bounded::<()>(1);
        let t0 = Instant::now();
        let e = w
            .run("read", Path::new("/stuck"), move || {
                let _ = wait.recv();
                Ok(())
            })
            .unwrap_err();
        let took = t0.elapsed();
        println!("maintenance worker: gave up after {took:?} (deadline 100 ms, bound 151 ms)");
        assert!(took >= Duration::from_millis(100), "{took:?}");
        assert!(took <= Duration::from_millis(151), "{took:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("read /stuck did not answer within 100 ms"),
            "{msg}"
        );
        // Later operations fail at once, naming the stuck one.
        let t1 = Instant::now();
        let e = w.run("stat", Path::new("/other"), || Ok(())).unwrap_err();
        let refused = t1.elapsed();
        println!("maintenance worker: the next operation failed after {refused:?} (bound 50 ms)");
        assert!(refused < Duration::from_millis(50), "{refused:?}");
        assert!(e.to_string().contains("/stuck"), "{e}");
        release.send(()).unwrap();
    }
}
