//! Sizing tiers from a key stream before buying memory: the miss-ratio curve of
//! an LRU-like cache of every size at once (Mattson stack distances), sampled
//! spatially as SHARDS does so a billion-id trace plans in bounded memory, and
//! the store's own byte costs (index, records, cache entries) per table.
//!
//! A key's *stack distance* at an access is the number of distinct keys accessed
//! since its previous access; an LRU cache of `C` rows hits exactly the accesses
//! whose distance is below `C`. embank's row cache is CLOCK (second chance), which
//! tracks LRU closely on skewed streams; `docs/BENCHMARKS.md` compares the
//! prediction with measured hit rates.
//!
//! Sampling (SHARDS): only keys whose hash falls below `rate * 2^64` are tracked;
//! their distances, scaled by `1 / rate`, estimate the full stream's. Memory is
//! that of the sampled keys and accesses, so `rate = budget / accesses` bounds it.
//! As SHARDS-adj does, the difference between the accesses the rate should have
//! sampled and those it did goes to the smallest distance: a sample that drew a
//! very hot key (or missed one) would otherwise skew small caches most. A cache
//! of `C` rows is resolved by `C * rate` sampled rows: keep that above ~50.
//!
//! This file is the model; `simulate.rs` runs it over a plan's key streams (from
//! `trace.rs`) into a [`Plan`], and `request.rs` reads a plan's options from JSON (the
//! Python package's `embank.plan`). The command (`embank plan`) parses its flags into
//! [`PlanOptions`], prints the plan and draws it.

use std::collections::HashMap;

use serde::Serialize;

use crate::format::{block_stride, record_stride, DType};
use crate::index::{buckets_for, BUCKET_BYTES};
use crate::layout::RecordLayout;
use crate::medium::MediumKind;
use crate::optim::Optimizer;
use crate::table::LOAD_FACTOR_TARGET;

mod request;
mod simulate;
mod trace;

pub use request::plan_request;
pub use simulate::{plan, CurvePoint, Limits, Plan, PlanOptions, PlanProgress, StorePlan, TablePlan};

/// Stack-distance histogram of a (sampled) key stream.
pub struct StackDistances {
    rate: f64,
    threshold: u64,
    /// Fenwick tree over access times: 1 where an access is its key's latest so far.
    tree: Vec<u32>,
    now: usize,
    last: HashMap<u64, usize>,
    /// `hist[d]`: sampled accesses at distance `d` (in sampled keys); cold misses apart.
    hist: Vec<u64>,
    cold: u64,
    accesses: u64,
    /// Whether accesses count toward the hit rates (off during a warm-up).
    counting: bool,
    /// Sampled accesses counted.
    counted: u64,
    /// Accesses counted, sampled or not.
    counted_all: u64,
}

impl StackDistances {
    /// `rate` in (0, 1]: the fraction of keys tracked; `capacity`: sampled accesses at
    /// most (the tree's size; more are counted as seen but not tracked).
    pub fn new(rate: f64, capacity: usize) -> StackDistances {
        let rate = rate.clamp(1e-9, 1.0);
        StackDistances {
            rate,
            threshold: if rate >= 1.0 { u64::MAX } else { (rate * u64::MAX as f64) as u64 },
            tree: vec![0; capacity + 1],
            now: 0,
            last: HashMap::new(),
            hist: Vec::new(),
            cold: 0,
            accesses: 0,
            counting: true,
            counted: 0,
            counted_all: 0,
        }
    }

    fn add(&mut self, mut i: usize, delta: i32) {
        i += 1;
        while i < self.tree.len() {
            self.tree[i] = (self.tree[i] as i64 + delta as i64) as u32;
            i += i & i.wrapping_neg();
        }
    }

    fn prefix(&self, mut i: usize) -> u64 {
        // Sum of [0, i).
        let mut s = 0u64;
        while i > 0 {
            s += self.tree[i] as u64;
            i -= i & i.wrapping_neg();
        }
        s
    }

    /// Whether the next accesses count toward the hit rates (they always update the
    /// recency order): off while a warm-up part of a trace goes by.
    pub fn set_counting(&mut self, on: bool) {
        self.counting = on;
    }

    /// Counts one access of `key`.
    #[inline]
    pub fn access(&mut self, key: u64) {
        self.accesses += 1;
        if self.counting {
            self.counted_all += 1;
        }
        if crate::hash::splitmix64(key ^ 0x5eed_9a11) > self.threshold {
            return;
        }
        if self.now + 1 >= self.tree.len() {
            return; // past the capacity: counted, not tracked
        }
        let t = self.now;
        self.now += 1;
        match self.last.insert(key, t) {
            Some(prev) => {
                if self.counting {
                    let d = (self.prefix(t) - self.prefix(prev + 1)) as usize;
                    if d >= self.hist.len() {
                        self.hist.resize(d + 1, 0);
                    }
                    self.hist[d] += 1;
                }
                self.add(prev, -1);
            }
            None => {
                if self.counting {
                    self.cold += 1;
                }
            }
        }
        if self.counting {
            self.counted += 1;
        }
        self.add(t, 1);
    }

    /// Accesses seen (sampled or not).
    pub fn accesses(&self) -> u64 {
        self.accesses
    }

    /// Distinct keys, estimated (sampled distinct keys / rate).
    pub fn distinct(&self) -> f64 {
        self.last.len() as f64 / self.rate
    }

    /// The sampling rate.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Bytes this histogram holds (tree, map, histogram).
    pub fn bytes(&self) -> u64 {
        (self.tree.len() * 4 + self.last.capacity() * 24 + self.hist.len() * 8) as u64
    }

    /// Predicted hit rate of an LRU cache of `rows` rows.
    pub fn hit_rate(&self, rows: f64) -> f64 {
        let (expected, adjust) = self.adjusted();
        if expected <= 0.0 {
            return 0.0;
        }
        // A sampled distance d stands for d / rate keys.
        let limit = (rows * self.rate).floor() as usize;
        if limit == 0 {
            return 0.0;
        }
        let hits: u64 = self.hist.iter().take(limit.min(self.hist.len())).sum();
        ((hits as f64 + adjust) / expected).clamp(0.0, 1.0)
    }

    /// The sampled accesses the rate should have drawn, and the correction (expected
    /// less drawn) added at the smallest distance (SHARDS-adj).
    fn adjusted(&self) -> (f64, f64) {
        if self.rate >= 1.0 {
            return (self.counted as f64, 0.0);
        }
        let expected = self.counted_all as f64 * self.rate;
        (expected, expected - self.counted as f64)
    }

    /// The least rows giving hit rate `target` (None if the stream never reaches it;
    /// the tests').
    #[cfg(test)]
    pub fn rows_for(&self, target: f64) -> Option<f64> {
        let (expected, adjust) = self.adjusted();
        if expected <= 0.0 {
            return None;
        }
        let need = target * expected;
        let mut sum = adjust;
        for (d, &n) in self.hist.iter().enumerate() {
            sum += n as f64;
            if sum >= need - 1e-9 {
                return Some(((d + 1) as f64 / self.rate).ceil());
            }
        }
        None
    }
}

/// What an access of a stream is to the row cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// A read that warms the cache but is not counted (a warm-up pass).
    Warmup,
    /// A read the store counts as a hit or a miss (a pull, or a push's re-read).
    Counted,
    /// A read ahead of use (`lookahead`): an absent row that exists enters the cache
    /// referenced; a present row is left as it is; a row never written is skipped (a
    /// read ahead creates nothing). Never counted.
    Ahead,
    /// A push: counted like a pull (`push_grad` re-reads the row), then the row is
    /// dirty in the cache, which never evicts a dirty row (a shard whose rows are all
    /// dirty runs over budget) until it is written back: by the writer itself past
    /// half the budget, by the maintenance thread past an eighth.
    Push,
    /// A training step ends (the key is not used; never sampled out): the maintenance
    /// thread, which runs a write-back round after each request and every 20 ms, has
    /// brought the dirty rows down to an eighth of the budget.
    StepEnd,
}

/// The sampled part of a stream, kept for miniature simulations of the row cache's
/// own policy (CLOCK): the keys SHARDS keeps, in order, and what each access is.
#[derive(Default)]
pub struct SampledStream {
    pub keys: Vec<u64>,
    pub kinds: Vec<Access>,
    /// Accesses counted, sampled or not (for the SHARDS-adj correction).
    pub counted_all: u64,
    pub rate: f64,
}

impl SampledStream {
    pub fn new(rate: f64) -> SampledStream {
        SampledStream { rate: rate.clamp(1e-9, 1.0), ..Default::default() }
    }

    /// Keeps `key` if the sample takes it: a counted read, or a warm-up one.
    #[inline]
    pub fn access(&mut self, key: u64, counting: bool, max: usize) {
        self.access_as(key, if counting { Access::Counted } else { Access::Warmup }, max)
    }

    /// Keeps `key` if the sample takes it (SHARDS: by a hash of the key, so a key is
    /// kept in all its accesses or none).
    #[inline]
    pub fn access_as(&mut self, key: u64, kind: Access, max: usize) {
        if kind == Access::StepEnd {
            self.keys.push(0);
            self.kinds.push(kind);
            return;
        }
        if matches!(kind, Access::Counted | Access::Push) {
            self.counted_all += 1;
        }
        let threshold = if self.rate >= 1.0 { u64::MAX } else { (self.rate * u64::MAX as f64) as u64 };
        if crate::hash::splitmix64(key ^ 0x5eed_9a11) <= threshold && self.keys.len() < max {
            self.keys.push(key);
            self.kinds.push(kind);
        }
    }

    /// Hit rate of embank's row cache (CLOCK with a reference bit per entry, new
    /// entries unreferenced unless read ahead, a hit sets the bit, the hand gives
    /// referenced entries a second chance; sharded as the store shards it) holding
    /// `rows` rows, simulated on the sample with `rows * rate` rows (SHARDS for
    /// policies other than LRU).
    pub fn clock_hit_rate(&self, rows: f64, shards: usize) -> f64 {
        let cap = (rows * self.rate).floor() as usize;
        let shards = shards.clamp(1, cap.max(1));
        let per = cap / shards;
        if per == 0 {
            return 0.0;
        }
        struct Shard {
            map: HashMap<u64, usize>,
            /// (key, referenced, dirty)
            slots: Vec<(u64, bool, bool)>,
            hand: usize,
        }
        let mut sh: Vec<Shard> =
            (0..shards).map(|_| Shard { map: HashMap::new(), slots: Vec::with_capacity(per), hand: 0 }).collect();
        // Rows written so far (only needed to skip reads ahead of rows never created).
        let any_ahead = self.kinds.contains(&Access::Ahead);
        let mut written: std::collections::HashSet<u64> = std::collections::HashSet::new();
        // Dirty rows, oldest first (a key may be listed again after a write-back).
        let mut dirty: std::collections::VecDeque<u64> = std::collections::VecDeque::new();
        let mut dirty_rows = 0usize;
        let shard_of = |k: u64| (crate::hash::splitmix64(k) % shards as u64) as usize;
        let write_back = |sh: &mut Vec<Shard>,
                          dirty: &mut std::collections::VecDeque<u64>,
                          dirty_rows: &mut usize,
                          down_to: usize| {
            while *dirty_rows > down_to {
                let Some(k) = dirty.pop_front() else { break };
                let s = &mut sh[shard_of(k)];
                if let Some(&i) = s.map.get(&k) {
                    if std::mem::take(&mut s.slots[i].2) {
                        *dirty_rows -= 1;
                    }
                }
            }
        };
        let (mut hits, mut counted) = (0u64, 0u64);
        for (&k, &kind) in self.keys.iter().zip(&self.kinds) {
            if kind == Access::StepEnd {
                write_back(&mut sh, &mut dirty, &mut dirty_rows, cap / 8);
                continue;
            }
            let c = matches!(kind, Access::Counted | Access::Push);
            if c {
                counted += 1;
            }
            let s = &mut sh[shard_of(k)];
            if let Some(&i) = s.map.get(&k) {
                if kind != Access::Ahead {
                    s.slots[i].1 = true;
                    if c {
                        hits += 1;
                    }
                }
                if kind == Access::Push && !std::mem::replace(&mut s.slots[i].2, true) {
                    dirty_rows += 1;
                    dirty.push_back(k);
                    if dirty_rows > cap / 2 {
                        write_back(&mut sh, &mut dirty, &mut dirty_rows, cap / 2);
                    }
                }
                continue;
            }
            if kind == Access::Ahead {
                if !written.contains(&k) {
                    continue;
                }
            } else if any_ahead {
                written.insert(k);
            }
            // CLOCK, skipping dirty rows; after two sweeps the shard runs over budget.
            let mut steps = 2 * s.slots.len();
            while s.slots.len() >= per && steps > 0 {
                steps -= 1;
                if s.hand >= s.slots.len() {
                    s.hand = 0;
                }
                let h = s.hand;
                if s.slots[h].2 || std::mem::take(&mut s.slots[h].1) {
                    s.hand += 1;
                    continue;
                }
                let (gone, _, _) = s.slots.swap_remove(h);
                s.map.remove(&gone);
                if h < s.slots.len() {
                    let moved = s.slots[h].0;
                    s.map.insert(moved, h);
                }
            }
            s.map.insert(k, s.slots.len());
            // A pushed row that missed is read, updated and written to the cache dirty.
            s.slots.push((k, kind == Access::Ahead, kind == Access::Push));
            if kind == Access::Push {
                dirty_rows += 1;
                dirty.push_back(k);
                if dirty_rows > cap / 2 {
                    write_back(&mut sh, &mut dirty, &mut dirty_rows, cap / 2);
                }
            }
        }
        let expected = if self.rate >= 1.0 { counted as f64 } else { self.counted_all as f64 * self.rate };
        if expected <= 0.0 {
            return 0.0;
        }
        let adjust = expected - counted as f64;
        ((hits as f64 + adjust) / expected).clamp(0.0, 1.0)
    }
}

/// Shards the row cache of a store with `budget` bytes uses (the same rule as the
/// cache: at least 256 KiB each, a power of two up to 64).
pub fn row_cache_shards(budget: u64) -> usize {
    ((budget / (256 << 10)) as usize).clamp(1, 64).next_power_of_two().min(64)
}

/// What a table stores, for its byte costs.
#[derive(Clone, Debug, Serialize)]
pub struct TableShape {
    pub name: String,
    pub dim: usize,
    pub dtype: DType,
    pub optimizer: Optimizer,
    pub medium: MediumKind,
}

/// Bytes per tier of one table of `rows` rows.
#[derive(Clone, Debug, Serialize)]
pub struct TierBytes {
    /// The index file (grown to keep the load at most 0.7 as rows were created).
    pub index: u64,
    /// Rows on the medium: records of `record_bytes` each.
    pub medium: u64,
    pub record_bytes: u64,
    /// One row in the DRAM row cache (encoded record and the entry's overhead).
    pub cache_entry_bytes: u64,
    /// One row in a GPU cache (the row in its type, key, score and digest).
    pub gpu_entry_bytes: u64,
    /// One row in a training cache on the GPU (`embank.gpu.TrainCache`): the row and its
    /// optimizer state in f32, key, clock and dirty flag.
    pub train_cache_entry_bytes: u64,
}

/// The byte costs of a table of `rows` rows, from the store's own layouts.
pub fn tier_bytes(shape: &TableShape, rows: u64) -> TierBytes {
    let layout = RecordLayout::new(shape.dim, shape.optimizer.state_len(shape.dim), shape.dtype);
    let payload = layout.payload_bytes();
    let record = match shape.medium {
        MediumKind::Mmap => record_stride(payload, shape.dtype) as u64,
        MediumKind::Block => block_stride(payload, 512) as u64,
    };
    let buckets = buckets_for(rows.max(1), LOAD_FACTOR_TARGET);
    TierBytes {
        index: crate::format::INDEX_HEADER_BYTES as u64 + buckets * BUCKET_BYTES as u64,
        medium: rows * record,
        record_bytes: record,
        cache_entry_bytes: crate::tier::dram::entry_bytes(payload),
        gpu_entry_bytes: shape.dtype.row_bytes(shape.dim) as u64 + 8 + 4 + 1,
        train_cache_entry_bytes: 4 * (shape.dim + shape.optimizer.state_len(shape.dim)) as u64 + 8 + 8 + 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::dram::ENTRY_OVERHEAD_BYTES;

    /// Brute-force LRU hit rate of a trace for a cache of `c` rows.
    fn lru(trace: &[u64], c: usize) -> f64 {
        let mut stack: Vec<u64> = Vec::new();
        let mut hits = 0;
        for &k in trace {
            if let Some(p) = stack.iter().position(|&x| x == k) {
                if p < c {
                    hits += 1;
                }
                stack.remove(p);
            }
            stack.insert(0, k);
        }
        hits as f64 / trace.len() as f64
    }

    #[test]
    fn exact_distances_match_a_brute_force_lru() {
        let mut x = 7u64;
        let trace: Vec<u64> = (0..5000)
            .map(|_| {
                x = crate::hash::splitmix64(x);
                // Skewed: small keys far more often.
                (x % 1000) * (x % 1000) / 1000
            })
            .collect();
        let mut sd = StackDistances::new(1.0, trace.len());
        for &k in &trace {
            sd.access(k);
        }
        for c in [1, 5, 20, 100, 400] {
            let want = lru(&trace, c);
            let got = sd.hit_rate(c as f64);
            assert!((want - got).abs() < 1e-12, "c={c}: {got} vs {want}");
        }
        let r = sd.rows_for(0.5).unwrap();
        assert!(sd.hit_rate(r) >= 0.5 && sd.hit_rate(r - 1.0) < 0.5);
    }

    #[test]
    fn sampled_distances_stay_close_and_small() {
        let mut x = 11u64;
        let trace: Vec<u64> = (0..400_000)
            .map(|_| {
                x = crate::hash::splitmix64(x);
                let u = (x >> 11) as f64 / (1u64 << 53) as f64;
                (100_000f64.powf(u) as u64) * 7919 // log-uniform popularity
            })
            .collect();
        let mut exact = StackDistances::new(1.0, trace.len());
        let mut sampled = StackDistances::new(0.05, trace.len() / 10);
        for &k in &trace {
            exact.access(k);
            sampled.access(k);
        }
        // Sampling at 5 % resolves caches of 20 rows and more; from 50 sampled rows on it
        // is within 2 points here.
        for c in [1000.0, 5000.0, 20_000.0, 60_000.0] {
            let (e, s) = (exact.hit_rate(c), sampled.hit_rate(c));
            assert!((e - s).abs() < 0.02, "c={c}: sampled {s} vs exact {e}");
        }
        assert!(sampled.bytes() < exact.bytes() / 5);
    }

    /// The simulated hit rate of a cache of `rows` rows (one shard) over `events`.
    fn clock_over(events: &[(u64, Access)], rows: f64) -> f64 {
        let mut s = SampledStream::new(1.0);
        for &(k, a) in events {
            s.access_as(k, a, usize::MAX);
        }
        s.clock_hit_rate(rows, 1)
    }

    #[test]
    fn reads_ahead_enter_referenced_and_create_nothing() {
        let run = |events: &[(u64, Access)]| clock_over(events, 2.0);
        use Access::*;
        let base = [(1, Counted), (2, Counted), (3, Counted)];
        // Without a read ahead, 1 was evicted: its pull misses.
        assert_eq!(run(&[&base[..], &[(1, Counted)]].concat()), 0.0);
        // Read ahead, it is back before its pull: a hit, and the read is not counted.
        assert_eq!(run(&[&base[..], &[(1, Ahead), (1, Counted)]].concat()), 0.25);
        // A key never written is not created by a read ahead: its pull misses.
        assert_eq!(run(&[&base[..], &[(9, Ahead), (9, Counted)]].concat()), 0.0);
        // A read ahead of a present row does not reference it: 2 (unreferenced) goes
        // when 4 comes in, as it would without the read ahead.
        let with = run(&[&base[..], &[(2, Ahead), (4, Counted), (2, Counted)]].concat());
        let without = run(&[&base[..], &[(4, Counted), (2, Counted)]].concat());
        assert_eq!(with, without);
    }

    #[test]
    fn dirty_rows_stay_until_written_back() {
        let run = |events: &[(u64, Access)]| clock_over(events, 4.0);
        use Access::*;
        let tail = [(3, Counted), (4, Counted), (5, Counted), (1, Counted)];
        // Pushed rows 1 and 2 are dirty: 5 evicts 3, and 1 is still there.
        assert_eq!(run(&[&[(1, Push), (2, Push)][..], &tail].concat()), 1.0 / 6.0);
        // Read only, 1 is the oldest unreferenced row: 5 evicts it.
        assert_eq!(run(&[&[(1, Counted), (2, Counted)][..], &tail].concat()), 0.0);
        // Written back at the step's end, they are clean again.
        assert_eq!(run(&[&[(1, Push), (2, Push), (0, StepEnd)][..], &tail].concat()), 0.0);
    }

    #[test]
    fn tier_bytes_follow_the_layouts() {
        let shape = TableShape {
            name: "t".into(),
            dim: 16,
            dtype: DType::F32,
            optimizer: Optimizer::None,
            medium: MediumKind::Mmap,
        };
        let b = tier_bytes(&shape, 1000);
        assert_eq!(b.record_bytes, 80); // 16 + 64, packed to 16: 2 lines wherever it starts
        assert_eq!(b.cache_entry_bytes, 64 + ENTRY_OVERHEAD_BYTES);
        let block = tier_bytes(&TableShape { medium: MediumKind::Block, dtype: DType::Int8, ..shape }, 10);
        assert_eq!(block.record_bytes, 512);
    }
}
