//! Hostile or broken peers: clear errors, dropped connections, nobody else stalled, no panic.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kvx_core::{BlockError, BlockKey, RequestId, TaskState};
use kvx_rdma::wire::{ErrorCode, PROTOCOL_VERSION, Reply, Request};
use kvx_rdma::{RemoteDescriptor, TransportKind};

use super::peer::{Consumer, Peer, pattern};

const BLOCK: usize = 64 * 1024;
const TOKEN: &str = "s3cret";

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn hello(version: u16, token: &str) -> Vec<u8> {
    Request::Hello {
        version,
        reader: 0,
        token: token.as_bytes().to_vec(),
    }
    .encode()
}

/// Read one server frame: `(type, body)`; `None` on EOF.
fn frame(s: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).ok()?;
    Some((body[0], body))
}

fn expect_error(s: &mut TcpStream, code: ErrorCode, what: &str) -> String {
    let (_, body) = frame(s).unwrap_or_else(|| panic!("{what}: no error frame"));
    match Reply::decode(&body) {
        Ok(Reply::Error {
            code: c, message, ..
        }) => {
            assert_eq!(c, code, "{what}: {message}");
            assert!(!message.is_empty(), "{what}: empty message");
            message
        }
        other => panic!("{what}: expected an error frame, got {other:?}"),
    }
}

fn expect_closed(s: &mut TcpStream, what: &str) {
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("{what}: connection should be closed, got {other:?}"),
    }
}

fn logged_in(addr: SocketAddr) -> TcpStream {
    let mut s = connect(addr);
    s.write_all(&hello(PROTOCOL_VERSION, TOKEN)).unwrap();
    let (_, body) = frame(&mut s).expect("welcome");
    assert!(matches!(Reply::decode(&body), Ok(Reply::Welcome { .. })));
    s
}

fn read_req(tag: u64, request: u64, block: u32, offset: u64, len: u64) -> Vec<u8> {
    Request::Read {
        tag,
        request,
        block,
        offset,
        len,
    }
    .encode()
}

pub fn bad_peer_input() {
    let mut p = Peer::producer(&[
        ("KVX_TOKEN", TOKEN.into()),
        ("KVX_HANDSHAKE_MS", "1000".into()),
    ]);
    let desc = p.export(1, 0, 4, 60_000, 1);
    p.ready(1);
    let addr = desc.addr;

    // Slow and stuck peers hold their own connections only.
    let mut half_hello = connect(addr);
    half_hello
        .write_all(&hello(PROTOCOL_VERSION, TOKEN)[..7])
        .unwrap();
    let mut half_frame = logged_in(addr);
    half_frame.write_all(&[0, 0]).unwrap();
    let mut silent = logged_in(addr);

    // Garbage instead of a hello (an HTTP request, say).
    let mut s = connect(addr);
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let m = expect_error(&mut s, ErrorCode::BadHandshake, "garbage");
    assert!(m.contains("not a kvx-rdma hello"), "{m}");
    expect_closed(&mut s, "garbage");

    // Wrong protocol version, wrong and missing token.
    let mut s = connect(addr);
    s.write_all(&hello(PROTOCOL_VERSION + 1, TOKEN)).unwrap();
    let m = expect_error(&mut s, ErrorCode::VersionMismatch, "version");
    assert!(m.contains("version 2") && m.contains("speaks 1"), "{m}");
    expect_closed(&mut s, "version");
    let mut s = connect(addr);
    s.write_all(&hello(PROTOCOL_VERSION, "guess")).unwrap();
    assert_eq!(
        expect_error(&mut s, ErrorCode::BadToken, "wrong token"),
        "wrong token"
    );
    expect_closed(&mut s, "wrong token");
    let mut s = connect(addr);
    s.write_all(&hello(PROTOCOL_VERSION, "")).unwrap();
    assert!(expect_error(&mut s, ErrorCode::BadToken, "no token").contains("requires a token"));
    expect_closed(&mut s, "no token");

    // Oversize length prefix.
    let mut s = logged_in(addr);
    s.write_all(&0xFFFF_FFF0u32.to_be_bytes()).unwrap();
    let m = expect_error(&mut s, ErrorCode::FrameTooLarge, "oversize");
    assert!(m.contains("4294967280"), "{m}");
    expect_closed(&mut s, "oversize");

    // Malformed frames: unknown type, truncated read, zero length, a second hello.
    for (what, bytes) in [
        ("unknown type", vec![0, 0, 0, 1, 0x7f]),
        ("truncated read", vec![0, 0, 0, 5, 2, 0, 0, 0, 1]),
        ("zero length", vec![0, 0, 0, 0]),
        ("second hello", hello(PROTOCOL_VERSION, TOKEN)),
    ] {
        let mut s = logged_in(addr);
        s.write_all(&bytes).unwrap();
        expect_error(&mut s, ErrorCode::MalformedFrame, what);
        expect_closed(&mut s, what);
    }

    // Bad reads get an error frame each; the connection stays usable.
    let mut s = logged_in(addr);
    let bb = desc.block_bytes;
    for (what, req, code) in [
        (
            "block index out of bounds",
            read_req(1, 1, 99, 0, bb),
            ErrorCode::OutOfBounds,
        ),
        (
            "offset out of bounds",
            read_req(2, 1, 0, bb - 10, 100),
            ErrorCode::OutOfBounds,
        ),
        (
            "offset overflow",
            read_req(3, 1, 0, u64::MAX, 2),
            ErrorCode::OutOfBounds,
        ),
        (
            "huge read",
            read_req(4, 1, 0, 0, u64::MAX),
            ErrorCode::ReadTooLarge,
        ),
        (
            "unknown request",
            read_req(5, 999, 0, 0, bb),
            ErrorCode::UnknownRequest,
        ),
    ] {
        s.write_all(&req).unwrap();
        let m = expect_error(&mut s, code, what);
        if code == ErrorCode::UnknownRequest {
            assert!(m.contains("req-999"), "{m}");
        }
    }
    s.write_all(
        &Request::Heartbeat {
            tag: 6,
            request: 999,
        }
        .encode(),
    )
    .unwrap();
    expect_error(
        &mut s,
        ErrorCode::UnknownRequest,
        "heartbeat of an unknown request",
    );
    s.write_all(&read_req(7, 1, 2, 100, 50)).unwrap();
    let (ty, body) = frame(&mut s).expect("data after errors");
    assert_eq!(ty, 0x82);
    assert_eq!(u64::from_be_bytes(body[1..9].try_into().unwrap()), 7);
    let expect: Vec<u8> = (100..150).map(|j| pattern(2, j)).collect();
    assert_eq!(&body[9..], &expect[..]);

    // Reads sent together are answered together, in order, a refused one with its error
    // frame between the data frames; a heartbeat among them ends a batch, not the answers.
    let batch: Vec<u8> = [
        read_req(10, 1, 0, 0, 100),
        read_req(11, 1, 99, 0, bb),
        read_req(12, 1, 0, 0, u64::MAX),
        read_req(13, 1, 3, 5, 20),
        Request::Heartbeat {
            tag: 14,
            request: 999,
        }
        .encode(),
        read_req(15, 1, 1, 0, 30),
    ]
    .concat();
    s.write_all(&batch).unwrap();
    let data = |s: &mut TcpStream, tag: u64, block: u32, from: usize, to: usize| {
        let (ty, body) = frame(s).unwrap_or_else(|| panic!("no frame for tag {tag}"));
        assert_eq!(ty, 0x82, "tag {tag}: {:?}", Reply::decode(&body));
        assert_eq!(u64::from_be_bytes(body[1..9].try_into().unwrap()), tag);
        let expect: Vec<u8> = (from..to).map(|j| pattern(block, j)).collect();
        assert_eq!(&body[9..], &expect[..], "tag {tag}");
    };
    let refused = |s: &mut TcpStream, tag: u64, code: ErrorCode| {
        let (_, body) = frame(s).unwrap_or_else(|| panic!("no frame for tag {tag}"));
        match Reply::decode(&body) {
            Ok(Reply::Error {
                tag: t, code: c, ..
            }) => assert_eq!((t, c), (tag, code)),
            other => panic!("tag {tag}: expected an error frame, got {other:?}"),
        }
    };
    data(&mut s, 10, 0, 0, 100);
    refused(&mut s, 11, ErrorCode::OutOfBounds);
    refused(&mut s, 12, ErrorCode::ReadTooLarge);
    data(&mut s, 13, 3, 5, 25);
    refused(&mut s, 14, ErrorCode::UnknownRequest);
    data(&mut s, 15, 1, 0, 30);

    // Meanwhile a real consumer reads everything, in time, despite the stuck peers.
    let mut c = Consumer::new(0, BLOCK, 4, Some(TOKEN.into()), true);
    c.handle.register(desc.clone()).unwrap();
    let t0 = Instant::now();
    let report = c.load(&desc.blocks, t0 + Duration::from_secs(3));
    assert!(
        report.is_ok(),
        "{:?}",
        report.blocks.iter().map(|b| &b.result).collect::<Vec<_>>()
    );
    // The half hello is cut at the handshake timeout with a clear error.
    let m = expect_error(&mut half_hello, ErrorCode::BadHandshake, "half hello");
    assert!(m.contains("no hello within"), "{m}");
    // A consumer with the wrong token gets invalid blocks, not a hang.
    let mut wrong = Consumer::new(1, BLOCK, 4, Some("nope".into()), false);
    wrong.handle.register(desc.clone()).unwrap();
    let r = wrong.load(&desc.blocks, Instant::now() + Duration::from_secs(3));
    assert!(
        matches!(&r.blocks[0].result, Err(BlockError::Io(m)) if m.contains("BadToken")),
        "{:?}",
        r.blocks[0].result
    );

    c.handle.done(desc.request).unwrap();
    assert_eq!(
        p.wait_for("released", Duration::from_secs(2)),
        "released 1 Read"
    );
    assert!(
        p.child.try_wait().unwrap().is_none(),
        "the producer is still running"
    );
    let s = p.status(1);
    assert!(s.contains("pins=0"), "{s}");
    drop((half_frame.write_all(&[0]), silent.write_all(&[])));
    let err = p.stderr_text();
    assert!(!err.contains("panicked"), "producer panicked: {err}");
}

/// A descriptor of one block of `block_bytes` served by a hand-written server at `addr`.
fn one_block_at(addr: SocketAddr, block_bytes: u64) -> RemoteDescriptor {
    RemoteDescriptor {
        request: RequestId(1),
        addr,
        transport: TransportKind::Tcp,
        block_bytes,
        blocks: vec![BlockKey(1)],
        heartbeat_interval_ms: 1000,
        ttl_ms: 6000,
        expected_readers: 1,
    }
}

/// The consumer side of bad input: a server that lies about lengths and tags.
pub fn bad_peer_input_from_server() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        for (i, conn) in listener.incoming().take(3).enumerate() {
            let mut s = conn.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(
                &Reply::Welcome {
                    version: PROTOCOL_VERSION,
                    max_read: 1 << 20,
                }
                .encode(),
            );
            let _ = s.read(&mut buf);
            let evil: Vec<u8> = match i {
                // A data frame announcing 4 GiB.
                0 => {
                    let mut f = 0xFFFF_FFF0u32.to_be_bytes().to_vec();
                    f.push(0x82);
                    f.extend_from_slice(&1u64.to_be_bytes());
                    f
                }
                // A reply for a tag nobody asked for.
                1 => Reply::Ack { tag: 12345 }.encode(),
                // Garbage.
                _ => vec![0, 0, 0, 3, 0x99, 1, 2],
            };
            let _ = s.write_all(&evil);
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let desc = one_block_at(addr, BLOCK as u64);
    let mut c = Consumer::new(0, BLOCK, 1, None, false);
    c.handle.register(desc.clone()).unwrap();
    for what in ["announces", "broke the protocol", "unknown frame type"] {
        let t0 = Instant::now();
        let r = c.load(&desc.blocks, t0 + Duration::from_secs(3));
        assert_eq!(r.state, TaskState::Failed(kvx_core::FailReason::Blocks));
        match &r.blocks[0].result {
            Err(BlockError::Io(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("expected an I/O error naming {what:?}, got {other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(2), "failed fast");
    }
    server.join().unwrap();
}

/// A producer that sends more than was asked for: a whole reply to the one read, then a frame
/// nobody asked for, in one segment, so the consumer's read-ahead buffer holds the stray frame
/// when the load ends. The load gets its block; its connection is not pooled (pooling it would
/// drop the buffered bytes and leave the stream wherever they ended), so the next load opens a
/// new connection and gets its block too. This server answers one read per connection: a load
/// on a pooled connection would time out.
pub fn surplus_reply_is_not_pooled() {
    const SMALL: usize = 1024;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let mut conns = Vec::new();
        let until = Instant::now() + Duration::from_secs(5);
        while conns.len() < 2 && Instant::now() < until {
            let mut s = match listener.accept() {
                Ok((s, _)) => s,
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
            };
            s.set_nonblocking(false).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            frame(&mut s).expect("hello");
            let welcome = Reply::Welcome {
                version: PROTOCOL_VERSION,
                max_read: 1 << 20,
            };
            s.write_all(&welcome.encode()).unwrap();
            let (_, body) = frame(&mut s).expect("a read");
            let Ok(Request::Read { tag, len, .. }) = Request::decode(&body) else {
                panic!("expected a read, got {body:?}");
            };
            let mut reply = Reply::Data { tag, len }.encode();
            reply.extend((0..len as usize).map(|j| pattern(1, j)));
            if conns.is_empty() {
                reply.extend(Reply::Ack { tag: 999_999 }.encode());
            }
            s.write_all(&reply).unwrap();
            conns.push(s); // kept open: the consumer decides whether to reuse it
        }
        conns.len()
    });
    let desc = one_block_at(addr, SMALL as u64);
    let mut c = Consumer::new(0, SMALL, 1, None, false);
    c.handle.register(desc.clone()).unwrap();
    for load in ["first", "second"] {
        let r = c.load(&desc.blocks, Instant::now() + Duration::from_secs(3));
        assert!(r.is_ok(), "{load} load: {:?}", r.blocks[0].result);
        let got = r.blocks[0].buf.as_ref().expect("a buffer").as_slice();
        let want: Vec<u8> = (0..SMALL).map(|j| pattern(1, j)).collect();
        assert_eq!(got, &want[..], "{load} load's bytes");
    }
    assert_eq!(
        server.join().unwrap(),
        2,
        "the second load needed a new connection"
    );
}

/// The producer closes a connection that stayed idle past its idle timeout. The consumer had
/// pooled it after a load; its next load must not read from the closed connection (the load
/// would fail, and the engine recompute blocks it could have had): it sees the close when it
/// takes the connection from the pool, and opens a new one.
pub fn a_pooled_connection_the_producer_closed_is_not_used() {
    let idle = Duration::from_millis(200);
    let mut p = Peer::producer(&[("KVX_IDLE_MS", idle.as_millis().to_string())]);
    let desc = p.export(1, 0, 2, 30_000, 1);
    p.ready(1);
    let mut c = Consumer::new(0, BLOCK, 2, None, false);
    c.handle.register(desc.clone()).unwrap();
    for (i, load) in ["before the idle timeout", "after it"]
        .into_iter()
        .enumerate()
    {
        if i > 0 {
            // Long enough for the producer to close every connection the load left idle.
            std::thread::sleep(idle * 3);
        }
        let r = c.load(&desc.blocks, Instant::now() + Duration::from_secs(5));
        assert_loaded(&c, &r, load);
    }
}

/// Every block of `r` arrived, and engine block 1 holds the producer's block 1.
fn assert_loaded(c: &Consumer, r: &kvx_core::TaskReport, what: &str) {
    for (b, block) in r.blocks.iter().enumerate() {
        assert!(
            block.result.is_ok(),
            "{what}: block {b}: {:?}",
            block.result
        );
    }
    let engine = c.arena.read_block(kvx_core::EngineBlockId(1)).unwrap();
    assert_eq!(engine[7], pattern(1, 7), "{what}: the bytes of block 1");
}

/// What the [`CuttingProxy`] does to a request (a frame after the hello).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// Forward it.
    Never,
    /// Close the next connection that carries one, once, without forwarding it.
    Once,
    /// Close every connection that carries one, without forwarding it.
    Always,
}

/// A TCP proxy in front of a producer that closes connections as requests arrive on them, as
/// a producer's idle timeout closing a pooled connection just as a load's reads (or a done)
/// go out on it would. Counts the connections it accepted.
struct CuttingProxy {
    addr: SocketAddr,
    cut: std::sync::Arc<std::sync::Mutex<Cut>>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl CuttingProxy {
    fn start(producer: SocketAddr) -> CuttingProxy {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Mutex};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(Mutex::new(Cut::Never));
        let accepted = Arc::new(AtomicUsize::new(0));
        let (cut2, accepted2) = (cut.clone(), accepted.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(mut client) = client else { return };
                accepted2.fetch_add(1, Ordering::SeqCst);
                let mut server = TcpStream::connect(producer).unwrap();
                let (mut client_rx, mut server_tx) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                // Producer → client: bytes as they come.
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut server, &mut client);
                    let _ = client.shutdown(std::net::Shutdown::Both);
                });
                // Client → producer: frame by frame, each read request checked first.
                let cut = cut2.clone();
                std::thread::spawn(move || {
                    loop {
                        let mut len = [0u8; 4];
                        if client_rx.read_exact(&mut len).is_err() {
                            break;
                        }
                        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
                        if client_rx.read_exact(&mut body).is_err() {
                            break;
                        }
                        if !matches!(Request::decode(&body), Ok(Request::Hello { .. })) {
                            let mut c = cut.lock().unwrap();
                            if *c != Cut::Never {
                                if *c == Cut::Once {
                                    *c = Cut::Never;
                                }
                                break;
                            }
                        }
                        if server_tx.write_all(&len).is_err() || server_tx.write_all(&body).is_err()
                        {
                            break;
                        }
                    }
                    let _ = client_rx.shutdown(std::net::Shutdown::Both);
                    let _ = server_tx.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        CuttingProxy {
            addr,
            cut,
            accepted,
        }
    }

    fn cut(&self, c: Cut) {
        *self.cut.lock().unwrap() = c;
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A pooled connection closed just as a load's reads go out on it (the producer's idle
/// timeout landing between the pool's check and the write): the load goes on over one new
/// connection and every block arrives. A producer that closes that one too fails the load at
/// once, with no second retry. A done sent on such a connection is sent again on a new one.
/// Before the retry, the first case failed every block with "early eof" and D recomputed what
/// it could have read.
pub fn a_pooled_connection_closed_as_the_reads_go_out_is_replaced_once() {
    let mut p = Peer::producer(&[]);
    let mut desc = p.export(1, 0, 2, 30_000, 1);
    p.ready(1);
    let proxy = CuttingProxy::start(desc.addr);
    desc.addr = proxy.addr;
    // No heartbeats: only the loads use connections.
    let mut c = Consumer::new(0, BLOCK, 2, None, false);
    c.handle.register(desc.clone()).unwrap();

    let r = c.load(&desc.blocks, Instant::now() + Duration::from_secs(5));
    assert_loaded(&c, &r, "first load");
    drop(r); // its staging buffers go back to the pool
    assert_eq!(proxy.accepted(), 1);

    proxy.cut(Cut::Once);
    let r = c.load(&desc.blocks, Instant::now() + Duration::from_secs(5));
    assert_loaded(&c, &r, "the pooled connection closed under the reads");
    drop(r);
    assert_eq!(proxy.accepted(), 2, "exactly one new connection");

    proxy.cut(Cut::Always);
    let t0 = Instant::now();
    let r = c.load(&desc.blocks, t0 + Duration::from_secs(5));
    let took = t0.elapsed();
    assert!(matches!(r.state, TaskState::Failed(_)), "{:?}", r.state);
    for (b, block) in r.blocks.iter().enumerate() {
        assert!(
            matches!(&block.result, Err(BlockError::Io(m)) if m.contains("closed before an answer")),
            "block {b}: {:?}",
            block.result
        );
    }
    assert_eq!(proxy.accepted(), 3, "one retry, not more");
    assert!(
        took < Duration::from_secs(1),
        "failed after {took:?}, not at once"
    );
    drop(r);

    proxy.cut(Cut::Never);
    let r = c.load(&desc.blocks, Instant::now() + Duration::from_secs(5));
    assert_loaded(&c, &r, "after the cuts");
    assert_eq!(proxy.accepted(), 4);
    proxy.cut(Cut::Once);
    c.handle.done(desc.request).unwrap();
    assert_eq!(
        proxy.accepted(),
        5,
        "the done went out again on a new connection"
    );
    // The producer heard it: the request is released as read.
    assert_eq!(
        p.wait_for("released", Duration::from_secs(2)),
        "released 1 Read"
    );
}
