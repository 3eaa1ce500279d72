//! A second near tier, as a sketch of what plugging one in takes: a FIFO DRAM cache
//! (evicts the oldest clean row, where the row cache runs a clock), one mutex over a
//! map. It implements [`Tier`] and [`TierKey`] and nothing else; the tests stack it
//! alone and under the row cache, through the [`TierStack`] a table uses.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use super::{CacheStats, Changed, DirtyRow, Listener, StoreTiers, Tier, TierKey, TierStack, TierUse};
use crate::layout::RecordLayout;
use crate::medium::ReadItem;

#[derive(Clone)]
struct Entry {
    record: Vec<f32>,
    version: u64,
    dirty: bool,
}

#[derive(Default)]
struct Rows {
    map: HashMap<(u32, u64), Entry>,
    order: VecDeque<(u32, u64)>,
}

struct Fifo {
    rows_max: usize,
    rows: Mutex<Rows>,
    version: AtomicU64,
}

impl Fifo {
    fn new(rows_max: usize) -> Fifo {
        Fifo { rows_max, rows: Mutex::new(Rows::default()), version: AtomicU64::new(1) }
    }

    fn insert(&self, rows: &mut Rows, id: (u32, u64), record: &[f32], dirty: bool) {
        while rows.map.len() >= self.rows_max {
            let Some(pos) = rows.order.iter().position(|k| rows.map.get(k).is_some_and(|e| !e.dirty)) else {
                break;
            };
            let old = rows.order.remove(pos).expect("position in range");
            rows.map.remove(&old);
        }
        let version = self.version.fetch_add(1, Ordering::Relaxed);
        rows.map.insert(id, Entry { record: record.to_vec(), version, dirty });
        rows.order.push_back(id);
    }
}

struct FifoKey<'a> {
    fifo: &'a Fifo,
    rows: MutexGuard<'a, Rows>,
    id: (u32, u64),
}

impl TierKey for FifoKey<'_> {
    fn get(&self, _layout: &RecordLayout, out: &mut [f32]) -> bool {
        let Some(e) = self.rows.map.get(&self.id) else { return false };
        out.copy_from_slice(&e.record);
        true
    }
    fn contains(&self) -> bool {
        self.rows.map.contains_key(&self.id)
    }
    fn dirty_version(&self) -> Option<u64> {
        self.rows.map.get(&self.id).filter(|e| e.dirty).map(|e| e.version)
    }
    fn replace(&mut self, _layout: &RecordLayout, record: &[f32], dirty: bool) -> bool {
        let version = self.fifo.version.fetch_add(1, Ordering::Relaxed);
        let Some(e) = self.rows.map.get_mut(&self.id) else { return false };
        *e = Entry { record: record.to_vec(), version, dirty };
        true
    }
    fn insert(&mut self, _layout: &RecordLayout, record: &[f32], dirty: bool, _pinned: bool) {
        self.fifo.insert(&mut self.rows, self.id, record, dirty);
    }
    fn mark_clean(&mut self, version: u64) {
        if let Some(e) = self.rows.map.get_mut(&self.id).filter(|e| e.version == version) {
            e.dirty = false;
        }
    }
    fn remove(&mut self) {
        let id = self.id;
        if self.rows.map.remove(&id).is_some() {
            self.rows.order.retain(|&k| k != id);
        }
    }
}

impl Tier for Fifo {
    fn get_batch(&self, table: u32, keys: &[u64], layout: &RecordLayout, out: &mut [f32], miss: &mut Vec<usize>) {
        let rows = self.rows.lock();
        for (i, (&key, row)) in keys.iter().zip(out.chunks_exact_mut(layout.elems())).enumerate() {
            match rows.map.get(&(table, key)) {
                Some(e) => row.copy_from_slice(&e.record),
                None => miss.push(i),
            }
        }
    }
    fn admit_batch(
        &self,
        table: u32,
        items: &[ReadItem],
        layout: &RecordLayout,
        out: &mut [f32],
        _pinned: bool,
        _referenced: bool,
        current: &mut dyn FnMut(&ReadItem) -> bool,
    ) {
        let w = layout.elems();
        let mut rows = self.rows.lock();
        for it in items {
            let row = &mut out[it.pos * w..(it.pos + 1) * w];
            match rows.map.get(&(table, it.key)) {
                Some(e) => row.copy_from_slice(&e.record),
                None if current(it) => self.insert(&mut rows, (table, it.key), row, false),
                None => {}
            }
        }
    }
    fn absent(&self, table: u32, keys: &[u64]) -> Vec<u64> {
        let rows = self.rows.lock();
        keys.iter().copied().filter(|&k| !rows.map.contains_key(&(table, k))).collect()
    }
    fn with_key(&self, table: u32, key: u64, f: &mut dyn FnMut(&mut dyn TierKey)) {
        f(&mut FifoKey { fifo: self, rows: self.rows.lock(), id: (table, key) })
    }
    fn take_dirty(&self, table: u32, _layout: &RecordLayout, max: usize) -> Vec<DirtyRow> {
        let rows = self.rows.lock();
        let dirty = rows.map.iter().filter(|((t, _), e)| *t == table && e.dirty).take(max);
        dirty.map(|(&(_, key), e)| DirtyRow { key, version: e.version, row: e.record.clone().into() }).collect()
    }
    fn requeue(&self, _table: u32, _keys: &[u64]) {}
    fn dirty_over_high(&self) -> bool {
        false
    }
    fn dirty_over_target(&self) -> bool {
        false
    }
    fn drop_table(&self, table: u32) {
        let mut rows = self.rows.lock();
        rows.map.retain(|&(t, _), _| t != table);
        rows.order.retain(|&(t, _)| t != table);
    }
    fn stats(&self) -> CacheStats {
        let rows = self.rows.lock().map.len() as u64;
        CacheStats {
            budget_bytes: 0,
            shards: 1,
            bytes_cached: 0,
            rows_cached: rows,
            dirty_bytes: 0,
            pinned_bytes: 0,
            inserts: 0,
            evictions: 0,
            rows_written_back: 0,
        }
    }
}

#[derive(Default)]
struct Heard(Mutex<Vec<u64>>);

impl Listener for Heard {
    fn rows_changed(&self, changed: &Changed<'_>) {
        self.0.lock().extend_from_slice(changed.keys);
    }
}

fn stack(near: Vec<Arc<dyn Tier>>, heard: &Arc<Heard>) -> TierStack {
    let store = Arc::new(StoreTiers::new(near, vec![Arc::clone(heard) as Arc<dyn Listener>]));
    let uses = TierUse { near: true, shared: true, pinned: false };
    TierStack::new(store, uses, 7, Arc::from("t"), RecordLayout::new(2, 0, crate::DType::F32))
}

/// A medium of rows `[key, -key]`, as the stack's `read_below` sees it.
fn read_medium(items: &[ReadItem], out: &mut [f32]) -> crate::Result<()> {
    for it in items {
        out[it.pos * 2..it.pos * 2 + 2].copy_from_slice(&[it.key as f32, -(it.key as f32)]);
    }
    Ok(())
}

/// The tiered read as `table/read.rs` does it: near tiers, then below, then admission.
fn read(tiers: &TierStack, keys: &[u64]) -> (Vec<f32>, usize) {
    let mut out = vec![0f32; keys.len() * 2];
    let miss = tiers.get(keys, &mut out);
    let items: Vec<ReadItem> = miss.iter().map(|&i| ReadItem { key: keys[i], ptr: 1, pos: i }).collect();
    tiers.read_below(&items, &mut out, read_medium).unwrap();
    tiers.admit(&items, &mut out, false, &mut |_| true);
    (out, miss.len())
}

#[test]
fn fifo_tier_alone_reads_writes_back_and_notifies() {
    let heard = Arc::new(Heard::default());
    let tiers = stack(vec![Arc::new(Fifo::new(2))], &heard);
    assert_eq!(read(&tiers, &[1, 2]), (vec![1.0, -1.0, 2.0, -2.0], 2), "first read misses");
    assert_eq!(read(&tiers, &[1, 2]).1, 0, "admitted rows hit");
    assert_eq!(read(&tiers, &[3]).1, 1);
    assert_eq!(tiers.absent(&[1, 2, 3]), vec![1], "FIFO evicted the oldest row");
    // A push of a held row stays in the tier, dirty, and is written back by version.
    let mut through = Vec::new();
    tiers.write_dirty(&[2], &[5.0, 5.0], &mut |_| true, &mut through);
    assert!(through.is_empty(), "a held row stays in the tier");
    tiers.changed(&[2]);
    let dirty = tiers.take_dirty(10);
    assert_eq!(dirty.len(), 1);
    assert_eq!((dirty[0].key, &dirty[0].row[..]), (2, &[5.0, 5.0][..]));
    tiers.locked(2, |locks| {
        assert!(locks.dirty_at(dirty[0].version));
        locks.written_back(dirty[0].version);
        assert!(!locks.dirty_at(dirty[0].version));
    });
    assert!(tiers.take_dirty(10).is_empty());
    assert_eq!(*heard.0.lock(), vec![2], "the listener heard the batch's notice");
}

#[test]
fn fifo_tier_under_the_row_cache() {
    let heard = Arc::new(Heard::default());
    let fifo = Arc::new(Fifo::new(100));
    let tiers = stack(vec![Arc::new(super::RowCache::new(64 << 10)), Arc::clone(&fifo) as Arc<dyn Tier>], &heard);
    read(&tiers, &[1, 2, 3]);
    // Taken out of the nearest tier only: the farther one answers.
    tiers.locked(2, |locks| locks.remove());
    fifo.insert(&mut fifo.rows.lock(), (7, 2), &[9.0, 9.0], false);
    let (rows, missed) = read(&tiers, &[1, 2, 3]);
    assert_eq!((missed, &rows[2..4]), (0, &[9.0, 9.0][..]));
    // A dirty write lands in the nearest tier and drops the farther copy.
    let mut through = Vec::new();
    tiers.write_dirty(&[1, 99], &[4.0, 4.0, 5.0, 5.0], &mut |key| key == 1, &mut through);
    assert_eq!(through, vec![1], "a key the index lacks goes through");
    assert_eq!(tiers.locked(1, |locks| locks.cached()), Some(vec![4.0, 4.0]));
    assert_eq!(fifo.absent(7, &[1]), vec![1]);
}
