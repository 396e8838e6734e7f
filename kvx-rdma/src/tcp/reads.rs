//! Which reads are answered together: the reads a client pipelined, already whole in the
//! server's buffer, up to a batch's limits ([`super::replies`] writes their replies).

use kvx_core::RequestId;

use crate::wire::{self, Request};

/// Reads admitted and answered together, at most.
pub(crate) const BATCH_READS: usize = 64;

/// Bytes of reads admitted at once: no read joins a batch that holds this many already (the
/// last one may take it to this plus the server's `max_read`). Admitted reads pin their
/// request's blocks until written.
pub(crate) const BATCH_BYTES: u64 = 8 << 20;

/// One read request off the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Read {
    /// The client's tag for the reply.
    pub tag: u64,
    /// The exported request read.
    pub request: RequestId,
    /// Block index in the request's export.
    pub block: u32,
    /// First byte of the block read.
    pub offset: u64,
    /// Bytes read.
    pub len: u64,
}

impl Read {
    /// The read a decoded request asks for, if it is a read.
    pub(super) fn of(req: &Request) -> Option<Read> {
        match *req {
            Request::Read {
                tag,
                request,
                block,
                offset,
                len,
            } => Some(Read {
                tag,
                request: RequestId(request),
                block,
                offset,
                len,
            }),
            _ => None,
        }
    }
}

/// Append to `batch` the reads that lie whole at the start of `buffered`, up to the batch's
/// limits, stopping at any other frame, a partial one, or one that does not decode (the
/// serving loop reads and answers those itself); returns the bytes the appended reads span.
pub(super) fn take_buffered(buffered: &[u8], max_frame: u32, batch: &mut Vec<Read>) -> usize {
    let mut used = 0;
    let mut bytes = batch.iter().fold(0u64, |b, r| b.saturating_add(r.len));
    while batch.len() < BATCH_READS && bytes < BATCH_BYTES {
        let Some((body, n)) = wire::buffered_frame(&buffered[used..], max_frame) else {
            break;
        };
        let Some(read) = Request::decode(body).ok().as_ref().and_then(Read::of) else {
            break;
        };
        bytes = bytes.saturating_add(read.len);
        batch.push(read);
        used += n;
    }
    used
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn read(tag: u64, len: u64) -> Request {
        Request::Read {
            tag,
            request: 7,
            block: tag as u32,
            offset: 0,
            len,
        }
    }

    /// Whole reads join the batch in order; a partial frame, another kind of frame or the
    /// batch's limits stop it, and only the bytes taken are reported used.
    #[test]
    fn pipelined_reads_join_a_batch_until_a_limit_or_another_frame() {
        let mut bytes = [read(1, 10), read(2, 10)]
            .iter()
            .flat_map(Request::encode)
            .collect::<Vec<u8>>();
        let two = bytes.len();
        bytes.extend(Request::Heartbeat { tag: 3, request: 7 }.encode());
        bytes.extend(read(4, 10).encode());
        let mut batch = vec![Read::of(&read(0, 10)).unwrap()];
        assert_eq!(take_buffered(&bytes, 4096, &mut batch), two);
        let tags: Vec<u64> = batch.iter().map(|r| r.tag).collect();
        assert_eq!(tags, [0, 1, 2]);

        // A partial read at the end stays in the buffer.
        let whole = read(5, 10).encode();
        let mut batch = Vec::new();
        let partial = [whole.clone(), whole[..whole.len() - 1].to_vec()].concat();
        assert_eq!(take_buffered(&partial, 4096, &mut batch), whole.len());
        assert_eq!(batch.len(), 1);

        // The count limit.
        let many: Vec<u8> = (0..BATCH_READS as u64 + 5)
            .flat_map(|t| read(t, 1).encode())
            .collect();
        let mut batch = Vec::new();
        let used = take_buffered(&many, 4096, &mut batch);
        assert_eq!(batch.len(), BATCH_READS);
        assert_eq!(used, BATCH_READS * whole.len());

        // The byte limit: the read that reaches it joins, the next does not.
        let big: Vec<u8> = (0..4)
            .flat_map(|t| read(t, BATCH_BYTES / 2).encode())
            .collect();
        let mut batch = Vec::new();
        assert_eq!(take_buffered(&big, 4096, &mut batch), 2 * whole.len());
        assert_eq!(batch.len(), 2);

        // A frame that does not decode is left for the serving loop to refuse.
        let mut bad = read(9, 10).encode();
        bad[4] = 0x7f;
        let mut batch = Vec::new();
        assert_eq!(take_buffered(&bad, 4096, &mut batch), 0);
        assert!(batch.is_empty());
    }

    proptest! {
        /// Whatever a peer sends, the batch parser never panics, never takes more than it
        /// was given, takes whole frames only (each one a read that decodes alone), and
        /// stops at the first byte it leaves for the serving loop.
        #[test]
        fn the_batch_parser_takes_whole_reads_only_from_any_bytes(
            frames in prop::collection::vec(
                prop_oneof![
                    (any::<u64>(), 0u64..(BATCH_BYTES / 4))
                        .prop_map(|(t, len)| read(t, len).encode()),
                    prop::collection::vec(any::<u8>(), 0..40),
                ],
                0..80,
            ),
            max_frame in 1u32..8192,
        ) {
            let bytes: Vec<u8> = frames.concat();
            let mut batch = Vec::new();
            let used = take_buffered(&bytes, max_frame, &mut batch);
            prop_assert!(used <= bytes.len());
            prop_assert!(batch.len() <= BATCH_READS);
            // Re-walk the taken bytes: exactly `batch`, frame by frame.
            let mut at = 0;
            for r in &batch {
                let (body, n) = wire::buffered_frame(&bytes[at..used], max_frame).unwrap();
                let decoded = Request::decode(body).unwrap();
                prop_assert_eq!(Read::of(&decoded), Some(*r));
                at += n;
            }
            prop_assert_eq!(at, used);
            // Below the limits, what follows is not a whole read.
            let taken = batch.iter().fold(0u64, |b, r| b.saturating_add(r.len));
            if batch.len() < BATCH_READS && taken < BATCH_BYTES {
                let next = wire::buffered_frame(&bytes[used..], max_frame)
                    .and_then(|(body, _)| Request::decode(body).ok());
                prop_assert_eq!(next.as_ref().and_then(Read::of), None);
            }
        }
    }
}
