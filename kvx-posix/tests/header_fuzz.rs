//! The block header parser fed arbitrary bytes and truncations (10,000+ cases each): it never
//! panics, every rejection says why, and it allocates nothing, whatever length a header claims.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvx_core::BlockKey;
use kvx_posix::format::{HEADER_LEN, HeaderError, encode_header, parse_header};
use proptest::prelude::*;

/// Counts the allocations a thread makes while it is armed.
struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ARMED.try_with(Cell::get).unwrap_or(false) {
            let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Parse with the allocation counter armed; the result and the allocations made.
fn parse_counted(bytes: &[u8]) -> (Result<kvx_posix::format::Header, HeaderError>, usize) {
    let before = ALLOCS.with(Cell::get);
    ARMED.with(|a| a.set(true));
    let r = parse_header(bytes);
    ARMED.with(|a| a.set(false));
    (r, ALLOCS.with(Cell::get) - before)
}

fn valid(key: u128, payload_len: usize) -> Vec<u8> {
    let mut h = vec![0u8; HEADER_LEN];
    encode_header(&mut h, BlockKey(key), &vec![7u8; payload_len], 99);
    h
}

/// `len` arbitrary bytes from `seed` (xorshift; much faster than a strategy per byte).
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn check(bytes: &[u8]) {
    let (r, allocs) = parse_counted(bytes);
    assert_eq!(allocs, 0, "the parser allocated");
    match r {
        Ok(h) => {
            // Only a header whose checksum matches parses: its fields are what was encoded.
            assert!(bytes.len() >= HEADER_LEN);
            assert_eq!(&bytes[0..8], b"KVXBLOCK");
            assert_eq!(h.len, u64::from_le_bytes(bytes[32..40].try_into().unwrap()));
        }
        Err(e) => {
            let msg = e.to_string();
            let named = ["short header", "wrong magic", "not readable", "checksum"];
            assert!(
                named.iter().any(|n| msg.contains(n)),
                "unclear error: {msg}"
            );
            if bytes.len() < HEADER_LEN {
                assert_eq!(e, HeaderError::Short { len: bytes.len() });
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 10_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn arbitrary_bytes(seed in any::<u64>(), len in 0..HEADER_LEN + 64) {
        check(&noise(seed, len));
    }

    #[test]
    fn arbitrary_bytes_behind_the_magic(
        version in any::<u32>(),
        seed in any::<u64>(),
        len in HEADER_LEN - 64..HEADER_LEN,
    ) {
        let rest = noise(seed, len);
        let mut b = b"KVXBLOCK".to_vec();
        b.extend_from_slice(&version.to_le_bytes());
        b.extend_from_slice(&rest);
        check(&b);
        if b.len() >= HEADER_LEN && version != kvx_posix::format::VERSION {
            prop_assert_eq!(parse_header(&b), Err(HeaderError::NotReadable { found: version }));
        }
    }

    #[test]
    fn truncated_and_flipped_headers(
        key in any::<u128>(),
        len in 0usize..(1 << 20),
        cut in 0usize..=HEADER_LEN,
        flip in proptest::option::of((0usize..48, 1u8..=255)),
    ) {
        let mut h = valid(key, len % 5000);
        h.truncate(cut);
        if let Some((at, x)) = flip && at < h.len() {
            h[at] ^= x;
        }
        check(&h);
        let whole = cut == HEADER_LEN && flip.is_none_or(|(at, _)| at >= cut);
        if whole {
            prop_assert_eq!(parse_header(&h).map(|p| p.key), Ok(BlockKey(key)));
        } else if cut < HEADER_LEN {
            prop_assert_eq!(parse_header(&h), Err(HeaderError::Short { len: cut }));
        } else {
            prop_assert!(parse_header(&h).is_err(), "a flipped byte in 0..48 is caught");
        }
    }
}
