//! The remote tier: a producer engine exports a finished request's engine blocks under a lease
//! (kvx-rdma's `Exporter` and TCP server), a consumer engine loads them by key with a deadline
//! (kvx-rdma's `Importer`, a backend like the others) — prefill/decode disaggregation.
//!
//! What the consumer needs to read a producer's request is a [`RemoteSource`]: the producer
//! hands it out (an engine passes it from the prefill's response to the decode's request, as
//! JSON), and the consumer's scheduler side plans loads from it.

use std::net::{IpAddr, SocketAddr};

use kvx_core::{BlockKey, RequestId};
use kvx_rdma::{RemoteDescriptor, TransportKind};
use serde::{Deserialize, Serialize};

use crate::error::OffloadError;

/// The remote tier's settings (the `remote` section of [`crate::OffloadConfig`]).
///
/// ```toml
/// [remote]
/// listen = "10.0.0.5:7400"   # producer: rank r of a parallel engine listens on port + r
/// lease_ttl_ms = 480000      # producer: blocks no reader said done with are freed then
/// heartbeat_ms = 10000       # producer: how often readers renew the lease
/// load_ms = 10000            # consumer: a remote load's deadline
/// export_blocks = 1024       # producer on a GPU: pinned host buffers exports are served from
/// threads = 2                # serving / reading threads per worker (default: 1 per core, ≤ 8)
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteTierConfig {
    /// Producer: where rank 0's server listens (rank `r` of a parallel engine listens on the
    /// port + `r`); `None` (the default): this engine exports nothing.
    pub listen: Option<SocketAddr>,
    /// Producer: the address consumers connect to, when `listen` is a wildcard (default: the
    /// listen address).
    pub advertise: Option<IpAddr>,
    /// Producer: a request's lease lasts this long without a reader's heartbeat, from the
    /// step that exported it (default 480 000: vLLM's abort timeout for P/D).
    pub lease_ttl_ms: u64,
    /// Producer: how often readers renew a lease (default 10 000; below the TTL).
    pub heartbeat_ms: u64,
    /// Consumer: a remote load ends by this deadline, from the step that starts it (default
    /// 10 000); blocks not read by then fail.
    pub load_ms: u64,
    /// Consumer: how long a producer may not know a request yet (it exports it at its next
    /// step) before the consumer gives it up and recomputes (default 2 000).
    pub export_grace_ms: u64,
    /// Shared token producer and consumers present (default none).
    pub token: Option<String>,
    /// Producer with engine memory on a GPU: pinned host buffers, in blocks, that exported
    /// requests are copied into and read from until their lease ends (default 1024: a
    /// 16k-token prompt of 16-token blocks); an export that finds too few free (one larger
    /// than this, or while leases hold the rest) is refused, and its reader computes the
    /// prompt itself.
    pub export_blocks: usize,
    /// Serving threads of a producer's worker and reading threads of a consumer's (default
    /// `None`: one per core, at most 8). Each connection or load task runs on one of them; on
    /// a machine whose cores the engine's own threads need, fewer leave them their cores.
    pub threads: Option<usize>,
}

impl Default for RemoteTierConfig {
    fn default() -> Self {
        RemoteTierConfig {
            listen: None,
            advertise: None,
            lease_ttl_ms: 480_000,
            heartbeat_ms: 10_000,
            load_ms: 10_000,
            export_grace_ms: 2_000,
            token: None,
            export_blocks: 1024,
            threads: None,
        }
    }
}

impl RemoteTierConfig {
    /// Check the settings; the error names the field (`remote.<key>`).
    pub fn validate(&self) -> Result<(), OffloadError> {
        if self.lease_ttl_ms == 0 {
            return Err(OffloadError::config(
                "remote.lease_ttl_ms",
                "must be positive",
            ));
        }
        if self.heartbeat_ms == 0 || self.heartbeat_ms >= self.lease_ttl_ms {
            return Err(OffloadError::config(
                "remote.heartbeat_ms",
                format!(
                    "must be positive and below remote.lease_ttl_ms ({}), got {}",
                    self.lease_ttl_ms, self.heartbeat_ms
                ),
            ));
        }
        if self.load_ms == 0 {
            return Err(OffloadError::config("remote.load_ms", "must be positive"));
        }
        if self.export_blocks == 0 || u32::try_from(self.export_blocks).is_err() {
            return Err(OffloadError::config(
                "remote.export_blocks",
                format!(
                    "must be between 1 and {}, got {}",
                    u32::MAX,
                    self.export_blocks
                ),
            ));
        }
        if let Some(t) = self.threads {
            if !(1..=64).contains(&t) {
                return Err(OffloadError::config(
                    "remote.threads",
                    format!("must be between 1 and 64, got {t}"),
                ));
            }
        }
        if let Some(l) = self.listen {
            if l.port() == 0 {
                return Err(OffloadError::config(
                    "remote.listen",
                    format!("{l}: needs a fixed port (the scheduler names it to consumers)"),
                ));
            }
            if l.ip().is_unspecified() && self.advertise.is_none() {
                return Err(OffloadError::config(
                    "remote.advertise",
                    format!("remote.listen {l} is a wildcard: name the address consumers reach"),
                ));
            }
        }
        Ok(())
    }

    /// Where the server of worker `rank` (of `world`) listens, if this engine exports.
    pub fn listen_addr(&self, rank: u32) -> Option<SocketAddr> {
        let l = self.listen?;
        Some(SocketAddr::new(l.ip(), l.port().wrapping_add(rank as u16)))
    }

    /// The addresses consumers reach the servers of `world` workers at, by rank.
    pub fn producers(&self, world: u32) -> Option<Vec<SocketAddr>> {
        let l = self.listen?;
        let ip = self.advertise.unwrap_or(l.ip());
        Some(
            (0..world)
                .map(|r| SocketAddr::new(ip, l.port().wrapping_add(r as u16)))
                .collect(),
        )
    }
}

/// Blocks per task of a remote load, at least.
pub const REMOTE_TASK_BLOCKS: usize = 16;

/// Tasks of one remote load, at most: each reads on a connection of its own, and a long
/// prompt's load would otherwise open more connections than the importer keeps pooled.
pub const REMOTE_TASKS: usize = 8;

/// Blocks per task when a consumer's remote load reads `blocks` blocks (all its tasks at
/// once): [`REMOTE_TASK_BLOCKS`], or more when that would make more than [`REMOTE_TASKS`]
/// tasks. `kvx bench remote` reads in this shape by default.
pub fn remote_task_blocks(blocks: usize) -> usize {
    REMOTE_TASK_BLOCKS.max(blocks.div_ceil(REMOTE_TASKS))
}

/// Most blocks one remote source may name (a 1 Mi-token prompt of 16-token blocks is 65 536).
pub const MAX_REMOTE_BLOCKS: usize = 1 << 20;

/// A producer's exported request, as a consumer needs it: handed from the prefill's response to
/// the decode's request (JSON), checked by [`RemoteSource::from_json`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteSource {
    /// The engine namespace the keys belong to (model, dtypes, block size, parallelism,
    /// layout): a consumer of another namespace must not read the blocks.
    pub namespace: String,
    /// The producer's export id (it names the request on every producer rank).
    pub export: u64,
    /// Each producer rank's server, by rank.
    pub producers: Vec<SocketAddr>,
    /// Keys of the exported blocks, in prompt order (in JSON: 32 hex digits each; an
    /// integer above 2^64 is not a value vLLM carries in a request's `kv_transfer_params`).
    #[serde(with = "hex_keys")]
    pub keys: Vec<BlockKey>,
    /// The lease TTL, in milliseconds.
    pub ttl_ms: u64,
    /// How often to renew the lease, in milliseconds.
    pub heartbeat_ms: u64,
}

impl RemoteSource {
    /// Parse and check a source; the error says what is wrong (never a panic, whatever the
    /// bytes).
    pub fn from_json(text: &str) -> Result<RemoteSource, OffloadError> {
        let s: RemoteSource = serde_json::from_str(text)
            .map_err(|e| OffloadError::config("kv_transfer_params.kvx", e))?;
        s.validate()?;
        Ok(s)
    }

    /// The source as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Check the fields make sense.
    pub fn validate(&self) -> Result<(), OffloadError> {
        let bad = |what: &str, why: String| {
            Err(OffloadError::config(
                format!("kv_transfer_params.kvx.{what}"),
                why,
            ))
        };
        if self.producers.is_empty() {
            return bad("producers", "names no producer".into());
        }
        if self.keys.is_empty() || self.keys.len() > MAX_REMOTE_BLOCKS {
            return bad(
                "keys",
                format!(
                    "must name 1..={MAX_REMOTE_BLOCKS} blocks, names {}",
                    self.keys.len()
                ),
            );
        }
        if self.heartbeat_ms == 0 || self.heartbeat_ms >= self.ttl_ms {
            return bad(
                "heartbeat_ms",
                format!(
                    "must be positive and below ttl_ms ({}), got {}",
                    self.ttl_ms, self.heartbeat_ms
                ),
            );
        }
        Ok(())
    }

    /// The descriptor worker `rank` reads with (each rank reads its own producer rank), for
    /// blocks of `block_bytes` (the consumer's own: a source of the same namespace has blocks
    /// of the same size).
    pub fn descriptor(
        &self,
        rank: u32,
        block_bytes: u64,
    ) -> Result<RemoteDescriptor, OffloadError> {
        let addr = *self.producers.get(rank as usize).ok_or_else(|| {
            OffloadError::config(
                "kv_transfer_params.kvx.producers",
                format!(
                    "names {} producer ranks; this consumer's rank {rank} has none",
                    self.producers.len()
                ),
            )
        })?;
        Ok(RemoteDescriptor {
            request: RequestId(self.export),
            addr,
            transport: TransportKind::Tcp,
            block_bytes,
            blocks: self.keys.clone(),
            heartbeat_interval_ms: self.heartbeat_ms,
            ttl_ms: self.ttl_ms,
            expected_readers: 1,
        })
    }

    /// Every producer rank's descriptor (what a consumer's lease keeper renews; heartbeats
    /// and done name no block, so the block size there is a placeholder of 1).
    pub fn descriptors(&self) -> Vec<RemoteDescriptor> {
        (0..self.producers.len() as u32)
            .filter_map(|r| self.descriptor(r, 1).ok())
            .collect()
    }
}

/// Block keys as strings of 32 hex digits.
mod hex_keys {
    use kvx_core::BlockKey;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub(super) fn serialize<S: Serializer>(keys: &[BlockKey], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(keys.iter().map(|k| k.to_string()))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<BlockKey>, D::Error> {
        let texts = Vec::<String>::deserialize(d)?;
        texts
            .iter()
            .map(|t| {
                BlockKey::from_hex(t)
                    .ok_or_else(|| D::Error::custom(format!("{t:?} is not a key of 32 hex digits")))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn source() -> RemoteSource {
        RemoteSource {
            namespace: "ns".into(),
            export: 42,
            producers: vec![
                "127.0.0.1:7400".parse().unwrap(),
                "127.0.0.1:7401".parse().unwrap(),
            ],
            keys: vec![BlockKey::chain(None, b"a"), BlockKey(u128::MAX)],
            ttl_ms: 1000,
            heartbeat_ms: 100,
        }
    }

    #[test]
    fn a_source_round_trips_and_each_rank_reads_its_producer() {
        let s = source();
        let back = RemoteSource::from_json(&s.to_json()).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.descriptor(1, 4096).unwrap().addr.port(), 7401);
        assert!(back.descriptor(2, 4096).is_err());
        assert_eq!(back.descriptors().len(), 2);
    }

    #[test]
    fn keys_travel_as_hex_strings() {
        let v: serde_json::Value = serde_json::from_str(&source().to_json()).unwrap();
        assert_eq!(v["keys"][1], serde_json::json!("f".repeat(32)));
        let e = RemoteSource::from_json(&source().to_json().replace(&"f".repeat(32), "xyz"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"xyz\" is not a key of 32 hex digits"), "{e}");
    }

    #[test]
    fn a_bad_source_names_the_field() {
        let mut s = source();
        s.heartbeat_ms = 1000;
        let e = RemoteSource::from_json(&s.to_json())
            .unwrap_err()
            .to_string();
        assert!(e.contains("kv_transfer_params.kvx.heartbeat_ms"), "{e}");
        let mut s = source();
        s.keys.clear();
        let e = RemoteSource::from_json(&s.to_json())
            .unwrap_err()
            .to_string();
        assert!(e.contains("kvx.keys"), "{e}");
        let e = RemoteSource::from_json(r#"{"export": 1, "extra": 2}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("kv_transfer_params.kvx"), "{e}");
    }

    #[test]
    fn a_thread_count_outside_1_to_64_names_the_field() {
        for bad in [0, 65] {
            let c: RemoteTierConfig =
                serde_json::from_str(&format!(r#"{{"threads": {bad}}}"#)).unwrap();
            let e = c.validate().unwrap_err().to_string();
            assert!(
                e.contains("remote.threads") && e.contains(&bad.to_string()),
                "{e}"
            );
        }
        let c: RemoteTierConfig = serde_json::from_str(r#"{"threads": 3}"#).unwrap();
        c.validate().unwrap();
        assert_eq!(c.threads, Some(3));
        assert_eq!(RemoteTierConfig::default().threads, None);
    }

    #[test]
    fn a_producer_config_needs_a_fixed_port_and_a_reachable_address() {
        let mut c = RemoteTierConfig {
            listen: Some("0.0.0.0:7400".parse().unwrap()),
            ..RemoteTierConfig::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("remote.advertise")
        );
        c.advertise = Some("10.0.0.5".parse().unwrap());
        c.validate().unwrap();
        assert_eq!(
            c.producers(2).unwrap(),
            vec![
                "10.0.0.5:7400".parse().unwrap(),
                "10.0.0.5:7401".parse().unwrap()
            ]
        );
        assert_eq!(c.listen_addr(1).unwrap().port(), 7401);
        c.listen = Some("127.0.0.1:0".parse().unwrap());
        assert!(c.validate().unwrap_err().to_string().contains("fixed port"));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Whatever a peer sends as a source, parsing answers (a source or an error), and a
        /// source it accepts is one whose every rank has a valid descriptor.
        #[test]
        fn any_text_parses_or_errs(text in ".{0,300}") {
            if let Ok(s) = RemoteSource::from_json(&text) {
                for d in s.descriptors() {
                    prop_assert!(d.validate().is_ok());
                }
            }
        }

        /// Truncating or mutating a valid source's JSON never panics, and what still parses
        /// validates.
        #[test]
        fn mutated_sources_parse_or_err(cut in 0usize..400, at in 0usize..400, byte in any::<u8>()) {
            let mut b = source().to_json().into_bytes();
            let i = at % b.len();
            b[i] = byte;
            b.truncate(cut.min(b.len()));
            let text = String::from_utf8_lossy(&b);
            if let Ok(s) = RemoteSource::from_json(&text) {
                prop_assert!(s.validate().is_ok());
                prop_assert!(!s.producers.is_empty());
            }
        }
    }

    /// A short load reads in tasks of 16 blocks; a long one in at most 8 tasks.
    #[test]
    fn a_load_reads_in_tasks_of_16_blocks_and_at_most_8_tasks() {
        for (blocks, per_task, tasks) in [
            (1, 16, 1),
            (16, 16, 1),
            (17, 16, 2),
            (128, 16, 8),
            (129, 17, 8),
            (256, 32, 8),
            (2049, 257, 8),
        ] {
            assert_eq!(remote_task_blocks(blocks), per_task, "{blocks} blocks");
            assert_eq!(blocks.div_ceil(per_task), tasks, "{blocks} blocks");
        }
    }
}
