//! The wire decoder fed arbitrary bytes and truncated frames: never a panic, always an error
//! that says what is wrong, and never an allocation sized by a length field rather than by
//! the bytes that actually arrived.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvx_rdma::wire::{
    self, FrameError, PROTOCOL_VERSION, Reply, ReplyHead, Request, read_body, read_reply_head_limit,
};
use proptest::prelude::*;

/// The system allocator, recording the largest single allocation made on each thread.
struct Counting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with`: a thread being torn down has no slot any more; nothing to record then.
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

// SAFETY: every call is forwarded unchanged to `System`; the bookkeeping touches only a
// const-initialised thread-local `Cell`, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The largest single allocation `f` made on this thread.
fn largest_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    let out = f();
    (out, LARGEST.with(|l| l.get()))
}

/// What a decoder may allocate for `n` input bytes: the bytes themselves with growth slack,
/// the 4 KiB a frame reader reserves up front, and room for an error message.
fn bound(n: usize) -> usize {
    2 * n + 8192
}

const CASES: u32 = 10_000;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
}

/// A frame length field: anything, with the extremes well represented.
fn length_field() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(u32::MAX),
        Just(0u32),
        Just(1u32 << 31),
        0u32..64,
        any::<u32>(),
    ]
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        (
            any::<u16>(),
            any::<u32>(),
            prop::collection::vec(any::<u8>(), 0..=256)
        )
            .prop_map(|(version, reader, token)| Request::Hello {
                version,
                reader,
                token
            }),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(|(tag, request, block, offset, len)| Request::Read {
                tag,
                request,
                block,
                offset,
                len
            }),
        (any::<u64>(), any::<u64>()).prop_map(|(tag, request)| Request::Heartbeat { tag, request }),
        (any::<u64>(), any::<u64>()).prop_map(|(tag, request)| Request::Done { tag, request }),
        (any::<u64>(), prop::collection::vec(any::<u8>(), 0..64))
            .prop_map(|(tag, body)| Request::Verbs { tag, body }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Arbitrary frame bodies: decoded or refused with a message, allocation bounded.
    #[test]
    fn any_body_decodes_or_is_refused(body in prop::collection::vec(any::<u8>(), 0..600)) {
        let (req, big) = largest_alloc(|| Request::decode(&body));
        prop_assert!(big <= bound(body.len()), "request decode allocated {big} for {} bytes", body.len());
        if let Err(e) = &req {
            prop_assert!(!e.is_empty());
        }
        let (reply, big) = largest_alloc(|| Reply::decode(&body));
        prop_assert!(big <= bound(body.len()), "reply decode allocated {big} for {} bytes", body.len());
        match reply {
            Err(e) => prop_assert!(!e.is_empty()),
            // What decodes re-encodes to the same bytes (so nothing was silently skipped),
            // except an error code outside the table, which reads as Internal.
            Ok(r @ (Reply::Welcome { .. } | Reply::Ack { .. } | Reply::Verbs { .. })) => {
                prop_assert_eq!(&r.encode()[4..], &body[..]);
            }
            Ok(_) => {}
        }
    }

    /// Every request round-trips, and every truncation of it is an error naming the cut.
    #[test]
    fn truncated_requests_are_errors(req in request(), cut in any::<prop::sample::Index>()) {
        let bytes = req.encode();
        prop_assert_eq!(
            u32::from_be_bytes(bytes[..4].try_into().unwrap()) as usize,
            bytes.len() - 4
        );
        prop_assert_eq!(Request::decode(&bytes[4..]).unwrap(), req.clone());
        let body = &bytes[4..];
        let at = cut.index(body.len());
        let short = Request::decode(&body[..at]);
        match (&req, short) {
            // A verbs body is opaque: a shorter one is still a frame, with a shorter body.
            (Request::Verbs { .. }, Ok(Request::Verbs { .. })) if at >= 9 => {}
            (_, Ok(r)) => prop_assert!(false, "a cut at {at} decoded as {r:?}"),
            (_, Err(e)) => prop_assert!(
                e.contains("truncated") || e.contains("unknown frame type") || e.contains("trailing"),
                "{e}"
            ),
        }
    }

    /// A stream that announces any length and then carries arbitrary (often far fewer) bytes:
    /// the reader refuses or reads it, and never allocates for bytes that did not arrive.
    #[test]
    fn stream_lengths_do_not_size_allocations(
        len in length_field(),
        tail in prop::collection::vec(any::<u8>(), 0..300),
        max in prop_oneof![Just(u32::MAX), Just(4096u32), 0u32..64],
    ) {
        let rt = runtime();
        let mut input = len.to_be_bytes().to_vec();
        input.extend_from_slice(&tail);
        let (body, big) = largest_alloc(|| rt.block_on(read_body(&mut &input[..], max)));
        prop_assert!(big <= bound(input.len()), "read_body allocated {big} for {} bytes", input.len());
        match body {
            Ok(b) => {
                prop_assert_eq!(b.len(), len as usize);
                prop_assert!(len <= max);
            }
            Err(FrameError::TooLarge(n)) => prop_assert!(n > max && n == len),
            Err(FrameError::Empty) => prop_assert_eq!(len, 0),
            Err(FrameError::Eof) => prop_assert!(input.is_empty()),
            Err(FrameError::Io(e)) => {
                prop_assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
                prop_assert!((len as usize) > tail.len());
            }
        }
        let (head, big) = largest_alloc(|| {
            rt.block_on(read_reply_head_limit(&mut &input[..], u64::from(max), max))
        });
        prop_assert!(big <= bound(input.len()), "read_reply_head allocated {big} for {} bytes", input.len());
        match head {
            Ok(ReplyHead::Data { len: n, .. }) => prop_assert!(n <= u64::from(max)),
            Ok(ReplyHead::Control(_)) => prop_assert!(len <= max),
            Err(e) => prop_assert!(!e.is_empty()),
        }
    }
}

/// The extreme by hand: a 4 GiB length prefix with the largest maximum allowed.
#[test]
fn four_gib_length_field_allocates_nothing_large() {
    let rt = runtime();
    let mut input = u32::MAX.to_be_bytes().to_vec();
    input.extend_from_slice(&[wire::MAGIC[0]; 64]);
    let (r, big) = largest_alloc(|| rt.block_on(read_body(&mut &input[..], u32::MAX)));
    assert!(matches!(r, Err(FrameError::Io(_))), "{r:?}");
    assert!(big <= bound(input.len()), "allocated {big}");
    let (r, big) =
        largest_alloc(|| rt.block_on(read_reply_head_limit(&mut &input[..], 0, u32::MAX)));
    let e = r.unwrap_err();
    assert!(e.contains("reading a reply"), "{e}");
    assert!(big <= bound(input.len()), "allocated {big}");
    let hello = Request::Hello {
        version: PROTOCOL_VERSION,
        reader: 1,
        token: vec![],
    };
    assert!(Request::decode(&hello.encode()[4..]).is_ok());
}
