//! Helpers shared by the crash-style integration tests.

/// xorshift64: a seedable stream for kill timings and key choices (seed must be non-zero).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}
