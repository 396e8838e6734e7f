//! Errors of kvx-posix: opening a store, and what a block on disk can be wrong with.

use std::path::PathBuf;

use kvx_core::{BlockError, BlockKey};

/// What went wrong in kvx-posix.
#[derive(Debug, thiserror::Error)]
pub enum PosixError {
    /// The configuration names no root directory.
    #[error("the store has no root directory")]
    NoRoots,
    /// A setting that makes no sense.
    #[error("invalid configuration: {0}")]
    BadConfig(String),
    /// A root directory cannot be created, listed or written.
    #[error("root {path}: {source}")]
    Root {
        /// The root.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// An I/O engine could not start (ring setup, thread spawn).
    #[error("{engine} engine: {msg}")]
    Engine {
        /// `uring` or `psync`.
        engine: &'static str,
        /// What failed.
        msg: String,
    },
    /// A benchmark run failed.
    #[error("benchmark: {0}")]
    Bench(String),
    /// The file is shorter than a header.
    #[error("{path}: short file: {len} bytes, a header needs {need}")]
    ShortHeader {
        /// Block file.
        path: PathBuf,
        /// Bytes found.
        len: usize,
        /// Bytes needed.
        need: usize,
    },
    /// The header does not start with the kvx magic.
    #[error("{path}: wrong magic {found:02x?}")]
    WrongMagic {
        /// Block file.
        path: PathBuf,
        /// The first bytes found.
        found: [u8; 8],
    },
    /// The block was written by another format version: a miss here, never deleted.
    #[error("{path}: format version {found} is not readable by this version")]
    NotReadable {
        /// Block file.
        path: PathBuf,
        /// Version found.
        found: u32,
    },
    /// A read returned fewer bytes than the file holds (an I/O error; the file is left alone).
    #[error("{path}: short read: {read} of {expected} bytes")]
    ShortRead {
        /// Block file.
        path: PathBuf,
        /// Bytes the read returned.
        read: usize,
        /// Bytes asked for.
        expected: usize,
    },
    /// The header's own checksum does not match.
    #[error("{path}: header checksum mismatch")]
    HeaderChecksum {
        /// Block file.
        path: PathBuf,
    },
    /// The file holds another block.
    #[error("{path}: holds block {found}, expected {expected}")]
    WrongKey {
        /// Block file.
        path: PathBuf,
        /// Key asked for.
        expected: BlockKey,
        /// Key in the header.
        found: BlockKey,
    },
    /// The payload is shorter than the header says.
    #[error("{path}: short file: {found} payload bytes, header says {expected}")]
    ShortPayload {
        /// Block file.
        path: PathBuf,
        /// Bytes in the header.
        expected: u64,
        /// Bytes present.
        found: u64,
    },
    /// The payload's checksum does not match the header.
    #[error("{path}: payload checksum mismatch (crc32c {found:08x}, header says {expected:08x})")]
    PayloadChecksum {
        /// Block file.
        path: PathBuf,
        /// Checksum in the header.
        expected: u32,
        /// Checksum of the bytes read.
        found: u32,
    },
    /// The block is larger than the buffer it should be loaded into.
    #[error("{path}: block of {len} bytes does not fit a buffer of {cap}")]
    BufferTooSmall {
        /// Block file.
        path: PathBuf,
        /// Payload length in the header.
        len: u64,
        /// Buffer capacity.
        cap: usize,
    },
}

impl PosixError {
    /// The per-block error this becomes when it fails one block of an op: checksum, key,
    /// magic and length mismatches are `Corrupt`; another format version is a miss
    /// (`NotFound`); a short read is `Io`.
    pub fn to_block_error(&self) -> BlockError {
        match self {
            PosixError::BufferTooSmall { .. } => BlockError::Invalid(self.to_string()),
            PosixError::NotReadable { .. } => BlockError::NotFound,
            PosixError::ShortRead { .. } => BlockError::Io(self.to_string()),
            PosixError::ShortHeader { .. }
            | PosixError::WrongMagic { .. }
            | PosixError::HeaderChecksum { .. }
            | PosixError::WrongKey { .. }
            | PosixError::ShortPayload { .. }
            | PosixError::PayloadChecksum { .. } => BlockError::Corrupt(self.to_string()),
            PosixError::NoRoots
            | PosixError::BadConfig(_)
            | PosixError::Root { .. }
            | PosixError::Engine { .. }
            | PosixError::Bench(_) => BlockError::Io(self.to_string()),
        }
    }
}
