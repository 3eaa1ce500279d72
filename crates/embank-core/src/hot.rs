//! Automatic hot placement: each table samples the keys its reads ask for (one
//! batch in `sample_every`, into a bounded frequent-items sketch), and the store's
//! maintenance thread, at most once per `every_seconds` per table, takes the
//! sketch's `keys` most frequent keys and, if fewer than `min_home_fraction` of
//! them sit in their home index bucket, places them there
//! ([`Table::place_hot`](crate::Table::place_hot): one index rebuild). The cost is
//! bounded by the interval: one pass over the index per table per interval at
//! most, and none while the hot set is already at home.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::tier::dram::MixHasher;

/// Options of automatic hot placement (`StoreOptions::hot_placement`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HotOptions {
    /// Size of the hot set placed per table. Default 10 000.
    pub keys: usize,
    /// Least seconds between two placements of a table. Default 600.
    pub every_seconds: f64,
    /// Sample one read batch in this many. Default 16.
    pub sample_every: u32,
    /// Place when fewer of the hot set than this are in their home bucket. Default 0.99.
    pub min_home_fraction: f64,
}

impl Default for HotOptions {
    fn default() -> Self {
        HotOptions { keys: 10_000, every_seconds: 600.0, sample_every: 16, min_home_fraction: 0.99 }
    }
}

impl HotOptions {
    pub fn validate(&self) -> crate::Result<()> {
        if self.keys == 0 || self.sample_every == 0 || self.every_seconds.is_nan() || self.every_seconds < 0.0 {
            return Err(crate::Error::config(
                "hot_placement: keys and sample_every must be at least 1, every_seconds >= 0",
            ));
        }
        if !(0.0..=1.0).contains(&self.min_home_fraction) {
            return Err(crate::Error::config("hot_placement: min_home_fraction must be in [0, 1]"));
        }
        Ok(())
    }
}

/// A table's sample of the keys its reads ask for.
pub(crate) struct HotSampler {
    calls: AtomicU64,
    every: u64,
    /// Keys tracked at most (4x the hot set).
    capacity: usize,
    sketch: Mutex<HashMap<u64, u64, std::hash::BuildHasherDefault<MixHasher>>>,
    pub last_round: Mutex<Option<Instant>>,
}

impl HotSampler {
    pub fn new(opts: &HotOptions) -> HotSampler {
        HotSampler {
            calls: AtomicU64::new(0),
            every: opts.sample_every as u64,
            capacity: opts.keys.saturating_mul(4).max(64),
            sketch: Mutex::new(HashMap::default()),
            last_round: Mutex::new(Some(Instant::now())),
        }
    }

    /// Counts `keys` in one batch of `sample_every` (skipped when another thread is in).
    #[inline]
    pub fn observe(&self, keys: &[u64]) {
        if !self.calls.fetch_add(1, Ordering::Relaxed).is_multiple_of(self.every) {
            return;
        }
        let Some(mut sketch) = self.sketch.try_lock() else { return };
        for &k in keys {
            *sketch.entry(k).or_insert(0) += 1;
        }
        if sketch.len() > self.capacity {
            // Misra-Gries style: drop the lower half, subtract its top count from the rest.
            let mut counts: Vec<u64> = sketch.values().copied().collect();
            let mid = counts.len() / 2;
            let (_, &mut cut, _) = counts.select_nth_unstable(mid);
            sketch.retain(|_, c| {
                let keep = *c > cut;
                *c = c.saturating_sub(cut);
                keep
            });
        }
    }

    /// The `n` most sampled keys, most frequent first; halves every count (so the hot
    /// set follows a drifting workload).
    pub fn top(&self, n: usize) -> Vec<u64> {
        let mut sketch = self.sketch.lock();
        let mut all: Vec<(u64, u64)> = sketch.iter().map(|(&k, &c)| (k, c)).collect();
        all.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        all.truncate(n);
        sketch.retain(|_, c| {
            *c /= 2;
            *c > 0
        });
        all.into_iter().map(|(k, _)| k).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sketch_finds_the_frequent_keys_within_its_bound() {
        let s = HotSampler::new(&HotOptions { keys: 10, sample_every: 1, ..Default::default() });
        for round in 0..200u64 {
            let mut batch: Vec<u64> = (0..10).collect(); // hot: every batch
            batch.extend((0..30).map(|i| 1_000 + round * 30 + i)); // cold: once each
            s.observe(&batch);
            assert!(s.sketch.lock().len() <= s.capacity + batch.len());
        }
        let mut top = s.top(10);
        top.sort_unstable();
        assert_eq!(top, (0..10).collect::<Vec<u64>>());
    }
}
