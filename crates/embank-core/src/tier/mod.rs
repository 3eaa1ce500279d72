//! Tiers above the persistent medium, and the stack a table composes them into.
//!
//! Two kinds of tier plug in here, each behind a small trait, and no tier imports
//! another, the table or the medium's implementations:
//!
//! - a [`Tier`] (near: in this process) holds records of many tables, keyed by
//!   `(table id, key)`, answers in batches with decoded records and locks one key
//!   at a time for the write protocol. It may hold rows newer than the medium
//!   (dirty, written back later). The DRAM row cache (`dram.rs`) is one.
//! - a [`SharedTier`] (far: shared with other stores over the network, `shared.rs`)
//!   caches encoded records of what the stores' media hold; it is read through
//!   between the near tiers and the medium and is dropped from on every change.
//!
//! A table never talks to a tier: its read and write paths call its [`TierStack`],
//! which composes the tiers its placement uses (nearest first) and is the only place
//! that knows there is more than one, as foyer's hybrid cache composes its memory and
//! disk caches. The stack also sends the one notice that rows changed ([`Changed`]),
//! once per batch, to every tier and to the store's [`Listener`]s (the pooled-bag
//! cache, and whatever the embedder registers, e.g. a GPU cache: see
//! [`Store::add_change_listener`](crate::Store::add_change_listener)).

pub mod dram;
pub mod shared;
#[cfg(test)]
mod sketch;

pub use dram::{CacheStats, DirtyRow, RowCache};
pub use shared::{SharedTier, SharedTierStats};

use std::sync::Arc;

use parking_lot::RwLock;

use crate::error::Result;
use crate::layout::RecordLayout;
use crate::medium::ReadItem;

/// Near tiers one table may stack.
pub const TIERS_MAX: usize = 4;

/// A tier of records above the medium, in this process. Every call carries a batch and
/// the table's layout, except [`lock`](Self::lock), the write protocol's per-key step.
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
    /// Locks `key`'s entry and calls `f` with it: the write protocol changes the key's
    /// index slot inside `f` (the caller holds the key's stripe lock). The lock lives
    /// on the tier's stack, so a key's lock costs no allocation.
    fn with_key(&self, table: u32, key: u64, f: &mut dyn FnMut(&mut dyn TierKey));
    /// Writes records that stay in the tier, dirty (no I/O), each under its key's lock:
    /// replaces a held record, or inserts it where `present(key)` (the index has the
    /// key); appends the positions it did not take to `through`. The default goes key
    /// by key through [`with_key`](Self::with_key).
    #[allow(clippy::too_many_arguments)]
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
        let w = layout.elems();
        for (i, (&key, record)) in keys.iter().zip(records.chunks_exact(w)).enumerate() {
            let mut taken = true;
            self.with_key(table, key, &mut |k| {
                if !k.replace(layout, record, true) {
                    if present(key) {
                        k.insert(layout, record, true, pinned);
                    } else {
                        taken = false;
                    }
                }
            });
            if !taken {
                through.push(i);
            }
        }
    }
    /// Copies out up to `max` dirty records of `table` for write-back.
    fn take_dirty(&self, table: u32, layout: &RecordLayout, max: usize) -> Vec<DirtyRow>;
    /// Puts records whose write-back failed back on the dirty queues.
    fn requeue(&self, table: u32, keys: &[u64]);
    /// True when writers should write back before returning (back-pressure).
    fn dirty_over_high(&self) -> bool;
    /// True when the maintenance thread should write back.
    fn dirty_over_target(&self) -> bool;
    /// Rows of `table` changed (after the change). A tier that is changed under the
    /// key locks, as the DRAM cache is, has nothing more to do.
    fn changed(&self, _table: u32, _keys: &[u64]) {}
    /// Forgets every record of `table`.
    fn drop_table(&self, table: u32);
    fn stats(&self) -> CacheStats;
}

/// One key's entry in a [`Tier`], locked.
pub trait TierKey {
    /// Decodes the held record into `out`; false if none is held.
    fn get(&self, layout: &RecordLayout, out: &mut [f32]) -> bool;
    fn contains(&self) -> bool;
    /// The version of the held record if it is dirty.
    fn dirty_version(&self) -> Option<u64>;
    /// Replaces a held record (dirty: newer than the medium; clean: what the medium
    /// has); false if none is held.
    fn replace(&mut self, layout: &RecordLayout, record: &[f32], dirty: bool) -> bool;
    /// Inserts a record not held yet.
    fn insert(&mut self, layout: &RecordLayout, record: &[f32], dirty: bool, pinned: bool);
    /// The dirty record of `version` is on the medium now (nothing if it changed since).
    fn mark_clean(&mut self, version: u64);
    fn remove(&mut self);
}

/// One batch of rows that changed: written, created or deleted.
#[derive(Clone, Copy, Debug)]
pub struct Changed<'a> {
    pub table: u32,
    pub name: &'a str,
    pub keys: &'a [u64],
}

/// Hears of every batch of changed rows of a store's tables, after the change.
pub trait Listener: Send + Sync {
    fn rows_changed(&self, changed: &Changed<'_>);
}

/// The tiers and listeners of a store, from which each table's stack is drawn.
#[derive(Default)]
pub(crate) struct StoreTiers {
    /// The near tiers, nearest first (today the DRAM row cache, when it has a budget).
    near: Vec<Arc<dyn Tier>>,
    /// A tier shared with other stores (set after open by the serving process).
    shared: RwLock<Option<Arc<dyn SharedTier>>>,
    listeners: RwLock<Vec<Arc<dyn Listener>>>,
}

impl StoreTiers {
    pub fn new(near: Vec<Arc<dyn Tier>>, listeners: Vec<Arc<dyn Listener>>) -> StoreTiers {
        assert!(near.len() <= TIERS_MAX, "{} near tiers, at most {TIERS_MAX}", near.len());
        StoreTiers { near, shared: RwLock::new(None), listeners: RwLock::new(listeners) }
    }

    pub fn near(&self) -> &[Arc<dyn Tier>] {
        &self.near
    }

    pub fn shared(&self) -> Option<Arc<dyn SharedTier>> {
        self.shared.read().clone()
    }

    pub fn set_shared(&self, tier: Option<Arc<dyn SharedTier>>) {
        *self.shared.write() = tier;
    }

    pub fn add_listener(&self, listener: Arc<dyn Listener>) {
        self.listeners.write().push(listener);
    }

    /// True when the maintenance thread should write back.
    pub fn dirty_over_target(&self) -> bool {
        self.near.iter().any(|t| t.dirty_over_target())
    }
}

/// Which of the store's tiers a table uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TierUse {
    /// Reads and writes through the near tiers.
    pub near: bool,
    /// Reads through the shared tier (when the store has one).
    pub shared: bool,
    /// Every row kept in the near tiers (loaded at open, never evicted).
    pub pinned: bool,
}

/// The tiers one table reads and writes through, nearest first, and the notice of its
/// changed rows. Made once per table at open.
pub(crate) struct TierStack {
    store: Arc<StoreTiers>,
    near: Vec<Arc<dyn Tier>>,
    shared: bool,
    table: u32,
    name: Arc<str>,
    layout: RecordLayout,
    pinned: bool,
}

/// The per-key locks of every near tier of a stack, held across a change of the key's
/// index slot (after the key's stripe lock: the lock order is stripe, then tiers
/// nearest first). Dirty records live in the nearest tier only; the others hold clean
/// copies.
pub(crate) struct KeyLocks<'a> {
    held: [Option<&'a mut (dyn TierKey + 'a)>; TIERS_MAX],
    layout: RecordLayout,
    pinned: bool,
}

impl TierStack {
    pub fn new(store: Arc<StoreTiers>, uses: TierUse, table: u32, name: Arc<str>, layout: RecordLayout) -> TierStack {
        let near = if uses.near { store.near.clone() } else { Vec::new() };
        TierStack { store, near, shared: uses.shared, table, name, layout, pinned: uses.pinned }
    }

    /// True when the table reads and writes straight to the medium (no near tier).
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.near.is_empty()
    }

    /// Rows of the near tiers into `out`; returns the positions no tier holds.
    pub fn get(&self, keys: &[u64], out: &mut [f32]) -> Vec<usize> {
        let mut miss = Vec::new();
        let Some((first, rest)) = self.near.split_first() else {
            miss.extend(0..keys.len());
            return miss;
        };
        first.get_batch(self.table, keys, &self.layout, out, &mut miss);
        let w = self.layout.elems();
        for tier in rest {
            if miss.is_empty() {
                break;
            }
            let sub: Vec<u64> = miss.iter().map(|&i| keys[i]).collect();
            let mut rows = vec![0f32; sub.len() * w];
            let mut still = Vec::new();
            tier.get_batch(self.table, &sub, &self.layout, &mut rows, &mut still);
            let mut next = still.iter().peekable();
            for (j, &i) in miss.iter().enumerate() {
                if next.peek() == Some(&&j) {
                    next.next();
                } else {
                    out[i * w..(i + 1) * w].copy_from_slice(&rows[j * w..(j + 1) * w]);
                }
            }
            miss = still.iter().map(|&j| miss[j]).collect();
        }
        miss
    }

    /// Reads `items` (keys the index has that no near tier had) into `out`: from the
    /// shared tier when the store has one and the table reads through it, the rest with
    /// `read_below` (the medium), which then fill the shared tier. Returns how many the
    /// shared tier gave.
    pub fn read_below(
        &self,
        items: &[ReadItem],
        out: &mut [f32],
        read_below: impl FnOnce(&[ReadItem], &mut [f32]) -> Result<()>,
    ) -> Result<usize> {
        let tier = if self.shared && !items.is_empty() { self.store.shared() } else { None };
        let Some(tier) = tier else {
            read_below(items, out)?;
            return Ok(0);
        };
        let layout = self.layout;
        let (w, enc) = (layout.elems(), layout.payload_bytes());
        let keys: Vec<u64> = items.iter().map(|it| it.key).collect();
        let got = tier.get(&self.name, &keys);
        // Shared hits first, then what the medium must give.
        let mut hit = vec![false; items.len()];
        for (j, g) in got.iter().enumerate() {
            if let Some(bytes) = g.as_deref().filter(|b| b.len() == enc) {
                let pos = items[j].pos;
                layout.decode(bytes, &mut out[pos * w..(pos + 1) * w]);
                hit[j] = true;
            }
        }
        let hits = hit.iter().filter(|&&h| h).count();
        let below: Vec<ReadItem> = items.iter().zip(&hit).filter(|(_, &h)| !h).map(|(it, _)| *it).collect();
        read_below(&below, out)?;
        if !below.is_empty() {
            let puts = below
                .iter()
                .map(|it| {
                    let mut b = vec![0u8; enc];
                    layout.encode(&out[it.pos * w..(it.pos + 1) * w], &mut b);
                    (it.key, b)
                })
                .collect();
            tier.put(&self.name, puts);
        }
        Ok(hits)
    }

    /// Admits rows read from below into every near tier (see [`Tier::admit_batch`]).
    pub fn admit(&self, items: &[ReadItem], out: &mut [f32], ahead: bool, current: &mut dyn FnMut(&ReadItem) -> bool) {
        for tier in &self.near {
            tier.admit_batch(self.table, items, &self.layout, out, self.pinned, ahead, current);
        }
    }

    /// Keys no near tier holds.
    pub fn absent(&self, keys: &[u64]) -> Vec<u64> {
        let mut absent = keys.to_vec();
        if self.near.is_empty() {
            return absent;
        }
        for tier in &self.near {
            absent = tier.absent(self.table, &absent);
        }
        absent
    }

    /// Locks `key` in every near tier, nearest first, and calls `f` with the locks (call
    /// with the key's stripe lock held).
    #[inline]
    pub fn locked<R>(&self, key: u64, mut f: impl FnMut(&mut KeyLocks<'_>) -> R) -> R {
        let (layout, pinned) = (self.layout, self.pinned);
        let mut out = None;
        match self.near.as_slice() {
            [] => return f(&mut KeyLocks { held: Default::default(), layout, pinned }),
            // One tier (the common stack): no walk over the others.
            [tier] => tier.with_key(self.table, key, &mut |locked| {
                let mut held: [Option<&mut dyn TierKey>; TIERS_MAX] = Default::default();
                held[0] = Some(locked);
                out = Some(f(&mut KeyLocks { held, layout, pinned }));
            }),
            _ => self.nest(0, key, Default::default(), &mut |locks| out = Some(f(locks))),
        }
        out.expect("the innermost tier calls back")
    }

    /// Takes the lock of near tier `depth` and goes on with the next, `held` the locks
    /// taken so far; with every lock held, calls `body`.
    fn nest(
        &self,
        depth: usize,
        key: u64,
        mut held: [Option<&mut dyn TierKey>; TIERS_MAX],
        body: &mut dyn FnMut(&mut KeyLocks<'_>),
    ) {
        let Some(tier) = self.near.get(depth) else {
            return body(&mut KeyLocks { held, layout: self.layout, pinned: self.pinned });
        };
        tier.with_key(self.table, key, &mut |locked| {
            let mut next: [Option<&mut dyn TierKey>; TIERS_MAX] = Default::default();
            for (n, h) in next.iter_mut().zip(held.iter_mut()) {
                *n = h.as_deref_mut().map(|h| h as &mut dyn TierKey);
            }
            next[depth] = Some(locked);
            self.nest(depth + 1, key, next, body);
        });
    }

    /// Writes that stay in the tiers (no I/O): the nearest tier takes each record whose
    /// key it holds, or whose key `present` says the index has, dirty, and the farther
    /// tiers drop their older copies. Appends the positions it did not take (they go
    /// through to the medium) to `through`, in order.
    pub fn write_dirty(
        &self,
        keys: &[u64],
        records: &[f32],
        present: &mut dyn FnMut(u64) -> bool,
        through: &mut Vec<usize>,
    ) {
        let Some((near, rest)) = self.near.split_first() else {
            through.extend(0..keys.len());
            return;
        };
        let from = through.len();
        near.write_dirty_batch(self.table, keys, &self.layout, records, self.pinned, present, through);
        if rest.is_empty() {
            return;
        }
        let mut skip = through[from..].iter().peekable();
        for (i, &key) in keys.iter().enumerate() {
            if skip.next_if_eq(&&i).is_none() {
                for tier in rest {
                    tier.with_key(self.table, key, &mut |k| k.remove());
                }
            }
        }
    }

    /// Up to `max` dirty rows for write-back (the nearest tier holds them).
    pub fn take_dirty(&self, max: usize) -> Vec<DirtyRow> {
        self.near.first().map_or_else(Vec::new, |t| t.take_dirty(self.table, &self.layout, max))
    }

    pub fn requeue(&self, keys: &[u64]) {
        if let Some(t) = self.near.first() {
            t.requeue(self.table, keys);
        }
    }

    pub fn dirty_over_high(&self) -> bool {
        self.near.first().is_some_and(|t| t.dirty_over_high())
    }

    /// True when a change has anyone to tell: a near tier, the shared tier or a listener.
    pub fn hears_changes(&self) -> bool {
        !self.near.is_empty() || self.store.shared.read().is_some() || !self.store.listeners.read().is_empty()
    }

    /// The table's rows of `keys` changed (after the change, once per batch): tells
    /// every tier (the shared tier drops its copies, older than this store's now) and
    /// every listener of the store.
    pub fn changed(&self, keys: &[u64]) {
        if keys.is_empty() {
            return;
        }
        for tier in &self.near {
            tier.changed(self.table, keys);
        }
        if let Some(t) = self.store.shared.read().as_ref() {
            t.invalidate(&self.name, keys);
        }
        let changed = Changed { table: self.table, name: &self.name, keys };
        for l in self.store.listeners.read().iter() {
            l.rows_changed(&changed);
        }
    }

    /// The nearest tier's numbers (a pinned table's load checks its budget).
    pub fn stats(&self) -> Option<CacheStats> {
        self.near.first().map(|t| t.stats())
    }

    pub fn drop_table(&self) {
        for tier in &self.near {
            tier.drop_table(self.table);
        }
    }
}

impl<'a> KeyLocks<'a> {
    fn tiers(&self) -> impl Iterator<Item = &(dyn TierKey + 'a)> + '_ {
        self.held.iter().map_while(|h| h.as_deref())
    }

    fn tiers_mut(&mut self) -> impl Iterator<Item = &mut &'a mut (dyn TierKey + 'a)> + '_ {
        self.held.iter_mut().map_while(|h| h.as_mut())
    }

    /// The record a tier holds for the key, decoded, if any (nearest first).
    pub fn cached(&self) -> Option<Vec<f32>> {
        let mut out = vec![0f32; self.layout.elems()];
        self.tiers().any(|t| t.get(&self.layout, &mut out)).then_some(out)
    }

    /// True when the nearest tier still holds the dirty copy of `version` (a write-back's).
    pub fn dirty_at(&self, version: u64) -> bool {
        self.tiers().next().and_then(|t| t.dirty_version()) == Some(version)
    }

    /// The record was just created on the medium and published.
    pub fn created(&mut self, record: &[f32]) {
        let (layout, pinned) = (self.layout, self.pinned);
        for t in self.tiers_mut() {
            t.insert(&layout, record, false, pinned);
        }
    }

    /// The record was just written through to the medium and published: a held copy is
    /// replaced; otherwise write-around (it enters when read: a bulk load would
    /// otherwise flush the hot set), except in a pinned table.
    pub fn written(&mut self, record: &[f32]) {
        let (layout, pinned) = (self.layout, self.pinned);
        for t in self.tiers_mut() {
            if !t.replace(&layout, record, false) && pinned {
                t.insert(&layout, record, false, true);
            }
        }
    }

    /// The dirty copy of `version` is now on the medium.
    pub fn written_back(&mut self, version: u64) {
        if let Some(t) = self.tiers_mut().next() {
            t.mark_clean(version);
        }
    }

    /// The key is being deleted.
    pub fn remove(&mut self) {
        for t in self.tiers_mut() {
            t.remove();
        }
    }

    /// A pinned table's load: inserts a record read at open where a tier lacks the key.
    pub fn load(&mut self, record: &[f32]) {
        let layout = self.layout;
        for t in self.tiers_mut() {
            if !t.contains() {
                t.insert(&layout, record, false, true);
            }
        }
    }
}
