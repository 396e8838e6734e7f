//! Block payloads: real bytes, a deterministic function of the block key, so any copy of a
//! block can be checked byte for byte against what was computed.

use kvx_core::BlockKey;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn seed(key: BlockKey) -> u64 {
    (key.0 as u64) ^ ((key.0 >> 64) as u64).rotate_left(17)
}

/// Fill `out` with the content of the block keyed `key`.
pub fn fill(key: BlockKey, out: &mut [u8]) {
    let s = seed(key);
    let mut words = out.chunks_exact_mut(8);
    for (i, w) in (&mut words).enumerate() {
        w.copy_from_slice(
            &splitmix(s ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)).to_le_bytes(),
        );
    }
    let rest = words.into_remainder();
    let tail = splitmix(!s).to_le_bytes();
    rest.copy_from_slice(&tail[..rest.len()]);
}

/// True when `data` is exactly the content of the block keyed `key`.
pub fn matches(key: BlockKey, data: &[u8]) -> bool {
    let s = seed(key);
    let mut words = data.chunks_exact(8);
    for (i, w) in (&mut words).enumerate() {
        let want = splitmix(s ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)).to_le_bytes();
        if w != want {
            return false;
        }
    }
    let rest = words.remainder();
    rest == &splitmix(!s).to_le_bytes()[..rest.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_per_key_and_checked_exactly() {
        let a = BlockKey::chain(None, b"a");
        let b = BlockKey::chain(None, b"b");
        let mut x = vec![0u8; 4100];
        fill(a, &mut x);
        assert!(matches(a, &x));
        assert!(!matches(b, &x));
        let mut y = x.clone();
        fill(a, &mut y);
        assert_eq!(x, y, "deterministic");
        y[4099] ^= 1;
        assert!(!matches(a, &y), "the tail byte counts");
        x[17] ^= 0x80;
        assert!(!matches(a, &x), "one flipped bit is caught");
    }
}
