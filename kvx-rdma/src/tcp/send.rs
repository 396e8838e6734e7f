//! Writing a connection's outgoing bytes under a deadline that may move while they go out: a
//! control frame has a fixed one, a batch of replies one per reply and per lease.

use std::io::IoSlice;
use std::time::Instant;

use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

/// Why a connection stops being served after a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    /// The write failed: the peer is gone.
    WriteFailed,
    /// The reply did not finish in time and was cut mid-frame: reset the connection.
    Cut,
}

/// Bytes a connection writes in order, over as many writes as the socket takes.
pub(super) trait Outgoing {
    /// Whether every byte went out.
    fn is_done(&self) -> bool;
    /// Re-read what the deadline depends on (leases may have ended since the last call):
    /// `Some((cut, wake))` cuts the write at `cut` and looks again at `wake` (at most `cut`)
    /// even if no byte went out; `None` cuts it now.
    fn deadline(&mut self) -> Option<(Instant, Instant)>;
    /// The bytes still to write, for one vectored write.
    fn slices(&self) -> Vec<IoSlice<'_>>;
    /// `n` more bytes went out.
    fn advance(&mut self, n: usize);
}

/// One frame that must be fully written by a fixed instant.
pub(super) struct Frame<'a> {
    bytes: &'a [u8],
    until: Instant,
}

impl<'a> Frame<'a> {
    /// `bytes`, to be written by `until`.
    pub(super) fn new(bytes: &'a [u8], until: Instant) -> Frame<'a> {
        Frame { bytes, until }
    }
}

impl Outgoing for Frame<'_> {
    fn is_done(&self) -> bool {
        self.bytes.is_empty()
    }

    fn deadline(&mut self) -> Option<(Instant, Instant)> {
        Some((self.until, self.until))
    }

    fn slices(&self) -> Vec<IoSlice<'_>> {
        vec![IoSlice::new(self.bytes)]
    }

    fn advance(&mut self, n: usize) {
        self.bytes = &self.bytes[n.min(self.bytes.len())..];
    }
}

/// Write all of `out` before its deadline, re-read after each write and each wake-up: at the
/// cut instant, or when the deadline says cut now, the write stops with [`Stop::Cut`].
/// `events` wakes the writer early when the deadline may have moved (a lease ended).
pub(super) async fn send_until<W: AsyncWrite + Unpin>(
    stream: &mut W,
    out: &mut impl Outgoing,
    mut events: Option<&mut watch::Receiver<u64>>,
) -> Result<(), Stop> {
    while !out.is_done() {
        let Some((cut, wake)) = out.deadline().filter(|(cut, _)| *cut > Instant::now()) else {
            return Err(Stop::Cut);
        };
        let lease_event = async {
            let alive = match events.as_mut() {
                Some(rx) => rx.changed().await.is_ok(),
                None => false,
            };
            if !alive {
                std::future::pending::<()>().await;
            }
        };
        let slices = out.slices();
        let wrote = tokio::select! {
            r = stream.write_vectored(&slices) => Some(r),
            _ = tokio::time::sleep_until(tokio::time::Instant::from_std(wake.min(cut))) => None,
            _ = lease_event => None,
        };
        drop(slices);
        match wrote {
            Some(Ok(n)) if n > 0 => out.advance(n),
            Some(_) => return Err(Stop::WriteFailed),
            None => {}
        }
    }
    Ok(())
}
