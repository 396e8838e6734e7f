//! The physical paths kvx's remote reads are measured against: plain loopback TCP copies of
//! the same bytes, with nothing but the kernel between the two ends.

use std::io::{IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvx_core::AlignedBuf;

use crate::tcp::{BATCH_BYTES, BATCH_READS};

/// How long a raw-copy thread or the caller waits for the other end before giving up with an
/// error.
pub(super) const RAW_COPY_STALL: Duration = Duration::from_secs(30);

/// Blocking I/O with no delay and a read timeout of [`RAW_COPY_STALL`].
fn configure(s: &TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(RAW_COPY_STALL))
}

/// The raw copy of a [`super::LoopbackRig`]'s engine memory: `connections` plain loopback TCP
/// connections, block `i` on connection `i % connections`, each with a sender thread that
/// writes its blocks straight from the engine memory (several per vectored write, as kvx's
/// server answers pipelined reads) and a receiver thread that reads them into its share of as
/// many destination buffers as the rig's staging pool has, in turn.
///
/// Connections, threads and buffers live as long as this value, as kvx's server, importer and
/// pooled connections live as long as the rig: both paths sit idle while the other one runs,
/// and both are warmed up by one untimed pass right before the timed one ([`Self::measure`]).
pub struct RawTcpCopy {
    lanes: Vec<Lane>,
    /// Destination buffers over all connections.
    dests: usize,
}

/// One connection of a [`RawTcpCopy`] and the two threads at its ends.
struct Lane {
    /// Tells the sender to write one pass; dropped to stop it.
    write: Option<Sender<()>>,
    /// Tells the receiver to read one pass; dropped to stop it.
    read: Option<Sender<()>>,
    /// The receiver's verdict on each pass.
    done: Receiver<std::io::Result<()>>,
    threads: Vec<JoinHandle<()>>,
}

impl RawTcpCopy {
    /// Connect `connections` lanes (at least 1, at most one per block) over loopback and start
    /// their threads; `dests` destination buffers in all.
    pub(super) fn start(
        arena: Arc<AlignedBuf>,
        block_bytes: usize,
        connections: usize,
        dests: usize,
    ) -> std::io::Result<RawTcpCopy> {
        let blocks = arena.as_slice().len() / block_bytes.max(1);
        let n = connections.clamp(1, blocks.max(1));
        let dests_each = (dests / n).max(1);
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let mut lanes = Vec::with_capacity(n);
        for c in 0..n {
            // The backlog completes the connection; the accept that follows returns it.
            let rx_stream = TcpStream::connect(addr)?;
            let (tx_stream, _) = listener.accept()?;
            configure(&rx_stream)?;
            configure(&tx_stream)?;
            let mine: Vec<usize> = (c..blocks).step_by(n).collect();
            let (write, write_rx) = channel::<()>();
            let (read, read_rx) = channel::<()>();
            let (done_tx, done) = channel();
            let arena = arena.clone();
            let to_send = mine.clone();
            let sender = std::thread::Builder::new()
                .name("raw-copy-send".into())
                .spawn(move || {
                    let mut s = tx_stream;
                    let blocks: Vec<&[u8]> = to_send
                        .iter()
                        .map(|&b| &arena.as_slice()[b * block_bytes..(b + 1) * block_bytes])
                        .collect();
                    while write_rx.recv().is_ok() {
                        if write_batched(&mut s, &blocks).is_err() {
                            // The receiver sees the connection end and reports it.
                            return;
                        }
                    }
                })?;
            let mut dest = touched_buffers(dests_each, block_bytes);
            let receiver = std::thread::Builder::new()
                .name("raw-copy-recv".into())
                .spawn(move || {
                    let mut s = rx_stream;
                    while read_rx.recv().is_ok() {
                        let r = (0..mine.len())
                            .try_for_each(|k| s.read_exact(&mut dest[k % dests_each]));
                        let failed = r.is_err();
                        if done_tx.send(r).is_err() || failed {
                            return;
                        }
                    }
                })?;
            lanes.push(Lane {
                write: Some(write),
                read: Some(read),
                done,
                threads: vec![sender, receiver],
            });
        }
        Ok(RawTcpCopy {
            lanes,
            dests: dests_each * n,
        })
    }

    /// Connections in use.
    pub fn connections(&self) -> usize {
        self.lanes.len()
    }

    /// Destination buffers the receivers rotate through, over all connections.
    pub fn destinations(&self) -> usize {
        self.dests
    }

    /// One pass over every block on every connection at once; returns how long it took, from
    /// the moment the senders are told to start to the last byte read.
    fn pass(&mut self) -> std::io::Result<Duration> {
        // Receivers first: no sender writes before every receiver is reading.
        for lane in &self.lanes {
            tell(&lane.read)?;
        }
        let t0 = Instant::now();
        for lane in &self.lanes {
            tell(&lane.write)?;
        }
        finish_pass(t0, self.lanes.iter().map(|l| &l.done), "raw-copy receiver")
    }

    /// One untimed pass (the warm-up, like kvx's untimed round), then a timed one; returns the
    /// timed pass's duration.
    pub fn measure(&mut self) -> std::io::Result<Duration> {
        self.pass()?;
        self.pass()
    }
}

/// Write `blocks` in order, handing each vectored write as many blocks as kvx's server answers
/// together (at most [`BATCH_READS`] blocks, no block joining once [`BATCH_BYTES`] are in):
/// the raw copy pays the kernel no more per block than kvx does.
fn write_batched(s: &mut TcpStream, blocks: &[&[u8]]) -> std::io::Result<()> {
    let mut rest = blocks;
    while !rest.is_empty() {
        let mut n = 0;
        let mut bytes = 0u64;
        while n < rest.len() && n < BATCH_READS && bytes < BATCH_BYTES {
            bytes += rest[n].len() as u64;
            n += 1;
        }
        let mut slices: Vec<IoSlice<'_>> = rest[..n].iter().map(|b| IoSlice::new(b)).collect();
        let mut bufs = &mut slices[..];
        while !bufs.is_empty() {
            match s.write_vectored(bufs)? {
                0 => return Err(std::io::ErrorKind::WriteZero.into()),
                k => IoSlice::advance_slices(&mut bufs, k),
            }
        }
        rest = &rest[n..];
    }
    Ok(())
}

/// `n` buffers of `bytes` bytes, each page written on the calling thread before this returns.
/// A reading thread that faulted its buffers in after `start` returned would zero pages while
/// the other paths are measured (~75 ms of a core for 512 MiB here, in kvx's first round).
pub(super) fn touched_buffers(n: usize, bytes: usize) -> Vec<Vec<u8>> {
    (0..n).map(|_| vec![1u8; bytes]).collect()
}

/// Tell a lane's thread to do one pass; an error if the thread is gone.
pub(super) fn tell(thread: &Option<Sender<()>>) -> std::io::Result<()> {
    let gone = || std::io::Error::other("a raw-copy thread is gone");
    thread
        .as_ref()
        .ok_or_else(gone)?
        .send(())
        .map_err(|_| gone())
}

/// Wait for every reading thread's verdict on the pass started at `t0` (each at most
/// [`RAW_COPY_STALL`]); the pass's duration, or the first error.
pub(super) fn finish_pass<'a>(
    t0: Instant,
    verdicts: impl Iterator<Item = &'a Receiver<std::io::Result<()>>>,
    who: &str,
) -> std::io::Result<Duration> {
    let mut first_error = None;
    for done in verdicts {
        let r = done.recv_timeout(RAW_COPY_STALL).unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("a {who} did not finish its pass"),
            ))
        });
        if let Err(e) = r {
            first_error.get_or_insert(e);
        }
    }
    let took = t0.elapsed();
    first_error.map_or(Ok(took), Err)
}

impl Drop for RawTcpCopy {
    fn drop(&mut self) {
        // Closed channels end the threads' loops; a receiver stuck in a read ends when its
        // sender's end of the connection closes, or at its read timeout.
        for lane in &mut self.lanes {
            lane.write.take();
            lane.read.take();
        }
        for lane in &mut self.lanes {
            for t in lane.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}

/// A reference point, not the baseline: `total` bytes over one loopback connection from one
/// cache-hot `chunk`-byte buffer into another (the loopback's best case for this chunk size).
pub fn raw_tcp_hot_copy(total: u64, chunk: usize) -> std::io::Result<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut buf = vec![1u8; chunk];
    std::thread::scope(|scope| {
        let sender = scope.spawn(|| -> std::io::Result<()> {
            let (mut s, _) = listener.accept()?;
            s.set_nodelay(true)?;
            let src = vec![7u8; chunk];
            // An untimed warm-up pass, then the timed one.
            let mut left = 2 * total;
            while left > 0 {
                let n = left.min(chunk as u64) as usize;
                s.write_all(&src[..n])?;
                left -= n as u64;
            }
            Ok(())
        });
        let mut s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let mut pass = |s: &mut TcpStream| -> std::io::Result<()> {
            let mut left = total;
            while left > 0 {
                let n = left.min(chunk as u64) as usize;
                s.read_exact(&mut buf[..n])?;
                left -= n as u64;
            }
            Ok(())
        };
        pass(&mut s)?;
        let t0 = Instant::now();
        pass(&mut s)?;
        let took = t0.elapsed();
        sender
            .join()
            .map_err(|_| std::io::Error::other("sender thread panicked"))??;
        Ok(took)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lanes are clamped to one per block; every pass moves every block, again and again on
    /// the same connections; dropping the copy ends its threads.
    #[test]
    fn passes_repeat_on_the_same_lanes() {
        let mut arena = AlignedBuf::new(8 * 4096, 4096).unwrap();
        arena.as_mut_slice().fill(3);
        let arena = Arc::new(arena);
        let mut copy = RawTcpCopy::start(arena.clone(), 4096, 100, 4).unwrap();
        assert_eq!(copy.connections(), 8);
        for _ in 0..3 {
            copy.measure().unwrap();
        }
        drop(copy);
        assert_eq!(
            Arc::strong_count(&arena),
            1,
            "the senders' threads are gone"
        );
        let mut copy = RawTcpCopy::start(arena, 4096, 3, 4).unwrap();
        assert_eq!(copy.connections(), 3);
        copy.measure().unwrap();
    }
}
