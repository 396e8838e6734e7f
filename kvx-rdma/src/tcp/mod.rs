//! The TCP transport (tokio): a producer-side server and a consumer-side client.

mod client;
mod reads;
mod replies;
mod send;
mod server;

pub use client::{TcpClientConfig, TcpTransport};
#[cfg_attr(not(feature = "bench"), allow(unused_imports))]
pub(crate) use reads::{BATCH_BYTES, BATCH_READS};
#[cfg_attr(not(feature = "verbs"), allow(unused_imports))]
pub(crate) use server::SideChannel;
pub use server::{ServerConfig, TcpServer};
