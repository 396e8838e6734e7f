//! What a consumer needs to read an exported request: where, how, which blocks, how big.

use std::net::SocketAddr;
use std::time::Duration;

use kvx_core::{BlockKey, RequestId};
use serde::{Deserialize, Serialize};

use crate::error::RdmaError;

/// The transport a descriptor's producer serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// Framed reads over TCP (tokio).
    Tcp,
    /// One-sided RDMA READ on RC queue pairs, set up over the TCP side channel.
    Verbs,
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Verbs => "verbs",
        })
    }
}

/// A request exported by a producer: handed to consumers out of band (router, KV-transfer
/// params), as JSON or as the struct.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteDescriptor {
    /// The producer's request id.
    pub request: RequestId,
    /// The producer's TCP address (data for `tcp`, side channel for `verbs`).
    pub addr: SocketAddr,
    /// Which transport to read with.
    pub transport: TransportKind,
    /// Bytes of each block.
    pub block_bytes: u64,
    /// Block keys, in export order (a read names a block by its index here).
    pub blocks: Vec<BlockKey>,
    /// How often a reader should renew the lease, in milliseconds.
    pub heartbeat_interval_ms: u64,
    /// The lease TTL, in milliseconds.
    pub ttl_ms: u64,
    /// Readers the producer waits for before releasing.
    pub expected_readers: u32,
}

impl RemoteDescriptor {
    /// The heartbeat interval.
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }

    /// Check the fields make sense (non-empty, non-zero sizes, heartbeat below the TTL).
    pub fn validate(&self) -> Result<(), RdmaError> {
        let bad = |what: &str| {
            Err(RdmaError::BadDescriptor {
                request: self.request,
                what: what.into(),
            })
        };
        if self.blocks.is_empty() {
            return bad("no blocks");
        }
        if self.block_bytes == 0 {
            return bad("zero block size");
        }
        if self.heartbeat_interval_ms == 0 || self.heartbeat_interval_ms >= self.ttl_ms {
            return bad("heartbeat interval must be positive and below the TTL");
        }
        if self.expected_readers == 0 {
            return bad("zero expected readers");
        }
        Ok(())
    }

    /// The descriptor as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parse and validate a JSON descriptor.
    pub fn from_json(s: &str) -> Result<RemoteDescriptor, RdmaError> {
        let d: RemoteDescriptor =
            serde_json::from_str(s).map_err(|e| RdmaError::BadDescriptor {
                request: RequestId(0),
                what: format!("not a descriptor: {e}"),
            })?;
        d.validate()?;
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor() -> RemoteDescriptor {
        RemoteDescriptor {
            request: RequestId(7),
            addr: "127.0.0.1:4000".parse().unwrap(),
            transport: TransportKind::Tcp,
            block_bytes: 4096,
            blocks: vec![BlockKey(u128::MAX), BlockKey::chain(None, b"x")],
            heartbeat_interval_ms: 100,
            ttl_ms: 600,
            expected_readers: 2,
        }
    }

    #[test]
    fn json_round_trip_and_validation() {
        let d = descriptor();
        let back = RemoteDescriptor::from_json(&d.to_json()).unwrap();
        assert_eq!(back, d);
        let mut bad = d.clone();
        bad.heartbeat_interval_ms = 600;
        assert!(matches!(
            RemoteDescriptor::from_json(&bad.to_json()),
            Err(RdmaError::BadDescriptor { .. })
        ));
        assert!(RemoteDescriptor::from_json("{").is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 512,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Whatever a peer hands over as a descriptor, parsing answers (never a panic), and a
        /// descriptor it accepts validates.
        #[test]
        fn any_text_parses_or_errs(text in ".{0,300}") {
            if let Ok(d) = RemoteDescriptor::from_json(&text) {
                proptest::prop_assert!(d.validate().is_ok());
            }
        }

        /// A valid descriptor's JSON, cut short or with one byte changed, parses or errs.
        #[test]
        fn mutated_descriptors_parse_or_err(cut in 0usize..400, at in 0usize..400, byte in proptest::prelude::any::<u8>()) {
            let mut b = descriptor().to_json().into_bytes();
            let i = at % b.len();
            b[i] = byte;
            b.truncate(cut.min(b.len()));
            if let Ok(d) = RemoteDescriptor::from_json(&String::from_utf8_lossy(&b)) {
                proptest::prop_assert!(d.validate().is_ok());
                proptest::prop_assert!(!d.blocks.is_empty());
            }
        }
    }
}
