//! The DRAM row cache (tier T1): one per store, shared by all its tables,
//! bounded in bytes, sharded.
//!
//! Each shard is a hash map from `(table, key)` to a slot of a slot vector,
//! behind a read-write lock. A hit takes the shard's read lock, copies the row
//! and sets the slot's reference bit (an atomic store): no list to move, no
//! write lock, so the lookup path carries no replacement bookkeeping.
//! Replacement is CLOCK over the slot vector, run when an insert finds its
//! shard over budget: referenced slots get a second chance, pinned and dirty
//! slots are skipped. Dirty slots are written back in batches by the store's
//! maintenance thread (and by writers when dirty bytes pass a high-water
//! mark); a dirty slot is never evicted.
//!
//! Slots hold records *encoded* by their table's [`RecordLayout`] (an `f16`
//! row takes half the bytes of an `f32` one, an `int8` row about a quarter), so
//! the budget counts the bytes rows really take and a compact table caches 2-4x
//! the rows in the same DRAM. Rows are decoded into the caller's `f32`s on a hit.
//!
//! Every slot carries a version from a cache-wide counter. A write-back
//! publishes its record only if the slot still holds the version it copied,
//! so a write-back racing a newer push or a delete never installs old bytes.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{RwLock, RwLockWriteGuard};
use serde::Serialize;

use crate::layout::RecordLayout;

/// Bytes a slot costs beyond its encoded record (slot, map entry, allocation header).
pub const ENTRY_OVERHEAD_BYTES: u64 = 96;
/// Shards get at least this much budget each (fewer shards for small caches).
const SHARD_BYTES_MIN: u64 = 256 << 10;
const SHARDS_MAX: usize = 64;

/// Multiply-rotate hasher for the shard maps (keys are already well mixed).
#[derive(Default)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u32(&mut self, x: u32) {
        self.write_u64(x as u64);
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(23) ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type Map = HashMap<(u32, u64), u32, BuildHasherDefault<MixHasher>>;

pub struct Entry {
    pub table: u32,
    pub key: u64,
    /// The record as its layout encodes it (row, then optimizer state).
    pub row: Box<[u8]>,
    pub version: u64,
    pub dirty: bool,
    pub pinned: bool,
    /// In its shard's dirty queue.
    queued: bool,
    referenced: AtomicBool,
}

#[derive(Default)]
pub struct ShardInner {
    map: Map,
    slots: Vec<Entry>,
    hand: usize,
    bytes: u64,
    dirty_queue: VecDeque<(u32, u64)>,
}

/// A dirty row copied out for write-back.
pub struct DirtyRow {
    pub key: u64,
    pub version: u64,
    pub row: Box<[f32]>,
}

#[derive(Default)]
struct Counters {
    inserts: AtomicU64,
    evictions: AtomicU64,
    written_back: AtomicU64,
    bytes: AtomicU64,
    dirty_bytes: AtomicU64,
    pinned_bytes: AtomicU64,
    entries: AtomicU64,
}

/// Numbers about the row cache.
#[derive(Clone, Debug, Serialize)]
pub struct CacheStats {
    pub budget_bytes: u64,
    pub shards: usize,
    pub bytes_cached: u64,
    pub rows_cached: u64,
    pub dirty_bytes: u64,
    pub pinned_bytes: u64,
    pub inserts: u64,
    pub evictions: u64,
    pub rows_written_back: u64,
}

pub struct RowCache {
    shards: Box<[RwLock<ShardInner>]>,
    shard_budget: u64,
    budget: u64,
    version: AtomicU64,
    counters: Counters,
}

#[inline(always)]
fn mix(table: u32, key: u64) -> u64 {
    let mut z = key ^ (table as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What a slot holding `payload` encoded bytes counts against the budget.
pub fn entry_bytes(payload: usize) -> u64 {
    payload as u64 + ENTRY_OVERHEAD_BYTES
}

impl RowCache {
    pub fn new(budget_bytes: u64) -> RowCache {
        let shards =
            ((budget_bytes / SHARD_BYTES_MIN) as usize).clamp(1, SHARDS_MAX).next_power_of_two().min(SHARDS_MAX);
        RowCache {
            shards: (0..shards).map(|_| RwLock::new(ShardInner::default())).collect(),
            shard_budget: budget_bytes / shards as u64,
            budget: budget_bytes,
            version: AtomicU64::new(1),
            counters: Counters::default(),
        }
    }

    /// Hash of a cached row's identity; picks its shard.
    #[inline(always)]
    pub fn hash(&self, table: u32, key: u64) -> u64 {
        mix(table, key)
    }

    #[inline(always)]
    fn shard(&self, h: u64) -> &RwLock<ShardInner> {
        &self.shards[(h as usize) & (self.shards.len() - 1)]
    }

    /// Decodes a cached record into `out`; false on a miss.
    #[inline]
    pub fn get(&self, table: u32, key: u64, h: u64, layout: &RecordLayout, out: &mut [f32]) -> bool {
        let shard = self.shard(h).read();
        match shard.map.get(&(table, key)) {
            Some(&slot) => {
                let e = &shard.slots[slot as usize];
                layout.decode(&e.row, out);
                if !e.referenced.load(Ordering::Relaxed) {
                    e.referenced.store(true, Ordering::Relaxed);
                }
                true
            }
            None => false,
        }
    }

    /// True when the row is cached (no copy, no reference bit).
    pub fn contains(&self, table: u32, key: u64, h: u64) -> bool {
        self.shard(h).read().map.contains_key(&(table, key))
    }

    /// Locks the shard of `h` for a compound update.
    pub fn lock(&self, h: u64) -> Locked<'_> {
        Locked { cache: self, shard: self.shard(h).write() }
    }

    pub fn next_version(&self) -> u64 {
        self.version.fetch_add(1, Ordering::Relaxed)
    }

    pub fn dirty_bytes(&self) -> u64 {
        self.counters.dirty_bytes.load(Ordering::Relaxed)
    }

    /// Dirty bytes above which the maintenance thread writes back.
    pub fn dirty_target(&self) -> u64 {
        self.budget / 8
    }

    /// Dirty bytes above which writers write back themselves before returning.
    pub fn dirty_high(&self) -> u64 {
        self.budget / 2
    }

    /// Copies out up to `max` dirty rows of `table` and takes them off the dirty queues.
    /// A failed write-back must [`requeue`](Self::requeue) them.
    pub fn take_dirty(&self, table: u32, layout: &RecordLayout, max: usize) -> Vec<DirtyRow> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            if out.len() >= max {
                break;
            }
            let mut s = shard.write();
            if s.dirty_queue.is_empty() {
                continue;
            }
            let mut keep = Vec::new();
            while out.len() < max {
                let Some((t, key)) = s.dirty_queue.pop_front() else { break };
                let Some(&slot) = s.map.get(&(t, key)) else { continue };
                if t != table {
                    keep.push((t, key));
                    continue;
                }
                let e = &mut s.slots[slot as usize];
                e.queued = false;
                if e.dirty {
                    let mut row = vec![0f32; layout.elems()].into_boxed_slice();
                    layout.decode(&e.row, &mut row);
                    out.push(DirtyRow { key, version: e.version, row });
                }
            }
            for k in keep.into_iter().rev() {
                s.dirty_queue.push_front(k);
            }
        }
        out
    }

    /// Puts rows whose write-back failed back on the dirty queues.
    pub fn requeue(&self, table: u32, keys: &[u64]) {
        for &key in keys {
            let mut l = self.lock(self.hash(table, key));
            l.queue_if_dirty(table, key);
        }
    }

    /// Drops every row of `table` (dirty ones too: call after writing them back).
    pub fn remove_table(&self, table: u32) {
        for shard in self.shards.iter() {
            let mut l = Locked { cache: self, shard: shard.write() };
            let keys: Vec<u64> = l.shard.slots.iter().filter(|e| e.table == table).map(|e| e.key).collect();
            for key in keys {
                l.remove(table, key);
            }
            l.shard.dirty_queue.retain(|&(t, _)| t != table);
        }
    }

    pub fn stats(&self) -> CacheStats {
        let c = &self.counters;
        CacheStats {
            budget_bytes: self.budget,
            shards: self.shards.len(),
            bytes_cached: c.bytes.load(Ordering::Relaxed),
            rows_cached: c.entries.load(Ordering::Relaxed),
            dirty_bytes: c.dirty_bytes.load(Ordering::Relaxed),
            pinned_bytes: c.pinned_bytes.load(Ordering::Relaxed),
            inserts: c.inserts.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            rows_written_back: c.written_back.load(Ordering::Relaxed),
        }
    }
}

impl super::Tier for RowCache {
    fn get_batch(&self, table: u32, keys: &[u64], layout: &RecordLayout, out: &mut [f32], miss: &mut Vec<usize>) {
        for (i, (&key, row)) in keys.iter().zip(out.chunks_exact_mut(layout.elems())).enumerate() {
            if !self.get(table, key, self.hash(table, key), layout, row) {
                miss.push(i);
            }
        }
    }

    fn admit_batch(
        &self,
        table: u32,
        items: &[crate::medium::ReadItem],
        layout: &RecordLayout,
        out: &mut [f32],
        pinned: bool,
        referenced: bool,
        current: &mut dyn FnMut(&crate::medium::ReadItem) -> bool,
    ) {
        let elems = layout.elems();
        for it in items {
            let mut l = self.lock(self.hash(table, it.key));
            let row = &mut out[it.pos * elems..(it.pos + 1) * elems];
            if let Some(e) = l.get(table, it.key) {
                // Cached meanwhile (a push, or another reader): that copy is at least as new.
                layout.decode(&e.row, row);
            } else if current(it) {
                l.insert(table, it.key, layout, row, false, pinned);
                if referenced {
                    // Read ahead of its use: survives one sweep of the hand.
                    if let Some(e) = l.get(table, it.key) {
                        e.referenced.store(true, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    fn absent(&self, table: u32, keys: &[u64]) -> Vec<u64> {
        keys.iter().copied().filter(|&k| !self.contains(table, k, self.hash(table, k))).collect()
    }

    fn take_dirty(&self, table: u32, layout: &RecordLayout, max: usize) -> Vec<DirtyRow> {
        RowCache::take_dirty(self, table, layout, max)
    }

    fn requeue(&self, table: u32, keys: &[u64]) {
        RowCache::requeue(self, table, keys)
    }

    fn write_dirty_batch(
        &self,
        table: u32,
        keys: &[u64],
        layout: &RecordLayout,
        records: &[f32],
        pinned: bool,
        present: &mut dyn FnMut(u64) -> bool,
        through: &mut Vec<usize>,
    ) {
        for (i, (&key, record)) in keys.iter().zip(records.chunks_exact(layout.elems())).enumerate() {
            let mut l = self.lock(self.hash(table, key));
            if !l.update_dirty(table, key, layout, record) {
                if present(key) {
                    l.insert(table, key, layout, record, true, pinned);
                } else {
                    through.push(i);
                }
            }
        }
    }

    #[inline]
    fn with_key(&self, table: u32, key: u64, f: &mut dyn FnMut(&mut dyn super::TierKey)) {
        f(&mut KeyEntry { locked: self.lock(self.hash(table, key)), table, key })
    }

    fn dirty_over_high(&self) -> bool {
        self.dirty_bytes() > self.dirty_high()
    }

    fn dirty_over_target(&self) -> bool {
        self.dirty_bytes() > self.dirty_target()
    }

    fn drop_table(&self, table: u32) {
        self.remove_table(table)
    }

    fn stats(&self) -> CacheStats {
        RowCache::stats(self)
    }
}

/// One key's entry, its shard write-locked: the cache as the write protocol sees it.
struct KeyEntry<'a> {
    locked: Locked<'a>,
    table: u32,
    key: u64,
}

impl super::TierKey for KeyEntry<'_> {
    fn get(&self, layout: &RecordLayout, out: &mut [f32]) -> bool {
        let Some(e) = self.locked.get(self.table, self.key) else { return false };
        layout.decode(&e.row, out);
        true
    }

    fn contains(&self) -> bool {
        self.locked.get(self.table, self.key).is_some()
    }

    fn dirty_version(&self) -> Option<u64> {
        self.locked.get(self.table, self.key).filter(|e| e.dirty).map(|e| e.version)
    }

    fn replace(&mut self, layout: &RecordLayout, record: &[f32], dirty: bool) -> bool {
        if dirty {
            self.locked.update_dirty(self.table, self.key, layout, record)
        } else {
            self.locked.update_clean(self.table, self.key, layout, record)
        }
    }

    fn insert(&mut self, layout: &RecordLayout, record: &[f32], dirty: bool, pinned: bool) {
        self.locked.insert(self.table, self.key, layout, record, dirty, pinned)
    }

    fn mark_clean(&mut self, version: u64) {
        self.locked.mark_clean(self.table, self.key, version);
    }

    fn remove(&mut self) {
        self.locked.remove(self.table, self.key);
    }
}

/// A write-locked shard.
pub struct Locked<'a> {
    cache: &'a RowCache,
    shard: RwLockWriteGuard<'a, ShardInner>,
}

impl Locked<'_> {
    pub fn get(&self, table: u32, key: u64) -> Option<&Entry> {
        self.shard.map.get(&(table, key)).map(|&s| &self.shard.slots[s as usize])
    }

    /// Replaces the row of a cached entry and marks it dirty; false if not cached.
    pub fn update_dirty(&mut self, table: u32, key: u64, layout: &RecordLayout, row: &[f32]) -> bool {
        if !self.replace(table, key, layout, row, true) {
            return false;
        }
        self.queue_if_dirty(table, key);
        true
    }

    /// Replaces the row of a cached entry with what was just written to the medium (clean).
    pub fn update_clean(&mut self, table: u32, key: u64, layout: &RecordLayout, row: &[f32]) -> bool {
        self.replace(table, key, layout, row, false)
    }

    /// Replaces a cached entry's row under a new version, dirty or clean (a dirty
    /// replacement also sets the reference bit); false if not cached.
    fn replace(&mut self, table: u32, key: u64, layout: &RecordLayout, row: &[f32], dirty: bool) -> bool {
        let Some(&slot) = self.shard.map.get(&(table, key)) else { return false };
        let version = self.cache.next_version();
        let e = &mut self.shard.slots[slot as usize];
        let bytes = entry_bytes(e.row.len());
        layout.encode(row, &mut e.row);
        e.version = version;
        if dirty {
            e.referenced.store(true, Ordering::Relaxed);
        }
        if e.dirty != dirty {
            e.dirty = dirty;
            let counter = &self.cache.counters.dirty_bytes;
            if dirty {
                counter.fetch_add(bytes, Ordering::Relaxed);
            } else {
                counter.fetch_sub(bytes, Ordering::Relaxed);
            }
        }
        true
    }

    /// Marks an entry clean if it still holds `version` (its write-back landed); false otherwise.
    pub fn mark_clean(&mut self, table: u32, key: u64, version: u64) -> bool {
        let Some(&slot) = self.shard.map.get(&(table, key)) else { return false };
        let e = &mut self.shard.slots[slot as usize];
        if !e.dirty || e.version != version {
            return false;
        }
        e.dirty = false;
        let bytes = entry_bytes(e.row.len());
        self.cache.counters.dirty_bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.cache.counters.written_back.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Inserts a row that is not cached yet, evicting clean rows if the shard is over budget.
    pub fn insert(&mut self, table: u32, key: u64, layout: &RecordLayout, row: &[f32], dirty: bool, pinned: bool) {
        debug_assert!(!self.shard.map.contains_key(&(table, key)));
        let mut encoded = vec![0u8; layout.payload_bytes()].into_boxed_slice();
        layout.encode(row, &mut encoded);
        let bytes = entry_bytes(encoded.len());
        self.evict_for(bytes);
        let slot = self.shard.slots.len() as u32;
        let version = self.cache.next_version();
        self.shard.slots.push(Entry {
            table,
            key,
            row: encoded,
            version,
            dirty,
            pinned,
            queued: false,
            referenced: AtomicBool::new(false),
        });
        self.shard.map.insert((table, key), slot);
        self.shard.bytes += bytes;
        let c = &self.cache.counters;
        c.bytes.fetch_add(bytes, Ordering::Relaxed);
        c.entries.fetch_add(1, Ordering::Relaxed);
        c.inserts.fetch_add(1, Ordering::Relaxed);
        if pinned {
            c.pinned_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        if dirty {
            c.dirty_bytes.fetch_add(bytes, Ordering::Relaxed);
            self.queue_if_dirty(table, key);
        }
    }

    /// Removes an entry (dirty or not); true if it was cached.
    pub fn remove(&mut self, table: u32, key: u64) -> bool {
        let Some(slot) = self.shard.map.remove(&(table, key)) else { return false };
        self.drop_slot(slot as usize);
        true
    }

    fn drop_slot(&mut self, slot: usize) {
        let e = self.shard.slots.swap_remove(slot);
        if slot < self.shard.slots.len() {
            let moved = &self.shard.slots[slot];
            let id = (moved.table, moved.key);
            self.shard.map.insert(id, slot as u32);
        }
        let bytes = entry_bytes(e.row.len());
        self.shard.bytes -= bytes;
        let c = &self.cache.counters;
        c.bytes.fetch_sub(bytes, Ordering::Relaxed);
        c.entries.fetch_sub(1, Ordering::Relaxed);
        if e.dirty {
            c.dirty_bytes.fetch_sub(bytes, Ordering::Relaxed);
        }
        if e.pinned {
            c.pinned_bytes.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    fn queue_if_dirty(&mut self, table: u32, key: u64) {
        let Some(&slot) = self.shard.map.get(&(table, key)) else { return };
        let e = &mut self.shard.slots[slot as usize];
        if e.dirty && !e.queued {
            e.queued = true;
            self.shard.dirty_queue.push_back((table, key));
        }
    }

    /// CLOCK: evicts clean, unpinned, unreferenced rows until `incoming` more bytes fit.
    /// Gives up after two sweeps (everything dirty or pinned): the shard runs over budget
    /// until write-back catches up.
    fn evict_for(&mut self, incoming: u64) {
        let budget = self.cache.shard_budget;
        let mut steps = 2 * self.shard.slots.len();
        while self.shard.bytes + incoming > budget && steps > 0 && !self.shard.slots.is_empty() {
            steps -= 1;
            if self.shard.hand >= self.shard.slots.len() {
                self.shard.hand = 0;
            }
            let hand = self.shard.hand;
            let e = &self.shard.slots[hand];
            if e.pinned || e.dirty {
                self.shard.hand += 1;
                continue;
            }
            if e.referenced.swap(false, Ordering::Relaxed) {
                self.shard.hand += 1;
                continue;
            }
            let id = (e.table, e.key);
            self.shard.map.remove(&id);
            self.drop_slot(hand);
            self.cache.counters.evictions.fetch_add(1, Ordering::Relaxed);
            // The slot now holds the moved last entry: look at it next.
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_keeps_referenced_rows_and_never_evicts_dirty_or_pinned() {
        let dim = 16;
        let layout = RecordLayout::new(dim, 0, crate::format::DType::F32);
        let per = entry_bytes(layout.payload_bytes());
        let cache = RowCache::new(per * 4);
        assert_eq!(cache.shards.len(), 1);
        let row = vec![1.0f32; dim];
        for k in 0..4 {
            cache.lock(cache.hash(1, k)).insert(1, k, &layout, &row, k == 1, k == 2);
        }
        let mut out = vec![0.0; dim];
        assert!(cache.get(1, 0, cache.hash(1, 0), &layout, &mut out), "referenced now");
        // Two inserts must evict two rows: 3 (unreferenced, clean) first, then 0 after its second chance.
        cache.lock(cache.hash(1, 10)).insert(1, 10, &layout, &row, false, false);
        assert!(!cache.contains(1, 3, cache.hash(1, 3)));
        assert!(cache.contains(1, 0, cache.hash(1, 0)), "second chance");
        cache.lock(cache.hash(1, 11)).insert(1, 11, &layout, &row, false, false);
        for k in [1, 2] {
            assert!(cache.contains(1, k, cache.hash(1, k)), "dirty and pinned rows stay");
        }
        assert_eq!(cache.stats().evictions, 2);
        assert_eq!(cache.stats().dirty_bytes, per);
    }

    #[test]
    fn write_back_versions() {
        let cache = RowCache::new(1 << 20);
        let row = vec![2.0f32; 4];
        let layout = RecordLayout::new(4, 0, crate::format::DType::F32);
        let h = cache.hash(3, 9);
        cache.lock(h).insert(3, 9, &layout, &row, true, false);
        let taken = cache.take_dirty(3, &layout, 10);
        assert_eq!(taken.len(), 1);
        assert!(cache.take_dirty(3, &layout, 10).is_empty(), "taken rows leave the queue");
        // A newer push arrives before the write-back lands: the old version must not clean it.
        assert!(cache.lock(h).update_dirty(3, 9, &layout, &[5.0; 4]));
        assert!(!cache.lock(h).mark_clean(3, 9, taken[0].version));
        let again = cache.take_dirty(3, &layout, 10);
        assert_eq!(again.len(), 1);
        assert_eq!(&*again[0].row, &[5.0; 4]);
        assert!(cache.lock(h).mark_clean(3, 9, again[0].version));
        assert_eq!(cache.dirty_bytes(), 0);
        // Other tables' rows stay queued.
        cache.lock(cache.hash(4, 1)).insert(4, 1, &layout, &row, true, false);
        assert!(cache.take_dirty(3, &layout, 10).is_empty());
        assert_eq!(cache.take_dirty(4, &layout, 10).len(), 1);
        cache.requeue(4, &[1]);
        assert_eq!(cache.take_dirty(4, &layout, 10).len(), 1);
        cache.remove_table(4);
        assert_eq!(cache.stats().rows_cached, 1);
    }
}

#[cfg(test)]
mod compact_tests {
    use super::*;
    use crate::format::DType;

    #[test]
    fn compact_rows_count_their_encoded_bytes_and_decode_on_a_hit() {
        let dim = 64;
        let budget = 1 << 20;
        let mut held = Vec::new();
        for dtype in DType::ALL {
            let layout = RecordLayout::new(dim, 0, dtype);
            let cache = RowCache::new(budget);
            let row: Vec<f32> = (0..dim).map(|i| i as f32 / 7.0 - 3.0).collect();
            let mut expect = row.clone();
            layout.round_trip(&mut expect);
            for k in 0..100_000u64 {
                cache.lock(cache.hash(1, k)).insert(1, k, &layout, &row, false, false);
            }
            let stats = cache.stats();
            assert!(stats.bytes_cached <= budget);
            assert_eq!(stats.bytes_cached, stats.rows_cached * entry_bytes(layout.payload_bytes()));
            let k = (0..100_000u64).rev().find(|&k| cache.contains(1, k, cache.hash(1, k))).unwrap();
            let mut out = vec![0f32; dim];
            assert!(cache.get(1, k, cache.hash(1, k), &layout, &mut out));
            assert_eq!(out, expect, "{dtype}: a hit decodes what was stored");
            held.push(stats.rows_cached as f64);
        }
        // Same budget: f16 holds more rows than f32, int8 more than f16.
        assert!(held[1] > held[0] * 1.4 && held[2] > held[1] * 1.3, "{held:?}");
    }
}
