//! A reader that trickles a reply (a tiny receive window, one byte every 100 ms) cannot hold
//! the producer's engine blocks: each reply has one deadline, bounded by the lease, and a reply
//! that misses it is cut, its pin dropped, the connection reset.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvx_core::{BlockError, TaskState};
use kvx_rdma::wire::{PROTOCOL_VERSION, Reply, Request};

use super::peer::{Consumer, Peer, REUSED};
use super::timing::{ALLOWANCE, TICK};

/// Larger than the kernel's largest send buffer (`tcp_wmem` max is 4 MiB here) plus the
/// reader's window, so the reply cannot be handed to the kernel whole.
const BLOCK: usize = 16 << 20;
/// How often the trickling reader takes one byte.
const TRICKLE: Duration = Duration::from_millis(100);

fn producer(write_ms: u64) -> Peer {
    Peer::producer(&[
        ("KVX_BLOCKS", "2".into()),
        ("KVX_BLOCK_BYTES", BLOCK.to_string()),
        ("KVX_WRITE_MS", write_ms.to_string()),
    ])
}

/// A raw client with a 4 KiB receive buffer, set before connecting so the window it
/// advertises stays tiny.
fn small_window_client(addr: SocketAddr) -> TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let s = rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        sock.connect(addr).await.unwrap()
    });
    let s = s.into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// `TCP_ESTABLISHED` of Linux's `tcp_states.h`.
const TCP_ESTABLISHED: u8 = 1;

/// The kernel's TCP state of `s` (`TCP_INFO`).
fn tcp_state(s: &TcpStream) -> u8 {
    use std::os::fd::AsRawFd;
    // SAFETY: `tcp_info` is plain old data, zeroed is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt(2) on a socket this test owns, writing at most `len` bytes into
    // `info`, which lives across the call.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "TCP_INFO: {}", std::io::Error::last_os_error());
    info.tcpi_state
}

fn frame(s: &mut TcpStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    body
}

/// Log in, ask for block 0 of `request` whole, and read the data head; returns the stream, the
/// announced payload length, and when the read request was sent (the server's reply, and its
/// write timeout, start after that: the connection's setup before it is the test's own work).
fn start_read(addr: SocketAddr, request: u64) -> (TcpStream, u64, Instant) {
    let mut s = small_window_client(addr);
    let hello = Request::Hello {
        version: PROTOCOL_VERSION,
        reader: 0,
        token: Vec::new(),
    };
    s.write_all(&hello.encode()).unwrap();
    assert!(matches!(
        Reply::decode(&frame(&mut s)),
        Ok(Reply::Welcome { .. })
    ));
    let read = Request::Read {
        tag: 7,
        request,
        block: 0,
        offset: 0,
        len: BLOCK as u64,
    };
    let sent = Instant::now();
    s.write_all(&read.encode()).unwrap();
    let mut head = [0u8; 13];
    s.read_exact(&mut head).unwrap();
    assert_eq!(head[4], 0x82, "a data frame");
    assert_eq!(u64::from_be_bytes(head[5..13].try_into().unwrap()), 7);
    let len = u64::from(u32::from_be_bytes(head[..4].try_into().unwrap())) - 9;
    assert_eq!(len, BLOCK as u64);
    (s, len, sent)
}

/// A reader thread: one byte every [`TRICKLE`] until `drain` is set, then as fast as it can
/// (what already sits in its own receive buffer would take minutes at the trickle) until the
/// stream ends. Joins to the payload bytes received, how the stream ended, and when.
struct Trickle {
    drain: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(u64, String, Instant)>,
}

impl Trickle {
    fn start(s: TcpStream, len: u64) -> Trickle {
        let drain = Arc::new(AtomicBool::new(false));
        let d = drain.clone();
        let thread = std::thread::spawn(move || trickle(s, len, &d));
        Trickle { drain, thread }
    }

    fn drain_and_join(self) -> (u64, String, Instant) {
        self.drain.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

fn trickle(mut s: TcpStream, len: u64, drain: &AtomicBool) -> (u64, String, Instant) {
    let mut got = 0u64;
    let mut b = vec![0u8; 64 * 1024];
    loop {
        let fast = drain.load(Ordering::Relaxed);
        let want = if fast { b.len() } else { 1 };
        match s.read(&mut b[..want]) {
            Ok(n) if n > 0 => {
                got += n as u64;
                assert!(got < len, "the whole reply arrived");
                if !fast {
                    std::thread::sleep(TRICKLE);
                }
            }
            Ok(_) => return (got, "eof".into(), Instant::now()),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                return (got, "reset".into(), Instant::now());
            }
            Err(e) => panic!("unexpected read error after {got} bytes: {e}"),
        }
    }
}

/// No heartbeat: the reply is cut at the lease's expiry and the producer releases the request
/// within TTL plus one tick (plus the stated allowance); the reader's stream ends short of the
/// announced length, and a kvx reader of the same request then gets invalid blocks.
pub fn slow_reader_cut_at_lease_end() {
    const TTL: u64 = 500;
    let mut p = producer(60_000);
    let desc = p.export(1, 0, 1, TTL, 1);
    let ttl = Duration::from_millis(TTL);
    p.ready(1);
    let (s, len, _) = start_read(desc.addr, 1);
    let reader = Trickle::start(s, len);
    let line = p.wait_for("released 1", Duration::from_secs(5));
    let released = Instant::now();
    assert_eq!(line, "released 1 Expired");
    // Timed in the producer's clock, from `ready` to the engine loop polling the release.
    let after = p.release_timing(1).0.expect("ready was timed");
    println!(
        "slow_reader_cut_at_lease_end: released {after:?} after ready (bound {:?})",
        ttl + TICK + ALLOWANCE
    );
    assert!(
        after >= ttl,
        "released {after:?} after ready, before the TTL"
    );
    assert!(
        after <= ttl + TICK + ALLOWANCE,
        "released {after:?} after ready; TTL {ttl:?} + tick + {ALLOWANCE:?}"
    );
    let (got, how, ended) = reader.drain_and_join();
    assert!(
        got < len,
        "the reader must not get the whole block ({got} of {len})"
    );
    println!(
        "slow_reader_cut_at_lease_end: the reader saw the cut {:?} after the test heard of the release (bound {:?})",
        ended.saturating_duration_since(released),
        TRICKLE + ALLOWANCE
    );
    assert!(how == "reset" || how == "eof", "{how}");
    assert!(
        ended <= released + TRICKLE + ALLOWANCE,
        "the reader saw the cut ({how}) {:?} after the release",
        ended.saturating_duration_since(released)
    );
    let st = p.status(1);
    assert!(
        st.starts_with("status gone exported=0 active=0 draining=0 pins=0 read=0 expired=1"),
        "{st}"
    );
    // A kvx reader of the same request: every block invalid, never the reused bytes.
    let mut c = Consumer::new(0, BLOCK, 1, None, false);
    c.handle.register(desc.clone()).unwrap();
    let report = c.load(&desc.blocks, Instant::now() + Duration::from_secs(3));
    assert_eq!(
        report.state,
        TaskState::Failed(kvx_core::FailReason::Blocks)
    );
    match &report.blocks[0].result {
        Err(BlockError::Remote(m)) => assert!(m.contains("LeaseEnded"), "{m}"),
        other => panic!("expected a lease error, got {other:?}"),
    }
    assert!(
        !report.blocks[0]
            .buf
            .as_ref()
            .unwrap()
            .as_slice()
            .contains(&REUSED)
    );
}

/// The producer aborts the request while a reply trickles: the reply is cut at once and the
/// release follows within one tick plus the allowance.
pub fn slow_reader_cut_at_abort() {
    let mut p = producer(60_000);
    let desc = p.export(1, 0, 1, 60_000, 1);
    p.ready(1);
    let (s, len, _) = start_read(desc.addr, 1);
    let reader = Trickle::start(s, len);
    std::thread::sleep(Duration::from_millis(300));
    assert!(p.status(1).contains("pins=1"), "the reply holds its pin");
    assert_eq!(p.ask("abort 1"), "ok");
    let line = p.wait_for("released 1", Duration::from_secs(5));
    assert_eq!(line, "released 1 Aborted");
    let took = p.release_timing(1).1.expect("abort was timed");
    println!(
        "slow_reader_cut_at_abort: released {took:?} after the abort (bound {:?})",
        TICK + ALLOWANCE
    );
    assert!(
        took <= TICK + ALLOWANCE,
        "released {took:?} after the abort"
    );
    let (got, how, _) = reader.drain_and_join();
    assert!(got < len, "{got} of {len}");
    assert!(how == "reset" || how == "eof", "{how}");
}

/// A reader that heartbeats on another connection keeps the lease, but its trickled reply
/// still has the server's write timeout as a total bound: it is cut then, the pin drops, and
/// the lease lives on until the reader says done.
pub fn slow_reader_cut_at_write_timeout() {
    const WRITE_MS: u64 = 600;
    let mut p = producer(WRITE_MS);
    let desc = p.export(1, 0, 1, 300, 1);
    p.ready(1);
    let c = Consumer::new(0, BLOCK, 1, None, true);
    c.handle.register(desc.clone()).unwrap();
    // Timed from the read request: building the client and logging in come before it and may
    // be slow on a cold machine; the server's write timeout starts once the request arrived.
    let (s, len, t0) = start_read(desc.addr, 1);
    // The cut resets the connection: the reader's socket leaves ESTABLISHED at once, while
    // its receive buffer still holds bytes the trickle would take minutes to reach.
    let watch = s.try_clone().unwrap();
    let reader = Trickle::start(s, len);
    while tcp_state(&watch) == TCP_ESTABLISHED && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let took = t0.elapsed();
    let bound = Duration::from_millis(WRITE_MS) + TICK + ALLOWANCE;
    println!(
        "slow_reader_cut_at_write_timeout: cut {took:?} after the read request (bound {bound:?})"
    );
    assert!(
        took >= Duration::from_millis(WRITE_MS),
        "cut after {took:?}, before the write timeout"
    );
    assert!(took <= bound, "cut after {took:?} (bound {bound:?})");
    let st = p.status(1);
    assert!(
        st.starts_with("status active exported=1 active=1 draining=0 pins=0"),
        "{st}"
    );
    let (got, how, _) = reader.drain_and_join();
    assert!(got < len, "{got} of {len}");
    assert!(how == "reset" || how == "eof", "{how}");
    c.handle.done(desc.request).unwrap();
    assert_eq!(
        p.wait_for("released 1", Duration::from_secs(2)),
        "released 1 Read"
    );
}
