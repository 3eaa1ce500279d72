//! Reads: the lock-free fast path of mmap tables that bypass the tiers, and the
//! tiered path (tiers → index → one batch of medium reads for every miss, rows
//! read admitted into the tiers); both feed `pull`, `lookup` and `push_grad`.

use std::sync::atomic::Ordering;

use super::write::{Change, Notice, Outcome, RecordWriter};
use super::{State, Table};
use crate::error::{Error, Result};
use crate::index::STAGED_KEYS_MAX;
use crate::medium::{Mapped, Medium, ReadItem};

/// How far ahead of the key being resolved its home bucket is prefetched, where keys are
/// looked up one at a time (the tiered path; the fast path on a small index). With all four
/// lines of a bucket asked for, 16 keys ahead beat 8 for every row type (ycsb-c 10 M x 128
/// on huge pages, alternating pairs: f32 +4-8 %, f16 +24 %, int8 +7-30 %; 24 and 32 gained
/// nothing more): fewer lines per key leave room for more keys in flight.
pub(super) const PREFETCH_KEYS_AHEAD: usize = 16;

/// Prefetches the home buckets a probe loop over `hashes` needs next, called at each `i`:
/// at 0 the first [`PREFETCH_KEYS_AHEAD`] and the one that far ahead (without them a batch
/// began with a run of misses waited for one after another), then the one that far ahead.
#[inline(always)]
pub(super) fn prefetch_buckets(index: &crate::index::Index, hashes: &[u64], i: usize) {
    if i == 0 {
        for &h in hashes.iter().take(PREFETCH_KEYS_AHEAD) {
            index.prefetch(h);
        }
    }
    if let Some(&h) = hashes.get(i + PREFETCH_KEYS_AHEAD) {
        index.prefetch(h);
    }
}

/// Index bytes below which [`resolve`] looks keys up one at a time (prefetching whole
/// buckets [`PREFETCH_KEYS_AHEAD`] keys ahead) rather than in stages: an index this small
/// stays in the caches (1 MiB of L2 a core and 32 MiB of L3 on the machines measured), so
/// fetching fewer lines of a bucket saves nothing, and the stages' extra passes cost
/// instructions (ycsb-c 100 k x 16: 120 M keys/s staged against 138 M; at 400 k keys, a
/// 16 MiB index, staged was ahead, 95 against 85 M).
pub(super) const STAGED_INDEX_BYTES_MIN: u64 = 8 << 20;

/// Resolves `keys` through the index in batches of [`STAGED_KEYS_MAX`], prefetching each
/// found record: in stages ([`Index::get_staged`](crate::index::Index::get_staged), then
/// the batch's records in a pass of their own), or one key at a time for an index below
/// [`STAGED_INDEX_BYTES_MIN`]. `ptrs[i]` becomes key
/// `i`'s record (0 when absent, its position pushed to `missing`). After each batch
/// `batch(range)` runs, so a caller can copy that batch's records while they are in cache.
#[inline(always)]
pub(super) fn resolve(
    index: &crate::index::Index,
    medium: &Mapped<'_>,
    keys: &[u64],
    ptrs: &mut [u64],
    missing: &mut Vec<usize>,
    mut batch: impl FnMut(std::ops::Range<usize>, &[u64]),
) {
    let staged = index.bucket_count() * crate::index::BUCKET_BYTES as u64 >= STAGED_INDEX_BYTES_MIN;
    let mut hashes = [0u64; STAGED_KEYS_MAX];
    for start in (0..keys.len()).step_by(STAGED_KEYS_MAX) {
        let end = keys.len().min(start + STAGED_KEYS_MAX);
        let (chunk, ptrs_here, hashes) = (&keys[start..end], &mut ptrs[start..end], &mut hashes[..end - start]);
        for (h, &k) in hashes.iter_mut().zip(chunk) {
            *h = index.hash(k);
        }
        if staged {
            index.get_staged(chunk, hashes, ptrs_here);
            for &ptr in ptrs_here.iter() {
                if ptr != 0 {
                    medium.prefetch(ptr);
                }
            }
        } else {
            for (i, &key) in chunk.iter().enumerate() {
                prefetch_buckets(index, hashes, i);
                ptrs_here[i] = index.get(key, hashes[i]).unwrap_or(0);
                if ptrs_here[i] != 0 {
                    medium.prefetch(ptrs_here[i]);
                }
            }
        }
        missing.extend((start..end).filter(|&i| ptrs[i] == 0));
        batch(start..end, ptrs);
    }
}

impl Table {
    /// The records of a table on the fast path (only tables on a mapped medium without tiers).
    #[inline(always)]
    pub(super) fn mapped<'s>(&self, st: &'s State) -> Mapped<'s> {
        st.medium.as_mapped().expect("tables without a mapped medium take the tiered path")
    }

    /// Fast path: resolves every key (lock-free, prefetching) and hands each found record
    /// to `copy(medium, ptr, i)` (key `i`'s record at `ptr`) while it is in cache, after
    /// checking the record's key. Returns the positions of keys that were not found; fills
    /// `found` if given. The one loop of [`gather`](Self::gather) and
    /// [`gather_stored`](Self::gather_stored): generic over `copy`, so each is compiled
    /// with its copy inlined.
    #[inline(always)]
    fn gather_with(
        &self,
        st: &State,
        keys: &[u64],
        found: Option<&mut [bool]>,
        mut copy: impl FnMut(&Mapped<'_>, u64, usize),
    ) -> Result<Vec<usize>> {
        let (index, medium) = (&st.index, self.mapped(st));
        let mut ptrs = vec![0u64; keys.len()];
        let mut missing = Vec::new();
        let mut corrupt = None;
        resolve(index, &medium, keys, &mut ptrs, &mut missing, |range, ptrs| {
            for i in range {
                let ptr = ptrs[i];
                if ptr == 0 {
                    continue;
                }
                if medium.key_at(ptr) != keys[i] {
                    corrupt = Some(i);
                    continue;
                }
                copy(&medium, ptr, i);
            }
        });
        if let Some(found) = found {
            for (i, &p) in ptrs.iter().enumerate() {
                found[i] = p != 0;
            }
        }
        if let Some(i) = corrupt {
            return Err(Error::corrupt(format!(
                "table {:?}: the index points key {} at a record of another key",
                self.shared.config.name, keys[i]
            )));
        }
        Ok(missing)
    }

    /// Fast path: copies found records (decoded) into `out`. Returns the positions of keys
    /// that were not found; fills `found` if given.
    fn gather(&self, st: &State, keys: &[u64], out: &mut [f32], found: Option<&mut [bool]>) -> Result<Vec<usize>> {
        let w = self.shared.config.layout.elems();
        self.gather_with(st, keys, found, |medium, ptr, i| medium.read_into(ptr, &mut out[i * w..(i + 1) * w]))
    }

    /// Fast path of [`lookup_stored`](Table::lookup_stored): like [`gather`](Self::gather)
    /// but copies each found record's stored row (`row_bytes` bytes, not decoded) into
    /// `out`. Returns the positions of keys that were not found and fills `found`.
    pub(super) fn gather_stored(
        &self,
        st: &State,
        keys: &[u64],
        out: &mut [u8],
        found: &mut [bool],
    ) -> Result<Vec<usize>> {
        let rb = self.shared.config.layout.row_bytes();
        self.gather_with(st, keys, Some(found), |medium, ptr, i| {
            out[i * rb..(i + 1) * rb].copy_from_slice(medium.row_bytes(ptr))
        })
    }

    /// Tiered path: tiers, index, medium. Returns positions found nowhere; fills `found`
    /// if given; counts hits and misses with `count`.
    pub(super) fn tier_read(
        &self,
        st: &State,
        keys: &[u64],
        out: &mut [f32],
        found: Option<&mut [bool]>,
        count: bool,
    ) -> Result<Vec<usize>> {
        let tiers = self.tiers();
        let miss = tiers.get(keys, out);
        let index = &st.index;
        let hashes: Vec<u64> = miss.iter().map(|&i| index.hash(keys[i])).collect();
        let mut items = Vec::with_capacity(miss.len());
        let mut absent = Vec::new();
        for (j, &i) in miss.iter().enumerate() {
            prefetch_buckets(index, &hashes, j);
            match index.get(keys[i], hashes[j]) {
                Some(ptr) => items.push(ReadItem { key: keys[i], ptr, pos: i }),
                None => absent.push(i),
            }
        }
        let shared_hits = tiers.read_below(&items, out, |items, out| st.medium.read(items, out))?;
        // A read admitted only if the index still points at the record read: a stale
        // read never lands in a tier.
        // Reads that are not counted (lookahead, a re-read) are ahead of their use.
        tiers.admit(&items, out, !count, &mut |it| index.get(it.key, index.hash(it.key)) == Some(it.ptr));
        if let Some(found) = found {
            found.fill(true);
            for &i in &absent {
                found[i] = false;
            }
        }
        let counters = &self.shared.counters;
        counters.rows_read.fetch_add((items.len() - shared_hits) as u64, Ordering::Relaxed);
        if count && !tiers.is_empty() {
            counters.hits.fetch_add((keys.len() - miss.len()) as u64, Ordering::Relaxed);
            counters.misses.fetch_add(miss.len() as u64, Ordering::Relaxed);
        }
        Ok(absent)
    }

    /// Whole records of the keys that exist (never creates); `found[i]` tells which.
    /// Returns the positions of the missing keys.
    pub(super) fn lookup_records(&self, keys: &[u64], records: &mut [f32], found: &mut [bool]) -> Result<Vec<usize>> {
        let st = self.state()?;
        let _pin = crossbeam_epoch::pin();
        if self.tiered() {
            self.tier_read(&st, keys, records, Some(found), true)
        } else {
            self.gather(&st, keys, records, Some(found))
        }
    }

    /// Records (row and optimizer state) of `keys`, created if missing.
    pub(super) fn pull_records(&self, keys: &[u64], out: &mut [f32]) -> Result<()> {
        // Pulls may create rows: a checkpoint sees all of a batch or none of it.
        let _gate = self.shared.runtime.gate.batch();
        let missing = {
            let st = self.state()?;
            let _pin = crossbeam_epoch::pin();
            if self.tiered() {
                self.tier_read(&st, keys, out, None, true)?
            } else {
                self.gather(&st, keys, out, None)?
            }
        };
        if missing.is_empty() {
            return Ok(());
        }
        self.create_missing(keys, &missing, out)
    }

    /// Creates the rows at `positions` with the initializer (written through to the
    /// medium, entering the tiers); a key another writer created first is read instead.
    fn create_missing(&self, keys: &[u64], positions: &[usize], out: &mut [f32]) -> Result<()> {
        let notice = Notice::new(self.tiers());
        let w = self.shared.config.layout.elems();
        for &i in positions {
            self.init_record(keys[i], &mut out[i * w..(i + 1) * w]);
        }
        let mut reread = Vec::new();
        self.with_room(|st, from| {
            let todo = &positions[from..];
            let ptrs = self.write_records(st, todo.iter().map(|&i| (keys[i], &out[i * w..(i + 1) * w])))?;
            let mut p = RecordWriter::new(self, st, Some(&notice));
            for (j, &i) in todo.iter().enumerate() {
                // A tier that has the row by now (another writer created it): its copy is the row.
                let mut cached: Option<Vec<f32>> = None;
                let outcome = p.publish(
                    keys[i],
                    Change::Create(ptrs[j]),
                    |locks| {
                        cached = locks.cached();
                        cached.is_some()
                    },
                    |locks| locks.created(&out[i * w..(i + 1) * w]),
                )?;
                match outcome {
                    Outcome::Present(ptr) => match st.medium.as_mapped() {
                        // The epoch guard of the pass keeps the record readable.
                        Some(m) if self.tiers().is_empty() => m.read_into(ptr, &mut out[i * w..(i + 1) * w]),
                        _ => reread.push(i),
                    },
                    Outcome::NoRoom => {
                        p.unused(&ptrs[j + 1..]);
                        p.finish();
                        return Ok(Some(j));
                    }
                    Outcome::Skipped => {
                        out[i * w..(i + 1) * w].copy_from_slice(&cached.expect("vetoed for a cached row"))
                    }
                    Outcome::Published | Outcome::Absent => {}
                }
            }
            p.finish();
            Ok(None)
        })?;
        if !reread.is_empty() {
            // Created by another writer between our read and our create: read theirs.
            let sub: Vec<u64> = reread.iter().map(|&i| keys[i]).collect();
            let mut rows = vec![0f32; sub.len() * w];
            {
                let st = self.state()?;
                let _pin = crossbeam_epoch::pin();
                self.tier_read(&st, &sub, &mut rows, None, false)?;
            }
            for (j, &i) in reread.iter().enumerate() {
                out[i * w..(i + 1) * w].copy_from_slice(&rows[j * w..(j + 1) * w]);
            }
        }
        Ok(())
    }

    /// Allocates records and writes `(key, record)`s to them in one batch; nothing is
    /// published.
    pub(super) fn write_records<'a>(
        &self,
        st: &State,
        records: impl Iterator<Item = (u64, &'a [f32])>,
    ) -> Result<Vec<u64>> {
        let records: Vec<(u64, &[f32])> = records.collect();
        let alloc = st.medium.alloc();
        let mut ptrs = Vec::new();
        alloc.allocate(records.len(), &mut ptrs)?;
        let items: Vec<(u64, u64, &[f32])> = records.iter().zip(&ptrs).map(|(&(k, r), &p)| (k, p, r)).collect();
        if let Err(e) = st.medium.write(&items) {
            alloc.release(ptrs);
            return Err(e);
        }
        Ok(ptrs)
    }
}
