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
//!
//! The rest of the header is zero. With O_DIRECT the payload is written rounded up to
//! [`HEADER_LEN`]; the padding after the payload is ignored on load.

use std::path::Path;

use kvx_core::BlockKey;

use crate::error::PosixError;

/// Header size, equal to the O_DIRECT alignment.
pub const HEADER_LEN: usize = 4096;
/// First bytes of every block file.
pub const MAGIC: [u8; 8] = *b"KVXBLOCK";
/// Format version written by this build.
pub const VERSION: u32 = 1;
const FIELDS: usize = 44;

/// Write the header of a block with `key` and `payload` into `out` (at least [`HEADER_LEN`]).
pub fn encode_header(out: &mut [u8], key: BlockKey, payload: &[u8]) {
    let out = &mut out[..HEADER_LEN];
    out.fill(0);
    out[0..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
    out[16..32].copy_from_slice(&key.to_be_bytes());
    out[32..40].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    out[40..44].copy_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    let hcrc = crc32c::crc32c(&out[..FIELDS]);
    out[44..48].copy_from_slice(&hcrc.to_le_bytes());
}

fn le32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Check a header read from `path` for `key`; `file_payload` is how many bytes followed the
/// header and `cap` the buffer they were read into. Returns the payload length.
pub fn check_header(
    path: &Path,
    header: &[u8],
    header_bytes: usize,
    key: BlockKey,
    file_payload: usize,
    cap: usize,
) -> Result<usize, PosixError> {
    if header_bytes < HEADER_LEN || header.len() < HEADER_LEN {
        return Err(PosixError::ShortHeader {
            path: path.to_path_buf(),
            len: header_bytes,
            need: HEADER_LEN,
        });
    }
    let mut magic = [0u8; 8];
    magic.copy_from_slice(&header[0..8]);
    if magic != MAGIC {
        return Err(PosixError::WrongMagic {
            path: path.to_path_buf(),
            found: magic,
        });
    }
    let version = le32(&header[8..12]);
    if version != VERSION {
        return Err(PosixError::WrongVersion {
            path: path.to_path_buf(),
            found: version,
        });
    }
    if le32(&header[44..48]) != crc32c::crc32c(&header[..FIELDS])
        || le32(&header[12..16]) as usize != HEADER_LEN
    {
        return Err(PosixError::HeaderChecksum {
            path: path.to_path_buf(),
        });
    }
    let mut kb = [0u8; 16];
    kb.copy_from_slice(&header[16..32]);
    let found = BlockKey::from_be_bytes(kb);
    if found != key {
        return Err(PosixError::WrongKey {
            path: path.to_path_buf(),
            expected: key,
            found,
        });
    }
    let len = le64(&header[32..40]);
    if len > cap as u64 {
        return Err(PosixError::BufferTooSmall {
            path: path.to_path_buf(),
            len,
            cap,
        });
    }
    if (file_payload as u64) < len {
        return Err(PosixError::ShortPayload {
            path: path.to_path_buf(),
            expected: len,
            found: file_payload as u64,
        });
    }
    Ok(len as usize)
}

/// Check the payload against the checksum in `header` (already checked by [`check_header`]).
pub fn check_payload(path: &Path, header: &[u8], payload: &[u8]) -> Result<(), PosixError> {
    let expected = le32(&header[40..44]);
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
        encode_header(&mut h, key, payload);
        h
    }

    #[test]
    fn header_round_trip_and_each_error() {
        let key = BlockKey(42);
        let payload = vec![9u8; 1000];
        let p = Path::new("x.kvb");
        let h = block(key, &payload);
        assert_eq!(
            check_header(p, &h, HEADER_LEN, key, 1000, 4096).unwrap(),
            1000
        );
        check_payload(p, &h, &payload).unwrap();

        let e = check_header(p, &h, 100, key, 0, 4096).unwrap_err();
        assert!(matches!(e, PosixError::ShortHeader { len: 100, .. }), "{e}");
        let mut bad = h.clone();
        bad[0] = b'X';
        assert!(matches!(
            check_header(p, &bad, HEADER_LEN, key, 1000, 4096),
            Err(PosixError::WrongMagic { .. })
        ));
        let mut bad = h.clone();
        bad[8] = 7;
        assert!(matches!(
            check_header(p, &bad, HEADER_LEN, key, 1000, 4096),
            Err(PosixError::WrongVersion { found: 7, .. })
        ));
        let mut bad = h.clone();
        bad[33] ^= 1;
        assert!(matches!(
            check_header(p, &bad, HEADER_LEN, key, 1000, 4096),
            Err(PosixError::HeaderChecksum { .. })
        ));
        assert!(matches!(
            check_header(p, &h, HEADER_LEN, BlockKey(43), 1000, 4096),
            Err(PosixError::WrongKey { .. })
        ));
        assert!(matches!(
            check_header(p, &h, HEADER_LEN, key, 999, 4096),
            Err(PosixError::ShortPayload {
                expected: 1000,
                found: 999,
                ..
            })
        ));
        assert!(matches!(
            check_header(p, &h, HEADER_LEN, key, 1000, 512),
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
