//! A reference point, not the baseline: the same bytes as plain loopback TCP copies in
//! request/response tasks, the shape of kvx's reads without kvx. What it costs to ask for each
//! task and wait for its answer on this machine shows here, apart from what kvx adds.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvx_core::AlignedBuf;

use super::raw::{RAW_COPY_STALL as STALL, finish_pass, tell, touched_buffers};

/// `connections` loopback connections, each with a server thread that answers a request for
/// blocks `first..first+count` by writing them straight from the engine memory, and a reader
/// thread that asks for its share of the tasks one at a time (task `t` on connection
/// `t % connections`, as kvx keeps `depth` tasks in flight) and reads each answer into
/// destination buffers in turn. Threads and connections live as long as this value.
pub struct RawTcpTasks {
    readers: Vec<Reader>,
    servers: Vec<JoinHandle<()>>,
}

/// One connection's reading end.
struct Reader {
    /// Tells the reader to read one pass; dropped to stop it.
    go: Option<Sender<()>>,
    /// The reader's verdict on each pass.
    done: Receiver<std::io::Result<()>>,
    thread: Option<JoinHandle<()>>,
}

/// A request: the first block and how many follow, little-endian.
fn request(first: u32, count: u32) -> [u8; 8] {
    let mut r = [0u8; 8];
    r[..4].copy_from_slice(&first.to_le_bytes());
    r[4..].copy_from_slice(&count.to_le_bytes());
    r
}

impl RawTcpTasks {
    /// Connect `connections` lanes (at least 1) over loopback; tasks of `task_blocks` blocks
    /// over the arena's blocks; `dests` destination buffers in all.
    pub(super) fn start(
        arena: Arc<AlignedBuf>,
        block_bytes: usize,
        task_blocks: usize,
        connections: usize,
        dests: usize,
    ) -> std::io::Result<RawTcpTasks> {
        let blocks = arena.as_slice().len() / block_bytes.max(1);
        let task_blocks = task_blocks.max(1);
        let tasks = blocks.div_ceil(task_blocks);
        let n = connections.clamp(1, tasks.max(1));
        let dests_each = (dests / n).max(1);
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let mut readers = Vec::with_capacity(n);
        let mut servers = Vec::with_capacity(n);
        for lane in 0..n {
            let mut client = TcpStream::connect(addr)?;
            let (mut server, _) = listener.accept()?;
            client.set_nodelay(true)?;
            client.set_read_timeout(Some(STALL))?;
            // No read timeout: the server waits for the next request however long the other
            // paths take between passes, and ends when the reader's end closes.
            server.set_nodelay(true)?;
            let served = arena.clone();
            servers.push(
                std::thread::Builder::new()
                    .name("raw-tasks-serve".into())
                    .spawn(move || {
                        let mut req = [0u8; 8];
                        // Ends when the reader's end closes (or at the read timeout).
                        while server.read_exact(&mut req).is_ok() {
                            let first = u32::from_le_bytes([req[0], req[1], req[2], req[3]]);
                            let count = u32::from_le_bytes([req[4], req[5], req[6], req[7]]);
                            let (first, count) = (first as usize, count as usize);
                            let end = (first + count).min(blocks);
                            let bytes =
                                &served.as_slice()[first.min(end) * block_bytes..end * block_bytes];
                            if server.write_all(bytes).is_err() {
                                return;
                            }
                        }
                    })?,
            );
            let mine: Vec<(u32, u32)> = (lane..tasks)
                .step_by(n)
                .map(|t| {
                    let first = t * task_blocks;
                    (first as u32, task_blocks.min(blocks - first) as u32)
                })
                .collect();
            let (go, go_rx) = channel::<()>();
            let (done_tx, done) = channel();
            let arena = arena.clone();
            let mut dest = touched_buffers(dests_each, block_bytes);
            let thread = std::thread::Builder::new()
                .name("raw-tasks-read".into())
                .spawn(move || {
                    let mut next = 0;
                    while go_rx.recv().is_ok() {
                        let r = mine.iter().try_for_each(|&(first, count)| {
                            client.write_all(&request(first, count))?;
                            for b in first as usize..(first + count) as usize {
                                let d = &mut dest[next % dests_each];
                                client.read_exact(d)?;
                                next += 1;
                                // One byte per block: the answer is the block asked for.
                                if d[0] != arena.as_slice()[b * block_bytes] {
                                    return Err(std::io::Error::other(format!(
                                        "block {b}: wrong bytes"
                                    )));
                                }
                            }
                            Ok(())
                        });
                        let failed = r.is_err();
                        if done_tx.send(r).is_err() || failed {
                            return;
                        }
                    }
                })?;
            readers.push(Reader {
                go: Some(go),
                done,
                thread: Some(thread),
            });
        }
        Ok(RawTcpTasks { readers, servers })
    }

    /// Connections in use.
    pub fn connections(&self) -> usize {
        self.readers.len()
    }

    /// Every task of every connection, each connection's one at a time; returns how long it
    /// took from the start signal to the last byte read.
    fn pass(&mut self) -> std::io::Result<Duration> {
        let t0 = Instant::now();
        for r in &self.readers {
            tell(&r.go)?;
        }
        finish_pass(t0, self.readers.iter().map(|r| &r.done), "raw-tasks reader")
    }

    /// One untimed pass (the warm-up), then a timed one; returns the timed pass's duration.
    pub fn measure(&mut self) -> std::io::Result<Duration> {
        self.pass()?;
        self.pass()
    }
}

impl Drop for RawTcpTasks {
    fn drop(&mut self) {
        // A closed channel ends a reader's loop, and its closed connection the server's.
        for r in &mut self.readers {
            r.go.take();
        }
        for r in &mut self.readers {
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
        for t in self.servers.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pass reads every block (each checked against the block asked for), task by task,
    /// on the same connections, and again; dropping ends every thread.
    #[test]
    fn tasks_repeat_on_the_same_connections() {
        let mut arena = AlignedBuf::new(10 * 4096, 4096).unwrap();
        for (b, chunk) in arena.as_mut_slice().chunks_mut(4096).enumerate() {
            chunk.fill(b as u8 + 1);
        }
        let arena = Arc::new(arena);
        // 10 blocks in tasks of 4: 3 tasks (the last of 2), so at most 3 connections.
        for (connections, lanes) in [(8, 3), (1, 1)] {
            let mut tasks = RawTcpTasks::start(arena.clone(), 4096, 4, connections, 8).unwrap();
            assert_eq!(tasks.connections(), lanes);
            for _ in 0..3 {
                tasks.measure().unwrap();
            }
            drop(tasks);
            assert_eq!(Arc::strong_count(&arena), 1, "every thread is gone");
        }
    }
}
