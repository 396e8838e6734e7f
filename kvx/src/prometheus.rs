//! A Prometheus endpoint for kvx's metrics (feature `prometheus`).
//!
//! [`PrometheusServer::start`] installs the process-wide `metrics` recorder and answers
//! `GET /metrics` in the Prometheus text format on one small thread (plain HTTP/1.0, one
//! connection at a time, each read and write bounded by [`IO_TIMEOUT`] so a slow scraper cannot
//! hold it). Dropping the server stops the thread; the recorder stays installed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The bound on each read and write of a scrape connection.
pub const IO_TIMEOUT: Duration = Duration::from_secs(1);

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum PrometheusError {
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// Another `metrics` recorder is already installed in this process.
    #[error("cannot install the Prometheus recorder: {0}")]
    Recorder(String),
}

/// A running `/metrics` endpoint.
pub struct PrometheusServer {
    addr: SocketAddr,
    handle: PrometheusHandle,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PrometheusServer {
    /// Install the recorder and serve `GET /metrics` on `addr` (e.g. `127.0.0.1:9464`).
    pub fn start(addr: &str) -> Result<PrometheusServer, PrometheusError> {
        let bind_err = |source| PrometheusError::Bind {
            addr: addr.to_string(),
            source,
        };
        let sockaddr = addr
            .to_socket_addrs()
            .map_err(bind_err)?
            .next()
            .ok_or_else(|| bind_err(std::io::Error::other("no address")))?;
        let listener = TcpListener::bind(sockaddr).map_err(bind_err)?;
        let local = listener.local_addr().map_err(bind_err)?;
        let handle = PrometheusBuilder::new()
            .install_recorder()
            .map_err(|e| PrometheusError::Recorder(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (handle, stop) = (handle.clone(), stop.clone());
            std::thread::Builder::new()
                .name("kvx-prometheus".into())
                .spawn(move || serve(listener, handle, stop))
                .map_err(bind_err)?
        };
        Ok(PrometheusServer {
            addr: local,
            handle,
            stop,
            thread: Some(thread),
        })
    }

    /// The address the endpoint listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The current metrics in the Prometheus text format (what a scrape returns).
    pub fn render(&self) -> String {
        self.handle.render()
    }
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept call; the thread sees the flag and ends.
        let _ = TcpStream::connect_timeout(&self.addr, IO_TIMEOUT);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(listener: TcpListener, handle: PrometheusHandle, stop: Arc<AtomicBool>) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        if let Ok(stream) = conn {
            // A broken scrape only costs that scrape.
            let _ = answer(stream, &handle);
        }
    }
}

fn answer(mut stream: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut req = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    // Read the request head (up to a blank line, bounded at 16 KiB).
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 16 * 1024 {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        req.extend_from_slice(&chunk[..n]);
    }
    let line = req.split(|&b| b == b'\n').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let (status, body) = if method == b"GET" && (path == b"/metrics" || path == b"/") {
        ("200 OK", handle.render())
    } else {
        ("404 Not Found", "only GET /metrics is served\n".to_string())
    };
    write!(
        stream,
        "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}
