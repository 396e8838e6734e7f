//! Block keys from an engine's block hashes: each chained under a namespace (model, dtypes,
//! block size, layout, parallelism, KV cache group), so engines that share a tier never mix
//! blocks.

use kvx_core::BlockKey;

/// Bytes of one block key on the wire (big-endian).
pub const KEY_BYTES: usize = 16;

/// A key namespace: the root every block key of one KV cache group chains from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Namespace(BlockKey);

impl Namespace {
    /// The namespace of an engine identity `text`.
    pub fn new(text: &[u8]) -> Namespace {
        Namespace(BlockKey::chain(None, text))
    }

    /// The key of the block an engine hashed to `hash`.
    pub fn key(self, hash: &[u8]) -> BlockKey {
        BlockKey::chain(Some(self.0), hash)
    }

    /// The short identity a producer names and a consumer checks (32 hex digits).
    pub fn id(self) -> String {
        format!("{:032x}", self.0.0)
    }
}

/// Concatenated big-endian keys.
pub fn key_bytes(keys: &[BlockKey]) -> Vec<u8> {
    keys.iter().flat_map(|k| k.to_be_bytes()).collect()
}

/// Keys from concatenated big-endian bytes; `None` when the length is not a multiple of
/// [`KEY_BYTES`].
pub fn keys_from_bytes(b: &[u8]) -> Option<Vec<BlockKey>> {
    if b.len() % KEY_BYTES != 0 {
        return None;
    }
    Some(
        b.chunks_exact(KEY_BYTES)
            .map(|c| {
                let mut k = [0u8; KEY_BYTES];
                k.copy_from_slice(c);
                BlockKey::from_be_bytes(k)
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_from_the_namespace_as_files_written_before_name_them() {
        // The file tier names blocks by these keys: the chaining must never change.
        let ns = Namespace::new(b"model|bf16|16");
        let root = BlockKey::chain(None, b"model|bf16|16");
        assert_eq!(ns.key(b"hash"), BlockKey::chain(Some(root), b"hash"));
        assert_ne!(ns.key(b"hash"), Namespace::new(b"other").key(b"hash"));
        assert_eq!(ns.id(), format!("{:032x}", root.0));
        assert_eq!(ns.id().len(), 32);
    }

    #[test]
    fn key_bytes_round_trip_and_a_cut_key_is_refused() {
        let ns = Namespace::new(b"n");
        let keys = vec![ns.key(b"a"), ns.key(b"b")];
        let bytes = key_bytes(&keys);
        assert_eq!(bytes.len(), 2 * KEY_BYTES);
        assert_eq!(keys_from_bytes(&bytes), Some(keys));
        assert_eq!(keys_from_bytes(&bytes[..KEY_BYTES + 3]), None);
        assert_eq!(keys_from_bytes(&[]), Some(Vec::new()));
    }
}
