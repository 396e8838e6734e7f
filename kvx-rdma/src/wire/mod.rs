//! The wire protocol of the TCP transport (and the verbs side channel).
//!
//! Every frame is a big-endian `u32` length, then that many bytes: a type byte and its fields.
//! The first client frame is `Hello` (magic, protocol version, reader id, optional token); the
//! server answers `Welcome` or an `Error` and closes. Read replies are `Data` frames whose
//! payload (the block bytes) follows the 13-byte head, so both sides move the payload straight
//! between sockets and block memory. Decoding never panics: every length is checked against
//! the bytes present and against configured maxima.

/// First bytes of a `Hello`: not a kvx-rdma peer without them.
pub const MAGIC: [u8; 4] = *b"KVXR";
/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// Longest shared token accepted in a `Hello`.
pub const MAX_TOKEN: usize = 256;
/// Largest `Hello` frame body.
pub(crate) const MAX_HELLO: u32 = 1 + 4 + 2 + 4 + 2 + MAX_TOKEN as u32;
/// Bytes of a `Data` frame before its payload: length, type, tag.
pub(crate) const DATA_HEAD: usize = 4 + 1 + 8;
/// Largest non-data frame a client accepts from a server.
pub(crate) const MAX_REPLY_FRAME: u32 = 64 * 1024;

mod read;

pub use read::{FrameError, ReplyHead, read_body, read_reply_head_limit};
pub(crate) use read::{buffered_frame, read_growing, read_len, read_reply_head};

const T_HELLO: u8 = 1;
const T_READ: u8 = 2;
const T_HEARTBEAT: u8 = 3;
const T_DONE: u8 = 4;
const T_VERBS: u8 = 5;
const T_WELCOME: u8 = 0x81;
pub(crate) const T_DATA: u8 = 0x82;
const T_ACK: u8 = 0x83;
const T_ERROR: u8 = 0x84;
const T_VERBS_REPLY: u8 = 0x85;

/// What an error frame reports. The first five close the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The first frame was not a kvx-rdma `Hello`.
    BadHandshake,
    /// The peer speaks another protocol version.
    VersionMismatch,
    /// The shared token is missing or wrong.
    BadToken,
    /// A frame's length prefix is above the maximum.
    FrameTooLarge,
    /// A frame could not be decoded (unknown type, truncated or trailing fields).
    MalformedFrame,
    /// The request id is not exported (never, or released long ago).
    UnknownRequest,
    /// The request is exported but its lease has not started (not ready to be read).
    NotReady,
    /// The request's lease ended (expired, read by all readers, aborted).
    LeaseEnded,
    /// The block index or byte range is outside the exported block.
    OutOfBounds,
    /// The read asks for more bytes than the server serves in one reply.
    ReadTooLarge,
    /// The server does not support this frame (e.g. verbs without the feature).
    Unsupported,
    /// The server is at its connection limit.
    Busy,
    /// Anything else on the server side.
    Internal,
}

impl ErrorCode {
    fn to_u16(self) -> u16 {
        self as u16 + 1
    }

    fn from_u16(v: u16) -> Option<ErrorCode> {
        use ErrorCode::*;
        const ALL: [ErrorCode; 13] = [
            BadHandshake,
            VersionMismatch,
            BadToken,
            FrameTooLarge,
            MalformedFrame,
            UnknownRequest,
            NotReady,
            LeaseEnded,
            OutOfBounds,
            ReadTooLarge,
            Unsupported,
            Busy,
            Internal,
        ];
        ALL.get(usize::from(v).checked_sub(1)?).copied()
    }

    /// True when the server closes the connection after sending this error.
    pub fn is_fatal(self) -> bool {
        matches!(
            self,
            ErrorCode::BadHandshake
                | ErrorCode::VersionMismatch
                | ErrorCode::BadToken
                | ErrorCode::FrameTooLarge
                | ErrorCode::MalformedFrame
                | ErrorCode::Busy
        )
    }
}

/// A frame from a consumer to a producer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First frame of a connection.
    Hello {
        /// Protocol version of the client.
        version: u16,
        /// The reader's id (e.g. its tensor-parallel rank), counted by the lease.
        reader: u32,
        /// Shared token, empty when none.
        token: Vec<u8>,
    },
    /// Read `len` bytes at `offset` of block `block` of `request`.
    Read {
        /// Echoed in the reply.
        tag: u64,
        /// Request id.
        request: u64,
        /// Index of the block in the export (descriptor order).
        block: u32,
        /// Byte offset inside the block.
        offset: u64,
        /// Bytes to read.
        len: u64,
    },
    /// Renew the lease of `request`.
    Heartbeat {
        /// Echoed in the reply.
        tag: u64,
        /// Request id.
        request: u64,
    },
    /// This reader is done with `request`.
    Done {
        /// Echoed in the reply.
        tag: u64,
        /// Request id.
        request: u64,
    },
    /// A message of the verbs side channel (opaque here).
    Verbs {
        /// Echoed in the reply.
        tag: u64,
        /// Serialized verbs message.
        body: Vec<u8>,
    },
}

/// A frame from a producer to a consumer (a `Data` reply is only its head; payload follows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Handshake accepted.
    Welcome {
        /// Protocol version of the server.
        version: u16,
        /// Largest read the server serves in one reply.
        max_read: u64,
    },
    /// `len` payload bytes for `tag` follow.
    Data {
        /// The read's tag.
        tag: u64,
        /// Payload bytes after the head.
        len: u64,
    },
    /// A heartbeat or done was accepted.
    Ack {
        /// The request's tag.
        tag: u64,
    },
    /// The frame with `tag` failed (tag 0: the connection itself).
    Error {
        /// The failing frame's tag, or 0.
        tag: u64,
        /// What failed.
        code: ErrorCode,
        /// A human-readable explanation.
        message: String,
    },
    /// A verbs side-channel answer (opaque here).
    Verbs {
        /// The request's tag.
        tag: u64,
        /// Serialized verbs message.
        body: Vec<u8>,
    },
}

fn frame(ty: u8, fields: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + fields.len());
    out.extend_from_slice(&((1 + fields.len()) as u32).to_be_bytes());
    out.push(ty);
    out.extend_from_slice(fields);
    out
}

impl Request {
    /// The frame's bytes, length prefix included.
    pub fn encode(&self) -> Vec<u8> {
        let mut f = Vec::new();
        match self {
            Request::Hello {
                version,
                reader,
                token,
            } => {
                f.extend_from_slice(&MAGIC);
                f.extend_from_slice(&version.to_be_bytes());
                f.extend_from_slice(&reader.to_be_bytes());
                f.extend_from_slice(&(token.len() as u16).to_be_bytes());
                f.extend_from_slice(token);
                frame(T_HELLO, &f)
            }
            Request::Read {
                tag,
                request,
                block,
                offset,
                len,
            } => {
                f.extend_from_slice(&tag.to_be_bytes());
                f.extend_from_slice(&request.to_be_bytes());
                f.extend_from_slice(&block.to_be_bytes());
                f.extend_from_slice(&offset.to_be_bytes());
                f.extend_from_slice(&len.to_be_bytes());
                frame(T_READ, &f)
            }
            Request::Heartbeat { tag, request } | Request::Done { tag, request } => {
                f.extend_from_slice(&tag.to_be_bytes());
                f.extend_from_slice(&request.to_be_bytes());
                let ty = if matches!(self, Request::Done { .. }) {
                    T_DONE
                } else {
                    T_HEARTBEAT
                };
                frame(ty, &f)
            }
            Request::Verbs { tag, body } => {
                f.extend_from_slice(&tag.to_be_bytes());
                f.extend_from_slice(body);
                frame(T_VERBS, &f)
            }
        }
    }

    /// Decode a frame body (type byte and fields, without the length prefix).
    pub fn decode(body: &[u8]) -> Result<Request, String> {
        let mut c = Cursor::new(body);
        let req = match c.u8()? {
            T_HELLO => {
                if c.take(4)? != MAGIC {
                    return Err("hello without the kvx-rdma magic".into());
                }
                let version = c.u16()?;
                let reader = c.u32()?;
                let n = usize::from(c.u16()?);
                if n > MAX_TOKEN {
                    return Err(format!("token of {n} bytes (max {MAX_TOKEN})"));
                }
                Request::Hello {
                    version,
                    reader,
                    token: c.take(n)?.to_vec(),
                }
            }
            T_READ => Request::Read {
                tag: c.u64()?,
                request: c.u64()?,
                block: c.u32()?,
                offset: c.u64()?,
                len: c.u64()?,
            },
            T_HEARTBEAT => Request::Heartbeat {
                tag: c.u64()?,
                request: c.u64()?,
            },
            T_DONE => Request::Done {
                tag: c.u64()?,
                request: c.u64()?,
            },
            T_VERBS => Request::Verbs {
                tag: c.u64()?,
                body: c.rest().to_vec(),
            },
            t => return Err(format!("unknown frame type {t:#04x}")),
        };
        c.finish()?;
        Ok(req)
    }
}

impl Reply {
    /// The frame's bytes, length prefix included (for `Data`: the head only).
    pub fn encode(&self) -> Vec<u8> {
        let mut f = Vec::new();
        match self {
            Reply::Welcome { version, max_read } => {
                f.extend_from_slice(&version.to_be_bytes());
                f.extend_from_slice(&max_read.to_be_bytes());
                frame(T_WELCOME, &f)
            }
            Reply::Data { tag, len } => {
                let mut out = Vec::with_capacity(DATA_HEAD);
                let body = (1 + 8 + *len).min(u64::from(u32::MAX)) as u32;
                out.extend_from_slice(&body.to_be_bytes());
                out.push(T_DATA);
                out.extend_from_slice(&tag.to_be_bytes());
                out
            }
            Reply::Ack { tag } => frame(T_ACK, &tag.to_be_bytes()),
            Reply::Error { tag, code, message } => {
                f.extend_from_slice(&tag.to_be_bytes());
                f.extend_from_slice(&code.to_u16().to_be_bytes());
                let msg = truncate(message, 1024);
                f.extend_from_slice(&(msg.len() as u16).to_be_bytes());
                f.extend_from_slice(msg.as_bytes());
                frame(T_ERROR, &f)
            }
            Reply::Verbs { tag, body } => {
                f.extend_from_slice(&tag.to_be_bytes());
                f.extend_from_slice(body);
                frame(T_VERBS_REPLY, &f)
            }
        }
    }

    /// Decode a non-data frame body (type byte and fields).
    pub fn decode(body: &[u8]) -> Result<Reply, String> {
        let mut c = Cursor::new(body);
        let reply = match c.u8()? {
            T_WELCOME => Reply::Welcome {
                version: c.u16()?,
                max_read: c.u64()?,
            },
            T_ACK => Reply::Ack { tag: c.u64()? },
            T_ERROR => {
                let tag = c.u64()?;
                let raw = c.u16()?;
                let code = ErrorCode::from_u16(raw).unwrap_or(ErrorCode::Internal);
                let n = usize::from(c.u16()?);
                let message = String::from_utf8_lossy(c.take(n)?).into_owned();
                Reply::Error { tag, code, message }
            }
            T_VERBS_REPLY => Reply::Verbs {
                tag: c.u64()?,
                body: c.rest().to_vec(),
            },
            T_DATA => return Err("data frame decoded as a control frame".into()),
            t => return Err(format!("unknown frame type {t:#04x}")),
        };
        c.finish()?;
        Ok(reply)
    }
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| {
                format!(
                    "truncated frame: needs {n} more bytes at offset {}, has {}",
                    self.pos,
                    self.buf.len() - self.pos
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, String> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_be_bytes(a))
    }

    fn u64(&mut self) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }

    fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }

    fn finish(&self) -> Result<(), String> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(format!(
                "{} trailing bytes after the frame's fields",
                self.buf.len() - self.pos
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        let all = [
            Request::Hello {
                version: PROTOCOL_VERSION,
                reader: 3,
                token: b"secret".to_vec(),
            },
            Request::Read {
                tag: 9,
                request: 77,
                block: 2,
                offset: 4096,
                len: 1 << 20,
            },
            Request::Heartbeat { tag: 1, request: 5 },
            Request::Done { tag: 2, request: 5 },
            Request::Verbs {
                tag: 4,
                body: vec![1, 2, 3],
            },
        ];
        for r in all {
            let bytes = r.encode();
            let len = u32::from_be_bytes(bytes[..4].try_into().unwrap()) as usize;
            assert_eq!(len, bytes.len() - 4);
            assert_eq!(Request::decode(&bytes[4..]).unwrap(), r);
        }
    }

    #[test]
    fn replies_round_trip_and_unknown_codes_map_to_internal() {
        for code in [
            ErrorCode::BadHandshake,
            ErrorCode::LeaseEnded,
            ErrorCode::Internal,
        ] {
            let r = Reply::Error {
                tag: 8,
                code,
                message: "why".into(),
            };
            assert_eq!(Reply::decode(&r.encode()[4..]).unwrap(), r);
        }
        let w = Reply::Welcome {
            version: 1,
            max_read: 99,
        };
        assert_eq!(Reply::decode(&w.encode()[4..]).unwrap(), w);
        let mut bad = Reply::Error {
            tag: 1,
            code: ErrorCode::Busy,
            message: String::new(),
        }
        .encode();
        bad[4 + 1 + 8 + 1] = 200; // code 200
        assert!(matches!(
            Reply::decode(&bad[4..]),
            Ok(Reply::Error {
                code: ErrorCode::Internal,
                ..
            })
        ));
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        let read = Request::Read {
            tag: 1,
            request: 1,
            block: 0,
            offset: 0,
            len: 1,
        }
        .encode();
        for cut in 0..read.len() - 4 {
            assert!(Request::decode(&read[4..4 + cut]).is_err(), "cut {cut}");
        }
        let mut long = read[4..].to_vec();
        long.push(0);
        assert!(Request::decode(&long).unwrap_err().contains("trailing"));
        assert!(Request::decode(&[0x7f]).unwrap_err().contains("unknown"));
        let mut hello = Request::Hello {
            version: 1,
            reader: 0,
            token: vec![],
        }
        .encode();
        hello[5] = b'X';
        assert!(Request::decode(&hello[4..]).unwrap_err().contains("magic"));
        // A token length beyond the maximum.
        let mut f = vec![T_HELLO];
        f.extend_from_slice(&MAGIC);
        f.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0xff, 0xff]);
        assert!(Request::decode(&f).is_err());
    }
}
