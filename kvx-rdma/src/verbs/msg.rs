//! Messages of the verbs side channel, carried in `Verbs` frames of the TCP protocol.

use super::sys::Endpoint;

/// One registered piece of a block on the producer: address, length, remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seg {
    pub addr: u64,
    pub len: u32,
    pub rkey: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum VerbsMsg {
    /// Consumer → producer: connect my queue pair to one of yours.
    Connect(Endpoint),
    /// Producer → consumer: your queue pair's peer.
    Accept(Endpoint),
    /// Consumer → producer: the lease allows me to read these blocks of `request`?
    Grant { request: u64, blocks: Vec<u32> },
    /// Producer → consumer: each granted block's registered segments.
    Granted(Vec<Vec<Seg>>),
}

impl VerbsMsg {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match self {
            VerbsMsg::Connect(e) => {
                b.push(1);
                e.encode(&mut b);
            }
            VerbsMsg::Accept(e) => {
                b.push(2);
                e.encode(&mut b);
            }
            VerbsMsg::Grant { request, blocks } => {
                b.push(3);
                b.extend_from_slice(&request.to_be_bytes());
                b.extend_from_slice(&(blocks.len() as u32).to_be_bytes());
                for x in blocks {
                    b.extend_from_slice(&x.to_be_bytes());
                }
            }
            VerbsMsg::Granted(blocks) => {
                b.push(4);
                b.extend_from_slice(&(blocks.len() as u32).to_be_bytes());
                for segs in blocks {
                    b.extend_from_slice(&(segs.len() as u32).to_be_bytes());
                    for s in segs {
                        b.extend_from_slice(&s.addr.to_be_bytes());
                        b.extend_from_slice(&s.len.to_be_bytes());
                        b.extend_from_slice(&s.rkey.to_be_bytes());
                    }
                }
            }
        }
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Result<VerbsMsg, String> {
        let (&ty, rest) = b.split_first().ok_or("empty verbs message")?;
        let mut r = Reader(rest);
        let msg = match ty {
            1 | 2 => {
                let e = Endpoint::decode(r.take(Endpoint::BYTES)?).ok_or("bad endpoint")?;
                if ty == 1 {
                    VerbsMsg::Connect(e)
                } else {
                    VerbsMsg::Accept(e)
                }
            }
            3 => {
                let request = r.u64()?;
                let n = r.u32()? as usize;
                if n > r.0.len() / 4 {
                    return Err(format!("grant of {n} blocks in {} bytes", r.0.len()));
                }
                let blocks = (0..n).map(|_| r.u32()).collect::<Result<_, _>>()?;
                VerbsMsg::Grant { request, blocks }
            }
            4 => {
                let n = r.u32()? as usize;
                if n > r.0.len() / 4 {
                    return Err(format!("{n} granted blocks in {} bytes", r.0.len()));
                }
                let mut blocks = Vec::with_capacity(n);
                for _ in 0..n {
                    let k = r.u32()? as usize;
                    if k > r.0.len() / 16 {
                        return Err(format!("{k} segments in {} bytes", r.0.len()));
                    }
                    let mut segs = Vec::with_capacity(k);
                    for _ in 0..k {
                        segs.push(Seg {
                            addr: r.u64()?,
                            len: r.u32()?,
                            rkey: r.u32()?,
                        });
                    }
                    blocks.push(segs);
                }
                VerbsMsg::Granted(blocks)
            }
            t => return Err(format!("unknown verbs message {t}")),
        };
        if !r.0.is_empty() {
            return Err(format!("{} trailing bytes in a verbs message", r.0.len()));
        }
        Ok(msg)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated verbs message".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().map_err(|_| "u32")?,
        ))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_be_bytes(
            self.take(8)?.try_into().map_err(|_| "u64")?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_reject_garbage() {
        let e = Endpoint {
            qpn: 1,
            lid: 2,
            psn: 3,
            gid: None,
        };
        for m in [
            VerbsMsg::Connect(e),
            VerbsMsg::Accept(e),
            VerbsMsg::Grant {
                request: 9,
                blocks: vec![0, 5],
            },
            VerbsMsg::Granted(vec![
                vec![Seg {
                    addr: 1,
                    len: 2,
                    rkey: 3,
                }],
                vec![],
            ]),
        ] {
            assert_eq!(VerbsMsg::decode(&m.encode()).unwrap(), m);
        }
        assert!(VerbsMsg::decode(&[]).is_err());
        assert!(VerbsMsg::decode(&[3, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(VerbsMsg::decode(&[4, 0, 0, 0, 1, 0x7f, 0, 0, 0]).is_err());
        assert!(VerbsMsg::decode(&[9]).is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 10_000,
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Arbitrary side-channel bytes (a type byte biased to the real ones): decoded and
        /// re-encoded to the same bytes, or refused with a message; never a panic.
        #[test]
        fn arbitrary_side_channel_bytes(
            ty in proptest::prop_oneof![1u8..=4, proptest::prelude::any::<u8>()],
            rest in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
        ) {
            let mut b = vec![ty];
            b.extend_from_slice(&rest);
            match VerbsMsg::decode(&b) {
                Ok(m @ (VerbsMsg::Grant { .. } | VerbsMsg::Granted(_))) => {
                    proptest::prop_assert_eq!(m.encode(), b)
                }
                Ok(_) => {}
                Err(e) => proptest::prop_assert!(!e.is_empty()),
            }
        }
    }
}
