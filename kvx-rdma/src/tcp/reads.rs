//! Answering reads: each one admitted against its request's lease, and the reads a client
//! pipelined (already whole in the server's buffer) answered together, every head and block
//! in one vectored write, so a batch of reads costs the kernel one send, not one per block.

use std::io::IoSlice;
use std::time::Instant;

use kvx_core::RequestId;
use tokio::io::AsyncWrite;
use tracing::warn;

use super::server::{Ctx, Stop, send_until};
use crate::memory::PinnedRead;
use crate::wire::{self, ErrorCode, Reply, Request};

/// Reads answered by one write, at most.
pub(crate) const BATCH_READS: usize = 64;

/// Bytes answered by one write: no read joins a batch that holds this many already. A block
/// written early in a batch stays pinned until the batch is written (~2 ms at 4 GiB/s).
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

/// Answer `reads` in order with one vectored write: a data frame and the block's bytes for
/// each read the lease admits, an error frame for each it refuses. The whole write has one
/// deadline: the write timeout from now, and never past the lease of a request it reads
/// (re-read when a lease is renewed or ends). A write that misses it is cut: the pins drop,
/// the connection is reset, the reader's blocks fail. Pins are held only until the write
/// ends, and the engine hears of a release only after they drop.
pub(super) async fn serve_reads<W: AsyncWrite + Unpin>(
    stream: &mut W,
    ctx: &Ctx,
    reads: &[Read],
) -> Result<(), Stop> {
    let cfg = &ctx.cfg;
    if !cfg.pace.is_zero() {
        tokio::time::sleep(cfg.pace).await;
    }
    // Subscribed before any read is admitted, so no lease end after admission is missed.
    let mut events = ctx.exporter.lease_events();
    let mut frames: Vec<Vec<u8>> = Vec::with_capacity(reads.len());
    let mut pins: Vec<Option<PinnedRead>> = Vec::with_capacity(reads.len());
    let mut leased: Vec<RequestId> = Vec::new();
    for r in reads {
        let admitted = if r.len > cfg.max_read {
            Err((
                ErrorCode::ReadTooLarge,
                format!(
                    "read of {} bytes exceeds the server's maximum of {}",
                    r.len, cfg.max_read
                ),
            ))
        } else {
            ctx.exporter.begin_read(r.request, r.block, r.offset, r.len)
        };
        match admitted {
            Ok(pin) => {
                frames.push(
                    Reply::Data {
                        tag: r.tag,
                        len: pin.len(),
                    }
                    .encode(),
                );
                if !leased.contains(&r.request) {
                    leased.push(r.request);
                }
                pins.push(Some(pin));
            }
            Err((code, message)) => {
                frames.push(
                    Reply::Error {
                        tag: r.tag,
                        code,
                        message,
                    }
                    .encode(),
                );
                pins.push(None);
            }
        }
    }
    let hard = Instant::now() + cfg.write_timeout;
    let exporter = &ctx.exporter;
    let mut bufs: Vec<IoSlice<'_>> = frames
        .iter()
        .zip(&pins)
        .flat_map(|(frame, pin)| {
            std::iter::once(IoSlice::new(frame))
                .chain(pin.iter().flat_map(|p| p.slices().map(IoSlice::new)))
        })
        .collect();
    let deadline = || {
        leased.iter().try_fold(hard, |until, request| {
            exporter
                .read_deadline(*request)
                .map(|lease| lease.min(until))
        })
    };
    let r = send_until(stream, &mut bufs, deadline, Some(&mut events)).await;
    drop(bufs);
    drop(pins);
    if r == Err(Stop::Cut) {
        warn!(
            reads = reads.len(),
            first = ?reads.first(),
            "kvx-rdma server: reply cut at its deadline (write timeout or lease end)"
        );
    }
    r
}

#[cfg(test)]
mod tests {
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
        take_buffered(&big, 4096, &mut batch);
        assert_eq!(batch.len(), 2);

        // A frame that does not decode is left for the serving loop to refuse.
        let mut bad = read(9, 10).encode();
        bad[4] = 0x7f;
        let mut batch = Vec::new();
        assert_eq!(take_buffered(&bad, 4096, &mut batch), 0);
        assert!(batch.is_empty());
    }
}
