//! Writing the replies to a batch of reads: each admitted against its request's lease, heads
//! and blocks in as few vectored writes as the socket takes, so a batch costs the kernel one
//! send where the socket has room, not one per block; each reply with its own pin and
//! deadline.

use std::io::IoSlice;
use std::time::{Duration, Instant};

use kvx_core::RequestId;
use tokio::io::AsyncWrite;
use tracing::warn;

use super::reads::Read;
use super::send::{Outgoing, Stop, send_until};
use super::server::{Ctx, ServerConfig};
use crate::exporter::Exporter;
use crate::exports::Refusal;
use crate::memory::PinnedRead;
use crate::wire::{ErrorCode, Reply};

/// The replies to a batch of reads, written in order: each read's frame (a data head, or a
/// whole error frame for a refused read) and, for an admitted read, its pin; a cursor at the
/// first byte not yet written.
///
/// Each reply keeps the deadline it had when reads were answered one by one: the write
/// timeout from when its first byte could go out, and never past its request's lease. A pin
/// drops as soon as its reply is written. A reply not started yet whose lease ends becomes
/// the refusal a read would get now, and its pin drops, without cutting the others. Every
/// read is admitted when the batch is taken: one refused then (its request not exported yet,
/// say) is not tried again at its turn.
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

    /// The lease deadline of each request that a pinned reply, from the one being written
    /// on, reads: one lookup per request.
    fn leases(&self) -> Vec<(RequestId, Option<Instant>)> {
        let mut leases: Vec<(RequestId, Option<Instant>)> = Vec::new();
        for i in self.at..self.reads.len() {
            let request = self.reads[i].request;
            if self.pins[i].is_some() && !leases.iter().any(|(r, _)| *r == request) {
                leases.push((request, self.exporter.read_deadline(request)));
            }
        }
        leases
    }

    /// Replies that have not started, whose request's lease ended (or is past its expiry)
    /// in `leases`, become refusals now.
    fn revoke_ended(&mut self, leases: &[(RequestId, Option<Instant>)], now: Instant) {
        let first = if self.written == 0 {
            self.at
        } else {
            self.at + 1
        };
        for i in first..self.reads.len() {
            let request = self.reads[i].request;
            if self.pins[i].is_none() || lease_of(leases, request).is_some_and(|l| l > now) {
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

/// `request`'s lease deadline in `leases`.
fn lease_of(leases: &[(RequestId, Option<Instant>)], request: RequestId) -> Option<Instant> {
    leases
        .iter()
        .find(|(r, _)| *r == request)
        .and_then(|(_, d)| *d)
}

/// Slices handed to one vectored write, at most (Linux's `UIO_MAXIOV`).
const MAX_SLICES: usize = 1024;

impl Outgoing for Replies<'_> {
    fn is_done(&self) -> bool {
        self.at == self.reads.len()
    }

    fn deadline(&mut self) -> Option<(Instant, Instant)> {
        let now = Instant::now();
        let leases = self.leases();
        self.revoke_ended(&leases, now);
        let mut cut = self.started + self.write_timeout;
        if self.pins.get(self.at).is_some_and(Option::is_some) {
            cut = cut.min(lease_of(&leases, self.reads[self.at].request)?);
        }
        // Look again when a later reply's lease expires, to revoke it then.
        let wake = (self.at + 1..self.reads.len())
            .filter(|&i| self.pins[i].is_some())
            .filter_map(|i| lease_of(&leases, self.reads[i].request))
            .filter(|lease| *lease > now)
            .fold(cut, Instant::min);
        Some((cut, wake))
    }

    fn slices(&self) -> Vec<IoSlice<'_>> {
        let mut skip = self.written;
        let mut out = Vec::new();
        for i in self.at..self.reads.len() {
            let frame = std::iter::once(&self.frames[i][..]);
            for part in frame.chain(self.pins[i].iter().flat_map(PinnedRead::slices)) {
                if skip >= part.len() {
                    skip -= part.len();
                    continue;
                }
                out.push(IoSlice::new(&part[skip..]));
                skip = 0;
                if out.len() == MAX_SLICES {
                    return out;
                }
            }
        }
        out
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
    use kvx_core::{BlockKey, CpuArena, EngineBlockId};
    use kvx_policy::LeaseConfig;

    use crate::wire;

    /// Room for one timer tick and scheduling on a 2-core machine.
    const TICK: Duration = Duration::from_millis(20);

    use super::*;

    const BLOCK: usize = 4096;

    /// Requests 1 and 2 exported with two blocks each (engine blocks 0-1 and 2-3), leases
    /// of 60 s started.
    fn exported(arena: &CpuArena) -> Exporter {
        exported_for(arena, [60_000, 60_000])
    }

    /// As [`exported`], with the leases' TTLs.
    fn exported_for(arena: &CpuArena, ttl_ms: [u64; 2]) -> Exporter {
        // SAFETY: every test keeps the arena alive until after the exporter is dropped, and
        // writes no block while it is exported.
        let exporter = unsafe { Exporter::new(arena.layout().clone()) }.unwrap();
        for r in [1u32, 2] {
            let lease = LeaseConfig::with_ttl_ms(ttl_ms[r as usize - 1]);
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
        let arena = CpuArena::contiguous(BLOCK, 4).unwrap();
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
        std::thread::sleep(Duration::from_millis(2));
        r.advance(10);
        let (cut, _) = r.deadline().unwrap();
        assert_eq!(
            cut, second_cut,
            "a partial write does not restart the reply's time"
        );
        // The rest of the second reply and the third's first bytes in one write, and the rest.
        r.advance(reply);
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
        let arena = CpuArena::contiguous(BLOCK, 4).unwrap();
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

    /// A lease that expires under a batch wakes the writer at its expiry, and the reply not
    /// started yet becomes a refusal then; a reply not started whose lease ended is revoked
    /// even when it is the next one to be written.
    #[test]
    fn an_expiring_lease_wakes_the_writer_and_the_next_reply_is_revoked_not_cut() {
        let arena = CpuArena::contiguous(BLOCK, 4).unwrap();
        let exporter = exported_for(&arena, [60_000, 150]);
        let cfg = ServerConfig::default();
        let reads = [whole(1, 1, 0), whole(2, 2, 0)];
        let mut r = Replies::admit(&exporter, &cfg, &reads);
        r.advance(10);
        let t0 = Instant::now();
        let (cut, wake) = r.deadline().unwrap();
        assert!(wake < cut, "wakes before the write timeout");
        assert!(
            wake > t0 && wake <= t0 + Duration::from_millis(150),
            "{wake:?}"
        );
        std::thread::sleep(wake.saturating_duration_since(Instant::now()) + TICK);
        assert!(r.deadline().is_some(), "request 1's reply goes on");
        assert_eq!(
            exporter.stats().pins,
            1,
            "request 2's pin dropped at its expiry"
        );
        assert!(matches!(
            Reply::decode(&r.frames[1][4..]),
            Ok(Reply::Error { tag: 2, .. })
        ));

        // The next reply to be written, no byte of it out yet, is revoked, not cut.
        let exporter = exported(&arena);
        let reads = [whole(1, 2, 0), whole(2, 1, 0)];
        let mut r = Replies::admit(&exporter, &cfg, &reads);
        exporter.abort(RequestId(2)).unwrap();
        assert!(r.deadline().is_some(), "not cut");
        assert!(matches!(
            Reply::decode(&r.frames[0][4..]),
            Ok(Reply::Error { tag: 1, .. })
        ));
        assert_eq!(exporter.stats().pins, 1);
    }

    /// Writes of any size, ending anywhere, move the whole batch in order: heads, error
    /// frames, and blocks of several segments (a per-layer layout) with reads at an offset.
    #[test]
    fn writes_of_any_size_move_every_reply_byte_exact_in_order() {
        let mut arena = CpuArena::per_layer(3, 1000, 4).unwrap();
        for b in 0..4u32 {
            let bytes: Vec<u8> = (0..3000)
                .map(|j| ((b as usize * 31 + j * 7) % 251) as u8)
                .collect();
            arena.write_block(EngineBlockId(b), &bytes).unwrap();
        }
        let exporter = exported(&arena);
        let cfg = ServerConfig::default();
        let part = Read {
            tag: 2,
            request: RequestId(1),
            block: 1,
            offset: 1500,
            len: 1000,
        };
        let reads = [
            Read {
                len: 3000,
                ..whole(1, 1, 0)
            },
            part,
            whole(3, 1, 9),
            Read {
                len: 3000,
                ..whole(4, 2, 1)
            },
        ];
        let mut r = Replies::admit(&exporter, &cfg, &reads);
        let mut out = Vec::new();
        for k in [1usize, 7, 999, 4096, 13].into_iter().cycle() {
            if r.is_done() {
                break;
            }
            let mut took = 0;
            for s in r.slices() {
                let n = s.len().min(k - took);
                out.extend_from_slice(&s[..n]);
                took += n;
                if took == k {
                    break;
                }
            }
            r.advance(took);
        }
        assert_eq!(exporter.stats().pins, 0);
        // Parse what went out.
        let mut at = 0;
        let mut next = || {
            let len = u32::from_be_bytes(out[at..at + 4].try_into().unwrap()) as usize;
            let body = out[at + 4..at + 4 + len].to_vec();
            at += 4 + len;
            body
        };
        let block = |b: u32| arena.read_block(EngineBlockId(b)).unwrap();
        let data = |body: Vec<u8>, tag: u64, want: &[u8]| {
            assert_eq!(body[0], wire::T_DATA);
            assert_eq!(u64::from_be_bytes(body[1..9].try_into().unwrap()), tag);
            assert_eq!(&body[9..], want, "tag {tag}");
        };
        data(next(), 1, &block(0));
        data(next(), 2, &block(1)[1500..2500]);
        assert!(matches!(
            Reply::decode(&next()),
            Ok(Reply::Error {
                tag: 3,
                code: ErrorCode::OutOfBounds,
                ..
            })
        ));
        data(next(), 4, &block(3));
        assert_eq!(at, out.len(), "nothing more went out");
    }

    /// A read the lease refuses at admission, and one larger than the server serves, are
    /// error frames in their place; they hold no pin.
    #[test]
    fn refused_reads_are_error_frames_in_their_place() {
        let arena = CpuArena::contiguous(BLOCK, 4).unwrap();
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
}
