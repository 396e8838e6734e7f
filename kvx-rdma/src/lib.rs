//! kvx-rdma: remote block reads with producer leases and consumer deadlines.
//!
//! With prefill and decode on different nodes, the decode side reads the KV blocks of a
//! finished prefill out of the prefill node's memory:
//!
//! - the **producer** ([`Exporter`] + a server) exports a request's engine blocks for N
//!   expected readers under a TTL lease (kvx-policy's [`kvx_policy::LeaseTable`]): the lease
//!   starts when the request is ready, reader heartbeats renew it, and it ends when all N
//!   readers said done, at expiry, or on abort. The engine polls [`Exporter::poll_released`]
//!   and frees the blocks then — never earlier, and a read after the end fails. Every reply
//!   has one deadline, the server's write timeout and never past the lease, so a reader that
//!   drains a reply slowly cannot hold the blocks: its reply is cut, the connection reset, its
//!   block fails, and the release comes on time;
//! - the **consumer** ([`Importer`], a kvx-core [`kvx_core::Backend`]) loads blocks named by key
//!   into the op's own buffers before the op's deadline, heartbeats while the request is
//!   registered, and reports every block that did not arrive, so the engine recomputes exactly
//!   those.
//!
//! Transports sit behind [`Transport`]: [`TcpTransport`]/[`TcpServer`] (tokio, the default)
//! and, with the `verbs` feature, `VerbsTransport`/`VerbsServer` (one-sided RDMA READ).
//!
//! A producer and a consumer over loopback, the consumer's blocks routed `[rdma]`:
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvx_core::*;
//! use kvx_policy::LeaseConfig;
//! use kvx_rdma::*;
//!
//! // Producer: engine memory with 4 blocks of 4 KiB; block 2 holds the bytes we want.
//! let mut arena = CpuArena::contiguous(4096, 4).unwrap();
//! arena.write_block(EngineBlockId(2), &[9u8; 4096]).unwrap();
//! // SAFETY: the arena outlives the exporter and its server, and block 2 is not written
//! // until the request is released.
//! let exporter = unsafe { Exporter::new(arena.layout().clone()) }.unwrap();
//! let server = TcpServer::start(exporter.clone(), ServerConfig::default()).unwrap();
//! let key = BlockKey::chain(None, b"prefill block");
//! let lease = LeaseConfig::with_ttl_ms(30_000);
//! exporter.export(RequestId(1), &[(key, EngineBlockId(2))], &lease).unwrap();
//! exporter.ready(RequestId(1)).unwrap();
//! let desc = server.descriptor(&exporter, RequestId(1)).unwrap();
//!
//! // Consumer: register the descriptor, then load the block by key.
//! let importer = Importer::new(ImporterConfig::default()).unwrap();
//! let remote = importer.handle();
//! remote.register(desc).unwrap();
//! let mut b = DriverBuilder::new(DriverConfig::default());
//! let rdma = b.backend(Box::new(importer));
//! let driver = b.spawn().unwrap();
//! let pool = BufferPool::new(4, 4096, DEFAULT_ALIGN).unwrap();
//! let deadline = Instant::now() + Duration::from_secs(5);
//! let task = driver.submit(TaskSpec {
//!     request: RequestId(10), dir: Direction::Load, route: vec![rdma],
//!     blocks: vec![OpBlock { key, engine: None, buf: Buf::Owned(pool.take().unwrap()) }],
//!     deadline, deferred: false,
//! }).unwrap();
//! let report = driver.wait_report(task, deadline).unwrap();
//! assert!(report.is_ok());
//! assert_eq!(report.blocks[0].buf.as_ref().unwrap().as_slice(), &[9u8; 4096][..]);
//!
//! // Done: the producer releases the request and the engine may free block 2.
//! remote.done(RequestId(1)).unwrap();
//! let released = exporter.poll_released().unwrap();
//! assert_eq!(released.reason, kvx_policy::ReleaseReason::Read);
//! assert_eq!(released.blocks, vec![EngineBlockId(2)]);
//! ```
#![warn(missing_docs)]

#[cfg(feature = "bench")]
pub mod bench;
mod descriptor;
mod error;
mod exporter;
mod exports;
mod importer;
mod keeper;
mod memory;
mod shards;
mod tcp;
mod transport;
#[cfg(feature = "verbs")]
pub mod verbs;
pub mod wire;

pub use descriptor::{RemoteDescriptor, TransportKind};
pub use error::RdmaError;
pub use exporter::Exporter;
pub use exports::{ExportStats, Released};
pub use importer::{Importer, ImporterConfig, ImporterHandle};
pub use keeper::{KeeperConfig, KeptLease, LeaseKeeper};
pub use tcp::{ServerConfig, TcpClientConfig, TcpServer, TcpTransport};
pub use transport::{BoxFuture, CancelToken, ReadSlot, Transport};
#[cfg(feature = "verbs")]
pub use verbs::{VerbsConfig, VerbsServer, VerbsTransport};
