//! Reading frames off a stream: partial reads resumed, every length checked before use.

use tokio::io::{AsyncRead, AsyncReadExt};

use super::{MAX_REPLY_FRAME, Reply, T_DATA};

/// Why a frame could not be read.
#[derive(Debug)]
pub enum FrameError {
    /// The peer closed the connection cleanly between frames.
    Eof,
    /// The length prefix is above the maximum.
    TooLarge(u32),
    /// A zero length prefix.
    Empty,
    /// The connection failed (or closed mid-frame).
    Io(std::io::Error),
}

/// Read one frame's length prefix; `Eof` if the peer closed before sending any byte of it.
pub(crate) async fn read_len<R: AsyncRead + Unpin>(r: &mut R, max: u32) -> Result<u32, FrameError> {
    let mut len = [0u8; 4];
    let first = r.read(&mut len[..1]).await.map_err(FrameError::Io)?;
    if first == 0 {
        return Err(FrameError::Eof);
    }
    r.read_exact(&mut len[1..]).await.map_err(FrameError::Io)?;
    let len = u32::from_be_bytes(len);
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > max {
        return Err(FrameError::TooLarge(len));
    }
    Ok(len)
}

/// Read one whole frame body of at most `max` bytes (partial reads are resumed).
pub async fn read_body<R: AsyncRead + Unpin>(r: &mut R, max: u32) -> Result<Vec<u8>, FrameError> {
    let len = read_len(r, max).await?;
    let mut body = Vec::new();
    read_growing(r, &mut body, len as usize)
        .await
        .map_err(FrameError::Io)?;
    Ok(body)
}

/// Append exactly `n` bytes of `r` to `out`, growing `out` as bytes arrive: the memory follows
/// what the peer sent, never what a length field claims.
pub(crate) async fn read_growing<R: AsyncRead + Unpin>(
    r: &mut R,
    out: &mut Vec<u8>,
    n: usize,
) -> std::io::Result<()> {
    /// Allocated up front (requests and control replies fit); beyond it, growth follows
    /// received bytes.
    const FIRST: usize = 4096;
    out.reserve(n.min(FIRST));
    let want = out.len() + n;
    (&mut *r).take(n as u64).read_to_end(out).await?;
    if out.len() < want {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "the frame announced {n} bytes, the stream ended after {}",
                n - (want - out.len())
            ),
        ));
    }
    Ok(())
}

/// The body of the frame at the start of `buf` and the bytes it spans, when the whole frame
/// is there and its length is 1 to `max`; `None` otherwise (read it from the stream then).
pub(crate) fn buffered_frame(buf: &[u8], max: u32) -> Option<(&[u8], usize)> {
    let len = u32::from_be_bytes(buf.get(..4)?.try_into().ok()?);
    if len == 0 || len > max {
        return None;
    }
    let end = usize::try_from(len).ok()?.checked_add(4)?;
    Some((buf.get(4..end)?, end))
}

/// What a client finds at the head of a server frame.
#[derive(Debug)]
pub enum ReplyHead {
    /// A data frame: `len` payload bytes for `tag` follow on the stream.
    Data {
        /// The read's tag.
        tag: u64,
        /// Payload bytes still to read.
        len: u64,
    },
    /// Any other frame, fully read.
    Control(Reply),
}

/// Read the next server frame: a data head (payload left on the stream) or a control frame.
/// `max_data` bounds the payload a data frame may announce.
pub(crate) async fn read_reply_head<R: AsyncRead + Unpin>(
    r: &mut R,
    max_data: u64,
) -> Result<ReplyHead, String> {
    read_reply_head_limit(r, max_data, MAX_REPLY_FRAME).await
}

/// Read the next server frame: a data head (payload left on the stream, at most `max_data`
/// bytes announced) or a control frame of at most `max_control` bytes (verbs grants can be
/// large). Memory grows with the bytes received, never with what a length field claims.
pub async fn read_reply_head_limit<R: AsyncRead + Unpin>(
    r: &mut R,
    max_data: u64,
    max_control: u32,
) -> Result<ReplyHead, String> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)
        .await
        .map_err(|e| format!("reading a reply: {e}"))?;
    let len = u32::from_be_bytes(len);
    if len == 0 {
        return Err("empty frame".into());
    }
    let mut ty = [0u8; 1];
    r.read_exact(&mut ty)
        .await
        .map_err(|e| format!("reading a reply: {e}"))?;
    if ty[0] == T_DATA {
        if len < 9 {
            return Err(format!("data frame of {len} bytes has no tag"));
        }
        let payload = u64::from(len) - 9;
        if payload > max_data {
            return Err(format!(
                "data frame announces {payload} bytes, more than the {max_data} asked for"
            ));
        }
        let mut tag = [0u8; 8];
        r.read_exact(&mut tag)
            .await
            .map_err(|e| format!("reading a data head: {e}"))?;
        return Ok(ReplyHead::Data {
            tag: u64::from_be_bytes(tag),
            len: payload,
        });
    }
    if len > max_control {
        return Err(format!("control frame of {len} bytes (max {max_control})"));
    }
    let mut body = vec![ty[0]];
    read_growing(r, &mut body, len as usize - 1)
        .await
        .map_err(|e| format!("reading a reply: {e}"))?;
    Reply::decode(&body).map(ReplyHead::Control)
}

#[cfg(test)]
mod tests {
    use super::super::Request;
    use super::*;

    /// Only a whole frame of an allowed length is taken from a buffer; a partial one, a
    /// zero or oversized length prefix, or a short buffer is left for the stream reader.
    #[test]
    fn a_buffered_frame_is_taken_only_when_whole_and_within_bounds() {
        let a = Request::Heartbeat { tag: 3, request: 4 }.encode();
        let b = Request::Done { tag: 5, request: 6 }.encode();
        let both = [a.clone(), b.clone()].concat();
        let (body, used) = buffered_frame(&both, 64).unwrap();
        assert_eq!(used, a.len());
        assert_eq!(
            Request::decode(body).unwrap(),
            Request::Heartbeat { tag: 3, request: 4 }
        );
        let (body, used) = buffered_frame(&both[used..], 64).unwrap();
        assert_eq!(used, b.len());
        assert_eq!(
            Request::decode(body).unwrap(),
            Request::Done { tag: 5, request: 6 }
        );
        for cut in 0..a.len() {
            assert!(buffered_frame(&a[..cut], 64).is_none(), "cut at {cut}");
        }
        assert!(
            buffered_frame(&a, (a.len() - 5) as u32).is_none(),
            "too large"
        );
        assert!(
            buffered_frame(&[0, 0, 0, 0, 9], 64).is_none(),
            "empty frame"
        );
    }

    #[tokio::test]
    async fn frame_reader_resumes_partial_reads_and_checks_lengths() {
        let bytes = Request::Heartbeat { tag: 3, request: 4 }.encode();
        // A reader that hands out one byte per read call.
        let mut slow = tokio_test_reader(bytes.clone());
        let body = read_body(&mut slow, 64).await.unwrap();
        assert_eq!(
            Request::decode(&body).unwrap(),
            Request::Heartbeat { tag: 3, request: 4 }
        );
        let mut r = &bytes[..];
        assert!(matches!(
            read_body(&mut r, 4).await,
            Err(FrameError::TooLarge(17))
        ));
        let mut empty: &[u8] = &[];
        assert!(matches!(
            read_body(&mut empty, 4).await,
            Err(FrameError::Eof)
        ));
        let mut zero: &[u8] = &[0, 0, 0, 0];
        assert!(matches!(
            read_body(&mut zero, 4).await,
            Err(FrameError::Empty)
        ));
        let mut cut: &[u8] = &bytes[..7];
        assert!(matches!(
            read_body(&mut cut, 64).await,
            Err(FrameError::Io(_))
        ));
    }

    fn tokio_test_reader(bytes: Vec<u8>) -> impl AsyncRead + Unpin {
        struct OneByte(Vec<u8>, usize);
        impl AsyncRead for OneByte {
            fn poll_read(
                mut self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
                buf: &mut tokio::io::ReadBuf<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                if self.1 < self.0.len() && buf.remaining() > 0 {
                    let b = self.0[self.1];
                    buf.put_slice(&[b]);
                    self.1 += 1;
                }
                std::task::Poll::Ready(Ok(()))
            }
        }
        OneByte(bytes, 0)
    }
}
