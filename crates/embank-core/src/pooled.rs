//! The pooled-embedding cache: for inference bags whose whole id sequence
//! repeats (the same user history, the same item list), the pooled vector of the
//! bag, so a hit skips the lookup of every member row, their decoding and the
//! pooling. One per store (`StoreOptions::pooled_cache_bytes`, 0: none), shared
//! by its tables, bounded in bytes, CLOCK replacement.
//!
//! **Admission on second sight.** Most bags never come back (the issue of an
//! inference trace is the few that do), so a bag is cached the second time it is
//! pooled: the first time only its hash enters a bounded FIFO of recently seen
//! bags (a direct-mapped table of 8-byte fingerprints: a collision forgets a bag,
//! which is then cached one sight later). One-off bags then cost one store of a
//! fingerprint, not an entry, an eviction and reverse-map upkeep.
//!
//! An entry is keyed by `(table, mode, ids, weights)`: a 128-bit hash picks it and
//! the stored ids and weights are compared on a hit, so a hash collision is a
//! miss, never a wrong answer.
//!
//! **Never stale.** Every write path of a table (push, push_grad, delete,
//! eviction; the replica's updates and a restore go through them or make new
//! tables) calls [`PooledCache::invalidate`] *after* its rows changed: it drops
//! every entry holding one of the keys (a reverse map from member key to
//! entries) and bumps the table's epoch. A lookup notes the epoch before it
//! reads rows and inserts what it pooled only if the epoch has not moved, so a
//! bag pooled from rows read before a write never lands after that write's
//! invalidation. (The epoch is per table: a write to any key of the table stops
//! that table's inserts in flight; inference tables see writes in bursts, once
//! per published checkpoint.)

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use parking_lot::Mutex;

use crate::tier::dram::MixHasher;
use serde::Serialize;

/// Bytes an entry costs beyond its ids, weights and pooled vector (map entries,
/// reverse-map entries, allocation headers).
const ENTRY_OVERHEAD_BYTES: u64 = 128;

/// How a bag's rows are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The (weighted) sum of the rows.
    Sum,
    /// The mean of the rows (no weights); an empty bag pools to zeros.
    Mean,
}

impl Pooling {
    pub fn parse(s: &str) -> crate::Result<Pooling> {
        match s {
            "sum" => Ok(Pooling::Sum),
            "mean" => Ok(Pooling::Mean),
            other => Err(crate::Error::invalid(format!("pooling mode must be \"sum\" or \"mean\", got {other:?}"))),
        }
    }

    pub fn code(self) -> u8 {
        match self {
            Pooling::Sum => 0,
            Pooling::Mean => 1,
        }
    }

    pub fn from_code(c: u8) -> crate::Result<Pooling> {
        match c {
            0 => Ok(Pooling::Sum),
            1 => Ok(Pooling::Mean),
            other => Err(crate::Error::invalid(format!("unknown pooling mode code {other}"))),
        }
    }
}

/// Numbers about the pooled cache.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PooledStats {
    pub budget_bytes: u64,
    pub bytes: u64,
    pub entries: u64,
    /// Bags answered from the cache.
    pub hits: u64,
    /// Bags pooled from their rows.
    pub misses: u64,
    pub hit_rate: Option<f64>,
    pub inserts: u64,
    /// Bags pooled but not inserted: a write to their table came in between.
    pub inserts_skipped: u64,
    /// Bags pooled for the first time (remembered by hash, cached when seen again).
    pub first_seen: u64,
    pub evictions: u64,
    /// Entries dropped because a member row changed.
    pub invalidated: u64,
}

struct Entry {
    table: u32,
    mode: Pooling,
    ids: Box<[u64]>,
    weights: Option<Box<[f32]>>,
    pooled: Box<[f32]>,
    referenced: bool,
}

impl Entry {
    fn bytes(&self) -> u64 {
        (self.ids.len() * 8 + self.weights.as_ref().map_or(0, |w| w.len() * 4) + self.pooled.len() * 4) as u64
            + ENTRY_OVERHEAD_BYTES
    }

    fn matches(&self, table: u32, mode: Pooling, ids: &[u64], weights: Option<&[f32]>) -> bool {
        self.table == table
            && self.mode == mode
            && *self.ids == *ids
            && match (&self.weights, weights) {
                (None, None) => true,
                // Bit equality: -0.0 and 0.0 weights are different bags to the hash too.
                (Some(a), Some(b)) => a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                _ => false,
            }
    }
}

/// Hasher of keys that are hashes already: their low 64 bits.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64;
        }
    }
    fn write_u128(&mut self, x: u128) {
        self.0 = x as u64;
    }
}

type ByHash<V> = HashMap<u128, V, BuildHasherDefault<Prehashed>>;

#[derive(Default)]
struct Inner {
    map: ByHash<usize>,
    slots: Vec<(u128, Entry)>,
    /// `(table, member key)` -> hashes of the entries holding it.
    members: HashMap<(u32, u64), Vec<u128>, BuildHasherDefault<MixHasher>>,
    /// Per table: bumped by every invalidation.
    epochs: HashMap<u32, u64>,
    hand: usize,
    bytes: u64,
    stats: PooledStats,
    /// Fingerprints of bags pooled once and not cached (yet), direct-mapped by hash.
    seen: Vec<u64>,
}

pub struct PooledCache {
    budget: u64,
    /// How many once-seen bag hashes are remembered.
    seen_max: usize,
    inner: Mutex<Inner>,
}

/// The hash of a bag: table, mode, ids, weights' bits.
pub fn bag_hash(table: u32, mode: Pooling, ids: &[u64], weights: Option<&[f32]>) -> u128 {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(0x706f_6f6c);
    h.update(&table.to_le_bytes());
    h.update(&[mode.code(), weights.is_some() as u8]);
    h.update(&(ids.len() as u64).to_le_bytes());
    // SAFETY: u64s are 8 initialized bytes each (little-endian: see lib.rs).
    h.update(unsafe { std::slice::from_raw_parts(ids.as_ptr() as *const u8, std::mem::size_of_val(ids)) });
    if let Some(w) = weights {
        h.update(crate::layout::f32_bytes(w));
    }
    h.digest128()
}

impl PooledCache {
    pub fn new(budget_bytes: u64) -> PooledCache {
        PooledCache {
            budget: budget_bytes,
            seen_max: ((budget_bytes / 256) as usize).clamp(1024, 1 << 22),
            inner: Mutex::new(Inner {
                stats: PooledStats { budget_bytes, ..Default::default() },
                ..Default::default()
            }),
        }
    }

    /// The table's epoch now (note it before reading rows for an insert; the tests').
    #[cfg(test)]
    pub fn epoch(&self, table: u32) -> u64 {
        self.inner.lock().epochs.get(&table).copied().unwrap_or(0)
    }

    /// Looks up bags: for bag `b` (`ids[offsets[b]..offsets[b + 1]]`, `offsets` of
    /// length `bags + 1`), copies a cached pooled vector into `out[b * dim..]` and sets
    /// `hit[b]`. Returns the table's epoch, read under the same lock.
    #[allow(clippy::too_many_arguments)]
    pub fn get_batch(
        &self,
        table: u32,
        mode: Pooling,
        ids: &[u64],
        offsets: &[usize],
        weights: Option<&[f32]>,
        hashes: &[u128],
        dim: usize,
        out: &mut [f32],
        hit: &mut [bool],
    ) -> u64 {
        let mut g = self.inner.lock();
        let inner = &mut *g;
        let (mut hits, mut misses) = (0, 0);
        for (b, &h) in hashes.iter().enumerate() {
            let (lo, hi) = (offsets[b], offsets[b + 1]);
            let w = weights.map(|w| &w[lo..hi]);
            let found =
                inner.map.get(&h).map(|&s| &mut inner.slots[s].1).filter(|e| e.matches(table, mode, &ids[lo..hi], w));
            match found {
                Some(e) => {
                    out[b * dim..(b + 1) * dim].copy_from_slice(&e.pooled);
                    e.referenced = true;
                    hit[b] = true;
                    hits += 1;
                }
                None => misses += 1,
            }
        }
        inner.stats.hits += hits;
        inner.stats.misses += misses;
        inner.epochs.get(&table).copied().unwrap_or(0)
    }

    /// Inserts pooled bags computed from rows read at `epoch`; none if the table was
    /// written since (they might hold a row from before the write).
    #[allow(clippy::too_many_arguments)]
    pub fn insert_batch(
        &self,
        table: u32,
        mode: Pooling,
        epoch: u64,
        bags: &[usize],
        ids: &[u64],
        offsets: &[usize],
        weights: Option<&[f32]>,
        hashes: &[u128],
        dim: usize,
        pooled: &[f32],
    ) {
        let mut g = self.inner.lock();
        let inner = &mut *g;
        if inner.epochs.get(&table).copied().unwrap_or(0) != epoch {
            inner.stats.inserts_skipped += bags.len() as u64;
            return;
        }
        for &b in bags {
            let h = hashes[b];
            if inner.map.contains_key(&h) {
                continue; // another reader inserted it (or a colliding bag holds the hash)
            }
            if inner.seen.is_empty() {
                inner.seen = vec![0; self.seen_max];
            }
            let (at, print) = ((h as u64 as usize) % self.seen_max, ((h >> 64) as u64) | 1);
            if inner.seen[at] != print {
                // First sight: remember the fingerprint only.
                inner.seen[at] = print;
                inner.stats.first_seen += 1;
                continue;
            }
            inner.seen[at] = 0;
            let (lo, hi) = (offsets[b], offsets[b + 1]);
            let e = Entry {
                table,
                mode,
                ids: ids[lo..hi].into(),
                weights: weights.map(|w| w[lo..hi].into()),
                pooled: pooled[b * dim..(b + 1) * dim].into(),
                referenced: false,
            };
            let bytes = e.bytes();
            if bytes > self.budget {
                continue;
            }
            self.evict_for(inner, bytes);
            let mut members: Vec<u64> = e.ids.to_vec();
            members.sort_unstable();
            members.dedup();
            for k in members {
                inner.members.entry((table, k)).or_default().push(h);
            }
            inner.map.insert(h, inner.slots.len());
            inner.slots.push((h, e));
            inner.bytes += bytes;
            inner.stats.inserts += 1;
        }
    }

    /// Drops every cached bag of `table` holding one of `keys` and moves the table's
    /// epoch on. Call after the rows changed.
    pub fn invalidate(&self, table: u32, keys: &[u64]) {
        let mut g = self.inner.lock();
        let inner = &mut *g;
        *inner.epochs.entry(table).or_insert(0) += 1;
        if inner.slots.is_empty() {
            return;
        }
        for &k in keys {
            let Some(hashes) = inner.members.remove(&(table, k)) else { continue };
            for h in hashes {
                if let Some(&slot) = inner.map.get(&h) {
                    if inner.slots[slot].1.table == table {
                        Self::remove_slot(inner, slot);
                        inner.stats.invalidated += 1;
                    }
                }
            }
        }
    }

    /// Drops every cached bag of `table` (a restore, a drop, a reset from the stream).
    pub fn invalidate_table(&self, table: u32) {
        let mut g = self.inner.lock();
        let inner = &mut *g;
        *inner.epochs.entry(table).or_insert(0) += 1;
        let mut slot = 0;
        while slot < inner.slots.len() {
            if inner.slots[slot].1.table == table {
                Self::remove_slot(inner, slot);
                inner.stats.invalidated += 1;
            } else {
                slot += 1;
            }
        }
    }

    pub fn stats(&self) -> PooledStats {
        let g = self.inner.lock();
        let mut s = g.stats.clone();
        s.bytes = g.bytes;
        s.entries = g.slots.len() as u64;
        s.hit_rate = (s.hits + s.misses > 0).then(|| s.hits as f64 / (s.hits + s.misses) as f64);
        s
    }

    /// CLOCK: evicts unreferenced entries until `incoming` more bytes fit.
    fn evict_for(&self, inner: &mut Inner, incoming: u64) {
        let mut steps = 2 * inner.slots.len() + 1;
        while inner.bytes + incoming > self.budget && !inner.slots.is_empty() && steps > 0 {
            steps -= 1;
            if inner.hand >= inner.slots.len() {
                inner.hand = 0;
            }
            let hand = inner.hand;
            if std::mem::take(&mut inner.slots[hand].1.referenced) {
                inner.hand += 1;
                continue;
            }
            Self::remove_slot(inner, hand);
            inner.stats.evictions += 1;
        }
    }

    /// Removes the entry at `slot` (and its reverse-map entries); the last slot moves in.
    fn remove_slot(inner: &mut Inner, slot: usize) {
        let (h, e) = inner.slots.swap_remove(slot);
        inner.map.remove(&h);
        if slot < inner.slots.len() {
            let moved = inner.slots[slot].0;
            inner.map.insert(moved, slot);
        }
        inner.bytes -= e.bytes();
        for k in e.ids.iter() {
            if let Some(list) = inner.members.get_mut(&(e.table, *k)) {
                list.retain(|&x| x != h);
                if list.is_empty() {
                    inner.members.remove(&(e.table, *k));
                }
            }
        }
    }
}

/// Checks a batch of bags and its output (`bags * dim` elements); returns the bag count.
pub fn check_batch(
    ids: &[u64],
    offsets: &[usize],
    weights: Option<&[f32]>,
    mode: Pooling,
    dim: usize,
    out: &[f32],
) -> crate::Result<usize> {
    check_bags(ids, offsets, weights, mode)?;
    let bags = offsets.len() - 1;
    if out.len() != bags * dim {
        return Err(crate::Error::invalid(format!(
            "lookup_pooled: {bags} bags of dim {dim} need {} output elements, got {}",
            bags * dim,
            out.len()
        )));
    }
    Ok(bags)
}

/// Pools the bags numbered in `bags` into `out[b * dim..]`, reading the distinct ids of
/// all of them with one `lookup(keys, rows)` call.
#[allow(clippy::too_many_arguments)]
pub fn pool_bags(
    ids: &[u64],
    offsets: &[usize],
    weights: Option<&[f32]>,
    mode: Pooling,
    dim: usize,
    bags: impl Iterator<Item = usize> + Clone,
    lookup: impl FnOnce(&[u64], &mut [f32]) -> crate::Result<()>,
    out: &mut [f32],
) -> crate::Result<()> {
    let mut uniq: Vec<u64> = bags.clone().flat_map(|b| ids[offsets[b]..offsets[b + 1]].iter().copied()).collect();
    uniq.sort_unstable();
    uniq.dedup();
    let mut rows = vec![0f32; uniq.len() * dim];
    lookup(&uniq, &mut rows)?;
    let mut members: Vec<&[f32]> = Vec::new();
    for b in bags {
        let (lo, hi) = (offsets[b], offsets[b + 1]);
        members.clear();
        members.extend(ids[lo..hi].iter().map(|k| {
            let j = uniq.binary_search(k).expect("every id was looked up");
            &rows[j * dim..(j + 1) * dim]
        }));
        pool(mode, &members, weights.map(|w| &w[lo..hi]), &mut out[b * dim..(b + 1) * dim]);
    }
    Ok(())
}

/// Pools `rows` (one per id, `dim` wide) into `out` (`dim`): the (weighted) sum, or
/// the mean (zeros for an empty bag).
pub fn pool(mode: Pooling, rows: &[&[f32]], weights: Option<&[f32]>, out: &mut [f32]) {
    out.fill(0.0);
    for (i, row) in rows.iter().enumerate() {
        match weights {
            Some(w) => {
                let wi = w[i];
                for (o, v) in out.iter_mut().zip(row.iter()) {
                    *o += wi * v;
                }
            }
            None => {
                for (o, v) in out.iter_mut().zip(row.iter()) {
                    *o += v;
                }
            }
        }
    }
    if mode == Pooling::Mean && !rows.is_empty() {
        let n = rows.len() as f32;
        for o in out.iter_mut() {
            *o /= n;
        }
    }
}

/// The pooled-bag cache hears of every changed row: bags holding one are stale.
impl crate::tier::Listener for PooledCache {
    fn rows_changed(&self, changed: &crate::tier::Changed<'_>) {
        self.invalidate(changed.table, changed.keys);
    }
}

/// Checks the shape of a batch of bags; the error names what is wrong.
pub fn check_bags(ids: &[u64], offsets: &[usize], weights: Option<&[f32]>, mode: Pooling) -> crate::Result<()> {
    let bad = |why: String| Err(crate::Error::invalid(format!("lookup_pooled: {why}")));
    if offsets.first() != Some(&0) || offsets.last() != Some(&ids.len()) {
        return bad(format!(
            "offsets must start at 0 and end at the number of ids ({}), one entry more than there are bags; got {} entries from {:?} to {:?}",
            ids.len(),
            offsets.len(),
            offsets.first(),
            offsets.last()
        ));
    }
    if let Some(b) = offsets.windows(2).position(|w| w[0] > w[1]) {
        return bad(format!("offsets decrease at bag {b} ({} then {})", offsets[b], offsets[b + 1]));
    }
    if let Some(w) = weights {
        if mode != Pooling::Sum {
            return bad("weights need mode \"sum\"".into());
        }
        if w.len() != ids.len() {
            return bad(format!("{} weights for {} ids", w.len(), ids.len()));
        }
        if let Some(i) = crate::optim::first_non_finite(w) {
            return bad(format!("weight {i} is not finite ({})", w[i]));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(c: &PooledCache, table: u32, ids: &[u64], dim: usize) -> Option<Vec<f32>> {
        let offsets = [0, ids.len()];
        let h = [bag_hash(table, Pooling::Sum, ids, None)];
        let mut out = vec![0f32; dim];
        let mut hit = [false];
        c.get_batch(table, Pooling::Sum, ids, &offsets, None, &h, dim, &mut out, &mut hit);
        hit[0].then_some(out)
    }

    fn put(c: &PooledCache, table: u32, epoch: u64, ids: &[u64], v: f32, dim: usize) {
        let offsets = [0, ids.len()];
        let h = [bag_hash(table, Pooling::Sum, ids, None)];
        // Twice: a bag is cached the second time it is pooled.
        c.insert_batch(table, Pooling::Sum, epoch, &[0], ids, &offsets, None, &h, dim, &vec![v; dim]);
        c.insert_batch(table, Pooling::Sum, epoch, &[0], ids, &offsets, None, &h, dim, &vec![v; dim]);
    }

    #[test]
    fn hits_invalidation_epochs_and_budget() {
        let c = PooledCache::new(10_000);
        put(&c, 1, 0, &[1, 2, 3], 6.0, 4);
        assert_eq!(one(&c, 1, &[1, 2, 3], 4), Some(vec![6.0; 4]));
        assert_eq!(one(&c, 1, &[3, 2, 1], 4), None, "order is part of the bag");
        assert_eq!(one(&c, 2, &[1, 2, 3], 4), None, "tables do not share bags");
        c.invalidate(2, &[2]);
        assert!(one(&c, 1, &[1, 2, 3], 4).is_some(), "another table's write leaves it");
        c.invalidate(1, &[2]);
        assert_eq!(one(&c, 1, &[1, 2, 3], 4), None, "a member's write drops it");
        // A bag pooled before a write (old epoch) is not inserted after it.
        put(&c, 1, 0, &[1, 2, 3], 6.0, 4);
        assert_eq!(one(&c, 1, &[1, 2, 3], 4), None);
        assert_eq!(c.stats().inserts_skipped, 2);
        let e = c.epoch(1);
        put(&c, 1, e, &[1, 2, 3], 7.0, 4);
        assert_eq!(one(&c, 1, &[1, 2, 3], 4), Some(vec![7.0; 4]));
        c.invalidate_table(1);
        assert_eq!(one(&c, 1, &[1, 2, 3], 4), None);
        // The budget holds: many bags, bytes stay under it, reverse map stays bounded.
        for i in 0..1000u64 {
            put(&c, 3, 0, &[i, i + 1], 1.0, 4);
        }
        let s = c.stats();
        assert!(s.bytes <= 10_000 && s.evictions > 0, "{s:?}");
        assert!(c.inner.lock().members.len() <= 2 * s.entries as usize);
    }

    #[test]
    fn pooling_matches_sum_weighted_sum_and_mean() {
        let (a, b) = ([1.0, 2.0], [3.0, 5.0]);
        let mut out = [0f32; 2];
        pool(Pooling::Sum, &[&a, &b], None, &mut out);
        assert_eq!(out, [4.0, 7.0]);
        pool(Pooling::Sum, &[&a, &b], Some(&[2.0, -1.0]), &mut out);
        assert_eq!(out, [-1.0, -1.0]);
        pool(Pooling::Mean, &[&a, &b], None, &mut out);
        assert_eq!(out, [2.0, 3.5]);
        pool(Pooling::Mean, &[], None, &mut out);
        assert_eq!(out, [0.0, 0.0]);
    }
}
