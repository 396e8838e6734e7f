//! The ring thread of the io_uring engine: owns one ring, turns jobs into ring ops, reaps
//! completions, writes off overdue ops and keeps each job's buffers until its CQE arrives.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};
use io_uring::{IoUring, opcode, squeue, types};

#[cfg(any(test, feature = "faults"))]
use super::super::fault::{Faults, Hold};
use super::super::{EngineCounters, MAINTENANCE_DEPTH, Outbox};
use super::{DETACHED, IDLE_WAIT, WAKE, ring_entries};
use crate::job::{BlockJob, Next, Syscall};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Lane {
    Io,
    /// A store on a local block file system whose data is written, closing and renaming its
    /// file: it leaves `active`, so the next load or store starts while it finishes.
    Closing,
    WrittenOff,
    Maintenance,
}

struct Slot {
    job: Box<BlockJob>,
    lane: Lane,
}

pub(super) struct RingThread {
    pub(super) rx: Receiver<Box<BlockJob>>,
    pub(super) maintenance_rx: Receiver<Box<BlockJob>>,
    pub(super) efd: Arc<OwnedFd>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) outbox: Arc<Outbox>,
    pub(super) counters: Arc<EngineCounters>,
    pub(super) qd: usize,
    pub(super) max_stuck: usize,
    #[cfg(any(test, feature = "faults"))]
    pub(super) faults: Option<Arc<Faults>>,
}

struct State {
    ring: IoUring,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// Loads and stores in the kernel, not written off, not closing.
    active: usize,
    /// Stores in [`Lane::Closing`] (at most the queue depth).
    closing: usize,
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
    #[cfg(any(test, feature = "faults"))]
    held: Vec<(u64, i32, Hold)>,
    wake_buf: Box<u64>,
}

/// The ring op of `call`. A job on a root with inline I/O is issued inline (the kernel hands an
/// op that would block to its workers); any other goes straight to the kernel's workers
/// (IOSQE_ASYNC), so a stuck mount never blocks this thread.
fn entry(call: &Syscall, inline: bool) -> squeue::Entry {
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
    if inline {
        e
    } else {
        e.flags(squeue::Flags::ASYNC)
    }
}

impl State {
    /// No completion is held back by a fault (always so without the `faults` feature).
    fn nothing_held(&self) -> bool {
        #[cfg(any(test, feature = "faults"))]
        return self.held.is_empty();
        #[cfg(not(any(test, feature = "faults")))]
        true
    }

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
                let e = entry(&call, job.inline()).user_data(slot as u64 + 1);
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
    pub(super) fn run(self, ready: mpsc::Sender<Result<(), String>>) {
        let want = ring_entries(self.qd, self.max_stuck);
        let entries = want.next_power_of_two().clamp(8, 32768) as u32;
        let cq = (want.next_power_of_two() * 2).clamp(16, 65536) as u32;
        // Only this thread submits, and completions are posted when it waits for them (not by
        // interrupting it): the setup for one thread owning a ring. Kernels before 6.1 lack
        // these flags and get a plain ring.
        let tuned = IoUring::builder()
            .setup_cqsize(cq)
            .setup_coop_taskrun()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(entries);
        let ring = match tuned.or_else(|_| IoUring::builder().setup_cqsize(cq).build(entries)) {
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
            closing: 0,
            stuck: 0,
            maintenance: 0,
            detached: 0,
            workers: 0,
            done: Vec::new(),
            backlog: Vec::new(),
            #[cfg(any(test, feature = "faults"))]
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
                && st.nothing_held()
                && self.rx.is_empty()
                && self.maintenance_rx.is_empty()
            {
                break;
            }
            if st.backlog.is_empty() {
                let wait = if st.nothing_held() {
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
            #[cfg(any(test, feature = "faults"))]
            self.complete_due(&mut st);
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
        #[cfg(any(test, feature = "faults"))]
        if self.hold(st, ud, res) {
            return;
        }
        self.complete(st, ud, res);
    }

    /// A fault holds this completion back: keep it for [`RingThread::complete_due`].
    #[cfg(any(test, feature = "faults"))]
    fn hold(&self, st: &mut State, ud: u64, res: i32) -> bool {
        let Some(f) = &self.faults else {
            return false;
        };
        let kind = st
            .slots
            .get((ud - 1) as usize)
            .and_then(Option::as_ref)
            .and_then(|s| s.job.pending_late());
        let h = f.hold(kind);
        if h != Hold::No {
            st.held.push((ud, res, h));
        }
        h != Hold::No
    }

    /// Complete the held-back completions whose fault let go of them.
    #[cfg(any(test, feature = "faults"))]
    fn complete_due(&self, st: &mut State) {
        if st.held.is_empty() {
            return;
        }
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
            self.complete(st, ud, res);
        }
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
            st.push(&entry(&Syscall::Close { fd }, s.job.inline()).user_data(DETACHED));
            st.detached += 1;
            next = s.job.advance(0);
        }
        if s.lane == Lane::Io
            && s.job.inline()
            && s.job.is_closing_store()
            && st.closing < self.qd
            && matches!(next, Next::Call(_))
        {
            // Its write is done: on a local file system the close and rename never wait for
            // the device (a frozen FUSE or network mount keeps every op in `active`).
            s.lane = Lane::Closing;
            st.active -= 1;
            st.closing += 1;
        }
        match next {
            Next::Call(call) => {
                let e = entry(&call, s.job.inline()).user_data(ud);
                st.slots[slot] = Some(s);
                st.push(&e);
            }
            Next::Done => {
                st.free.push(slot);
                match s.lane {
                    Lane::Io => st.active -= 1,
                    Lane::Closing => st.closing -= 1,
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
        let (mut io, mut closing) = (0, 0);
        for s in st.slots.iter_mut().flatten() {
            if matches!(s.lane, Lane::Io | Lane::Closing) && s.job.is_overdue(now) {
                if s.lane == Lane::Io {
                    io += 1;
                } else {
                    closing += 1;
                }
                s.lane = Lane::WrittenOff;
            }
        }
        let n = io + closing;
        if n > 0 {
            st.active -= io;
            st.closing -= closing;
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
        self.outbox.push(st.done.drain(..));
        // After the push: once the count reads zero, every remove can be absorbed.
        self.counters
            .maintenance
            .fetch_sub(maintenance, Ordering::AcqRel);
    }
}
