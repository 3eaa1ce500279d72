//! Exports: the whole table in pages (a remote client pages through it by cursor),
//! a table as it was at a retained checkpoint while training goes on, and the keys
//! changed since a checkpoint (the incremental export).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::{State, Table};
use crate::error::{Error, ErrorKind, Result};
use crate::index::SLOTS_PER_BUCKET;
use crate::medium::{Medium, ReadItem};

/// What an export as of a checkpoint ([`Table::export_at`]) hands out, and what it may
/// assume.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AtExport {
    /// Whole records (each row, then its optimizer state) instead of rows.
    pub with_state: bool,
    /// The caller keeps every writer of the store out until the export returns (it holds
    /// the checkpoint gate exclusively): no key changes meanwhile, so the export reads the
    /// journals once and remembers only keys changed since the checkpoint, not every key
    /// it emitted.
    pub writers_held: bool,
}

/// Where an export continues: the index generation it started on and a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportCursor {
    pub generation: u64,
    pub bucket: u64,
}

impl ExportCursor {
    /// The start of a table.
    pub const START: ExportCursor = ExportCursor { generation: u64::MAX, bucket: 0 };
    /// A paged export at a checkpoint ([`Table::export_page_at`]) past the index: the keys
    /// changed since the checkpoint, from key `bucket` on.
    const CHANGED: u64 = u64::MAX - 1;
}

/// Appends the `(key, record)` pairs of whole index buckets from `bucket` on while
/// another bucket's worth still fits in `chunk_keys`; returns the next bucket.
fn page_of_buckets(st: &State, mut bucket: u64, chunk_keys: usize, pairs: &mut Vec<(u64, u64)>) -> u64 {
    while bucket < st.index.bucket_count() && pairs.len() + SLOTS_PER_BUCKET <= chunk_keys {
        st.index.for_each(bucket, bucket + 1, |key, ptr| pairs.push((key, ptr)));
        bucket += 1;
    }
    bucket
}

impl Table {
    fn grew_during_export(&self) -> Error {
        Error::new(
            ErrorKind::Unsupported,
            format!("table {:?} grew during the export; run the export again", self.shared.config.name),
        )
    }

    /// Streams every `(key, row)` in chunks of at most `chunk_keys` keys. The table stays
    /// readable and writable meanwhile (its lock is held per chunk, not across `f`); a row
    /// written during the export may appear in its old or new form. If the index is rebuilt
    /// (the table grew) between two chunks the export stops with an error, since bucket
    /// positions changed. Checks each row's checksum.
    pub fn export(&self, chunk_keys: usize, mut f: impl FnMut(&[u64], &[f32]) -> Result<()>) -> Result<()> {
        let mut keys = Vec::new();
        let mut rows = Vec::new();
        let mut cursor = ExportCursor::START;
        loop {
            let next = self.export_page(cursor, chunk_keys, &mut keys, &mut rows)?;
            if !keys.is_empty() {
                f(&keys, &rows)?;
            }
            match next {
                Some(c) => cursor = c,
                None => return Ok(()),
            }
        }
    }

    /// Every key of the table in chunks of at most `chunk_keys` keys (at least a bucket's
    /// worth), reading no row: what a replica notes when a full snapshot begins. The
    /// table stays readable and writable (its lock is held per chunk, not across `f`); a
    /// key written or deleted meanwhile may be listed or not. Fails as [`Self::export`]
    /// does if the index is rebuilt between two chunks.
    pub fn export_keys(&self, chunk_keys: usize, mut f: impl FnMut(&[u64]) -> Result<()>) -> Result<()> {
        let chunk_keys = chunk_keys.max(SLOTS_PER_BUCKET);
        let generation = self.state()?.generation;
        let mut keys = Vec::with_capacity(chunk_keys);
        let mut bucket = 0u64;
        loop {
            keys.clear();
            let done = {
                let st = self.state()?;
                let st = &*st;
                if self.state()?.generation != generation {
                    return Err(self.grew_during_export());
                }
                // Dirty cached rows belong to keys the index has: no write-back needed.
                while bucket < st.index.bucket_count() && keys.len() + SLOTS_PER_BUCKET <= chunk_keys {
                    st.index.for_each(bucket, bucket + 1, |key, _| keys.push(key));
                    bucket += 1;
                }
                bucket >= st.index.bucket_count()
            };
            if !keys.is_empty() {
                f(&keys)?;
            }
            if done {
                return Ok(());
            }
        }
    }

    /// One page of an export: clears `keys` and `rows`, fills them with at most
    /// `chunk_keys` rows (at least one bucket's worth) from `cursor` on, and returns
    /// where the next page starts (`None` when the table is done). Pages of one export
    /// may be fetched by different calls (a remote client pages through a table this
    /// way); a page from a cursor of an older index generation fails with
    /// `Unsupported` (the table grew; start again).
    pub fn export_page(
        &self,
        cursor: ExportCursor,
        chunk_keys: usize,
        keys: &mut Vec<u64>,
        rows: &mut Vec<f32>,
    ) -> Result<Option<ExportCursor>> {
        let chunk_keys = chunk_keys.max(SLOTS_PER_BUCKET);
        keys.clear();
        rows.clear();
        if cursor.bucket == 0 {
            // Dirty cached rows are newer than the medium: write them back first.
            self.write_back_all()?;
        }
        let mut bucket = cursor.bucket;
        let st = self.state()?;
        let st = &*st;
        let current = self.state()?.generation;
        let generation = if cursor == ExportCursor::START { current } else { cursor.generation };
        if generation != current {
            return Err(self.grew_during_export());
        }
        let _pin = crossbeam_epoch::pin();
        let mut items = Vec::with_capacity(chunk_keys + SLOTS_PER_BUCKET);
        bucket = page_of_buckets(st, bucket, chunk_keys, &mut items);
        self.read_records(st, &items, rows, false)?;
        keys.extend(items.iter().map(|&(k, _)| k));
        Ok((bucket < st.index.bucket_count()).then_some(ExportCursor { generation, bucket }))
    }

    /// Reads the records at `items` (key, record) into rows of the user's dim (with
    /// `with_state`, whole records: each row, then its optimizer state), checking that each
    /// record holds its key and its checksum.
    fn read_records(&self, st: &State, items: &[(u64, u64)], rows: &mut Vec<f32>, with_state: bool) -> Result<()> {
        let w = self.shared.config.layout.elems();
        let mut records = vec![0f32; items.len() * w];
        match st.medium.as_mapped() {
            Some(m) => {
                for (i, &(key, ptr)) in items.iter().enumerate() {
                    if m.key_at(ptr) != key || !m.checksum_ok(ptr) {
                        return Err(Error::new(
                            ErrorKind::ChecksumMismatch,
                            format!("table {:?}: row of key {key} fails its checksum", self.shared.config.name),
                        ));
                    }
                    m.read_into(ptr, &mut records[i * w..(i + 1) * w]);
                }
            }
            None => {
                let reads: Vec<ReadItem> =
                    items.iter().enumerate().map(|(pos, &(key, ptr))| ReadItem { key, ptr, pos }).collect();
                st.medium.read(&reads, &mut records)?;
            }
        }
        rows.clear();
        if self.shared.config.layout.has_state() && !with_state {
            rows.resize(items.len() * self.dim(), 0.0);
            self.copy_rows(&records, rows);
        } else {
            *rows = records;
        }
        Ok(())
    }

    /// Looks `keys` up as they were at retained checkpoint `seq`, by the rule of
    /// [`export_at`](Self::export_at): a key's record is the current index's unless the
    /// key changed since the checkpoint, in which case its undo entry gives the record it
    /// had then (or says it was absent). Keys absent at the checkpoint get the table's
    /// missing-row default and `found[i] = false`. Costs a pass over the entries of the
    /// journals since the checkpoint (the keys changed since), then one read per key.
    /// The caller keeps the checkpoint retained meanwhile (a pin).
    pub(crate) fn lookup_at(&self, seq: u64, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        let d = self.dim();
        self.check_rows("lookup at a checkpoint", keys.len(), out.len())?;
        if found.len() != keys.len() {
            return Err(Error::invalid(format!("lookup: {} keys but a found-mask of {}", keys.len(), found.len())));
        }
        let st = self.state()?;
        let st = &*st;
        let _pin = crossbeam_epoch::pin();
        let mut ptrs: Vec<u64> = keys.iter().map(|&k| st.index.get(k, st.index.hash(k)).unwrap_or(0)).collect();
        // The journals after the index: a change is journaled before the index sees it,
        // so every key whose slot the pass above saw changed has its entry by now.
        let (mut journals, mut first) = (BTreeMap::new(), HashMap::new());
        self.shared.checkpoints.changed_since(seq, &mut journals, &mut first);
        for (ptr, key) in ptrs.iter_mut().zip(keys) {
            if let Some(&old) = first.get(key) {
                *ptr = old;
            }
        }
        let items: Vec<(u64, u64)> = keys.iter().zip(&ptrs).filter(|&(_, &p)| p != 0).map(|(&k, &p)| (k, p)).collect();
        let mut rows = Vec::new();
        self.read_records(st, &items, &mut rows, false)?;
        let mut missing = Vec::new();
        let mut next = 0;
        for (i, &ptr) in ptrs.iter().enumerate() {
            found[i] = ptr != 0;
            if ptr == 0 {
                missing.push(i);
            } else {
                out[i * d..(i + 1) * d].copy_from_slice(&rows[next * d..(next + 1) * d]);
                next += 1;
            }
        }
        self.fill_missing(keys, &missing, out);
        Ok(())
    }

    /// Streams every `(key, row)` as of checkpoint `seq` (rows and their values then),
    /// while the table keeps changing: the current index gives each key's record unless
    /// the key changed since the checkpoint, in which case its undo entry gives the record
    /// it had (kept from reuse while the checkpoint is retained). Keys deleted since come
    /// from their entries. With `how.with_state`, `f` gets whole records (row, then
    /// optimizer state). Memory: the keys changed since the checkpoint, one page, and,
    /// unless `how.writers_held`, every key emitted (a key changed during the export may
    /// move to a bucket the walk has yet to pass: only a record of what went out keeps it
    /// from going out twice). With writers held no key moves, so only changed keys can be
    /// met twice (in the walk and in the pass over the deleted ones).
    pub(crate) fn export_at(
        &self,
        seq: u64,
        chunk_keys: usize,
        how: AtExport,
        mut f: impl FnMut(&[u64], &[f32]) -> Result<()>,
    ) -> Result<()> {
        let chunk_keys = chunk_keys.max(SLOTS_PER_BUCKET);
        let mut first = HashMap::new();
        let mut journals = BTreeMap::new();
        // Keys that went out: every one, or (writers held) those changed since `seq`.
        let mut emitted = HashSet::new();
        let mut bucket = 0u64;
        let generation = self.state()?.generation;
        let mut rows = Vec::new();
        if how.writers_held {
            self.shared.checkpoints.changed_since(seq, &mut journals, &mut first);
        }
        loop {
            let mut pairs = Vec::with_capacity(chunk_keys + SLOTS_PER_BUCKET);
            let (keys, done) = {
                let st = self.state()?;
                let st = &*st;
                if self.state()?.generation != generation {
                    return Err(self.grew_during_export());
                }
                let _pin = crossbeam_epoch::pin();
                bucket = page_of_buckets(st, bucket, chunk_keys, &mut pairs);
                // Read the journals after the index: an index change is journaled before it
                // happens, so every changed key the page saw has its entry by now.
                if !how.writers_held {
                    self.shared.checkpoints.changed_since(seq, &mut journals, &mut first);
                }
                let mut items = Vec::with_capacity(pairs.len());
                for (key, ptr) in pairs {
                    let (ptr, remember) = match first.get(&key) {
                        Some(&old) => (old, true),
                        None => (ptr, !how.writers_held),
                    };
                    if ptr != 0 && (!remember || emitted.insert(key)) {
                        items.push((key, ptr));
                    }
                }
                self.read_records(st, &items, &mut rows, how.with_state)?;
                (items.into_iter().map(|(k, _)| k).collect::<Vec<u64>>(), bucket >= st.index.bucket_count())
            };
            if !keys.is_empty() {
                f(&keys, &rows)?;
            }
            if done {
                break;
            }
        }
        // Keys deleted (or moved past the cursor) since the checkpoint.
        let rest: Vec<(u64, u64)> =
            first.iter().filter(|(k, &old)| old != 0 && !emitted.contains(*k)).map(|(&k, &p)| (k, p)).collect();
        for chunk in rest.chunks(chunk_keys) {
            let st = self.state()?;
            let _pin = crossbeam_epoch::pin();
            self.read_records(&st, chunk, &mut rows, how.with_state)?;
            let keys: Vec<u64> = chunk.iter().map(|&(k, _)| k).collect();
            drop(st);
            f(&keys, &rows)?;
        }
        Ok(())
    }

    /// The changes between checkpoints `from` and `to` as they were at `to`, in chunks of
    /// at most `chunk_keys` keys: `f(keys, rows, deleted)` gets the rows at `to` of keys
    /// written since `from`, and the keys absent at `to` that changed since `from`. The
    /// table keeps changing meanwhile: a key changed since `to` is read from its undo
    /// entry, as [`export_at`](Self::export_at) does. Both checkpoints must stay retained
    /// (the caller checks after).
    pub(crate) fn changes_between(
        &self,
        from: u64,
        to: u64,
        chunk_keys: usize,
        mut f: impl FnMut(&[u64], &[f32], &[u64]) -> Result<()>,
    ) -> Result<()> {
        let changed = self.shared.checkpoints.keys_changed_between(from, to)?;
        // Every key's index pointer first, then the journals since `to` once: a key changed
        // after its lookup has its entry by then, naming its record at `to`. Every pointer
        // used is a record at `to`, held while checkpoint `to` is retained, so the records
        // can be read later, chunk by chunk.
        let ptrs: Vec<u64> = {
            let st = self.state()?;
            let index = &st.index;
            changed.iter().map(|&k| index.get(k, index.hash(k)).unwrap_or(0)).collect()
        };
        let mut first = HashMap::new();
        self.shared.checkpoints.changed_since(to, &mut BTreeMap::new(), &mut first);
        let mut rows = Vec::new();
        let chunk_keys = chunk_keys.max(1);
        for (keys, ptrs) in changed.chunks(chunk_keys).zip(ptrs.chunks(chunk_keys)) {
            let (mut items, mut deleted) = (Vec::with_capacity(keys.len()), Vec::new());
            for (&key, &ptr) in keys.iter().zip(ptrs) {
                match first.get(&key).copied().unwrap_or(ptr) {
                    0 => deleted.push(key),
                    ptr => items.push((key, ptr)),
                }
            }
            {
                let st = self.state()?;
                self.read_records(&st, &items, &mut rows, false)?;
            }
            let keys: Vec<u64> = items.iter().map(|&(k, _)| k).collect();
            f(&keys, &rows, &deleted)?;
        }
        Ok(())
    }

    /// Keys changed since checkpoint `seq` (written, created or deleted): what an
    /// incremental export sends.
    pub(crate) fn changed_keys(&self, seq: u64) -> Result<Vec<u64>> {
        let mut first = HashMap::new();
        self.shared.checkpoints.changed_since(seq, &mut BTreeMap::new(), &mut first);
        let mut keys: Vec<u64> = first.into_keys().collect();
        keys.sort_unstable();
        Ok(keys)
    }
}

impl Table {
    /// One page of the table as it was at retained checkpoint `seq`, by cursor, for a
    /// client paging through it over several requests (a new replica copying a sibling's
    /// served checkpoint): no state is kept between pages. Pages first walk the index and
    /// give each key not changed since the checkpoint (its record then is its record now),
    /// then give the keys changed since, in key order, from their undo entries (those
    /// present at the checkpoint). A key that changes after its bucket was given comes
    /// again among the changed ones, with the same row. Fails with `Unsupported` if the
    /// index is rebuilt meanwhile (start again); the caller keeps the checkpoint retained.
    pub(crate) fn export_page_at(
        &self,
        seq: u64,
        cursor: ExportCursor,
        chunk_keys: usize,
        keys: &mut Vec<u64>,
        rows: &mut Vec<f32>,
    ) -> Result<Option<ExportCursor>> {
        let chunk_keys = chunk_keys.max(SLOTS_PER_BUCKET);
        keys.clear();
        rows.clear();
        let (mut journals, mut first) = (BTreeMap::new(), HashMap::new());
        if cursor.generation != ExportCursor::CHANGED {
            let st = self.state()?;
            let st = &*st;
            let generation = if cursor == ExportCursor::START { st.generation } else { cursor.generation };
            if generation != st.generation {
                return Err(self.grew_during_export());
            }
            let _pin = crossbeam_epoch::pin();
            let mut pairs = Vec::with_capacity(chunk_keys + SLOTS_PER_BUCKET);
            let bucket = page_of_buckets(st, cursor.bucket, chunk_keys, &mut pairs);
            // The journals after the index (as in `export_at`): a key the page saw changed
            // has its entry by now.
            self.shared.checkpoints.changed_since(seq, &mut journals, &mut first);
            let items: Vec<(u64, u64)> = pairs.into_iter().filter(|(k, _)| !first.contains_key(k)).collect();
            self.read_records(st, &items, rows, false)?;
            keys.extend(items.iter().map(|&(k, _)| k));
            return Ok(Some(if bucket < st.index.bucket_count() {
                ExportCursor { generation, bucket }
            } else {
                ExportCursor { generation: ExportCursor::CHANGED, bucket: 0 }
            }));
        }
        self.shared.checkpoints.changed_since(seq, &mut journals, &mut first);
        let mut rest: Vec<(u64, u64)> = first.into_iter().filter(|&(k, old)| old != 0 && k >= cursor.bucket).collect();
        rest.sort_unstable();
        rest.truncate(chunk_keys);
        let st = self.state()?;
        let _pin = crossbeam_epoch::pin();
        self.read_records(&st, &rest, rows, false)?;
        keys.extend(rest.iter().map(|&(k, _)| k));
        Ok(match rest.last() {
            Some(&(last, _)) if rest.len() == chunk_keys && last < u64::MAX => {
                Some(ExportCursor { generation: ExportCursor::CHANGED, bucket: last + 1 })
            }
            _ => None,
        })
    }
}
