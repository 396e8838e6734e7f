//! The on-disk block format: a fixed header padded to [`HEADER_LEN`], then the payload.
//!
//! Header layout (little-endian integers):
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `KVXBLOCK` |
//! | 8..12 | format version (1) |
//! | 12..16 | header length (4096) |
//! | 16..32 | block key, big-endian |
//! | 32..40 | payload length |
//! | 40..44 | crc32c of the payload |
//! | 44..48 | crc32c of bytes 0..44 |
//! | 48..56 | write nonce: a number unique to the store that wrote the file |
//!
//! The rest of the header is zero. With O_DIRECT the payload is written rounded up to
//! [`HEADER_LEN`], the padding zero; the padding after the payload is ignored on load.
//!
//! A header of another format version is *not readable by this version*: a miss, never a
//! corrupt block, so that in a rolling upgrade on a shared mount old nodes never delete what
//! new ones wrote. The write nonce is outside the header checksum (format version 1 readers
//! ignore it); it lets a store undo exactly the file it wrote and nothing newer.

use std::path::Path;

use kvx_core::BlockKey;

use crate::error::PosixError;

/// Header size, equal to the O_DIRECT alignment.
pub const HEADER_LEN: usize = 4096;

/// `n` rounded up to whole sectors ([`HEADER_LEN`]), as O_DIRECT writes a payload.
pub(crate) fn round_up(n: usize) -> usize {
    n.div_ceil(HEADER_LEN) * HEADER_LEN
}
/// First bytes of every block file.
pub const MAGIC: [u8; 8] = *b"KVXBLOCK";
/// Format version written by this build.
pub const VERSION: u32 = 1;
const FIELDS: usize = 44;
const NONCE: std::ops::Range<usize> = 48..56;

/// What a well-formed header of this format version says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The block's key.
    pub key: BlockKey,
    /// Payload bytes after the header.
    pub len: u64,
    /// crc32c of the payload.
    pub payload_crc: u32,
    /// Nonce of the write that made the file.
    pub nonce: u64,
}

/// Why bytes are not a readable header (the path is added by the caller).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// Fewer bytes than a header.
    #[error("short header: {len} bytes, a header needs {HEADER_LEN}")]
    Short {
        /// Bytes given.
        len: usize,
    },
    /// The bytes do not start with [`MAGIC`].
    #[error("wrong magic {found:02x?}")]
    Magic {
        /// The first bytes found.
        found: [u8; 8],
    },
    /// A format version other than [`VERSION`]: written by another kvx version.
    #[error("format version {found} is not readable by this version (reads {VERSION})")]
    NotReadable {
        /// Version found.
        found: u32,
    },
    /// The header's checksum (or its length field) does not match.
    #[error("header checksum mismatch")]
    Checksum,
}

/// Write the header of a block with `key`, `payload` and write `nonce` into `out` (at least
/// [`HEADER_LEN`] bytes).
pub fn encode_header(out: &mut [u8], key: BlockKey, payload: &[u8], nonce: u64) {
    let crc = crc32c::crc32c(payload);
    encode_header_parts(out, key, payload.len(), crc, nonce);
}

/// [`encode_header`] with the payload's length and crc32c already known.
pub(crate) fn encode_header_parts(
    out: &mut [u8],
    key: BlockKey,
    len: usize,
    payload_crc: u32,
    nonce: u64,
) {
    let out = &mut out[..HEADER_LEN];
    out.fill(0);
    out[0..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
    out[16..32].copy_from_slice(&key.to_be_bytes());
    out[32..40].copy_from_slice(&(len as u64).to_le_bytes());
    out[40..44].copy_from_slice(&payload_crc.to_le_bytes());
    let hcrc = crc32c::crc32c(&out[..FIELDS]);
    out[44..48].copy_from_slice(&hcrc.to_le_bytes());
    out[NONCE].copy_from_slice(&nonce.to_le_bytes());
}

fn le32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Parse a header from `bytes` (any length, any content). Allocates nothing.
pub fn parse_header(bytes: &[u8]) -> Result<Header, HeaderError> {
    if bytes.len() < HEADER_LEN {
        return Err(HeaderError::Short { len: bytes.len() });
    }
    let mut magic = [0u8; 8];
    magic.copy_from_slice(&bytes[0..8]);
    if magic != MAGIC {
        return Err(HeaderError::Magic { found: magic });
    }
    let version = le32(bytes, 8);
    if version != VERSION {
        return Err(HeaderError::NotReadable { found: version });
    }
    if le32(bytes, 44) != crc32c::crc32c(&bytes[..FIELDS]) || le32(bytes, 12) as usize != HEADER_LEN
    {
        return Err(HeaderError::Checksum);
    }
    let mut kb = [0u8; 16];
    kb.copy_from_slice(&bytes[16..32]);
    Ok(Header {
        key: BlockKey::from_be_bytes(kb),
        len: le64(bytes, 32),
        payload_crc: le32(bytes, 40),
        nonce: le64(bytes, NONCE.start),
    })
}

/// The format version a header claims when its magic is right (whatever its checksum says).
pub(crate) fn claimed_version(bytes: &[u8]) -> Option<u32> {
    (bytes.len() >= 12 && bytes[0..8] == MAGIC).then(|| le32(bytes, 8))
}

/// Check a header read from `path` for `key`. `read` is how many header bytes the read
/// returned, `file_len` the file's size, `payload_read` how many payload bytes the read
/// returned and `cap` the buffer they were read into. Returns the payload length.
///
/// A file too short for its header or its payload is corrupt (a length mismatch); a read that
/// returned fewer bytes than a long enough file holds is a short read, an I/O error that leaves
/// the file alone.
pub(crate) fn check_header(
    path: &Path,
    header: &[u8],
    read: usize,
    key: BlockKey,
    file_len: usize,
    payload_read: usize,
    cap: usize,
) -> Result<usize, PosixError> {
    let p = || path.to_path_buf();
    if file_len < HEADER_LEN {
        return Err(PosixError::ShortHeader {
            path: p(),
            len: file_len,
            need: HEADER_LEN,
        });
    }
    if read < HEADER_LEN {
        return Err(PosixError::ShortRead {
            path: p(),
            read,
            expected: HEADER_LEN,
        });
    }
    let h = parse_header(&header[..HEADER_LEN.min(header.len())]).map_err(|e| match e {
        HeaderError::Short { len } => PosixError::ShortHeader {
            path: p(),
            len,
            need: HEADER_LEN,
        },
        HeaderError::Magic { found } => PosixError::WrongMagic { path: p(), found },
        HeaderError::NotReadable { found } => PosixError::NotReadable { path: p(), found },
        HeaderError::Checksum => PosixError::HeaderChecksum { path: p() },
    })?;
    if h.key != key {
        return Err(PosixError::WrongKey {
            path: p(),
            expected: key,
            found: h.key,
        });
    }
    if h.len > cap as u64 {
        return Err(PosixError::BufferTooSmall {
            path: p(),
            len: h.len,
            cap,
        });
    }
    let in_file = (file_len - HEADER_LEN) as u64;
    if in_file < h.len {
        return Err(PosixError::ShortPayload {
            path: p(),
            expected: h.len,
            found: in_file,
        });
    }
    if (payload_read as u64) < h.len {
        return Err(PosixError::ShortRead {
            path: p(),
            read: HEADER_LEN + payload_read,
            expected: HEADER_LEN + h.len as usize,
        });
    }
    Ok(h.len as usize)
}

/// Check the payload against the checksum in `header` (already checked by [`check_header`]).
pub(crate) fn check_payload(path: &Path, header: &[u8], payload: &[u8]) -> Result<(), PosixError> {
    let expected = le32(header, 40);
    let found = crc32c::crc32c(payload);
    if found != expected {
        return Err(PosixError::PayloadChecksum {
            path: path.to_path_buf(),
            expected,
            found,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(key: BlockKey, payload: &[u8]) -> Vec<u8> {
        let mut h = vec![0u8; HEADER_LEN];
        encode_header(&mut h, key, payload, 77);
        h
    }

    const FILE: usize = HEADER_LEN + 1000;

    #[test]
    fn header_round_trip_and_each_error() {
        let key = BlockKey(42);
        let payload = vec![9u8; 1000];
        let p = Path::new("x.kvb");
        let h = block(key, &payload);
        assert_eq!(parse_header(&h).unwrap().nonce, 77);
        let ok = |h: &[u8]| check_header(p, h, HEADER_LEN, key, FILE, 1000, 4096);
        assert_eq!(ok(&h).unwrap(), 1000);
        check_payload(p, &h, &payload).unwrap();

        let e = check_header(p, &h, 100, key, 100, 0, 4096).unwrap_err();
        assert!(matches!(e, PosixError::ShortHeader { len: 100, .. }), "{e}");
        assert!(matches!(
            e.to_block_error(),
            kvx_core::BlockError::Corrupt(_)
        ));
        let e = check_header(p, &h, 100, key, FILE, 0, 4096).unwrap_err();
        assert!(matches!(e, PosixError::ShortRead { read: 100, .. }), "{e}");
        assert!(matches!(e.to_block_error(), kvx_core::BlockError::Io(_)));
        let mut bad = h.clone();
        bad[0] = b'X';
        assert!(matches!(ok(&bad), Err(PosixError::WrongMagic { .. })));
        let mut newer = h.clone();
        newer[8] = 7;
        let e = ok(&newer).unwrap_err();
        assert!(matches!(e, PosixError::NotReadable { found: 7, .. }), "{e}");
        assert!(
            e.to_string().contains("not readable by this version"),
            "{e}"
        );
        assert_eq!(e.to_block_error(), kvx_core::BlockError::NotFound);
        assert_eq!(claimed_version(&newer), Some(7));
        let mut bad = h.clone();
        bad[33] ^= 1;
        assert!(matches!(ok(&bad), Err(PosixError::HeaderChecksum { .. })));
        assert!(matches!(
            check_header(p, &h, HEADER_LEN, BlockKey(43), FILE, 1000, 4096),
            Err(PosixError::WrongKey { .. })
        ));
        assert!(matches!(
            check_header(p, &h, HEADER_LEN, key, FILE - 1, 999, 4096),
            Err(PosixError::ShortPayload {
                expected: 1000,
                found: 999,
                ..
            })
        ));
        let e = check_header(p, &h, HEADER_LEN, key, FILE, 999, 4096).unwrap_err();
        assert!(matches!(e, PosixError::ShortRead { .. }), "{e}");
        assert!(matches!(
            check_header(p, &h, HEADER_LEN, key, FILE, 1000, 512),
            Err(PosixError::BufferTooSmall { .. })
        ));
        let mut flipped = payload.clone();
        flipped[500] ^= 0x40;
        let e = check_payload(p, &h, &flipped).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
        assert!(matches!(
            e.to_block_error(),
            kvx_core::BlockError::Corrupt(_)
        ));
    }
}
