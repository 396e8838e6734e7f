//! A CPU stand-in for the CUDA driver library, for tests only.
//!
//! Built as a shared library that the dynamic loader picks up instead of `libcuda.so`
//! (`scripts/cuda-standin.sh` links it under that name and puts it on `LD_LIBRARY_PATH`), so
//! kvx-cuda runs its real code, through cudarc's run-time loading, on machines without a GPU.
//! It implements every function kvx-cuda resolves (its `REQUIRED_SYMBOLS`, and
//! `cuMemcpyBatchAsync` through `cuGetProcAddress_v2`), and `cuLaunchHostFunc` for tests that
//! play the engine ([`engine_stream`]), over host memory, with the semantics
//! that make ordering bugs visible instead of hiding them:
//!
//! - **Asynchronous streams** ([`stream`]): each stream has a thread of its own that runs the
//!   stream's work later, in order. Nothing completes at submit. `cuEventRecord` completes
//!   when the stream's thread reaches it; `cuEventSynchronize`, `cuStreamSynchronize` and
//!   `cuCtxSynchronize` wait for that. `cuStreamWaitEvent` makes a stream run nothing queued
//!   after it until the event's record made before the call was reached (another stream's:
//!   the only ordering between streams), and `cuLaunchHostFunc` runs a host function on the
//!   stream's thread (a sleeping one is a slow "kernel"). Handle 0 (and `CU_STREAM_LEGACY`)
//!   is the context's default stream, a stream like the others.
//! - **"Device" memory** ([`memory`]): every `cuMemAlloc` is an anonymous mapping of its own,
//!   handed out at a device address in a window no host pointer can be (non-canonical
//!   addresses from `0xDE00_0000_0000_0000`, a gap after each allocation): a host access to a
//!   device pointer faults at once instead of silently working.
//! - **Range checks**: every copy is checked against the allocations and the host memory
//!   registered with `cuMemHostRegister` (asynchronous copies need registered memory, as DMA
//!   does); an out-of-range or unregistered pointer is `CUDA_ERROR_INVALID_VALUE`, not a
//!   crash. A copy whose memory went away while it was queued fails the context with
//!   `CUDA_ERROR_ILLEGAL_ADDRESS`.
//! - **Knobs** ([`knobs`], per device, set through [`control::Standin`]): a delay per copy, a
//!   stalled device (its streams stop: a hung copy), a sticky error after N copies (every later
//!   call on that context fails with `CUDA_ERROR_ILLEGAL_ADDRESS`, until the primary context is
//!   released and retained afresh), a limit on the bytes one `cuMemHostRegister` may pin, and a
//!   driver without the batch copy.
//!
//! The stand-in has [`DEVICES`] devices, so parallel tests that turn knobs can each take a
//! device of their own. It reports driver version 12080 (CUDA 12.8).
//!
//! Never link it into a program that should use a GPU: it is a test double.

pub mod control;
pub mod engine_stream;
mod exports;
pub mod knobs;
mod loaded;
pub mod memory;
mod registry;
pub mod stream;

#[cfg(test)]
mod semantics_tests;

/// Devices the stand-in reports (`cuDeviceGetCount`).
pub const DEVICES: i32 = 16;

/// `cuDriverGetVersion`: CUDA 12.8, the first driver with `cuMemcpyBatchAsync`.
pub const DRIVER_VERSION: i32 = 12080;
