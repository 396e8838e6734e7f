//! Block keys from an engine's block hashes: each chained under a namespace (model, dtypes,
//! block size, layout, parallelism, KV cache group), so engines that share a tier never mix
//! blocks.

use std::collections::{HashMap, HashSet};

use kvx_core::{BlockKey, RequestId};

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

/// Each request's block keys in every namespace of an engine (one per KV cache group), from
/// the engine's block hashes as they grow.
#[derive(Debug)]
pub struct Keyring {
    namespaces: Vec<Namespace>,
    /// Engine hashes per kvx block (an engine may hash finer than its KV blocks).
    hashes_per_block: usize,
    requests: HashMap<RequestId, RequestKeys>,
}

/// One request's keys per namespace, and how many engine hashes they cover.
#[derive(Debug)]
struct RequestKeys {
    by_group: Vec<Vec<BlockKey>>,
    hashes: usize,
}

impl Keyring {
    /// Keys in `namespaces`, from `hashes_per_block` engine hashes per block (at least 1).
    pub fn new(namespaces: Vec<Namespace>, hashes_per_block: usize) -> Result<Keyring, String> {
        if hashes_per_block == 0 {
            return Err("0 engine hashes per block".into());
        }
        Ok(Keyring {
            namespaces,
            hashes_per_block,
            requests: HashMap::new(),
        })
    }

    /// How many namespaces (KV cache groups).
    pub fn groups(&self) -> usize {
        self.namespaces.len()
    }

    /// How many engine hashes of `req` its keys cover (hashes from there on are new).
    pub fn hashes_seen(&self, req: RequestId) -> usize {
        self.requests.get(&req).map_or(0, |k| k.hashes)
    }

    /// Extend `req`'s keys with the engine's block hashes from [`Keyring::hashes_seen`] on
    /// (`new`, in order); the hashes of a block not yet whole wait for its last one.
    pub fn extend<'a>(&mut self, req: RequestId, new: impl IntoIterator<Item = &'a [u8]>) {
        let groups = self.namespaces.len();
        let keys = self.requests.entry(req).or_insert_with(|| RequestKeys {
            by_group: vec![Vec::new(); groups],
            hashes: 0,
        });
        let mut blocks = keys.hashes / self.hashes_per_block;
        for (i, hash) in new.into_iter().enumerate() {
            if (keys.hashes + i + 1) % self.hashes_per_block == 0 {
                for (g, ns) in self.namespaces.iter().enumerate() {
                    keys.by_group[g].push(ns.key(hash));
                }
                blocks += 1;
            }
        }
        keys.hashes = blocks * self.hashes_per_block;
    }

    /// Group `group`'s keys of `req`'s full blocks (none for a request or group unknown).
    pub fn keys(&self, req: RequestId, group: usize) -> &[BlockKey] {
        self.requests
            .get(&req)
            .and_then(|k| k.by_group.get(group))
            .map_or(&[], Vec::as_slice)
    }

    /// Full blocks of `req` with keys.
    pub fn blocks(&self, req: RequestId) -> u64 {
        (self.hashes_seen(req) / self.hashes_per_block) as u64
    }

    /// The lowest block index, in any group, of a key in `failed` (a load of it failed).
    pub fn first_failed(&self, req: RequestId, failed: &[BlockKey]) -> Option<u64> {
        let keys = self.requests.get(&req)?;
        let failed: HashSet<&BlockKey> = failed.iter().collect();
        keys.by_group
            .iter()
            .filter_map(|g| g.iter().position(|k| failed.contains(k)))
            .min()
            .map(|i| i as u64)
    }

    /// The engine is done with `req`: its keys go.
    pub fn forget(&mut self, req: RequestId) {
        self.requests.remove(&req);
    }

    /// Requests with keys.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// True when no request has keys.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
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

    #[test]
    fn a_keyring_keys_whole_blocks_in_every_namespace_and_finds_the_first_failed() {
        let (a, b) = (Namespace::new(b"g0"), Namespace::new(b"g1"));
        let mut ring = Keyring::new(vec![a, b], 2).unwrap();
        let hashes: Vec<Vec<u8>> = (0..5).map(|i| vec![i]).collect();
        let req = RequestId(1);
        ring.extend(req, hashes.iter().map(Vec::as_slice));
        assert_eq!((ring.blocks(req), ring.hashes_seen(req)), (2, 4));
        // A block's key is that of its last hash.
        assert_eq!(ring.keys(req, 1), &[b.key(&[1]), b.key(&[3])]);
        ring.extend(req, hashes[4..].iter().map(Vec::as_slice));
        assert_eq!(ring.blocks(req), 2, "the fifth hash alone is half a block");
        ring.extend(req, [&[4u8][..], &[5u8][..]]);
        assert_eq!(ring.keys(req, 0), &[a.key(&[1]), a.key(&[3]), a.key(&[5])]);
        assert_eq!(ring.first_failed(req, &[b.key(&[5]), a.key(&[3])]), Some(1));
        assert_eq!(ring.first_failed(req, &[BlockKey(9)]), None);
        ring.forget(req);
        assert!(ring.is_empty());
        assert!(Keyring::new(vec![a], 0).is_err());
    }
}
