//! Key hashing: one 64-bit xxh3 hash per key, seeded per table, split into
//! the home bucket, the probe step and the one-byte fingerprint.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Hash of a key under a table's seed.
#[inline(always)]
pub fn key_hash(key: u64, seed: u64) -> u64 {
    xxh3_64_with_seed(&key.to_le_bytes(), seed)
}

/// Fingerprint stored per slot: the top byte of the hash, never 0 (0 marks an empty slot).
#[inline(always)]
pub fn fingerprint(hash: u64) -> u8 {
    ((hash >> 56) as u8) | 1
}

/// Home bucket for `buckets` a power of two.
#[inline(always)]
pub fn home_bucket(hash: u64, bucket_mask: u64) -> u64 {
    hash & bucket_mask
}

/// Probe step: odd, so with a power-of-two bucket count the probe sequence
/// visits every bucket before it repeats.
#[inline(always)]
pub fn probe_step(hash: u64, bucket_mask: u64) -> u64 {
    ((hash >> 24) | 1) & bucket_mask.max(1)
}

/// SplitMix64: a tiny counter-based generator used for deterministic initial rows.
#[inline(always)]
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_sequence_visits_every_bucket() {
        for log in 0..10u32 {
            let n = 1u64 << log;
            let mask = n - 1;
            for key in 0..50u64 {
                let h = key_hash(key, 7);
                let step = probe_step(h, mask);
                let mut seen = vec![false; n as usize];
                let mut b = home_bucket(h, mask);
                for _ in 0..n {
                    seen[b as usize] = true;
                    b = (b + step) & mask;
                }
                assert!(seen.iter().all(|&s| s), "n={n} key={key} step={step}");
            }
        }
    }

    #[test]
    fn fingerprint_is_never_zero() {
        for key in 0..10_000u64 {
            assert_ne!(fingerprint(key_hash(key, 1)), 0);
        }
    }
}

/// A fast `Hasher` for maps keyed by ids (a multiply and a fold; ids are not attacker
/// input, and the store's own index uses its seeded `key_hash`).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, k: u64) {
        let x = (k ^ (k >> 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = x ^ (x >> 29);
    }
}

/// A `HashMap` keyed by ids, hashed with [`IdHasher`].
pub type IdMap<V> = std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<IdHasher>>;
