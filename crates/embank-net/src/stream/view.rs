//! What a replica serves: its last committed checkpoint, whole, while the next one is
//! applied.
//!
//! The applier writes a checkpoint's rows and deletes into the live tables as they
//! arrive. Before it changes a key for the first time in that checkpoint it keeps the
//! key's row as served (or its absence) in the *overlay*; a read through the view looks
//! its batch up in the live table and answers the keys the overlay holds with their kept
//! rows over that, holding the overlay's read lock throughout (so no key it did not find
//! kept can be kept and changed meanwhile). At the commit marker the replica takes its checkpoint and empties the
//! overlay: every table switches to the new checkpoint at once. A read that overlaps that
//! switch (the view's generation moved while it ran) is done again, so an answer is the
//! old checkpoint or the new one, never a mix.
//!
//! The overlay costs a row (`dim` × 4 bytes, plus ~48 bytes of map entry) per key the
//! checkpoint in progress changes, and one lookup per applied batch. Past
//! `staged_bytes_max` it is given up for the rest of that checkpoint: reads then see the
//! live tables (a mix, as before the view) until the commit, and the status counts it.

use std::collections::HashMap;
use std::hash::Hasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use embank_core::IdHasher;
use embank_core::{Error, ErrorKind, Result, Store, Table};

use super::replica::ReplicaMeta;
use parking_lot::RwLock;

/// Bound of the rows a view keeps for one checkpoint in progress, by default.
pub const STAGED_BYTES_MAX_DEFAULT: u64 = 256 << 20;

/// One table's kept rows for the checkpoint in progress: what a lookup answered for
/// each key at the served checkpoint (the row, the missing-row default when absent, and
/// whether it was found), in blocks of one [`ServedView::keep`] call each. A block is
/// built before the write lock is taken and moved in under it, so a read waits only for
/// the index's inserts, and a read copies a kept row out of a block without a hop through
/// a per-row allocation.
struct Kept {
    /// Key → (block, row in the block).
    at: KeptIndex,
    blocks: Vec<KeptBlock>,
    /// One bit per hash of a kept key ([`FILTER_BITS`] of them): a read tests a key's bit
    /// (one load from 256 KiB that stays in the L2 cache) and probes `at` only when it is
    /// set. While a checkpoint is applied every key of every read is tested, and most are
    /// not kept: the map's probe cost ~11 ns a key, a sixth of the read.
    filter: Box<[u64]>,
}

/// Bits of a [`Kept`]'s filter: 2^21, so 100 k kept keys set ~5 % of them (the share of
/// keys not kept that still probe the map), and the most a view keeps at dim 128
/// (~480 k) ~20 %.
const FILTER_BITS: u32 = 21;

impl Default for Kept {
    fn default() -> Kept {
        Kept { at: KeptIndex::default(), blocks: Vec::new(), filter: vec![0u64; 1 << (FILTER_BITS - 6)].into() }
    }
}

/// A key's hash with the store's id hasher: its top bits pick the filter's bit, its low
/// bits the index's home slot.
#[inline]
fn hash(key: u64) -> u64 {
    let mut hasher = IdHasher::default();
    hasher.write_u64(key);
    hasher.finish()
}

impl Kept {
    /// The filter's word and bit of a key's [`hash`].
    #[inline]
    fn bit(h: u64) -> (usize, u64) {
        let b = h >> (64 - FILTER_BITS);
        ((b >> 6) as usize, 1u64 << (b & 63))
    }

    /// Whether the filter lets the key of hash `h` through (it may be kept).
    #[inline]
    fn may_hold(&self, h: u64) -> bool {
        let (word, bit) = Kept::bit(h);
        self.filter[word] & bit != 0
    }
}

/// Where each kept key's row is: open addressing with linear probing over 16-byte slots
/// (four to a cache line), at most half full. Not a `HashMap` because a read probes it in
/// two passes: the first prefetches the home slot of every key the filter lets through,
/// the second probes them, so the probes' cache misses overlap instead of coming one after
/// another (with a `HashMap` they were ~56 % of the view's own time during ingest: the
/// map is megabytes, and the applier's writes evict it from the shared cache).
#[derive(Default)]
struct KeptIndex {
    slots: Box<[KeptSlot]>,
    len: usize,
}

#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct KeptSlot {
    key: u64,
    /// [`EMPTY_SLOT`] where no key is.
    block: u32,
    row: u32,
}

const EMPTY_SLOT: u32 = u32::MAX;

impl KeptIndex {
    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    fn home(&self, h: u64) -> usize {
        h as usize & (self.slots.len().wrapping_sub(1))
    }

    /// Hints the CPU to load the home slot of hash `h`.
    #[inline]
    fn prefetch(&self, h: u64) {
        if !self.slots.is_empty() {
            embank_core::prefetch_read(&self.slots[self.home(h)] as *const KeptSlot as *const u8);
        }
    }

    /// Where `key` (of hash `h`) is kept.
    #[inline]
    fn get(&self, key: u64, h: u64) -> Option<(u32, u32)> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = h as usize & mask;
        loop {
            let s = self.slots[i];
            if s.block == EMPTY_SLOT {
                return None;
            }
            if s.key == key {
                return Some((s.block, s.row));
            }
            i = (i + 1) & mask;
        }
    }

    /// Slots that hold `len` keys at most half full.
    fn slots_for(len: usize) -> usize {
        (len * 2).next_power_of_two().max(1024)
    }

    /// A copy of this index with room for `more` keys without passing half full, or
    /// `None` when it has that room already. Built apart from the index it copies, so the
    /// applier builds it under the overlay's read lock and readers never wait for a rehash.
    fn grown(&self, more: usize) -> Option<KeptIndex> {
        let want = Self::slots_for(self.len + more);
        if want <= self.slots.len() {
            return None;
        }
        let mut grown =
            KeptIndex { slots: vec![KeptSlot { key: 0, block: EMPTY_SLOT, row: 0 }; want].into_boxed_slice(), len: 0 };
        for s in self.slots.iter().filter(|s| s.block != EMPTY_SLOT) {
            grown.insert_if_absent(s.key, hash(s.key), (s.block, s.row));
        }
        Some(grown)
    }

    /// Room for `more` keys without passing half full (a rehash in place: tests).
    #[cfg(test)]
    fn reserve(&mut self, more: usize) {
        if let Some(grown) = self.grown(more) {
            *self = grown;
        }
    }

    /// Adds `key` at `at` unless it is there already; [`reserve`](Self::reserve) first.
    fn insert_if_absent(&mut self, key: u64, h: u64, at: (u32, u32)) {
        debug_assert!((self.len + 1) * 2 <= self.slots.len(), "reserve first");
        let mask = self.slots.len() - 1;
        let mut i = h as usize & mask;
        loop {
            let s = &mut self.slots[i];
            if s.block == EMPTY_SLOT {
                *s = KeptSlot { key, block: at.0, row: at.1 };
                self.len += 1;
                return;
            }
            if s.key == key {
                return;
            }
            i = (i + 1) & mask;
        }
    }
}

/// A read's scratch, kept per thread so a read allocates nothing.
#[derive(Default)]
struct ReadScratch {
    /// (position in the batch, hash) of the keys the filter let through.
    candidates: Vec<(u32, u64)>,
    /// (position in the batch, where its kept row is).
    hits: Vec<(usize, (u32, u32))>,
    /// The batch as the table looks it up (kept keys replaced by a stand-in).
    looked_up: Vec<u64>,
}

thread_local! {
    static READ_SCRATCH: std::cell::RefCell<ReadScratch> = std::cell::RefCell::default();
}

/// The rows one [`ServedView::keep`] call kept, `dim` floats each.
struct KeptBlock {
    rows: Box<[f32]>,
    found: Box<[bool]>,
}

/// A replica's served view (see the module docs). Shared by the applier and the server.
pub struct ServedView {
    /// Even while no commit is switching; odd during a switch.
    generation: AtomicU64,
    /// By table name.
    overlay: RwLock<HashMap<String, Kept>>,
    /// Held by [`keep`](Self::keep) and [`commit`](Self::commit), the overlay's only
    /// writers: a `keep` that reads the overlay, builds outside the write lock, then
    /// writes, sees no other change in between.
    keeping: parking_lot::Mutex<()>,
    bytes: AtomicU64,
    bytes_max: u64,
    /// Set when this checkpoint's overlay passed its bound (reads see the live tables).
    given_up: AtomicBool,
    /// Checkpoints whose overlay passed its bound.
    pub given_up_total: AtomicU64,
    /// The publisher's batch id of the served checkpoint; [`NONE`] before the first.
    served: AtomicU64,
    /// Set while a new replica copies a sibling's checkpoint: it takes no reads yet.
    bootstrapping: AtomicBool,
    /// Nanoseconds spent in reads through the view so far (summed over threads): the
    /// applier paces itself by the share of a core they took.
    read_nanos: AtomicU64,
}

/// Adds the time since `started` to `nanos` when dropped: a read's time, however it ends.
struct ReadTimer<'a> {
    nanos: &'a AtomicU64,
    started: std::time::Instant,
}

impl Drop for ReadTimer<'_> {
    fn drop(&mut self) {
        self.nanos.fetch_add(self.started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// [`ServedView::served`] before the first checkpoint.
const NONE: u64 = u64::MAX;

impl ServedView {
    pub fn new(bytes_max: u64) -> ServedView {
        ServedView {
            generation: AtomicU64::new(0),
            overlay: RwLock::new(HashMap::new()),
            keeping: parking_lot::Mutex::new(()),
            bytes: AtomicU64::new(0),
            bytes_max,
            given_up: AtomicBool::new(false),
            given_up_total: AtomicU64::new(0),
            served: AtomicU64::new(NONE),
            bootstrapping: AtomicBool::new(false),
            read_nanos: AtomicU64::new(0),
        }
    }

    /// Nanoseconds spent in reads through the view so far, summed over the threads that
    /// read.
    pub fn read_nanos(&self) -> u64 {
        self.read_nanos.load(Ordering::Relaxed)
    }

    /// Counts `d` as time spent reading (tests of the applier's pace).
    #[cfg(test)]
    pub(crate) fn count_read_time(&self, d: std::time::Duration) {
        self.read_nanos.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Whether the replica is still copying a sibling's checkpoint (reads are refused
    /// with `Unavailable`, so clients read its siblings).
    pub fn is_bootstrapping(&self) -> bool {
        self.bootstrapping.load(Ordering::Acquire)
    }

    pub(crate) fn set_bootstrapping(&self, on: bool) {
        self.bootstrapping.store(on, Ordering::Release);
    }

    /// The publisher's batch id of the checkpoint reads see, None before the first.
    pub fn served(&self) -> Option<u64> {
        Some(self.served.load(Ordering::Acquire)).filter(|&b| b != NONE)
    }

    /// Sets the served checkpoint without a switch (a replica starting at its last).
    pub fn set_served(&self, batch_id: u64) {
        self.served.store(batch_id, Ordering::Release);
    }

    /// Looks `keys` of `table` up as the served checkpoint has them (a [`Table::lookup`]
    /// otherwise): never a mix of two checkpoints.
    pub fn lookup(&self, table: &Table, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        self.lookup_served(table, None, keys, out, found).map(|_| ())
    }

    /// [`lookup`](Self::lookup) if the served checkpoint is the publisher's `batch_id`
    /// throughout the read (true), else nothing read (false): an exact read of the newest
    /// checkpoint, at the cost of a plain one.
    pub fn lookup_exact(
        &self,
        table: &Table,
        batch_id: u64,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<bool> {
        self.lookup_served(table, Some(batch_id), keys, out, found)
    }

    fn lookup_served(
        &self,
        table: &Table,
        want: Option<u64>,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<bool> {
        // Counted however the read ends (the applier paces itself by it).
        let _timed = ReadTimer { nanos: &self.read_nanos, started: std::time::Instant::now() };
        let d = table.dim();
        let mut spins = 0u32;
        loop {
            let before = self.generation.load(Ordering::Acquire);
            if before & 1 == 1 {
                // A swap is a few instructions under the write lock: spin, and yield only
                // if the committing thread lost its core in the middle of one.
                spins += 1;
                if spins < 1024 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
                continue;
            }
            if want.is_some_and(|b| self.served.load(Ordering::Acquire) != b || self.given_up.load(Ordering::Acquire)) {
                return Ok(false);
            }
            {
                // The whole batch is looked up in the live table straight into `out`, then
                // the keys the overlay holds are answered with their kept rows over it
                // (cheaper than splitting the batch: two more buffers and a scatter of
                // every row). The overlay's read lock is held through the table's lookup:
                // the applier keeps a key (under the write lock) before it changes it, so
                // a key not kept when the lock was taken is not changed until the lookup
                // is done.
                let overlay = self.overlay.read();
                match overlay.get(table.name()).filter(|k| !k.at.is_empty()) {
                    None => table.lookup(keys, out, found)?,
                    Some(kept) => READ_SCRATCH.with_borrow_mut(|scratch| -> Result<()> {
                        let ReadScratch { candidates, hits, looked_up } = scratch;
                        candidates.clear();
                        hits.clear();
                        // Two passes: the keys the filter lets through have their home
                        // slot prefetched, then they are probed (the misses overlap).
                        let mut not_kept = None;
                        for (i, &k) in keys.iter().enumerate() {
                            let h = hash(k);
                            if kept.may_hold(h) {
                                kept.at.prefetch(h);
                                candidates.push((i as u32, h));
                            } else if not_kept.is_none() {
                                not_kept = Some(k);
                            }
                        }
                        for &(i, h) in candidates.iter() {
                            let k = keys[i as usize];
                            match kept.at.get(k, h) {
                                Some(at) => hits.push((i as usize, at)),
                                None => not_kept = not_kept.or(Some(k)),
                            }
                        }
                        match not_kept {
                            None => {}
                            Some(_) if hits.is_empty() => table.lookup(keys, out, found)?,
                            // A kept key's place in the table's lookup goes to a key of
                            // the batch that is not kept: its row is read again from the
                            // L1 cache instead of the kept key's new record from memory.
                            Some(stand_in) => {
                                looked_up.clear();
                                looked_up.extend_from_slice(keys);
                                for &(i, _) in hits.iter() {
                                    looked_up[i] = stand_in;
                                }
                                table.lookup(looked_up, out, found)?;
                            }
                        }
                        for &(i, (b, r)) in hits.iter() {
                            let (block, r) = (&kept.blocks[b as usize], r as usize);
                            out[i * d..(i + 1) * d].copy_from_slice(&block.rows[r * d..(r + 1) * d]);
                            found[i] = block.found[r];
                        }
                        Ok(())
                    })?,
                }
            }
            if self.generation.load(Ordering::Acquire) == before {
                return Ok(true);
            }
        }
    }

    /// Called by the applier before it writes or deletes `keys` of `table`: keeps the
    /// served row of each key not kept yet in this checkpoint.
    pub fn keep(&self, table: &Table, keys: &[u64]) -> Result<()> {
        let _keeping = self.keeping.lock();
        if self.given_up.load(Ordering::Relaxed) {
            return Ok(());
        }
        let fresh: Vec<u64> = {
            let overlay = self.overlay.read();
            let kept = overlay.get(table.name());
            let mut fresh: Vec<u64> =
                keys.iter().copied().filter(|&k| kept.is_none_or(|m| m.at.get(k, hash(k)).is_none())).collect();
            fresh.sort_unstable();
            fresh.dedup();
            fresh
        };
        if fresh.is_empty() {
            return Ok(());
        }
        let d = table.dim();
        let mut rows = vec![0f32; fresh.len() * d];
        let mut found = vec![false; fresh.len()];
        table.lookup(&fresh, &mut rows, &mut found)?;
        let added = fresh.len() as u64 * (d as u64 * 4 + 48);
        if self.bytes.fetch_add(added, Ordering::Relaxed) + added > self.bytes_max {
            tracing::warn!(
                table = table.name(),
                bytes_max = self.bytes_max,
                "the checkpoint in progress changes more rows than the served view keeps: reads see it \
                 partly applied until its commit"
            );
            self.given_up.store(true, Ordering::Relaxed);
            self.given_up_total.fetch_add(1, Ordering::Relaxed);
            let kept = std::mem::take(&mut *self.overlay.write());
            drop(kept); // freed after the lock
            return Ok(());
        }
        // The block, a grown index (the rehash of up to every key kept so far) and a new
        // table's entry are built before the write lock is taken: readers wait only for
        // the new keys' inserts. `keeping` is held: what was read under the read lock is
        // still the overlay under the write lock.
        let block = KeptBlock { rows: rows.into(), found: found.into() };
        let (grown, fresh_entry) = {
            let overlay = self.overlay.read();
            match overlay.get(table.name()) {
                Some(kept) => (kept.at.grown(fresh.len()), None),
                None => (
                    None,
                    Some(Kept { at: KeptIndex::default().grown(fresh.len()).expect("grows"), ..Kept::default() }),
                ),
            }
        };
        let mut overlay = self.overlay.write();
        let kept = match fresh_entry {
            Some(entry) => overlay.entry(table.name().to_owned()).or_insert(entry),
            None => overlay.get_mut(table.name()).expect("the overlay changes only under `keeping`"),
        };
        let old = grown.map(|g| std::mem::replace(&mut kept.at, g));
        let b = u32::try_from(kept.blocks.len()).expect("fewer than 2^32 blocks in one checkpoint");
        kept.blocks.push(block);
        for (r, &k) in fresh.iter().enumerate() {
            let h = hash(k);
            kept.at.insert_if_absent(k, h, (b, r as u32));
            let (word, bit) = Kept::bit(h);
            kept.filter[word] |= bit;
        }
        drop(overlay);
        drop(old); // freed after the lock
        Ok(())
    }

    /// Called by the applier once the replica's checkpoint of a commit is taken (the
    /// publisher's `batch_id`): reads switch to it, every table at once.
    pub fn commit(&self, batch_id: u64) {
        let _keeping = self.keeping.lock();
        // The write lock first (it waits for the reads in flight), then the generation
        // odd for the swap alone: a read that starts meanwhile waits a few instructions
        // for the lock, not a yield of its core to whatever else is runnable there.
        let mut overlay = self.overlay.write();
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.served.store(batch_id, Ordering::Release);
        let kept = std::mem::take(&mut *overlay);
        self.bytes.store(0, Ordering::Relaxed);
        self.given_up.store(false, Ordering::Relaxed);
        self.generation.fetch_add(1, Ordering::AcqRel);
        drop(overlay);
        drop(kept); // freed after the switch: readers wait only for the swap
    }

    /// Looks `keys` of `table` up exactly as they were at the publisher's checkpoint
    /// `batch_id`, if this replica still holds it: the served one through the view (the
    /// cost of a plain read), an older one through the store's retained checkpoint taken
    /// at its commit (a pass over the keys changed since, per call: see
    /// [`Store::lookup_checkpoint`]). Fails with `Unavailable`, naming what is readable,
    /// for a checkpoint not held (dropped by `keep_checkpoints`, or not applied yet).
    pub fn lookup_at(
        &self,
        store: &Store,
        table: &Table,
        batch_id: u64,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<()> {
        if self.lookup_exact(table, batch_id, keys, out, found)? {
            return Ok(());
        }
        let own = store
            .checkpoints()?
            .into_iter()
            .rev()
            .find(|c| ReplicaMeta::parse(&c.meta).is_some_and(|m| m.batch_id == batch_id));
        let dropped = |e: Error| match e.kind() {
            ErrorKind::NotFound => not_held(store, batch_id),
            _ => e,
        };
        match own {
            Some(c) => store.lookup_checkpoint(table.name(), c.batch_id, keys, out, found).map_err(dropped),
            None => Err(not_held(store, batch_id)),
        }
    }

    /// Bytes the overlay holds now.
    pub fn staged_bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// The replica store's own checkpoint (its batch id) taken at the commit of the
/// publisher's checkpoint `batch_id`, with its metadata; `not_held` when it is not retained.
pub(crate) fn own_checkpoint(store: &Store, batch_id: u64) -> Result<(u64, ReplicaMeta)> {
    store
        .checkpoints()?
        .into_iter()
        .rev()
        .find_map(|c| ReplicaMeta::parse(&c.meta).filter(|m| m.batch_id == batch_id).map(|m| (c.batch_id, m)))
        .ok_or_else(|| not_held(store, batch_id))
}

/// The publisher's checkpoints a replica's store can be read at exactly (oldest first):
/// those of its retained checkpoints (`keep_checkpoints` of them).
pub fn readable(store: &Store) -> Vec<u64> {
    let mut v: Vec<u64> = store
        .checkpoints()
        .map(|list| list.iter().filter_map(|c| ReplicaMeta::parse(&c.meta)).map(|m| m.batch_id).collect())
        .unwrap_or_default();
    v.sort_unstable();
    v
}

pub(crate) fn not_held(store: &Store, batch_id: u64) -> Error {
    let held = readable(store);
    Error::new(
        ErrorKind::Unavailable,
        format!(
            "checkpoint {batch_id} is not readable on this replica: it holds {} (store_options.keep_checkpoints \
             bounds how many)",
            if held.is_empty() {
                "none yet".to_string()
            } else {
                held.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", ")
            }
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use embank_core::{StoreOptions, TableOptions};

    const DIM: usize = 4;

    fn rows_of(keys: &[u64], tag: f32) -> Vec<f32> {
        keys.iter().flat_map(|&k| [k as f32, tag, -(k as f32), tag]).collect()
    }

    #[test]
    fn the_kept_index_finds_what_was_inserted_and_nothing_else_across_growth_and_wrap_around() {
        // Small tables (1024 slots, half full before growing) make long probe runs that
        // wrap past the last slot; a model map says what each key should find.
        let mut index = KeptIndex::default();
        let mut model = std::collections::HashMap::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..6u32 {
            let batch: Vec<u64> = (0..700)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Every fourth key repeats an earlier one: the first place wins.
                    if x.is_multiple_of(4) && !model.is_empty() {
                        *model.keys().next().unwrap()
                    } else {
                        x % 50_000
                    }
                })
                .collect();
            index.reserve(batch.len());
            for (r, &k) in batch.iter().enumerate() {
                index.insert_if_absent(k, hash(k), (round, r as u32));
                model.entry(k).or_insert((round, r as u32));
            }
            assert_eq!(index.len(), model.len());
            for k in 0..50_000u64 {
                assert_eq!(index.get(k, hash(k)), model.get(&k).copied(), "key {k} after round {round}");
            }
        }
    }

    #[test]
    fn a_read_answers_kept_keys_with_their_served_rows_and_the_rest_from_the_table() {
        // 200 k keys served at checkpoint 1, then a checkpoint in progress rewrites every
        // third key and deletes every seventh: enough kept keys that the view's filter
        // has collisions (keys not kept whose bit is set), each checked against a model.
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), StoreOptions::default()).unwrap();
        let t = store.create_table("emb", TableOptions::new(DIM as u32)).unwrap();
        let n = 200_000u64;
        let all: Vec<u64> = (0..n).collect();
        t.push(&all, &rows_of(&all, 1.0)).unwrap();
        let view = ServedView::new(STAGED_BYTES_MAX_DEFAULT);
        view.commit(1);
        let rewritten: Vec<u64> = (0..n).filter(|k| k % 3 == 0).collect();
        let deleted: Vec<u64> = (0..n).filter(|k| k % 7 == 0 && k % 3 != 0).collect();
        for chunk in rewritten.chunks(1000) {
            view.keep(&t, chunk).unwrap();
            t.push(chunk, &rows_of(chunk, 2.0)).unwrap();
        }
        view.keep(&t, &deleted).unwrap();
        t.delete(&deleted).unwrap();
        // Keys the table never held, kept as absent and then written.
        let new: Vec<u64> = (n..n + 1000).collect();
        view.keep(&t, &new).unwrap();
        t.push(&new, &rows_of(&new, 2.0)).unwrap();
        let kept = view.overlay.read().get("emb").map_or(0, |k| k.at.len());
        assert_eq!(kept, rewritten.len() + deleted.len() + new.len());
        let check = |keys: &[u64], served: bool| {
            let (mut out, mut found) = (vec![f32::NAN; keys.len() * DIM], vec![false; keys.len()]);
            view.lookup(&t, keys, &mut out, &mut found).unwrap();
            for (i, &k) in keys.iter().enumerate() {
                let row = &out[i * DIM..(i + 1) * DIM];
                let (want, want_found): (Vec<f32>, bool) = if k >= n {
                    if served {
                        (vec![0.0; DIM], false)
                    } else {
                        (rows_of(&[k], 2.0), true)
                    }
                } else if k % 3 == 0 {
                    (rows_of(&[k], if served { 1.0 } else { 2.0 }), true)
                } else if k % 7 == 0 {
                    if served {
                        (rows_of(&[k], 1.0), true)
                    } else {
                        (vec![0.0; DIM], false)
                    }
                } else {
                    (rows_of(&[k], 1.0), true)
                };
                assert_eq!((row, found[i]), (&want[..], want_found), "key {k} (served: {served})");
            }
        };
        // Batches that mix kept and not kept keys, a batch of kept keys only, and one of
        // keys not kept only.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mixed: Vec<u64> = (0..5000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % (n + 1000)
            })
            .collect();
        for batch in mixed.chunks(500) {
            check(batch, true);
        }
        check(&rewritten[..500], true);
        check(&(1..n).filter(|k| k % 3 != 0 && k % 7 != 0).take(500).collect::<Vec<_>>(), true);
        // After the commit every key reads as the new checkpoint has it.
        view.commit(2);
        for batch in mixed.chunks(500) {
            check(batch, false);
        }
    }

    #[test]
    fn an_exact_read_that_a_commit_overtakes_answers_nothing_rather_than_the_new_rows() {
        // A writer applies checkpoint b (every key's row = b) and commits it, 20 k times;
        // two readers ask for the checkpoint they last saw served, exactly. A read whose
        // served check passed just before a commit then reads the new rows: the view must
        // see the switch (its generation) and answer "not that checkpoint".
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), StoreOptions::default()).unwrap();
        let t = store.create_table("emb", TableOptions::new(DIM as u32)).unwrap();
        let keys: Vec<u64> = (0..64).collect();
        let tagged = |b: u64| vec![b as f32; keys.len() * DIM];
        t.push(&keys, &tagged(1)).unwrap();
        let view = ServedView::new(STAGED_BYTES_MAX_DEFAULT);
        view.commit(1);
        let last = 20_000u64;
        std::thread::scope(|scope| {
            for _ in 0..2 {
                scope.spawn(|| {
                    let (mut out, mut found) = (vec![0f32; keys.len() * DIM], vec![false; keys.len()]);
                    let mut exact = 0u64;
                    loop {
                        let b = view.served().unwrap();
                        if view.lookup_exact(&t, b, &keys, &mut out, &mut found).unwrap() {
                            exact += 1;
                            assert!(out.iter().all(|&x| x == b as f32), "asked for {b}, read {:?}", &out[..DIM]);
                        }
                        if b == last {
                            assert!(exact > 0);
                            return;
                        }
                    }
                });
            }
            for b in 2..=last {
                view.keep(&t, &keys).unwrap();
                t.push(&keys, &tagged(b)).unwrap();
                view.commit(b);
            }
        });
    }
}
