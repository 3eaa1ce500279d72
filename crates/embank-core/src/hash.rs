//! Key hashing: one 64-bit xxh3 hash per key, seeded per table, split into
//! the home bucket, the probe step ([`Geometry`]) and the one-byte fingerprint.

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

/// Where keys' probe sequences run in an index of some count of buckets.
///
/// A power-of-two count (every index before format version 2) takes the home bucket
/// from the hash's low bits and probes with an odd step from bits 24 and up (double
/// hashing: the sequence visits every bucket before it repeats). Any other count (index
/// format version 2, sized to its keys rather than rounded up to a power of two) maps
/// the hash's low 48 bits onto the buckets by a multiply (`(h mod 2^48) * count >> 48`)
/// and probes linearly, the next bucket after the last being the first. Either way the
/// fingerprint is the top byte, apart from the bits that choose the bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    count: u64,
    /// `count - 1` for a power-of-two count.
    mask: u64,
    pow2: bool,
}

/// Hash bits a count that is not a power of two maps onto its buckets.
const RANGE_BITS: u32 = 48;

impl Geometry {
    /// The geometry of `count` buckets (1..=2^40).
    pub fn new(count: u64) -> Geometry {
        debug_assert!((1..=1 << 40).contains(&count));
        let pow2 = count.is_power_of_two();
        Geometry { count, mask: if pow2 { count - 1 } else { 0 }, pow2 }
    }

    /// The home bucket of a hash: where a lookup reads first.
    #[inline(always)]
    pub fn home(self, hash: u64) -> u64 {
        if self.pow2 {
            hash & self.mask
        } else {
            (((hash & ((1 << RANGE_BITS) - 1)) as u128 * self.count as u128) >> RANGE_BITS) as u64
        }
    }

    /// The probe step of a hash (1 where the count is not a power of two).
    #[inline(always)]
    pub fn step(self, hash: u64) -> u64 {
        if self.pow2 {
            ((hash >> 24) | 1) & self.mask.max(1)
        } else {
            1
        }
    }

    /// The bucket after `b` on a probe sequence of step `step`.
    #[inline(always)]
    pub fn next(self, b: u64, step: u64) -> u64 {
        if self.pow2 {
            (b + step) & self.mask
        } else {
            let n = b + step;
            if n >= self.count {
                n - self.count
            } else {
                n
            }
        }
    }
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
        // Powers of two (double hashing) and other counts (linear), small and odd ones.
        let counts = (0..10u32).map(|log| 1u64 << log).chain([3, 5, 6, 7, 12, 100, 1000, 1023]);
        for n in counts {
            let geo = Geometry::new(n);
            for key in 0..50u64 {
                let h = key_hash(key, 7);
                let step = geo.step(h);
                let mut seen = vec![false; n as usize];
                let mut b = geo.home(h);
                for _ in 0..n {
                    seen[b as usize] = true;
                    b = geo.next(b, step);
                }
                assert!(seen.iter().all(|&s| s), "n={n} key={key} step={step}");
            }
        }
    }

    #[test]
    fn homes_spread_evenly_over_any_count() {
        // 1,000 keys a bucket on average: every bucket within 15 % of it, fingerprints
        // independent of the bucket (each bucket sees many of them).
        for n in [7u64, 100, 1000, 1 << 10] {
            let geo = Geometry::new(n);
            let mut per = vec![0u64; n as usize];
            let mut fps = vec![std::collections::HashSet::new(); n as usize];
            for key in 0..n * 1000 {
                let h = key_hash(key, 3);
                per[geo.home(h) as usize] += 1;
                fps[geo.home(h) as usize].insert(fingerprint(h));
            }
            assert!(per.iter().all(|&c| (850..=1150).contains(&c)), "n={n}: {:?}", &per[..7.min(n as usize)]);
            assert!(fps.iter().all(|f| f.len() > 100), "n={n}: fingerprints follow the bucket");
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
