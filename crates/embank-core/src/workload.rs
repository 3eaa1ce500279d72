//! Deterministic key streams: Zipf-distributed ranks scrambled over the key
//! space (so hot keys scatter, as YCSB does), generated from a seed. The planner's
//! generated workloads and `embank bench`'s are the same streams.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};

/// Keys `0..keys`, drawn with Zipf exponent `zipf` (0 = uniform).
pub struct KeyStream {
    zipf: Option<Zipf<f64>>,
    rng: StdRng,
    keys: u64,
    multiplier: u64,
    offset: u64,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl KeyStream {
    pub fn new(keys: u64, zipf: f64, seed: u64) -> Result<KeyStream, String> {
        if keys == 0 {
            return Err("the key space must hold at least one key".into());
        }
        if !(zipf >= 0.0 && zipf.is_finite()) {
            return Err(format!("zipf exponent must be >= 0, got {zipf}"));
        }
        let zipf = if zipf == 0.0 {
            None
        } else {
            Some(Zipf::new(keys as f64, zipf).map_err(|e| format!("bad zipf parameters: {e}"))?)
        };
        // rank -> (rank * multiplier + offset) mod keys is a bijection when the
        // multiplier is coprime with the key count; neighbouring ranks land far apart.
        let mut multiplier = (0x9E37_79B9_7F4A_7C15u64 % keys).max(1);
        while gcd(multiplier, keys) != 1 {
            multiplier += 1;
        }
        let offset = 0x5851_F42D_4C95_7F2Du64 % keys;
        Ok(KeyStream { zipf, rng: StdRng::seed_from_u64(seed), keys, multiplier, offset })
    }

    /// The key of popularity rank `rank` (0 = hottest).
    pub fn key_of_rank(&self, rank: u64) -> u64 {
        ((rank as u128 * self.multiplier as u128 + self.offset as u128) % self.keys as u128) as u64
    }

    pub fn next_key(&mut self) -> u64 {
        let rank = match &self.zipf {
            Some(z) => (z.sample(&mut self.rng) as u64).clamp(1, self.keys) - 1,
            None => self.rng.random_range(0..self.keys),
        };
        self.key_of_rank(rank)
    }

    /// `batches` batches of `batch` keys, flattened.
    pub fn batches(&mut self, batches: usize, batch: usize) -> Vec<u64> {
        (0..batches * batch).map(|_| self.next_key()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn deterministic_and_skewed() {
        let a = KeyStream::new(100_000, 0.99, 7).unwrap().batches(10, 500);
        let b = KeyStream::new(100_000, 0.99, 7).unwrap().batches(10, 500);
        assert_eq!(a, b);
        let mut counts: HashMap<u64, u64> = HashMap::new();
        for k in &a {
            assert!(*k < 100_000);
            *counts.entry(*k).or_default() += 1;
        }
        let s = KeyStream::new(100_000, 0.99, 7).unwrap();
        let hottest = s.key_of_rank(0);
        let top = counts.values().max().copied().unwrap();
        assert_eq!(counts[&hottest], top, "rank 0 is the most frequent key");
        assert!(top as f64 > 5000.0 * 0.05, "zipf 0.99 puts several percent on the top key, saw {top}");
        // Scrambled: the hottest key is not key 0.
        assert_ne!(hottest, 0);
    }

    #[test]
    fn scramble_is_a_bijection() {
        for n in [1u64, 2, 10, 97, 1000, 4096] {
            let s = KeyStream::new(n, 1.0, 1).unwrap();
            let mut seen = vec![false; n as usize];
            for r in 0..n {
                seen[s.key_of_rank(r) as usize] = true;
            }
            assert!(seen.iter().all(|&x| x), "n={n}");
        }
    }
}
