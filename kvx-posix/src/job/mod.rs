//! One block's file operation as a state machine of syscalls, shared by all engines.
//!
//! A job owns everything the kernel touches while a syscall of it is in flight: the block's
//! buffer, its header buffer, the iovecs and the path strings. An engine keeps the job (boxed,
//! so its address is stable) until that syscall returns, then calls [`BlockJob::advance`] with
//! the result and runs whatever comes next. The psync engine runs the syscalls on a worker
//! thread; the uring engine turns them into ring ops.
//!
//! A job is its [`JobCore`] (what every machine and the engines share) and the [`Machine`] it
//! runs, one per [`FileOp`]: [`load`], [`store`], [`remove`] (a store that must undo a late
//! rename runs the remove machine inside its own, guarded by its write nonce) and
//! [`header_probe`].

mod header_probe;
mod load;
mod remove;
mod store;
pub(crate) mod sys;
mod syscall;

use std::ffi::CStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvx_core::{AlignedBuf, BlockError, BlockKey, Buf, OpId};

use crate::format::HEADER_LEN;
use crate::paths::BlockPaths;

pub(crate) use syscall::{Next, Syscall};

/// What a job does to its block's file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FileOp {
    /// Read and verify a block into the job's owned buffer.
    Load,
    /// Write the job's buffer as a block.
    Store,
    /// Unlink a block file: maintenance (eviction, cleanup), with no deadline, never written off.
    Remove,
    /// Read a block file's header to learn whether the block is there: maintenance too (the
    /// caller times it; see `ProbeTable`).
    Probe,
}

/// The settings a job is created with.
#[derive(Debug, Clone)]
pub(crate) struct JobParams {
    /// Use O_DIRECT when the buffer allows it.
    pub(crate) direct: bool,
    /// The root is a local block file system: ops may be issued inline, and a load reads
    /// without a statx (see `PosixConfig::inline_io`).
    pub(crate) inline: bool,
    /// The payload checksum is not the ring thread's work: a store's is computed by the caller
    /// before the job is queued ([`BlockJob::compute_payload_crc`]), a load's checked on the
    /// verify lane after the job is done ([`BlockJob::verify_payload`]). Set for the uring
    /// engine, whose one thread per ring would otherwise checksum every block; psync's threads
    /// do it in parallel.
    pub(crate) crc_off_ring: bool,
    /// fdatasync before the rename.
    pub(crate) fdatasync: bool,
    /// The leaf directory may not exist yet: create it first.
    pub(crate) make_dirs: bool,
    /// The op's deadline (ignored by removes).
    pub(crate) deadline: Instant,
    /// Set when the op is cancelled.
    pub(crate) cancel: Arc<AtomicBool>,
    /// See `PosixConfig::visibility_margin`.
    pub(crate) margin: Duration,
    /// Store: the nonce written into the header. Remove: delete only a file with this nonce
    /// (`None`: any file this format version wrote, or a corrupt one).
    pub(crate) nonce: Option<u64>,
}

impl JobParams {
    /// Parameters of a remove: no deadline, no cancel.
    pub(crate) fn remove(nonce: Option<u64>) -> JobParams {
        JobParams {
            direct: false,
            inline: false,
            crc_off_ring: false,
            fdatasync: false,
            make_dirs: false,
            deadline: Instant::now(),
            cancel: Arc::new(AtomicBool::new(false)),
            margin: Duration::ZERO,
            nonce,
        }
    }
}

/// What every machine of a job works with, and what the store reads back when it is done.
pub(crate) struct JobCore {
    /// Op the block belongs to.
    pub(crate) op: OpId,
    /// Position of the block in the op.
    pub(crate) index: usize,
    /// Root the block lives on.
    pub(crate) root: usize,
    /// Block key.
    pub(crate) key: BlockKey,
    /// The block's buffer (none for a remove or a probe).
    pub(crate) buf: Option<Buf>,
    /// The verdict, once `advance` returned `Done`.
    pub(crate) result: Result<(), BlockError>,
    /// Bytes moved by the data transfer.
    pub(crate) bytes: usize,
    header: Option<AlignedBuf>,
    paths: BlockPaths,
    p: JobParams,
    /// A syscall of the job is in flight (its result is what `advance` expects).
    running: bool,
    fd: Option<i32>,
    iov: [libc::iovec; 3],
    iov_n: u32,
    /// Bytes the last read or write asked for (a remove: the header bytes it read).
    expect: usize,
    /// The verdict a machine reached before its last syscalls (a close, an unlink).
    verdict: Option<Result<(), BlockError>>,
}

/// The machine a job runs, with the state only that machine needs.
enum Machine {
    Load(load::Load),
    Store(store::Store),
    Remove(remove::Remove),
    Probe(header_probe::Probe),
}

/// One block's file operation (see the module docs).
pub(crate) struct BlockJob {
    /// What every machine shares.
    pub(crate) core: JobCore,
    machine: Machine,
}

// SAFETY: the raw pointers inside (`iov`) point into the job's own heap buffers; the job is
// moved between threads only while no syscall of it is in flight.
unsafe impl Send for BlockJob {}

/// True when `res` says the file was replaced or removed by another node since its name was
/// looked up, as a distributed file system reports it: ESTALE (NFS, GlusterFS on lookup), or
/// ENOENT from a stat or read of a file already open (GlusterFS, whose bricks no longer hold
/// the open file's id once a rename replaced it). For a load that is a miss (the block as this
/// node knew it is gone), not a failing mount: it must not count against the root's breaker.
pub(crate) fn replaced(res: i64) -> bool {
    res == -(libc::ESTALE as i64) || res == -(libc::ENOENT as i64)
}

fn errno_name(res: i64) -> String {
    std::io::Error::from_raw_os_error((-res) as i32).to_string()
}

/// Which syscalls of a job a late-completion fault (`io::fault`) delays.
#[cfg(any(test, feature = "faults"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Late {
    /// A load's data read.
    Read,
    /// A store's rename into place.
    Rename,
}

/// Open flags `base`, close-on-exec, with O_DIRECT when `direct`.
fn open_flags(base: i32, direct: bool) -> i32 {
    let mut f = base | libc::O_CLOEXEC;
    if direct {
        f |= libc::O_DIRECT;
    }
    f
}

/// An all-zero `statx`, for a statx syscall to fill.
fn zeroed_statx() -> Box<libc::statx> {
    // SAFETY: statx is a plain C struct of integers; all-zero is a valid value.
    Box::new(unsafe { std::mem::zeroed() })
}

const EMPTY_IOV: libc::iovec = libc::iovec {
    iov_base: std::ptr::null_mut(),
    iov_len: 0,
};

impl JobCore {
    /// The error of a store or load whose op is past its deadline (given `margin` of slack
    /// before it) or cancelled (maintenance machines never ask).
    fn over(&self, margin: Duration) -> Option<BlockError> {
        if self.p.cancel.load(Ordering::Acquire) {
            return Some(BlockError::Cancelled);
        }
        if Instant::now() + margin >= self.p.deadline {
            return Some(BlockError::TimedOut);
        }
        None
    }

    /// Final path, for messages.
    fn block_path(&self) -> PathBuf {
        PathBuf::from(std::ffi::OsStr::from_bytes(self.paths.block.as_bytes()))
    }

    /// The fd an `open` of the block file returned, or the block's error (`NotFound` for a
    /// missing file).
    fn opened(&self, res: i64) -> Result<i32, BlockError> {
        if replaced(res) {
            return Err(BlockError::NotFound);
        }
        if res < 0 {
            let msg = format!("open {:?}: {}", self.block_path(), errno_name(res));
            return Err(BlockError::Io(msg));
        }
        Ok(res as i32)
    }

    fn done(&mut self, r: Result<(), BlockError>) -> Next {
        self.running = false;
        self.result = r;
        Next::Done
    }

    fn call(&mut self, s: Syscall) -> Next {
        self.running = true;
        Next::Call(s)
    }

    fn temp_ptr(&self) -> *const libc::c_char {
        self.paths
            .temp
            .as_deref()
            .map_or(std::ptr::null(), CStr::as_ptr)
    }

    /// The header buffer, allocated on first use.
    fn header(&mut self) -> Result<&mut AlignedBuf, BlockError> {
        if self.header.is_none() {
            self.header = Some(aligned_sector()?);
        }
        self.header
            .as_mut()
            .ok_or_else(|| BlockError::Io("no header buffer".into()))
    }

    /// Point the first iovec at the header buffer and read it from `fd`.
    fn read_header(&mut self, fd: i32) -> Result<Syscall, BlockError> {
        let ptr = self.header()?.as_mut_ptr();
        self.iov[0] = libc::iovec {
            iov_base: ptr.cast(),
            iov_len: HEADER_LEN,
        };
        self.iov_n = 1;
        Ok(Syscall::Readv {
            fd,
            iov: self.iov.as_ptr(),
            n: 1,
        })
    }
}

impl BlockJob {
    /// A new job. Its header buffer is allocated when it starts, so a queued job holds no
    /// more than its paths.
    pub(crate) fn new(
        op: OpId,
        index: usize,
        action: FileOp,
        key: BlockKey,
        buf: Option<Buf>,
        paths: BlockPaths,
        p: JobParams,
    ) -> BlockJob {
        let machine = match action {
            FileOp::Load => Machine::Load(load::Load::default()),
            FileOp::Store => Machine::Store(store::Store::default()),
            FileOp::Remove => Machine::Remove(remove::Remove::default()),
            FileOp::Probe => Machine::Probe(header_probe::Probe::default()),
        };
        BlockJob {
            core: JobCore {
                op,
                index,
                root: paths.root,
                key,
                buf,
                result: Err(BlockError::Io("job did not run".into())),
                bytes: 0,
                header: None,
                paths,
                p,
                running: false,
                fd: None,
                iov: [EMPTY_IOV; 3],
                iov_n: 0,
                expect: 0,
                verdict: None,
            },
            machine,
        }
    }

    /// What the job does to its block's file.
    pub(crate) fn action(&self) -> FileOp {
        match self.machine {
            Machine::Load(_) => FileOp::Load,
            Machine::Store(_) => FileOp::Store,
            Machine::Remove(_) => FileOp::Remove,
            Machine::Probe(_) => FileOp::Probe,
        }
    }

    /// The op's deadline.
    pub(crate) fn deadline(&self) -> Instant {
        self.core.p.deadline
    }

    /// A store with [`JobParams::crc_off_ring`]: compute the payload's checksum now, on the
    /// caller's thread.
    pub(crate) fn compute_payload_crc(&mut self) {
        if let Machine::Store(s) = &mut self.machine
            && self.core.p.crc_off_ring
        {
            s.payload_crc = self.core.buf.as_ref().map(|b| crc32c::crc32c(b.as_slice()));
        }
    }

    /// True for a finished load whose payload checksum is still to be checked.
    pub(crate) fn payload_unchecked(&self) -> bool {
        matches!(&self.machine, Machine::Load(l) if l.payload_unchecked)
    }

    /// Check a finished load's payload now (on the verify lane): a mismatch fails the block.
    pub(crate) fn verify_payload(&mut self) {
        if self.core.result.is_ok() {
            self.core.result = self.check_payload();
        }
    }

    /// A finished load whose payload checksum was left to the caller: check it now; a
    /// mismatch fails the block as corrupt.
    pub(crate) fn check_payload(&mut self) -> Result<(), BlockError> {
        let Machine::Load(l) = &mut self.machine else {
            return Ok(());
        };
        if !std::mem::take(&mut l.payload_unchecked) {
            return Ok(());
        }
        let c = &self.core;
        let path = c.block_path();
        let (Some(header), Some(buf)) = (c.header.as_ref(), c.buf.as_ref()) else {
            return Err(BlockError::Io("a load finished without its buffers".into()));
        };
        crate::format::check_payload(&path, header.as_slice(), buf.as_slice())
            .map_err(|e| e.to_block_error())
    }

    /// Whether the engine may issue this job's syscalls inline (see [`JobParams::inline`]).
    pub(crate) fn inline(&self) -> bool {
        self.core.p.inline
    }

    /// The nonce a store wrote into its header.
    pub(crate) fn nonce(&self) -> Option<u64> {
        self.core.p.nonce
    }

    /// True when the pending syscall is the close that ends a load: nothing depends on its
    /// result, so an engine may issue it and finish the job without waiting for it.
    pub(crate) fn is_final_close(&self) -> bool {
        matches!(&self.machine, Machine::Load(l) if l.step == Some(load::LoadStep::Close))
    }

    /// Write this store into the spare file `spare` instead of creating its temporary file.
    pub(crate) fn use_spare(&mut self, spare: std::ffi::CString) {
        self.core.paths.use_spare(spare);
    }

    /// The spare file of a store that never opened it (it ended before, or an engine refused
    /// it): untouched, so it can go back to the spares.
    pub(crate) fn take_unused_spare(&mut self) -> Option<std::ffi::CString> {
        match &self.machine {
            Machine::Store(s) if !s.spare_opened => self.core.paths.take_spare(),
            _ => None,
        }
    }

    /// Make this unguarded remove move a file of exactly `len` bytes to the spare name `spare`
    /// instead of unlinking it.
    pub(crate) fn recycle_into(&mut self, spare: std::ffi::CString, len: u64) {
        if let Machine::Remove(r) = &mut self.machine
            && self.core.p.nonce.is_none()
        {
            r.recycle = Some((spare, len));
        }
    }

    /// The spare name this remove was given, and whether it moved its file there.
    pub(crate) fn take_recycle(&mut self) -> Option<(std::ffi::CString, bool)> {
        let Machine::Remove(r) = &mut self.machine else {
            return None;
        };
        let moved = std::mem::take(&mut r.recycled);
        r.recycle.take().map(|(name, _)| (name, moved))
    }

    /// True when the job is a store whose data is written and that now only closes (and
    /// renames, or unlinks) its file: the rest touches no block device.
    pub(crate) fn is_closing_store(&self) -> bool {
        matches!(&self.machine, Machine::Store(s) if s.step == Some(store::StoreStep::CloseTemp))
    }

    /// A store that created its leaf directory.
    pub(crate) fn made_dirs(&self) -> bool {
        matches!(&self.machine, Machine::Store(s) if s.made_dirs)
    }

    /// A store whose rename landed too late and was removed again.
    pub(crate) fn undone(&self) -> bool {
        matches!(&self.machine, Machine::Store(s) if s.undone())
    }

    /// The length of the block file this store writes: the header, then the payload (rounded
    /// up to whole sectors with O_DIRECT); `None` for a job that is not a store.
    pub(crate) fn store_file_len(&self) -> Option<u64> {
        match &self.machine {
            Machine::Store(_) => store::file_len(&self.core),
            _ => None,
        }
    }

    /// The kind of the pending syscall, if a late-completion fault can target it.
    #[cfg(any(test, feature = "faults"))]
    pub(crate) fn pending_late(&self) -> Option<Late> {
        match &self.machine {
            Machine::Load(l) if l.step == Some(load::LoadStep::Read) => Some(Late::Read),
            Machine::Store(s) if s.step == Some(store::StoreStep::Rename) => Some(Late::Rename),
            _ => None,
        }
    }

    /// The op's cancel flag.
    pub(crate) fn cancel_flag(&self) -> Arc<AtomicBool> {
        self.core.p.cancel.clone()
    }

    /// True for maintenance (a remove or a probe): it has no deadline and is never written off.
    pub(crate) fn is_maintenance(&self) -> bool {
        matches!(self.machine, Machine::Remove(_) | Machine::Probe(_))
    }

    /// True once a load's or store's op was cancelled or its deadline passed (the job is
    /// written off if a syscall of it is still in the kernel). Never true for maintenance.
    pub(crate) fn is_overdue(&self, now: Instant) -> bool {
        !self.is_maintenance()
            && (self.core.p.cancel.load(Ordering::Acquire) || now >= self.core.p.deadline)
    }

    /// Final path, for messages.
    pub(crate) fn block_path(&self) -> PathBuf {
        self.core.block_path()
    }

    /// Finish the job without a syscall, as the noop engine does: a store or a remove
    /// succeeds, a load or a probe finds no file.
    pub(crate) fn complete_without_io(&mut self) {
        let r = match self.action() {
            FileOp::Store | FileOp::Remove => Ok(()),
            FileOp::Load | FileOp::Probe => Err(BlockError::NotFound),
        };
        self.core.done(r);
    }

    /// The first syscall.
    pub(crate) fn start(&mut self) -> Next {
        let c = &mut self.core;
        match &mut self.machine {
            Machine::Load(m) => m.start(c),
            Machine::Store(m) => m.start(c),
            Machine::Remove(m) => m.start(c),
            Machine::Probe(m) => m.start(c),
        }
    }

    /// Feed the result of the last syscall (`>= 0`, or `-errno`) and get the next one.
    pub(crate) fn advance(&mut self, res: i64) -> Next {
        let c = &mut self.core;
        if !c.running {
            return c.done(Err(BlockError::Io(
                "job advanced without a syscall in flight".into(),
            )));
        }
        match &mut self.machine {
            Machine::Load(m) => m.advance(c, res),
            Machine::Store(m) => m.advance(c, res),
            Machine::Remove(m) => m.advance(c, res),
            Machine::Probe(m) => m.advance(c, res),
        }
    }
}

impl std::fmt::Debug for BlockJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockJob")
            .field("op", &self.core.op)
            .field("index", &self.core.index)
            .field("action", &self.action())
            .field("key", &self.core.key)
            .field("running", &self.core.running)
            .finish()
    }
}

/// A zeroed [`HEADER_LEN`]-byte buffer aligned for O_DIRECT.
fn aligned_sector() -> Result<AlignedBuf, BlockError> {
    let mut b = AlignedBuf::new(HEADER_LEN, HEADER_LEN)
        .map_err(|e| BlockError::Io(format!("cannot allocate a header buffer: {e}")))?;
    b.as_mut_full().fill(0);
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::replaced;

    #[test]
    fn a_file_replaced_under_a_load_is_told_from_a_failing_mount() {
        assert!(replaced(-(libc::ESTALE as i64)));
        assert!(replaced(-(libc::ENOENT as i64)));
        assert!(!replaced(-(libc::EIO as i64)));
        assert!(!replaced(-(libc::ENOTCONN as i64)));
        assert!(!replaced(0));
    }
}
