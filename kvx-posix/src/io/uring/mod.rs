//! The io_uring engine: one thread per ring owns the ring, takes new jobs from two bounded
//! channels (loads and stores; removes) and reaps completions. A read of an eventfd is always
//! posted on the ring, so a submitter wakes the thread by writing the eventfd.
//!
//! Every file syscall (open, statx, readv, writev, fdatasync, close, rename, unlink, mkdir) is a
//! ring op with `IOSQE_ASYNC`: the kernel hands it to an io-wq worker at once instead of trying
//! it inline inside `io_uring_enter`, where an op on a stuck FUSE or NFS mount would block the
//! ring thread. No syscall that can touch a mount runs on the caller's thread or on the ring
//! thread.
//!
//! A load or store in flight whose op is cancelled or past its deadline is written off: it stops
//! counting against the ring's queue depth (so a healthy root sharing the ring keeps going), but
//! it keeps its slot, and so its buffers, until its CQE arrives. What can be in the kernel at
//! once is bounded: `queue_depth + max_stuck` loads and stores, [`MAINTENANCE_DEPTH`] removes,
//! `queue_depth` detached closes and the eventfd read; the submission and completion queues
//! are sized for all of it, and a full submission queue is handed to the kernel (reaping
//! completions when the kernel asks) rather than spun on.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError, TrySendError};
use io_uring::{IoUring, opcode, squeue, types};

use super::fault::{Faults, Hold};
use super::{EngineCounters, IoEngine, MAINTENANCE_DEPTH, MAINTENANCE_QUEUE, Refused, Sink};
use crate::error::PosixError;
use crate::job::{BlockJob, Next, Syscall};

/// user_data of the eventfd read; jobs use their slot + 1.
const WAKE: u64 = 0;
/// user_data of a detached close (the last op of a load; its result is not needed).
const DETACHED: u64 = u64::MAX;
/// Longest the ring thread sleeps without looking for overdue ops.
const IDLE_WAIT: Duration = Duration::from_millis(50);

struct Ring {
    tx: Sender<Box<BlockJob>>,
    maintenance_tx: Sender<Box<BlockJob>>,
    efd: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
}

/// The io_uring engine.
pub(crate) struct UringEngine {
    rings: Vec<Ring>,
    next: AtomicUsize,
    counters: Arc<EngineCounters>,
    qd: usize,
    capacity: usize,
}

fn wake(efd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a local u64 to an eventfd we own; an eventfd write only
    // blocks when the counter would overflow, which 1 per submission cannot reach.
    let r = unsafe { libc::write(efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    if r < 0 {
        tracing::error!(error = %std::io::Error::last_os_error(), "uring: cannot wake the ring thread");
    }
}

/// Entries the queues need for `qd` loads and stores and `max_stuck` written-off ones.
pub(crate) fn ring_entries(qd: usize, max_stuck: usize) -> usize {
    // Loads and stores (live and written off), removes, detached closes, the eventfd read.
    qd + max_stuck + MAINTENANCE_DEPTH + qd + 1
}

impl UringEngine {
    /// Start `rings` ring threads, each with `queue_depth` loads and stores in flight and
    /// `max_queued` waiting; `max_stuck` sizes the queues and the io-wq worker limit so
    /// written-off ops cannot starve new ones.
    pub(crate) fn new(
        rings: usize,
        queue_depth: usize,
        max_stuck: usize,
        max_queued: usize,
        sink: Arc<Sink>,
        faults: Option<Arc<Faults>>,
    ) -> Result<UringEngine, PosixError> {
        let counters = Arc::new(EngineCounters::default());
        let err = |msg: String| PosixError::Engine {
            engine: "uring",
            msg,
        };
        let qd = queue_depth.max(1);
        let per_ring = max_queued.max(1).div_ceil(rings.max(1));
        let mut out = Vec::with_capacity(rings);
        for i in 0..rings.max(1) {
            // SAFETY: plain eventfd creation; the fd is owned by the OwnedFd below.
            let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            if raw < 0 {
                return Err(err(format!("eventfd: {}", std::io::Error::last_os_error())));
            }
            // SAFETY: `raw` is a fresh fd that nothing else owns.
            let efd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
            let (tx, rx) = crossbeam_channel::bounded(per_ring);
            let (maintenance_tx, maintenance_rx) = crossbeam_channel::bounded(MAINTENANCE_QUEUE);
            let stop = Arc::new(AtomicBool::new(false));
            let (ready_tx, ready_rx) = mpsc::channel();
            let ctx = RingThread {
                rx,
                maintenance_rx,
                efd: efd.clone(),
                stop: stop.clone(),
                sink: sink.clone(),
                counters: counters.clone(),
                qd,
                max_stuck,
                faults: faults.clone(),
            };
            std::thread::Builder::new()
                .name(format!("kvx-uring-{i}"))
                .spawn(move || ctx.run(ready_tx))
                .map_err(|e| err(format!("cannot start the ring thread: {e}")))?;
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(err(e)),
                Err(_) => return Err(err("ring thread died while starting".into())),
            }
            out.push(Ring {
                tx,
                maintenance_tx,
                efd,
                stop,
            });
        }
        Ok(UringEngine {
            capacity: per_ring,
            rings: out,
            next: AtomicUsize::new(0),
            counters,
            qd,
        })
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn submit(&self, job: Box<BlockJob>) -> Result<(), Refused> {
        let maintenance = job.is_maintenance();
        let counter = if maintenance {
            &self.counters.maintenance
        } else {
            &self.counters.in_flight
        };
        counter.fetch_add(1, Ordering::AcqRel);
        let n = self.rings.len();
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        let mut job = job;
        for k in 0..n {
            let ring = &self.rings[(first + k) % n];
            let tx = if maintenance {
                &ring.maintenance_tx
            } else {
                &ring.tx
            };
            match tx.try_send(job) {
                Ok(()) => {
                    wake(&ring.efd);
                    return Ok(());
                }
                Err(TrySendError::Full(j)) => job = j,
                Err(TrySendError::Disconnected(j)) => {
                    counter.fetch_sub(1, Ordering::AcqRel);
                    return Err(Refused {
                        job: j,
                        reason: "the ring thread stopped".into(),
                    });
                }
            }
        }
        counter.fetch_sub(1, Ordering::AcqRel);
        Err(Refused {
            job,
            reason: format!(
                "busy: uring {} queue is full",
                if maintenance { "maintenance" } else { "job" }
            ),
        })
    }

    fn room(&self) -> usize {
        self.rings
            .iter()
            .map(|r| self.capacity.saturating_sub(r.tx.len()))
            .sum()
    }

    fn write_off_overdue(&self) {
        for r in &self.rings {
            wake(&r.efd);
        }
    }

    fn counters(&self) -> &EngineCounters {
        &self.counters
    }

    fn target(&self) -> usize {
        self.qd * self.rings.len()
    }

    fn queued(&self) -> usize {
        self.rings.iter().map(|r| r.tx.len()).sum()
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // Each ring thread drains what it holds and exits once no op of it is in the kernel;
        // it owns the buffers until then. Nothing here waits for a stuck mount.
        for r in &self.rings {
            r.stop.store(true, Ordering::Release);
            wake(&r.efd);
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Lane {
    Io,
    WrittenOff,
    Maintenance,
}

struct Slot {
    job: Box<BlockJob>,
    lane: Lane,
}

struct RingThread {
    rx: Receiver<Box<BlockJob>>,
    maintenance_rx: Receiver<Box<BlockJob>>,
    efd: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    sink: Arc<Sink>,
    counters: Arc<EngineCounters>,
    qd: usize,
    max_stuck: usize,
    faults: Option<Arc<Faults>>,
}

struct State {
    ring: IoUring,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// Loads and stores in the kernel, not written off.
    active: usize,
    /// Written off, still in the kernel.
    stuck: usize,
    /// Removes in the kernel.
    maintenance: usize,
    /// Detached closes still in the ring.
    detached: usize,
    /// What this ring last added to the engine's `workers`.
    workers: usize,
    done: Vec<Box<BlockJob>>,
    /// Completions reaped while making room in the submission queue, not yet processed.
    backlog: Vec<(u64, i32)>,
    /// Completions a fault holds back.
    held: Vec<(u64, i32, Hold)>,
    wake_buf: Box<u64>,
}

fn entry(call: &Syscall) -> squeue::Entry {
    let cwd = types::Fd(libc::AT_FDCWD);
    let e = match *call {
        Syscall::Mkdir { path } => opcode::MkDirAt::new(cwd, path).mode(0o755).build(),
        Syscall::Open { path, flags, mode } => opcode::OpenAt::new(cwd, path)
            .flags(flags)
            .mode(mode)
            .build(),
        Syscall::Readv { fd, iov, n } => opcode::Readv::new(types::Fd(fd), iov, n).build(),
        Syscall::Writev { fd, iov, n } => opcode::Writev::new(types::Fd(fd), iov, n).build(),
        Syscall::Statx { fd, buf } => {
            opcode::Statx::new(types::Fd(fd), c"".as_ptr(), buf.cast::<types::statx>())
                .flags(libc::AT_EMPTY_PATH)
                .mask(libc::STATX_SIZE)
                .build()
        }
        Syscall::Fdatasync { fd } => opcode::Fsync::new(types::Fd(fd))
            .flags(types::FsyncFlags::DATASYNC)
            .build(),
        Syscall::Close { fd } => opcode::Close::new(types::Fd(fd)).build(),
        Syscall::Rename {
            from,
            to,
            noreplace,
        } => opcode::RenameAt::new(cwd, from, cwd, to)
            .flags(if noreplace { libc::RENAME_NOREPLACE } else { 0 })
            .build(),
        Syscall::Unlink { path } => opcode::UnlinkAt::new(cwd, path).build(),
    };
    e.flags(squeue::Flags::ASYNC)
}

impl State {
    /// Queue an entry; a full submission queue is handed to the kernel first, and completions
    /// are reaped into the backlog when the kernel refuses more (its completion queue full).
    fn push(&mut self, e: &squeue::Entry) {
        loop {
            // SAFETY: every entry's pointers point into a job held in `slots` (or into
            // `wake_buf`), which stays in place until the entry's CQE is reaped.
            let pushed = unsafe { self.ring.submission().push(e) };
            if pushed.is_ok() {
                return;
            }
            match self.ring.submit() {
                Ok(_) => {}
                Err(err) => {
                    if err.raw_os_error() != Some(libc::EBUSY) {
                        tracing::error!(error = %err, "uring: submit failed while the SQ was full");
                    }
                    self.reap();
                }
            }
        }
    }

    fn reap(&mut self) {
        let cqes = self.ring.completion().map(|c| (c.user_data(), c.result()));
        self.backlog.extend(cqes);
    }

    fn arm_wake(&mut self, efd: &OwnedFd) {
        let ptr: *mut u64 = &mut *self.wake_buf;
        let e = opcode::Read::new(types::Fd(efd.as_raw_fd()), ptr.cast(), 8)
            .build()
            .user_data(WAKE);
        self.push(&e);
    }

    /// Start a job; true when it went into the ring.
    fn start(&mut self, mut job: Box<BlockJob>, lane: Lane) -> bool {
        match job.start() {
            Next::Done => {
                self.done.push(job);
                false
            }
            Next::Call(call) => {
                let slot = self.free.pop().unwrap_or_else(|| {
                    self.slots.push(None);
                    self.slots.len() - 1
                });
                let e = entry(&call).user_data(slot as u64 + 1);
                self.slots[slot] = Some(Slot { job, lane });
                self.push(&e);
                true
            }
        }
    }

    fn in_kernel(&self) -> bool {
        self.free.len() != self.slots.len() || self.detached != 0
    }
}

impl RingThread {
    fn run(self, ready: mpsc::Sender<Result<(), String>>) {
        let want = ring_entries(self.qd, self.max_stuck);
        let entries = want.next_power_of_two().clamp(8, 32768) as u32;
        let cq = (want.next_power_of_two() * 2).clamp(16, 65536) as u32;
        let ring = match IoUring::builder().setup_cqsize(cq).build(entries) {
            Ok(r) => r,
            Err(e) => {
                let _ = ready.send(Err(format!("io_uring_setup({entries}, cq {cq}): {e}")));
                return;
            }
        };
        // Bounded io-wq workers run the file ops; allow enough that `max_stuck` stuck ones
        // cannot starve a full queue depth of healthy ones.
        let workers = (self.qd + self.max_stuck + MAINTENANCE_DEPTH).min(u32::MAX as usize) as u32;
        let mut max = [workers, workers];
        if let Err(e) = ring.submitter().register_iowq_max_workers(&mut max) {
            tracing::warn!(error = %e, "uring: cannot raise the io-wq worker limit");
        }
        let mut st = State {
            ring,
            slots: Vec::new(),
            free: Vec::new(),
            active: 0,
            stuck: 0,
            maintenance: 0,
            detached: 0,
            workers: 0,
            done: Vec::new(),
            backlog: Vec::new(),
            held: Vec::new(),
            wake_buf: Box::new(0),
        };
        st.arm_wake(&self.efd);
        self.publish_workers(&mut st);
        let _ = ready.send(Ok(()));
        let (mut closed, mut closed_maintenance) = (false, false);
        loop {
            self.write_off(&mut st);
            while st.active < self.qd && st.active + st.stuck < self.qd + self.max_stuck && !closed
            {
                match self.rx.try_recv() {
                    Ok(job) => {
                        if st.start(job, Lane::Io) {
                            st.active += 1;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => closed = true,
                }
            }
            while st.maintenance < MAINTENANCE_DEPTH && !closed_maintenance {
                match self.maintenance_rx.try_recv() {
                    Ok(job) => {
                        if st.start(job, Lane::Maintenance) {
                            st.maintenance += 1;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => closed_maintenance = true,
                }
            }
            self.flush(&mut st);
            self.publish_workers(&mut st);
            let stopping = (closed && closed_maintenance) || self.stop.load(Ordering::Acquire);
            if stopping
                && !st.in_kernel()
                && st.held.is_empty()
                && self.rx.is_empty()
                && self.maintenance_rx.is_empty()
            {
                break;
            }
            if st.backlog.is_empty() {
                let wait = if st.held.is_empty() {
                    IDLE_WAIT
                } else {
                    Duration::from_millis(1)
                };
                let ts = types::Timespec::from(wait);
                let args = types::SubmitArgs::new().timespec(&ts);
                let r = if st.ring.params().is_feature_ext_arg() {
                    st.ring.submitter().submit_with_args(1, &args)
                } else {
                    // Kernels before 5.11 cannot time the wait: every submit and cancel
                    // wakes the ring through the eventfd instead.
                    st.ring.submit_and_wait(1)
                };
                match r {
                    Ok(_) => {}
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::EINTR | libc::EBUSY | libc::ETIME)
                        ) => {}
                    Err(e) => {
                        tracing::error!(error = %e, "uring: io_uring_enter failed");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
            st.reap();
            let mut cqes = std::mem::take(&mut st.backlog);
            if !st.held.is_empty() {
                let now = Instant::now();
                let f = self.faults.as_deref();
                let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut st.held)
                    .into_iter()
                    .partition(|(_, _, h)| f.is_none_or(|f| f.is_due(*h, now)));
                st.held = keep;
                for (ud, res, _) in due {
                    if let Some(f) = f {
                        f.release();
                    }
                    self.complete(&mut st, ud, res);
                }
            }
            for (ud, res) in cqes.drain(..) {
                self.on_cqe(&mut st, ud, res);
            }
        }
        self.flush(&mut st);
        // The eventfd read is still posted: the ring's teardown cancels it asynchronously, so
        // its 8-byte target is leaked rather than freed under it.
        let State { ring, wake_buf, .. } = st;
        drop(ring);
        std::mem::forget(wake_buf);
    }

    fn on_cqe(&self, st: &mut State, ud: u64, res: i32) {
        if ud == WAKE {
            st.arm_wake(&self.efd);
            return;
        }
        if ud == DETACHED {
            if res < 0 {
                tracing::debug!(res, "uring: close after a load failed");
            }
            st.detached -= 1;
            return;
        }
        if let Some(f) = &self.faults {
            let kind = st
                .slots
                .get((ud - 1) as usize)
                .and_then(Option::as_ref)
                .and_then(|s| s.job.pending_late());
            let h = f.hold(kind);
            if h != Hold::No {
                st.held.push((ud, res, h));
                return;
            }
        }
        self.complete(st, ud, res);
    }

    fn complete(&self, st: &mut State, ud: u64, res: i32) {
        let slot = (ud - 1) as usize;
        let Some(mut s) = st.slots.get_mut(slot).and_then(Option::take) else {
            tracing::error!(slot, "uring: completion for an empty slot");
            return;
        };
        let mut next = s.job.advance(res as i64);
        if let Next::Call(Syscall::Close { fd }) = next
            && s.job.is_final_close()
            && st.detached < self.qd
        {
            // The load is complete: close without waiting, so the buffer goes back one ring
            // round trip earlier. The close touches no job memory.
            st.push(&entry(&Syscall::Close { fd }).user_data(DETACHED));
            st.detached += 1;
            next = s.job.advance(0);
        }
        match next {
            Next::Call(call) => {
                let e = entry(&call).user_data(ud);
                st.slots[slot] = Some(s);
                st.push(&e);
            }
            Next::Done => {
                st.free.push(slot);
                match s.lane {
                    Lane::Io => st.active -= 1,
                    Lane::WrittenOff => {
                        st.stuck -= 1;
                        self.counters.written_off.fetch_sub(1, Ordering::AcqRel);
                    }
                    Lane::Maintenance => st.maintenance -= 1,
                }
                st.done.push(s.job);
            }
        }
    }

    fn write_off(&self, st: &mut State) {
        let now = Instant::now();
        let mut n = 0;
        for s in st.slots.iter_mut().flatten() {
            if s.lane == Lane::Io && s.job.is_overdue(now) {
                s.lane = Lane::WrittenOff;
                n += 1;
            }
        }
        if n > 0 {
            st.active -= n;
            st.stuck += n;
            self.counters.written_off.fetch_add(n, Ordering::AcqRel);
            tracing::warn!(
                n,
                stuck = self.counters.written_off.load(Ordering::Acquire),
                "uring: ops written off (cancelled or past their deadline, still in the kernel)"
            );
        }
    }

    /// Loads and stores this ring can start now: the queue depth, less what written-off ops
    /// beyond `max_stuck` take.
    fn publish_workers(&self, st: &mut State) {
        let now = self
            .qd
            .min((self.qd + self.max_stuck).saturating_sub(st.stuck));
        if now > st.workers {
            self.counters
                .workers
                .fetch_add(now - st.workers, Ordering::AcqRel);
        } else if now < st.workers {
            self.counters
                .workers
                .fetch_sub(st.workers - now, Ordering::AcqRel);
        }
        st.workers = now;
    }

    fn flush(&self, st: &mut State) {
        if st.done.is_empty() {
            return;
        }
        let (mut io, mut maintenance) = (0, 0);
        for j in &st.done {
            if j.is_maintenance() {
                maintenance += 1;
            } else {
                io += 1;
            }
        }
        self.counters.in_flight.fetch_sub(io, Ordering::AcqRel);
        self.counters
            .maintenance
            .fetch_sub(maintenance, Ordering::AcqRel);
        self.sink.push(st.done.drain(..));
    }
}
