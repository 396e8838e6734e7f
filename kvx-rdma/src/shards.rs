//! Threads that each run their own single-threaded tokio runtime. A future spawned on a shard
//! runs on that shard's thread only, and the sockets it opens or adopts wake that thread only:
//! a connection's bytes are moved by one thread from its first byte to its last.
//!
//! Why not one multi-threaded runtime: there, a woken connection task runs on whichever worker
//! polled the reactor, and every wake-up also rouses an idle worker to look for work. On a
//! 2-core machine those extra threads take the core the other end of a loopback copy needs:
//! measured with `perf sched`, a serving thread spent about 11% of a read waiting for a core,
//! against under 2% for a plain blocking copy (see `PERFORMANCE.md`).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::watch;

/// The default number of shards: one per core, at most 8. More busy threads than cores take
/// the engine's threads' cores: with 8 reading threads on 2 cores, an engine step that started
/// a remote load took 2-7 ms instead of 0.1 ms, preempted by the readers it woke.
pub(crate) fn default_count() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().min(8))
}

/// Where futures are spawned: on the shard with the fewest of them running, the first such
/// one (so a lone connection or op always lands on the same thread, whose core the scheduler
/// has learnt). Cheap to clone; spawning after the threads stopped drops the future unpolled.
#[derive(Clone, Debug)]
pub(crate) struct Shards {
    shards: Arc<[Shard]>,
}

/// One shard's runtime and how many futures spawned on it have not ended yet.
#[derive(Debug)]
struct Shard {
    handle: Handle,
    running: AtomicUsize,
}

/// Counts a future as running on its shard until the future is dropped (done or not).
struct Running(Arc<[Shard]>, usize);

impl Drop for Running {
    fn drop(&mut self) {
        self.0[self.1].running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The shards' threads: dropping this stops them (see [`Drop`]).
#[derive(Debug)]
pub(crate) struct ShardThreads {
    stop: watch::Sender<bool>,
    /// One message per thread that has dropped its runtime (and every task on it).
    stopped: Receiver<()>,
    /// Threads that have not sent that message yet.
    count: usize,
    /// The threads, so that a stop called on one of them does not wait for itself.
    ids: Vec<ThreadId>,
}

impl Shards {
    /// Start `n` (at least 1) threads named `name`, each running its own runtime.
    pub(crate) fn start(name: &str, n: usize) -> std::io::Result<(Shards, ShardThreads)> {
        let n = n.max(1);
        let (stop, stop_rx) = watch::channel(false);
        let (stopped_tx, stopped) = channel();
        let (handle_tx, handle_rx) = channel();
        // Dropped on an early return: the threads started so far stop.
        let mut threads = ShardThreads {
            stop,
            stopped,
            count: 0,
            ids: Vec::with_capacity(n),
        };
        for _ in 0..n {
            let mut stop_rx = stop_rx.clone();
            let stopped_tx = stopped_tx.clone();
            let handle_tx = handle_tx.clone();
            let thread = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    // Built here, so that it is dropped here too, whatever happens.
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            let _ = handle_tx.send(Err(e));
                            let _ = stopped_tx.send(());
                            return;
                        }
                    };
                    let _ = handle_tx.send(Ok(rt.handle().clone()));
                    rt.block_on(async {
                        // Ends when told to stop or when the stop sender is gone.
                        let _ = stop_rx.wait_for(|stop| *stop).await;
                    });
                    // Every task still on this runtime is dropped here, on this thread.
                    drop(rt);
                    let _ = stopped_tx.send(());
                })?;
            threads.ids.push(thread.thread().id());
            threads.count += 1;
        }
        drop(handle_tx);
        let handles = handle_rx
            .iter()
            .take(n)
            .collect::<std::io::Result<Vec<Handle>>>()?;
        if handles.len() < n {
            return Err(std::io::Error::other(
                "a shard thread ended before it started",
            ));
        }
        let shards = handles
            .into_iter()
            .map(|handle| Shard {
                handle,
                running: AtomicUsize::new(0),
            })
            .collect();
        Ok((Shards { shards }, threads))
    }

    /// Spawn `fut` on the shard with the fewest futures running (the first of them).
    pub(crate) fn spawn<F>(&self, fut: F)
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let i = (0..self.shards.len())
            .min_by_key(|&i| self.shards[i].running.load(Ordering::Relaxed))
            .unwrap_or(0);
        self.shards[i].running.fetch_add(1, Ordering::Relaxed);
        let running = Running(self.shards.clone(), i);
        self.shards[i].handle.spawn(async move {
            let _running = running;
            fut.await
        });
    }

    /// Spawn `fut` on the first shard, not counted as running (a loop that lives as long as
    /// the shards, mostly asleep).
    pub(crate) fn spawn_background<F>(&self, fut: F)
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.shards[0].handle.spawn(fut);
    }
}

impl ShardThreads {
    /// Tell every thread to stop and wait at most `wait` until each has dropped its runtime,
    /// and so every task on it; returns whether all did. Called on one of these threads, it
    /// cannot wait for itself and returns at once.
    fn stop(&mut self, wait: Duration) -> bool {
        let _ = self.stop.send(true);
        if self.ids.contains(&std::thread::current().id()) {
            return false;
        }
        let until = Instant::now() + wait;
        while self.count > 0 {
            let left = until.saturating_duration_since(Instant::now());
            if self.stopped.recv_timeout(left).is_err() {
                return false;
            }
            self.count -= 1;
        }
        true
    }
}

/// How long dropping [`ShardThreads`] waits for the threads: a reply or read in progress is a
/// non-blocking call, so they stop within microseconds unless the machine is starved.
const STOP_WAIT: Duration = Duration::from_secs(1);

impl Drop for ShardThreads {
    /// Stops the threads and waits (at most 1 s; not on one of them) until no task of theirs
    /// is left: no thread can then still touch memory a task borrowed from its owner.
    fn drop(&mut self) {
        self.stop(STOP_WAIT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// The thread a spawned future runs on.
    fn thread_of(shards: &Shards, hold: Option<watch::Receiver<bool>>) -> std::thread::ThreadId {
        let (tx, rx) = channel();
        shards.spawn(async move {
            let _ = tx.send(std::thread::current().id());
            if let Some(mut hold) = hold {
                let _ = hold.wait_for(|done| *done).await;
            }
        });
        rx.recv_timeout(Duration::from_secs(5)).unwrap()
    }

    /// Wait (at most 5 s) until no counted future is running on any shard.
    fn settle(shards: &Shards) {
        let until = Instant::now() + Duration::from_secs(5);
        while shards
            .shards
            .iter()
            .any(|s| s.running.load(Ordering::Relaxed) > 0)
        {
            assert!(Instant::now() < until, "futures still counted as running");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A future goes to the first shard with the fewest running, each runs on its shard's
    /// thread, and stopping waits until every task still on a shard has been dropped.
    #[test]
    fn spawns_on_the_least_busy_shard_and_stop_drops_every_task() {
        let (shards, mut threads) = Shards::start("kvx-test-shard", 3).unwrap();
        // One at a time: always the first shard.
        let alone = thread_of(&shards, None);
        settle(&shards);
        assert_eq!(thread_of(&shards, None), alone);
        assert_ne!(alone, std::thread::current().id());
        settle(&shards);
        // Three held at once: one per shard; the fourth shares the first's.
        let (release, hold) = watch::channel(false);
        let held: Vec<_> = (0..4)
            .map(|_| thread_of(&shards, Some(hold.clone())))
            .collect();
        assert_eq!(held[0], alone);
        assert_eq!(
            held[..3].iter().collect::<HashSet<_>>().len(),
            3,
            "{held:?}"
        );
        assert_eq!(held[3], alone);
        release.send(true).unwrap();
        settle(&shards);
        assert_eq!(
            thread_of(&shards, None),
            alone,
            "counts drop when futures end"
        );

        // A task that never finishes holds a guard; stopping drops it.
        let guard = Arc::new(());
        let held = guard.clone();
        shards.spawn(async move {
            let _held = held;
            std::future::pending::<()>().await;
        });
        assert_eq!(Arc::strong_count(&guard), 2);
        assert!(threads.stop(Duration::from_secs(5)));
        assert_eq!(Arc::strong_count(&guard), 1, "the pending task was dropped");

        // Spawning after the stop drops the future without running it.
        let late = guard.clone();
        shards.spawn(async move {
            let _late = late;
            panic!("a future spawned after the stop ran");
        });
        assert_eq!(Arc::strong_count(&guard), 1);
    }
}
