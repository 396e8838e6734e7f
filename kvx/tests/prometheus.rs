//! The Prometheus endpoint answers a real scrape with the metrics kvx-core records.
#![cfg(feature = "prometheus")]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use kvx::core::metrics::{self, BreakerGauge};
use kvx::core::{BlockKey, BlockReport, Direction, RequestId, TaskId, TaskReport, TaskState};
use kvx::prometheus::PrometheusServer;

fn scrape(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(s, "GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn scrape_returns_recorded_metrics_in_text_format() {
    let server = PrometheusServer::start("127.0.0.1:0").expect("start");
    let report = TaskReport {
        task: TaskId(1),
        request: RequestId(7),
        dir: Direction::Load,
        state: TaskState::TimedOut,
        blocks: vec![BlockReport {
            key: BlockKey::chain(None, b"k"),
            engine: None,
            result: Err(kvx::core::BlockError::TimedOut),
            buf: None,
        }],
        engine_blocks_held: false,
        finished_at: Instant::now(),
    };
    metrics::record_report(&report);
    metrics::record_breaker("/mnt/kv", BreakerGauge::Open);

    let body = scrape(server.local_addr(), "/metrics");
    assert!(body.starts_with("HTTP/1.0 200 OK"), "{body}");
    assert!(
        body.contains("kvx_tasks_total{dir=\"load\",outcome=\"timed_out\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("kvx_timeouts_total{dir=\"load\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("kvx_blocks_total{dir=\"load\",outcome=\"timed_out\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("kvx_breaker_state{target=\"/mnt/kv\"} 2"),
        "{body}"
    );

    let missing = scrape(server.local_addr(), "/nothing");
    assert!(missing.starts_with("HTTP/1.0 404"), "{missing}");

    // A second recorder in the same process is refused with a clear error.
    let second = PrometheusServer::start("127.0.0.1:0");
    assert!(matches!(
        second,
        Err(kvx::prometheus::PrometheusError::Recorder(_))
    ));
}
