//! The io_uring engine: one thread per ring owns the ring, takes new jobs from a channel and
//! reaps completions with `submit_and_wait`. A read of an eventfd is always posted on the ring,
//! so a submitter wakes the thread by writing the eventfd.
//!
//! Every file syscall (open, statx, readv, writev, fdatasync, close, rename, unlink, mkdir) is a ring op
//! with `IOSQE_ASYNC`: the kernel hands it to an io-wq worker at once instead of trying it inline
//! inside `io_uring_enter`, where an op on a stuck FUSE or NFS mount would block the ring thread.
//! No syscall that can touch a mount runs on the caller's thread or on the ring thread.
//!
//! A job in flight whose op is cancelled or past its deadline is written off: it stops counting
//! against the ring's queue depth (so a healthy root sharing the ring keeps going), but it keeps
//! its slot, and so its buffers, until its CQE arrives.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use io_uring::{IoUring, opcode, squeue, types};

use super::{EngineCounters, IoEngine, Refused, Sink};
use crate::error::PosixError;
use crate::job::{BlockJob, Next, Syscall};

/// user_data of the eventfd read; jobs use their slot + 1.
const WAKE: u64 = 0;
/// user_data of a detached close (the last op of a load; its result is not needed).
const DETACHED: u64 = u64::MAX;

struct Ring {
    tx: Sender<Box<BlockJob>>,
    efd: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
}

/// The io_uring engine.
pub struct UringEngine {
    rings: Vec<Ring>,
    next: AtomicUsize,
    counters: Arc<EngineCounters>,
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

impl UringEngine {
    /// Start `rings` ring threads, each with `queue_depth` jobs in flight; `max_stuck` sizes the
    /// io-wq worker limit so written-off ops cannot starve new ones.
    pub fn new(
        rings: usize,
        queue_depth: usize,
        max_stuck: usize,
        sink: Arc<Sink>,
    ) -> Result<UringEngine, PosixError> {
        let counters = Arc::new(EngineCounters::default());
        let err = |msg: String| PosixError::Engine {
            engine: "uring",
            msg,
        };
        let mut out = Vec::with_capacity(rings);
        for i in 0..rings.max(1) {
            // SAFETY: plain eventfd creation; the fd is owned by the OwnedFd below.
            let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            if raw < 0 {
                return Err(err(format!("eventfd: {}", std::io::Error::last_os_error())));
            }
            // SAFETY: `raw` is a fresh fd that nothing else owns.
            let efd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
            let (tx, rx) = crossbeam_channel::unbounded();
            let stop = Arc::new(AtomicBool::new(false));
            let (ready_tx, ready_rx) = mpsc::channel();
            let ctx = RingThread {
                rx,
                efd: efd.clone(),
                stop: stop.clone(),
                sink: sink.clone(),
                counters: counters.clone(),
                qd: queue_depth.max(1),
                max_stuck,
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
            out.push(Ring { tx, efd, stop });
        }
        Ok(UringEngine {
            rings: out,
            next: AtomicUsize::new(0),
            counters,
        })
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn submit(&self, job: Box<BlockJob>) -> Result<(), Refused> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.rings.len();
        let ring = &self.rings[i];
        self.counters.in_flight.fetch_add(1, Ordering::AcqRel);
        match ring.tx.send(job) {
            Ok(()) => {
                wake(&ring.efd);
                Ok(())
            }
            Err(e) => {
                self.counters.in_flight.fetch_sub(1, Ordering::AcqRel);
                Err(Refused {
                    job: e.0,
                    reason: "the ring thread stopped".into(),
                })
            }
        }
    }

    fn kick(&self) {
        for r in &self.rings {
            wake(&r.efd);
        }
    }

    fn counters(&self) -> &EngineCounters {
        &self.counters
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

struct Slot {
    job: Box<BlockJob>,
    written_off: bool,
}

struct RingThread {
    rx: Receiver<Box<BlockJob>>,
    efd: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    sink: Arc<Sink>,
    counters: Arc<EngineCounters>,
    qd: usize,
    max_stuck: usize,
}

struct State {
    ring: IoUring,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    active: usize,
    /// Detached closes still in the ring.
    detached: usize,
    done: Vec<Box<BlockJob>>,
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
        Syscall::Rename { from, to } => opcode::RenameAt::new(cwd, from, cwd, to).build(),
        Syscall::Unlink { path } => opcode::UnlinkAt::new(cwd, path).build(),
    };
    e.flags(squeue::Flags::ASYNC)
}

impl State {
    fn push(&mut self, e: &squeue::Entry) {
        loop {
            // SAFETY: every entry's pointers point into a job held in `slots` (or into
            // `wake_buf`), which stays in place until the entry's CQE is reaped.
            let pushed = unsafe { self.ring.submission().push(e) };
            if pushed.is_ok() {
                return;
            }
            if let Err(err) = self.ring.submit() {
                tracing::error!(error = %err, "uring: submit failed while the SQ was full");
            }
        }
    }

    fn arm_wake(&mut self, efd: &OwnedFd) {
        let ptr: *mut u64 = &mut *self.wake_buf;
        let e = opcode::Read::new(types::Fd(efd.as_raw_fd()), ptr.cast(), 8)
            .build()
            .user_data(WAKE);
        self.push(&e);
    }

    fn start(&mut self, mut job: Box<BlockJob>) -> bool {
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
                self.slots[slot] = Some(Slot {
                    job,
                    written_off: false,
                });
                self.push(&e);
                true
            }
        }
    }
}

impl RingThread {
    fn run(self, ready: mpsc::Sender<Result<(), String>>) {
        let entries = (self.qd + 2).next_power_of_two().max(8) as u32;
        let ring = match IoUring::builder().build(entries) {
            Ok(r) => r,
            Err(e) => {
                let _ = ready.send(Err(format!("io_uring_setup({entries}): {e}")));
                return;
            }
        };
        // Bounded io-wq workers run the file ops; allow enough that `max_stuck` stuck ones
        // cannot starve a full queue depth of healthy ones.
        let workers = (self.qd + self.max_stuck).min(u32::MAX as usize) as u32;
        let mut max = [workers, workers];
        if let Err(e) = ring.submitter().register_iowq_max_workers(&mut max) {
            tracing::warn!(error = %e, "uring: cannot raise the io-wq worker limit");
        }
        let mut st = State {
            ring,
            slots: Vec::new(),
            free: Vec::new(),
            active: 0,
            detached: 0,
            done: Vec::new(),
            wake_buf: Box::new(0),
        };
        st.arm_wake(&self.efd);
        let _ = ready.send(Ok(()));
        let mut closed = false;
        loop {
            self.write_off(&mut st);
            while st.active < self.qd && !closed {
                match self.rx.try_recv() {
                    Ok(job) => {
                        if st.start(job) {
                            st.active += 1;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => closed = true,
                }
            }
            self.flush(&mut st);
            let stopping = closed || self.stop.load(Ordering::Acquire);
            if stopping && st.free.len() == st.slots.len() && st.detached == 0 && self.rx.is_empty()
            {
                break;
            }
            match st.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    tracing::error!(error = %e, "uring: io_uring_enter failed");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            let cqes: Vec<(u64, i32)> = st
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (ud, res) in cqes {
                if ud == WAKE {
                    st.arm_wake(&self.efd);
                    continue;
                }
                if ud == DETACHED {
                    if res < 0 {
                        tracing::debug!(res, "uring: close after a load failed");
                    }
                    st.detached -= 1;
                    continue;
                }
                let slot = (ud - 1) as usize;
                let Some(mut s) = st.slots.get_mut(slot).and_then(Option::take) else {
                    tracing::error!(slot, "uring: completion for an empty slot");
                    continue;
                };
                let mut next = s.job.advance(res as i64);
                if let Next::Call(Syscall::Close { fd }) = next
                    && s.job.is_final_close()
                {
                    // The load is complete: close without waiting, so the buffer goes back
                    // one ring round trip earlier. The close touches no job memory.
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
                        if s.written_off {
                            self.counters.written_off.fetch_sub(1, Ordering::AcqRel);
                        } else {
                            st.active -= 1;
                        }
                        st.done.push(s.job);
                    }
                }
            }
        }
        self.flush(&mut st);
        // The eventfd read is still posted: the ring's teardown cancels it asynchronously, so
        // its 8-byte target is leaked rather than freed under it.
        let State { ring, wake_buf, .. } = st;
        drop(ring);
        std::mem::forget(wake_buf);
    }

    fn write_off(&self, st: &mut State) {
        let now = Instant::now();
        let mut n = 0;
        for s in st.slots.iter_mut().flatten() {
            if !s.written_off && s.job.is_overdue(now) {
                s.written_off = true;
                n += 1;
            }
        }
        if n > 0 {
            st.active -= n;
            self.counters.written_off.fetch_add(n, Ordering::AcqRel);
            tracing::warn!(
                n,
                stuck = self.counters.written_off(),
                "uring: ops written off (cancelled or past their deadline, still in the kernel)"
            );
        }
    }

    fn flush(&self, st: &mut State) {
        if !st.done.is_empty() {
            let n = st.done.len();
            self.counters.in_flight.fetch_sub(n, Ordering::AcqRel);
            self.sink.push(st.done.drain(..));
        }
    }
}
