//! Identifiers: block keys, requests, tasks, ops, engine blocks and backends.

use std::fmt;

use serde::{Deserialize, Serialize};

/// 128-bit content hash of one KV block, chained over the prefix that precedes it.
///
/// Files, remote descriptors and the offload index are keyed by it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockKey(pub u128);

impl BlockKey {
    /// Key of a block whose token content is `tokens`, following the block keyed `parent`
    /// (`None` for the first block of a sequence). Equal prefixes give equal keys.
    pub fn chain(parent: Option<BlockKey>, tokens: &[u8]) -> BlockKey {
        let seed = parent.map_or(0, |p| p.0);
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(0);
        h.update(&seed.to_le_bytes());
        h.update(tokens);
        BlockKey(h.digest128())
    }

    /// Big-endian bytes of the key (the order used on disk and on the wire).
    pub fn to_be_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// Key from big-endian bytes.
    pub fn from_be_bytes(b: [u8; 16]) -> BlockKey {
        BlockKey(u128::from_be_bytes(b))
    }

    /// The key as 32 lower-case hex digits.
    pub fn to_hex(self) -> String {
        format!("{:032x}", self.0)
    }

    /// Parse 32 hex digits; `None` if the text is not exactly that.
    pub fn from_hex(s: &str) -> Option<BlockKey> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u128::from_str_radix(s, 16).ok().map(BlockKey)
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({:032x})", self.0)
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

macro_rules! id_type {
    ($(#[$m:meta])* $name:ident, $inner:ty, $prefix:literal) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

id_type!(
    /// The engine's request (one sequence being prefilled or decoded).
    RequestId,
    u64,
    "req-"
);
id_type!(
    /// One transfer job of one request in one direction.
    TaskId,
    u64,
    "task-"
);
id_type!(
    /// One operation a backend executes on behalf of a task.
    OpId,
    u64,
    "op-"
);
id_type!(
    /// Index of a block in the engine's registered KV pool.
    EngineBlockId,
    u32,
    "blk-"
);
id_type!(
    /// A backend registered with a tracker or driver.
    BackendId,
    u16,
    "backend-"
);

/// Which way a task moves data, seen from the engine.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Direction {
    /// Into engine memory (from a tier).
    Load,
    /// Out of engine memory (into a tier).
    Store,
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::Load => "load",
            Direction::Store => "store",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_key_hex_round_trip_and_chain() {
        let a = BlockKey::chain(None, b"hello");
        let b = BlockKey::chain(Some(a), b"world");
        assert_ne!(a, b);
        assert_eq!(b, BlockKey::chain(Some(a), b"world"));
        assert_eq!(BlockKey::from_hex(&b.to_hex()), Some(b));
        assert_eq!(BlockKey::from_be_bytes(b.to_be_bytes()), b);
        assert_eq!(BlockKey::from_hex("zz"), None);
        assert_eq!(BlockKey::from_hex(&"g".repeat(32)), None);
    }
}
