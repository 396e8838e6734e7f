//! The reference: an ideal LRU cache of a given capacity replaying the same trace with the same
//! prefix semantics as the engine model. Requests run one after another; a request's hit is
//! its longest leading run of cached blocks; its blocks are inserted once it has been computed
//! (hits first touched, then every block of the request inserted or refreshed in order).

use hashlink::LruCache;
use kvx_core::BlockKey;

/// Blocks hit by an ideal LRU cache of `capacity` blocks over `requests` (each its block keys).
pub fn ideal_lru_hits<'a>(
    capacity: usize,
    requests: impl IntoIterator<Item = &'a [BlockKey]>,
) -> u64 {
    if capacity == 0 {
        return 0;
    }
    let mut lru: LruCache<BlockKey, ()> = LruCache::new(capacity);
    let mut hits = 0u64;
    for keys in requests {
        let hit = keys.iter().take_while(|k| lru.contains_key(*k)).count();
        hits += hit as u64;
        for k in keys {
            if lru.get(k).is_none() {
                lru.insert(*k, ());
            }
        }
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u128) -> BlockKey {
        BlockKey(i)
    }

    #[test]
    fn longest_leading_run_with_lru_eviction() {
        let reqs: Vec<Vec<BlockKey>> = vec![
            vec![k(1), k(2), k(3)],
            vec![k(1), k(2), k(4)], // hits 1, 2
            vec![k(5), k(2)],       // a gap first: no hit even though 2 is cached
            vec![k(1), k(3)],       // capacity 4 evicted 3 (LRU): hits 1 only
        ];
        let hits = ideal_lru_hits(4, reqs.iter().map(|r| r.as_slice()));
        assert_eq!(hits, 3, "2 + 0 + 1");
        assert_eq!(
            ideal_lru_hits(100, reqs.iter().map(|r| r.as_slice())),
            2 + 2
        );
        assert_eq!(ideal_lru_hits(0, reqs.iter().map(|r| r.as_slice())), 0);
    }
}
