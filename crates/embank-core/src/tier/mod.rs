//! Tiers above the persistent medium, and the stack a table composes them into.
//!
//! A [`Tier`] holds records of many tables, keyed by `(table id, key)`, and
//! answers in batches with decoded records (row and optimizer state, `f32`);
//! how it stores them is its own business (the DRAM cache keeps them encoded by
//! the table's layout, so compact element types take fewer bytes). Today's one
//! implementation is the DRAM row cache (`dram.rs`, T1). A table never talks
//! to a tier directly: its read and write paths call the [`TierStack`], which
//! composes the tiers the table's placement uses in order (nearest first) and
//! is the only place that knows there is more than one. No tier imports another
//! or the table (the stack is the third party, as in foyer's hybrid cache).
//!
//! The GPU cache (T0) lives in the model's process, over any table (embedded or
//! remote) through the one table interface, so it needs nothing here.

pub mod dram;
pub mod shared;

pub use dram::{CacheStats, DirtyRow, Locked, RowCache};
pub use shared::{SharedTier, SharedTierStats};

use crate::layout::RecordLayout;
use crate::medium::ReadItem;

/// A tier of records above the medium. Every call carries a batch and the table's layout.
pub trait Tier: Send + Sync {
    /// Decodes the record held for each of `keys` into `out[i * elems..]`; appends the
    /// positions of keys not held to `miss`.
    fn get_batch(&self, table: u32, keys: &[u64], layout: &RecordLayout, out: &mut [f32], miss: &mut Vec<usize>);
    /// Admits records just read from below (`items`, rows in `out`), each under its key's
    /// lock: a key the tier got meanwhile keeps the tier's copy (copied into `out`, it is
    /// at least as new), and a record `current` calls stale (the index moved on) is not
    /// admitted. `referenced`: rows read ahead of their use (lookahead) start with their
    /// reference bit set, so the reader's own traffic does not evict them first.
    #[allow(clippy::too_many_arguments)]
    fn admit_batch(
        &self,
        table: u32,
        items: &[ReadItem],
        layout: &RecordLayout,
        out: &mut [f32],
        pinned: bool,
        referenced: bool,
        current: &mut dyn FnMut(&ReadItem) -> bool,
    );
    /// The keys of `keys` the tier does not hold.
    fn absent(&self, table: u32, keys: &[u64]) -> Vec<u64>;
    /// Copies out up to `max` dirty records of `table` for write-back.
    fn take_dirty(&self, table: u32, layout: &RecordLayout, max: usize) -> Vec<DirtyRow>;
    /// Puts records whose write-back failed back on the dirty queues.
    fn requeue(&self, table: u32, keys: &[u64]);
    /// True when writers should write back before returning (back-pressure).
    fn dirty_over_high(&self) -> bool;
    /// Forgets every record of `table`.
    fn drop_table(&self, table: u32);
    fn stats(&self) -> CacheStats;
}

/// The tiers one table reads and writes through, nearest first (today: the DRAM row
/// cache when the table's placement is `cache` or `pin`). Cheap to make per call.
#[derive(Clone, Copy)]
pub(crate) struct TierStack<'a> {
    dram: Option<&'a RowCache>,
    table: u32,
    layout: RecordLayout,
    pinned: bool,
}

/// The per-key locks of every tier of a stack, held across a change of the key's index
/// slot (after the key's stripe lock: the lock order is stripe, then tiers nearest first).
pub(crate) struct KeyLocks<'a> {
    dram: Option<Locked<'a>>,
    table: u32,
    layout: RecordLayout,
    key: u64,
    pinned: bool,
}

impl<'a> TierStack<'a> {
    pub fn new(dram: Option<&'a RowCache>, table: u32, layout: RecordLayout, pinned: bool) -> TierStack<'a> {
        TierStack { dram, table, layout, pinned }
    }

    /// True when the table reads and writes straight to the medium.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.dram.is_none()
    }

    pub fn dram(&self) -> Option<&'a RowCache> {
        self.dram
    }

    /// Rows of the tiers into `out`; returns the positions no tier holds.
    pub fn get(&self, keys: &[u64], out: &mut [f32]) -> Vec<usize> {
        let mut miss = Vec::new();
        match self.dram {
            // A second tier would be asked for the keys at `miss` next.
            Some(c) => c.get_batch(self.table, keys, &self.layout, out, &mut miss),
            None => miss.extend(0..keys.len()),
        }
        miss
    }

    /// Admits rows read from the medium (see [`Tier::admit_batch`]).
    pub fn admit(&self, items: &[ReadItem], out: &mut [f32], ahead: bool, current: &mut dyn FnMut(&ReadItem) -> bool) {
        if let Some(c) = self.dram {
            c.admit_batch(self.table, items, &self.layout, out, self.pinned, ahead, current);
        }
    }

    /// Keys no tier holds.
    pub fn absent(&self, keys: &[u64]) -> Vec<u64> {
        match self.dram {
            Some(c) => c.absent(self.table, keys),
            None => keys.to_vec(),
        }
    }

    /// Locks `key` in every tier (call with the key's stripe lock held).
    #[inline]
    pub fn lock(&self, key: u64) -> KeyLocks<'a> {
        KeyLocks {
            dram: self.dram.map(|c| c.lock(c.hash(self.table, key))),
            table: self.table,
            layout: self.layout,
            key,
            pinned: self.pinned,
        }
    }

    pub fn take_dirty(&self, max: usize) -> Vec<DirtyRow> {
        self.dram.map_or_else(Vec::new, |c| c.take_dirty(self.table, &self.layout, max))
    }

    pub fn requeue(&self, keys: &[u64]) {
        if let Some(c) = self.dram {
            c.requeue(self.table, keys);
        }
    }

    pub fn dirty_over_high(&self) -> bool {
        self.dram.is_some_and(|c| c.dirty_over_high())
    }

    pub fn drop_table(&self) {
        if let Some(c) = self.dram {
            c.drop_table(self.table);
        }
    }
}

impl KeyLocks<'_> {
    /// The record a tier holds for the key, decoded, if any (nearest first).
    pub fn cached(&self) -> Option<Vec<f32>> {
        self.dram.as_ref().and_then(|l| l.get(self.table, self.key)).map(|e| {
            let mut out = vec![0f32; self.layout.elems()];
            self.layout.decode(&e.row, &mut out);
            out
        })
    }

    /// True when the nearest tier still holds the dirty copy of `version` (a write-back's).
    pub fn dirty_at(&self, version: u64) -> bool {
        self.dram.as_ref().and_then(|l| l.get(self.table, self.key)).is_some_and(|e| e.dirty && e.version == version)
    }

    /// A write that stays in the tiers (no I/O): replaces a held record and marks it
    /// dirty, or, with `present` (the index has the key), inserts it dirty. False when
    /// it must go through to the medium.
    pub fn write_dirty(&mut self, record: &[f32], present: impl FnOnce() -> bool) -> bool {
        let Some(l) = self.dram.as_mut() else { return false };
        if l.update_dirty(self.table, self.key, &self.layout, record) {
            return true;
        }
        if present() {
            l.insert(self.table, self.key, &self.layout, record, true, self.pinned);
            return true;
        }
        false
    }

    /// The record was just created on the medium and published.
    pub fn created(&mut self, record: &[f32]) {
        if let Some(l) = self.dram.as_mut() {
            l.insert(self.table, self.key, &self.layout, record, false, self.pinned);
        }
    }

    /// The record was just written through to the medium and published: a held copy is
    /// replaced; otherwise write-around (it enters when read: a bulk load would
    /// otherwise flush the hot set), except in a pinned table.
    pub fn written(&mut self, record: &[f32]) {
        if let Some(l) = self.dram.as_mut() {
            if !l.update_clean(self.table, self.key, &self.layout, record) && self.pinned {
                l.insert(self.table, self.key, &self.layout, record, false, true);
            }
        }
    }

    /// The dirty copy of `version` is now on the medium.
    pub fn written_back(&mut self, version: u64) {
        if let Some(l) = self.dram.as_mut() {
            l.mark_clean(self.table, self.key, version);
        }
    }

    /// The key is being deleted.
    pub fn remove(&mut self) {
        if let Some(l) = self.dram.as_mut() {
            l.remove(self.table, self.key);
        }
    }

    /// A pinned table's load: inserts a record read at open unless the tier has the key.
    pub fn load(&mut self, record: &[f32]) {
        if let Some(l) = self.dram.as_mut() {
            if l.get(self.table, self.key).is_none() {
                l.insert(self.table, self.key, &self.layout, record, false, true);
            }
        }
    }
}
