//! kvx: move LLM KV-cache blocks between engine memory, host memory, files and remote nodes,
//! with a hard deadline on every transfer and a verdict on every block.
//!
//! This facade re-exports the kvx crates, one cargo feature each:
//!
//! | feature | crate |
//! |---|---|
//! | (always) | [`core`] = `kvx-core` |
//! | `policy` (default) | [`policy`] = `kvx-policy` |
//! | `posix` | `posix` = `kvx-posix` (file block store: io_uring / psync, O_DIRECT, deadlines) |
//! | `offload` | `offload` = `kvx-offload` (tiered manager, engine connector, `OffloadBuilder`) |
//! | `cuda` | `cuda` = `kvx-cuda` (GPU<->pinned host copies; builds without CUDA; with `offload`, CUDA engine memory in the builder) |
//! | `rdma` | `rdma` = `kvx-rdma` (remote reads under leases; TCP; `rdma-verbs` adds ibverbs) |
//! | `prometheus` | `prometheus`: a `/metrics` endpoint for [`core::metrics`] |
//!
//! ```
//! let key = kvx::core::BlockKey::chain(None, b"tokens of the first block");
//! assert_eq!(key.to_hex().len(), 32);
//! ```

#![warn(missing_docs)]

pub use kvx_core as core;
#[cfg(feature = "cuda")]
pub use kvx_cuda as cuda;
#[cfg(feature = "offload")]
pub use kvx_offload as offload;
#[cfg(feature = "policy")]
pub use kvx_policy as policy;
#[cfg(feature = "posix")]
pub use kvx_posix as posix;
#[cfg(feature = "prometheus")]
pub mod prometheus;
#[cfg(feature = "rdma")]
pub use kvx_rdma as rdma;
