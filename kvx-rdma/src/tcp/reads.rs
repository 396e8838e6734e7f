//! Answering reads: each one admitted against its request's lease, and the reads a client
//! pipelined (already whole in the server's buffer) answered together, heads and blocks in
//! as few vectored writes as the socket takes, so a batch of reads costs the kernel one send
//! where the socket has room, not one per block.

use std::io::IoSlice;
use std::time::{Duration, Instant};

use kvx_core::RequestId;
use tokio::io::AsyncWrite;
use tracing::warn;

use super::send::{Outgoing, Stop, send_until};
use super::server::{Ctx, ServerConfig};
use crate::exporter::Exporter;
use crate::exports::Refusal;
use crate::memory::PinnedRead;
use crate::wire::{self, ErrorCode, Reply, Request};

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

/// The replies to a batch of reads, written in order: each read's frame (a data head, or a
/// whole error frame for a refused read) and, for an admitted read, its pin; a cursor at the
/// first byte not yet written.
///
/// Each reply keeps the deadline it had when reads were answered one by one: the write
/// timeout from when its first byte could go out, and never past its request's lease. A pin
/// drops as soon as its reply is written. A reply not started yet whose lease ends becomes
/// the refusal a read would get now, and its pin drops, without cutting the others.
pub(super) struct Replies<'a> {
    exporter: &'a Exporter,
    write_timeout: Duration,
    reads: &'a [Read],
    frames: Vec<Vec<u8>>,
    pins: Vec<Option<PinnedRead>>,
    /// The reply being written, and its bytes written so far.
    at: usize,
    written: usize,
    /// When the reply being written could start (its write timeout runs from then).
    started: Instant,
}

/// A refusal as the error frame for the read tagged `tag`.
fn refusal_frame(tag: u64, (code, message): Refusal) -> Vec<u8> {
    Reply::Error { tag, code, message }.encode()
}

impl<'a> Replies<'a> {
    /// Admit every read of `reads` (its pin, or its refusal) now, in order.
    pub(super) fn admit(exporter: &'a Exporter, cfg: &ServerConfig, reads: &'a [Read]) -> Self {
        let mut frames = Vec::with_capacity(reads.len());
        let mut pins = Vec::with_capacity(reads.len());
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
                exporter.begin_read(r.request, r.block, r.offset, r.len)
            };
            match admitted {
                Ok(pin) => {
                    let head = Reply::Data {
                        tag: r.tag,
                        len: pin.len(),
                    };
                    frames.push(head.encode());
                    pins.push(Some(pin));
                }
                Err(refusal) => {
                    frames.push(refusal_frame(r.tag, refusal));
                    pins.push(None);
                }
            }
        }
        Replies {
            exporter,
            write_timeout: cfg.write_timeout,
            reads,
            frames,
            pins,
            at: 0,
            written: 0,
            started: Instant::now(),
        }
    }

    fn reply_len(&self, i: usize) -> usize {
        self.frames[i].len() + self.pins[i].as_ref().map_or(0, |p| p.len() as usize)
    }

    /// Replies that have not started, whose request's lease ended (or is past its expiry),
    /// become refusals now.
    fn revoke_ended(&mut self, now: Instant) {
        let first = if self.written == 0 {
            self.at
        } else {
            self.at + 1
        };
        let mut ended: Vec<(RequestId, bool)> = Vec::new();
        for i in first..self.reads.len() {
            if self.pins[i].is_none() {
                continue;
            }
            let request = self.reads[i].request;
            let gone = match ended.iter().find(|(r, _)| *r == request) {
                Some(&(_, gone)) => gone,
                None => {
                    let gone = self
                        .exporter
                        .read_deadline(request)
                        .is_none_or(|lease| lease <= now);
                    ended.push((request, gone));
                    gone
                }
            };
            if !gone {
                continue;
            }
            // What a read of it gets now (`check_readable` refuses once the lease ended).
            if let Err(refusal) = self.exporter.check_readable(request) {
                self.pins[i] = None;
                self.frames[i] = refusal_frame(self.reads[i].tag, refusal);
            }
        }
    }
}

impl Outgoing for Replies<'_> {
    fn is_done(&self) -> bool {
        self.at == self.reads.len()
    }

    fn deadline(&mut self) -> Option<(Instant, Instant)> {
        let now = Instant::now();
        self.revoke_ended(now);
        let mut cut = self.started + self.write_timeout;
        if self.pins.get(self.at).is_some_and(Option::is_some) {
            cut = cut.min(self.exporter.read_deadline(self.reads[self.at].request)?);
        }
        // Look again when a later reply's lease expires, to revoke it then.
        let wake = (self.at + 1..self.reads.len())
            .filter(|&i| self.pins[i].is_some())
            .filter_map(|i| self.exporter.read_deadline(self.reads[i].request))
            .filter(|lease| *lease > now)
            .fold(cut, Instant::min);
        Some((cut, wake))
    }

    fn slices(&self) -> Vec<IoSlice<'_>> {
        let mut v: Vec<IoSlice<'_>> = (self.at..self.reads.len())
            .flat_map(|i| {
                std::iter::once(IoSlice::new(&self.frames[i])).chain(
                    self.pins[i]
                        .iter()
                        .flat_map(|p| p.slices().map(IoSlice::new)),
                )
            })
            .collect();
        let left = {
            let mut rest = &mut v[..];
            IoSlice::advance_slices(&mut rest, self.written);
            rest.len()
        };
        let skipped = v.len() - left;
        v.drain(..skipped);
        v
    }

    fn advance(&mut self, mut n: usize) {
        while n > 0 && !self.is_done() {
            let left = self.reply_len(self.at) - self.written;
            if n < left {
                self.written += n;
                return;
            }
            n -= left;
            // Written whole: its pin drops now, and the next reply's time starts.
            self.pins[self.at] = None;
            self.at += 1;
            self.written = 0;
            self.started = Instant::now();
        }
    }
}

/// Answer `reads` in order, as many per write as the socket takes: each read the lease admits
/// gets a data frame and the block's bytes, each it refuses an error frame (see [`Replies`]
/// for the deadlines). A reply that misses its deadline is cut: the pins drop, the connection
/// is reset, the reader's blocks fail. The engine hears of a release only after the pins drop.
pub(super) async fn serve_reads<W: AsyncWrite + Unpin>(
    stream: &mut W,
    ctx: &Ctx,
    reads: &[Read],
) -> Result<(), Stop> {
    let cfg = &ctx.cfg;
    // Fault injection: before each data reply (reads are not batched then).
    if !cfg.pace.is_zero() && reads.iter().any(|r| r.len <= cfg.max_read) {
        tokio::time::sleep(cfg.pace).await;
    }
    // Subscribed before any read is admitted, so no lease end after admission is missed.
    let mut events = ctx.exporter.lease_events();
    let mut replies = Replies::admit(&ctx.exporter, cfg, reads);
    let r = send_until(stream, &mut replies, Some(&mut events)).await;
    if r == Err(Stop::Cut) {
        let cut = reads.get(replies.at);
        warn!(
            ?cut,
            "kvx-rdma server: reply cut at its deadline (write timeout or lease end)"
        );
    }
    r
}

#[cfg(test)]
mod tests {
    use kvx_core::{BlockKey, EngineBlockId, HostArena};
    use kvx_policy::LeaseConfig;

    use super::*;

    const BLOCK: usize = 4096;

    /// Requests 1 and 2 exported with two blocks each, leases started.
    fn exported(arena: &HostArena) -> Exporter {
        // SAFETY: every test keeps the arena alive until after the exporter is dropped, and
        // writes no block while it is exported.
        let exporter = unsafe { Exporter::new(arena.layout().clone()) }.unwrap();
        let lease = LeaseConfig::with_ttl_ms(60_000);
        for r in [1u32, 2] {
            let blocks: Vec<_> = (0..2)
                .map(|b| {
                    let key = BlockKey::chain(None, &[r as u8, b as u8]);
                    (key, EngineBlockId(2 * (r - 1) + b))
                })
                .collect();
            exporter
                .export(RequestId(r.into()), &blocks, &lease)
                .unwrap();
            exporter.ready(RequestId(r.into())).unwrap();
        }
        exporter
    }

    fn whole(tag: u64, request: u64, block: u32) -> Read {
        Read {
            tag,
            request: RequestId(request),
            block,
            offset: 0,
            len: BLOCK as u64,
        }
    }

    fn left(r: &Replies<'_>) -> usize {
        r.slices().iter().map(|s| s.len()).sum()
    }

    /// A reply's pin drops as soon as its last byte is written, not when the batch is, and
    /// the next reply's write timeout starts then.
    #[test]
    fn each_reply_drops_its_pin_when_written_and_gets_its_own_write_timeout() {
        let arena = HostArena::contiguous(BLOCK, 4).unwrap();
        let exporter = exported(&arena);
        let cfg = ServerConfig::default();
        let reads = [whole(1, 1, 0), whole(2, 1, 1), whole(3, 2, 0)];
        let mut r = Replies::admit(&exporter, &cfg, &reads);
        let reply = wire::DATA_HEAD + BLOCK;
        assert_eq!(exporter.stats().pins, 3);
        assert_eq!(left(&r), 3 * reply);
        let (first_cut, _) = r.deadline().unwrap();
        r.advance(reply - 1);
        assert_eq!(
            exporter.stats().pins,
            3,
            "one byte of the first reply is still out"
        );
        assert_eq!(left(&r), 2 * reply + 1);
        std::thread::sleep(Duration::from_millis(2));
        r.advance(1);
        assert_eq!(exporter.stats().pins, 2, "the first reply's pin dropped");
        let (second_cut, _) = r.deadline().unwrap();
        assert!(
            second_cut > first_cut,
            "the second reply's write timeout starts later"
        );
        // Two replies' worth in one write, and the rest.
        r.advance(reply + 10);
        assert_eq!(exporter.stats().pins, 1);
        r.advance(reply - 10);
        assert!(r.is_done());
        assert_eq!(exporter.stats().pins, 0);
        assert_eq!(left(&r), 0);
    }

    /// A lease that ends under a batch: a reply not started yet becomes the refusal a read
    /// would get now and drops its pin, while the reply being written goes on; once the
    /// reply being written is the one whose lease ended, the write is cut.
    #[test]
    fn a_lease_ending_revokes_replies_not_started_and_cuts_the_one_being_written() {
        let arena = HostArena::contiguous(BLOCK, 4).unwrap();
        let exporter = exported(&arena);
        let cfg = ServerConfig::default();
        let reads = [
            whole(1, 1, 0),
            whole(2, 2, 0),
            whole(3, 2, 1),
            whole(4, 1, 1),
        ];
        let mut r = Replies::admit(&exporter, &cfg, &reads);
        let reply = wire::DATA_HEAD + BLOCK;
        r.advance(100);
        exporter.abort(RequestId(2)).unwrap();
        assert!(r.deadline().is_some(), "request 1's reply is not cut");
        assert_eq!(exporter.stats().pins, 2, "request 2's pins dropped at once");
        let refused: Vec<Reply> = (1..3)
            .map(|i| Reply::decode(&r.frames[i][4..]).unwrap())
            .collect();
        for (reply, tag) in refused.iter().zip([2, 3]) {
            assert!(
                matches!(reply, Reply::Error { tag: t, .. } if *t == tag),
                "{reply:?}"
            );
        }
        let refusals: usize = (1..3).map(|i| r.frames[i].len()).sum();
        assert_eq!(left(&r), reply - 100 + refusals + reply);
        // Past the first reply and the refusals, into request 1's second block; then its
        // lease ends too.
        r.advance(reply - 100 + refusals + 1);
        assert_eq!(exporter.stats().pins, 1);
        exporter.abort(RequestId(1)).unwrap();
        assert!(r.deadline().is_none(), "the reply being written is cut");
        drop(r);
        assert_eq!(
            exporter.stats().pins,
            0,
            "dropping the replies drops the last pin"
        );
    }

    /// A read the lease refuses at admission, and one larger than the server serves, are
    /// error frames in their place; they hold no pin.
    #[test]
    fn refused_reads_are_error_frames_in_their_place() {
        let arena = HostArena::contiguous(BLOCK, 4).unwrap();
        let exporter = exported(&arena);
        let cfg = ServerConfig {
            max_read: BLOCK as u64,
            ..ServerConfig::default()
        };
        let mut huge = whole(2, 1, 0);
        huge.len = BLOCK as u64 + 1;
        let reads = [whole(1, 1, 0), huge, whole(3, 9, 0), whole(4, 2, 1)];
        let r = Replies::admit(&exporter, &cfg, &reads);
        assert_eq!(exporter.stats().pins, 2);
        let codes: Vec<Option<ErrorCode>> = r
            .frames
            .iter()
            .map(|f| match Reply::decode(&f[4..]) {
                Ok(Reply::Error { code, .. }) => Some(code),
                _ => None,
            })
            .collect();
        assert_eq!(
            codes,
            [
                None,
                Some(ErrorCode::ReadTooLarge),
                Some(ErrorCode::UnknownRequest),
                None
            ]
        );
    }

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
}
