//! The one-read persistent hash index (after PETHash).
//!
//! A single level of 256-byte buckets in a memory-mapped file. A bucket holds
//! a seqlock version, an overflow counter, one-byte fingerprints and 17 slots
//! of a key and a 32-bit row number on one cache line (the row pointer is `base +
//! number * stride`, [`RowUnits`]; 15.1 bytes a slot). A key lives in its home bucket or, when that was
//! full at insert time, further along a probe sequence whose odd step comes
//! from the key's hash; every bucket passed on the way counts it in its
//! overflow counter, so a lookup stops at the key or at the first bucket
//! whose counter is zero. In the common case a lookup reads one bucket.
//! A batch read ([`Index::get_staged`]) reads less of it: the bucket's first
//! line (version, overflow counter, fingerprints) for every key of the batch,
//! then only the lines of the slots whose fingerprint matches, then those slots.
//!
//! Concurrency: readers never lock. They read a bucket between two loads of
//! its version and retry while it is odd or changed. Writers lock a single
//! bucket at a time by making its version odd. Callers serialise writers of
//! the *same key* (the table holds a striped lock per key), so a key is never
//! inserted twice.
//!
//! Disk space: the file is as long as its bucket count asks, but a page of it gets
//! blocks only when a key is first written there (`backing.rs`), so an index of a large
//! capacity holding few keys takes little disk, and a full disk is an insert's error.
//!
//! Crash safety: every word is written in place in the shared mapping, so a
//! killed process leaves its writes in the page cache. What a kill can leave
//! behind is an odd version (a bucket update cut short) and overflow counts
//! that are too high; [`Index::recover`] repairs both. The header's `state`
//! word tells whether the last user closed cleanly.
//!
//! Instant repair: after a killed process (same boot: every write it made is in
//! the page cache), the index need not be walked before it serves. With
//! [`Index::begin_lazy_repair`] every bucket is repaired the first time anyone
//! touches it (a byte per bucket in DRAM says which are done), while a
//! background pass ([`Index::repair_scan`]) walks the rest and counts the keys;
//! [`Index::finish_lazy_repair`] then sets the exact key count. Overflow
//! counters a kill left too high stay so (lookups walk a bucket further; the
//! counts come down as keys are removed).

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};

use memmap2::{MmapMut, MmapOptions};

use crate::error::{io_at, Error, ErrorKind, Result};
use crate::format::{self, IndexHeader, RowUnits, INDEX_HEADER_BYTES};
use crate::hash::{fingerprint, key_hash, Geometry};

mod backing;
mod bucket;
mod build;
mod legacy;
mod repair;
mod staged;
mod undo;

use backing::Backing;
#[cfg(test)]
use backing::PAGE_BYTES as BACKING_PAGE_BYTES;
use bucket::{empty_slots, MARK_SLOT_BITS};
pub use build::{fits_in_memory, index_file_bytes, mem_available_bytes};

#[cfg(feature = "testing")]
pub use bucket::slot_offsets;
pub use bucket::{
    Bucket, Found, RecoverReport, BUCKET_BYTES, BUCKET_COUNT_MAX, MARK_TAG_MASK, PROBE_BUCKETS_MAX,
    PROBE_SAMPLE_BUCKETS, SLOTS_PER_BUCKET,
};
use repair::LazyRepair;
pub use staged::STAGED_KEYS_MAX;

/// The index of one table: a mapped file of buckets.
pub struct Index {
    path: PathBuf,
    /// `None` while the index is built in DRAM (`build.rs`): `map` is anonymous memory.
    file: Option<File>,
    map: MmapMut,
    /// Which chunks of the file have blocks (see `backing.rs`).
    backing: Backing,
    bucket_count: u64,
    /// Where keys' probe sequences run (`hash.rs`).
    geo: Geometry,
    seed: u64,
    /// Row numbers to row pointers.
    units: RowUnits,
    /// True while buckets are repaired on first touch (see the module docs).
    repairing: AtomicBool,
    lazy: Option<Box<LazyRepair>>,
    /// A rollback on first touch (`undo.rs`), inside a lazy repair.
    undo: Option<Box<undo::LazyUndo>>,
    /// Counts slot changes while on ([`Index::watch`]): a bulk load's check that
    /// nobody else wrote the table meanwhile.
    watch: Watch,
}

#[derive(Default)]
struct Watch {
    on: AtomicBool,
    changes: AtomicU64,
}

// SAFETY: all shared mutation goes through atomics in the mapping.
unsafe impl Send for Index {}
unsafe impl Sync for Index {}

/// Buckets needed so that `capacity` keys fill at most `load` of the slots: exactly
/// that many (format version 2; before, rounded up to a power of two, which left an
/// index anywhere from `load` to half of it full: 43 bytes a key at 100 M keys).
pub fn buckets_for(capacity: u64, load: f64) -> u64 {
    let slots = (capacity.max(1) as f64 / load).ceil() as u64;
    slots.div_ceil(SLOTS_PER_BUCKET as u64).clamp(1, BUCKET_COUNT_MAX)
}

impl Index {
    /// Creates a new, empty index file (fails if it exists).
    pub fn create(path: &Path, bucket_count: u64, seed: u64, units: RowUnits) -> Result<Index> {
        if bucket_count == 0 || bucket_count > BUCKET_COUNT_MAX {
            return Err(Error::config(format!("bucket count {bucket_count} must be in 1..=2^40")));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| io_at("cannot create index file", path, e))?;
        let bytes = INDEX_HEADER_BYTES as u64 + bucket_count * BUCKET_BYTES as u64;
        // Sparse: chunks get blocks as keys arrive (`backing.rs`); the header's now.
        let backing = file
            .set_len(bytes)
            .map_err(|e| io_at("cannot size index file", path, e))
            .and_then(|()| Backing::create(&file, path, bytes))
            .inspect_err(|_| {
                let _ = std::fs::remove_file(path);
            })?;
        let mut map =
            unsafe { MmapOptions::new().map_mut(&file) }.map_err(|e| io_at("cannot map index file", path, e))?;
        let header = IndexHeader::new(bucket_count, seed, units);
        header.write(&mut map[..INDEX_HEADER_BYTES]);
        // A new index is in use (dirty) from the start, by this boot.
        let at = format::INDEX_BOOT_ID_OFFSET;
        map[at..at + 16].copy_from_slice(&crate::fsutil::boot_id());
        let index = Index {
            path: path.to_owned(),
            file: Some(file),
            map,
            backing,
            bucket_count,
            geo: Geometry::new(bucket_count),
            seed,
            units,
            repairing: AtomicBool::new(false),
            lazy: None,
            undo: None,
            watch: Watch::default(),
        };
        Ok(index)
    }

    /// Opens the index of a table whose rows lie at `units`: an index of format 1 or 2
    /// (before 17-slot buckets) is converted first (`legacy.rs`); one naming other units
    /// than the rows file is refused.
    pub fn open_for_rows(path: &Path, units: RowUnits) -> Result<Index> {
        legacy::convert_if_legacy(path, units)?;
        let index = Index::open(path)?;
        if index.units != units {
            return Err(Error::new(
                ErrorKind::Recover,
                format!(
                    "the index names rows of {} bytes from byte {}, the rows file {} from {}",
                    index.units.unit, index.units.base, units.unit, units.base
                ),
            )
            .context(path.display().to_string()));
        }
        Ok(index)
    }

    /// Maps an existing index file (format 3) and checks its header.
    pub fn open(path: &Path) -> Result<Index> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| io_at("cannot open index file", path, e))?;
        let len = file.metadata().map_err(|e| io_at("cannot stat index file", path, e))?.len();
        if len < INDEX_HEADER_BYTES as u64 {
            return Err(Error::new(ErrorKind::Recover, format!("index file is truncated: {len} bytes")))
                .map_err(|e| e.context(path.display().to_string()));
        }
        let map = unsafe { MmapOptions::new().map_mut(&file) }.map_err(|e| io_at("cannot map index file", path, e))?;
        let header =
            IndexHeader::read(&map[..INDEX_HEADER_BYTES]).map_err(|e| e.context(path.display().to_string()))?;
        let Some(units) = header.units else {
            return Err(Error::new(
                ErrorKind::FormatVersion,
                "index of format 1 or 2: open it through its table to convert it",
            )
            .context(path.display().to_string()));
        };
        let want = INDEX_HEADER_BYTES as u64 + header.bucket_count * BUCKET_BYTES as u64;
        if len != want {
            return Err(Error::new(ErrorKind::Recover, format!("index file has {len} bytes, its header says {want}"))
                .context(path.display().to_string()));
        }
        let backing = Backing::open(&file, path, len)?;
        Ok(Index {
            path: path.to_owned(),
            file: Some(file),
            map,
            backing,
            bucket_count: header.bucket_count,
            geo: Geometry::new(header.bucket_count),
            seed: header.seed,
            units,
            repairing: AtomicBool::new(false),
            lazy: None,
            undo: None,
            watch: Watch::default(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the index's file to `to` (replacing any file there); the mapping stays
    /// valid. The caller syncs the directory.
    pub fn rename(&mut self, to: &Path) -> Result<()> {
        std::fs::rename(&self.path, to).map_err(|e| io_at("cannot rename index file", &self.path, e))?;
        self.path = to.to_owned();
        Ok(())
    }

    pub fn bucket_count(&self) -> u64 {
        self.bucket_count
    }

    pub fn slot_count(&self) -> u64 {
        self.bucket_count * SLOTS_PER_BUCKET as u64
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn units(&self) -> RowUnits {
        self.units
    }

    /// The row number a slot stores for row pointer `ptr`. Panics on a pointer the slot
    /// cannot hold (not a row of these units, or past 2^32 rows: the rows file refuses
    /// to grow that far, `RecordAlloc`).
    #[inline(always)]
    fn row_of(&self, ptr: u64) -> u32 {
        let off = ptr.wrapping_sub(self.units.base);
        let row = off / self.units.unit;
        assert!(
            ptr >= self.units.base && row * self.units.unit == off && row < RowUnits::ROWS_MAX,
            "row pointer {ptr} is not a row of {:?}",
            self.units
        );
        row as u32
    }

    /// The row pointer of row number `row`.
    #[inline(always)]
    fn ptr_of(&self, row: u32) -> u64 {
        self.units.base + row as u64 * self.units.unit
    }

    /// Advises the kernel how to page the index (see `MmapMedium::advise`).
    pub fn advise(&self, advice: crate::medium::MapAdvice) {
        if let Some(a) = advice.advice() {
            let _ = self.map.advise(a);
        }
    }

    /// Asks the kernel to read buckets `[first, end)` from the file in the background
    /// (`MADV_WILLNEED`): the background passes (`repair.rs`, `undo.rs`) then find them
    /// in memory, read in large requests or many at a time, rather than faulting 4 KiB
    /// pages one by one (the mapping's advice is random access): on the VM's disk a
    /// cold 100 M-key pass took 34 s page by page.
    pub fn will_need(&self, first: u64, end: u64) {
        let end = end.min(self.bucket_count);
        if self.file.is_none() || first >= end {
            return;
        }
        const PAGE: usize = 4096;
        let from = (INDEX_HEADER_BYTES + first as usize * BUCKET_BYTES) / PAGE * PAGE;
        let to = (INDEX_HEADER_BYTES + end as usize * BUCKET_BYTES).div_ceil(PAGE) * PAGE;
        let _ = self.map.advise_range(memmap2::Advice::WillNeed, from, to.min(self.map.len()) - from);
    }

    pub fn file_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    /// Gives bucket `b`'s part of the file blocks before anything writes into it.
    #[inline(always)]
    fn back(&self, b: u64) -> Result<()> {
        match &self.file {
            Some(file) => self.backing.back(file, &self.path, b),
            // Built in DRAM: every page counts as backed.
            None => Ok(()),
        }
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= INDEX_HEADER_BYTES);
        // SAFETY: inside the mapped header, 8-aligned (the map is page-aligned).
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU64) }
    }

    fn word32(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset.is_multiple_of(4) && offset + 4 <= INDEX_HEADER_BYTES);
        // SAFETY: as above.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU32) }
    }

    /// Live keys.
    pub fn len(&self) -> u64 {
        self.word(format::INDEX_LEN_OFFSET).load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn add_len(&self, delta: i64) {
        let w = self.word(format::INDEX_LEN_OFFSET);
        if delta >= 0 {
            w.fetch_add(delta as u64, Ordering::Relaxed);
        } else {
            w.fetch_sub((-delta) as u64, Ordering::Relaxed);
        }
    }

    /// True when the last process to use this index closed it cleanly.
    pub fn was_closed_cleanly(&self) -> bool {
        self.word32(format::INDEX_STATE_OFFSET).load(Ordering::Acquire) == format::STATE_CLEAN
    }

    /// The generation of the free list saved at the last clean close.
    pub fn free_list_generation(&self) -> u64 {
        self.word(format::INDEX_FREE_GENERATION_OFFSET).load(Ordering::Acquire)
    }

    /// True when the index was last opened in the running boot of the machine: if it is
    /// dirty, a killed process (not a machine crash) left it, and every write that
    /// process made is in the page cache.
    pub fn opened_in_this_boot(&self) -> bool {
        let boot = crate::fsutil::boot_id();
        let at = format::INDEX_BOOT_ID_OFFSET;
        boot != [0; 16] && self.map[at..at + 16] == boot
    }

    /// Marks the index in use (dirty), with the running boot's id, and makes that
    /// durable before any write.
    pub fn mark_open(&self) -> Result<()> {
        let boot = crate::fsutil::boot_id();
        for (i, half) in boot.chunks(8).enumerate() {
            let w = u64::from_le_bytes(half.try_into().expect("8 bytes"));
            self.word(format::INDEX_BOOT_ID_OFFSET + 8 * i).store(w, Ordering::Relaxed);
        }
        self.word32(format::INDEX_STATE_OFFSET).store(format::STATE_OPEN, Ordering::Release);
        self.map.flush_range(0, INDEX_HEADER_BYTES).map_err(|e| io_at("cannot sync index header", &self.path, e))
    }

    /// Marks the index closed cleanly, naming the free-list generation saved with it.
    pub fn mark_closed(&self, free_generation: u64) -> Result<()> {
        self.flush()?;
        self.word(format::INDEX_FREE_GENERATION_OFFSET).store(free_generation, Ordering::Release);
        self.word32(format::INDEX_STATE_OFFSET).store(format::STATE_CLEAN, Ordering::Release);
        self.map.flush_range(0, INDEX_HEADER_BYTES).map_err(|e| io_at("cannot sync index header", &self.path, e))
    }

    /// Writes every dirty page of the index to the file (msync).
    pub fn flush(&self) -> Result<()> {
        if self.file.is_none() {
            return Ok(());
        }
        self.map.flush().map_err(|e| io_at("cannot sync index", &self.path, e))
    }

    /// Bucket `i`, repaired first while a lazy repair runs.
    #[inline(always)]
    fn bucket(&self, i: u64) -> &Bucket {
        if self.repairing.load(Ordering::Acquire) {
            self.repair_on_touch(i);
        }
        self.raw_bucket(i)
    }

    #[inline(never)]
    fn repair_on_touch(&self, i: u64) {
        if let Some(lazy) = &self.lazy {
            self.ensure_repaired(lazy, i);
        }
    }

    /// Bucket `i` as it lies in the file.
    #[inline(always)]
    fn raw_bucket(&self, i: u64) -> &Bucket {
        debug_assert!(i < self.bucket_count);
        // SAFETY: i < bucket_count and the file holds exactly that many buckets
        // after the header; buckets are 64-aligned because the header is 4096 bytes.
        unsafe { &*(self.map.as_ptr().add(INDEX_HEADER_BYTES + i as usize * BUCKET_BYTES) as *const Bucket) }
    }

    #[inline(always)]
    pub fn hash(&self, key: u64) -> u64 {
        key_hash(key, self.seed)
    }

    /// The home bucket of a hash: where a lookup reads first.
    #[inline(always)]
    pub fn home_of(&self, hash: u64) -> u64 {
        self.geo.home(hash)
    }

    /// Hints the CPU to load the home bucket of a hash: all four lines, the checkpoint
    /// marks (which a write's first-change check reads after its lookup) included.
    #[inline(always)]
    pub fn prefetch(&self, hash: u64) {
        self.prefetch_bucket(self.geo.home(hash))
    }

    /// Prefetches all four lines of bucket `b` (see [`Index::prefetch`]).
    #[inline(always)]
    fn prefetch_bucket(&self, b: u64) {
        let b = self.raw_bucket(b) as *const Bucket as *const u8;
        // All four lines: a key's slot may lie on any. (With 14-slot buckets, prefetching only the first two
        // lines left ~40 % of keys to a demand miss inside the probe, ycsb-c 10 M x 128 on
        // huge pages: 24 M keys/s with two lines, 28 M with four; fetching the
        // fingerprint line first and then only the matching slot's line was slower
        // still, its second stage waits on the first.) SAFETY: the bucket is 256 bytes.
        for line in 0..BUCKET_BYTES / 64 {
            crate::prefetch::prefetch_read(unsafe { b.add(line * 64) });
        }
    }

    /// Lock-free lookup.
    #[inline]
    pub fn get(&self, key: u64, hash: u64) -> Option<u64> {
        self.find(key, hash).map(|f| f.ptr)
    }

    /// Whether the key at `(bucket, slot)` is marked journaled in the interval `tag`
    /// (47 bits). Callers hold the key's writer lock, so its slot does not change.
    #[inline]
    pub fn journaled(&self, bucket: u64, slot: usize, tag: u64) -> bool {
        let m = self.bucket(bucket).marks.load(Ordering::Acquire);
        m >> MARK_SLOT_BITS == tag & MARK_TAG_MASK && m & (1 << slot) != 0
    }

    /// Marks the key at `(bucket, slot)` journaled in the interval `tag`; marks of an
    /// older tag in the bucket are dropped. Other slots' marks are kept (CAS loop).
    pub fn mark_journaled(&self, bucket: u64, slot: usize, tag: u64) {
        let word = &self.bucket(bucket).marks;
        let tag = tag & MARK_TAG_MASK;
        let mut cur = word.load(Ordering::Acquire);
        loop {
            let new = if cur >> MARK_SLOT_BITS == tag { cur | 1 << slot } else { tag << MARK_SLOT_BITS | 1 << slot };
            match word.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(x) => cur = x,
            }
        }
    }

    /// Clears the journaled mark of the key at `(bucket, slot)` (`undo.rs`).
    fn clear_mark(&self, bucket: u64, slot: usize) {
        self.raw_bucket(bucket).marks.fetch_and(!(1u64 << slot), Ordering::AcqRel);
    }

    /// Lock-free lookup, returning where the key sits.
    #[inline]
    pub fn find(&self, key: u64, hash: u64) -> Option<Found> {
        self.undo_gate(self.geo.home(hash));
        self.find_ungated(key, hash)
    }

    /// [`find`](Self::find) without the rollback's gate (`undo.rs`).
    fn find_ungated(&self, key: u64, hash: u64) -> Option<Found> {
        let fp = fingerprint(hash);
        let step = self.geo.step(hash);
        let mut b = self.geo.home(hash);
        for _ in 0..self.bucket_count {
            let (found, overflow) = self.bucket(b).read(key, fp);
            if let Some((slot, row)) = found {
                return Some(Found { bucket: b, slot, ptr: self.ptr_of(row) });
            }
            if overflow == 0 {
                return None;
            }
            b = self.geo.next(b, step);
        }
        None
    }

    /// Inserts a key the caller knows is absent (and holds the key's writer lock).
    /// Returns `false` when no free slot lies within [`PROBE_BUCKETS_MAX`] buckets, an
    /// `Io` error when the disk has no room for the part of the file it writes.
    pub fn insert_new(&self, key: u64, hash: u64, ptr: u64) -> Result<bool> {
        self.undo_gate(self.geo.home(hash));
        self.insert_new_ungated(key, hash, ptr)
    }

    fn insert_new_ungated(&self, key: u64, hash: u64, ptr: u64) -> Result<bool> {
        strict_assert!(ptr != 0);
        let row = self.row_of(ptr);
        self.note_change();
        strict_assert!(self.find_ungated(key, hash).is_none(), "key {key} inserted twice");
        let fp = fingerprint(hash);
        let step = self.geo.step(hash);
        let home = self.geo.home(hash);
        let mut b = home;
        let probes_max = PROBE_BUCKETS_MAX.min(self.bucket_count);
        for probe in 0..probes_max {
            if let Err(e) = self.back(b) {
                self.uncount(home, step, probe);
                return Err(e);
            }
            let bucket = self.bucket(b);
            let v = bucket.lock();
            let empty = empty_slots(bucket.fp_words());
            if empty != 0 {
                let slot = empty.trailing_zeros() as usize;
                bucket.set_slot(slot, key, row);
                bucket.set_fp(slot, fp);
                if self.repairing.load(Ordering::Acquire) {
                    self.count_change(b, 1);
                }
                bucket.unlock(v);
                self.add_len(1);
                return Ok(true);
            }
            // Count the key in every bucket it passes, before it lands further on.
            bucket.overflow.fetch_add(1, Ordering::Relaxed);
            bucket.unlock(v);
            if probe + 1 == probes_max {
                // Give up: take back the counts.
                self.uncount(home, step, probe + 1);
                return Ok(false);
            }
            b = self.geo.next(b, step);
        }
        Ok(false)
    }

    /// Counts a slot change (tried, not necessarily made) while watched.
    #[inline(always)]
    fn note_change(&self) {
        if self.watch.on.load(Ordering::Relaxed) {
            self.watch.changes.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Starts or stops counting slot changes (inserts, replaces, removes tried). The
    /// caller makes sure no writer is inside the index when it turns counting on (the
    /// table's state write lock), so every later change is counted. Returns false when
    /// counting was already on (a second bulk load).
    pub fn watch(&self, on: bool) -> bool {
        self.watch.on.swap(on, Ordering::AcqRel) != on
    }

    /// Slot changes counted while watched.
    pub fn changes(&self) -> u64 {
        self.watch.changes.load(Ordering::Acquire)
    }

    /// Decrements the overflow counters of the first `buckets` buckets of a probe sequence.
    fn uncount(&self, home: u64, step: u64, buckets: u64) {
        let mut b = home;
        for _ in 0..buckets {
            let bucket = self.bucket(b);
            let v = bucket.lock();
            let o = bucket.overflow.load(Ordering::Relaxed);
            strict_assert!(o > 0, "overflow counter underflow in bucket {b}");
            bucket.overflow.store(o.saturating_sub(1), Ordering::Relaxed);
            bucket.unlock(v);
            b = self.geo.next(b, step);
        }
    }

    /// Points an existing key at a new row; returns the old pointer, or None if absent.
    /// The caller holds the key's writer lock.
    pub fn replace(&self, key: u64, hash: u64, ptr: u64) -> Option<u64> {
        self.undo_gate(self.geo.home(hash));
        self.replace_ungated(key, hash, ptr)
    }

    fn replace_ungated(&self, key: u64, hash: u64, ptr: u64) -> Option<u64> {
        let row = self.row_of(ptr);
        self.note_change();
        let found = self.find_ungated(key, hash)?;
        let bucket = self.bucket(found.bucket);
        let v = bucket.lock();
        let old = bucket.row(found.slot).swap(row, Ordering::AcqRel);
        strict_assert_eq!(bucket.key(found.slot).load(Ordering::Relaxed), key);
        bucket.unlock(v);
        Some(self.ptr_of(old))
    }

    /// Removes a key; returns its row pointer. The caller holds the key's writer lock.
    pub fn remove(&self, key: u64, hash: u64) -> Option<u64> {
        self.undo_gate(self.geo.home(hash));
        self.remove_ungated(key, hash)
    }

    fn remove_ungated(&self, key: u64, hash: u64) -> Option<u64> {
        self.note_change();
        let found = self.find_ungated(key, hash)?;
        let bucket = self.bucket(found.bucket);
        let v = bucket.lock();
        strict_assert_eq!(bucket.key(found.slot).load(Ordering::Relaxed), key);
        bucket.set_fp(found.slot, 0);
        let old = self.ptr_of(bucket.row(found.slot).swap(0, Ordering::AcqRel));
        bucket.key(found.slot).store(0, Ordering::Relaxed);
        if self.repairing.load(Ordering::Acquire) {
            self.count_change(found.bucket, -1);
        }
        bucket.unlock(v);
        self.add_len(-1);
        // Only after the key is gone: it no longer passes the buckets before it.
        let home = self.geo.home(hash);
        let step = self.geo.step(hash);
        let distance = self.distance(home, step, found.bucket);
        self.uncount(home, step, distance);
        Some(old)
    }

    /// Buckets from `home` to `target` along a probe sequence.
    fn distance(&self, home: u64, step: u64, target: u64) -> u64 {
        let mut b = home;
        let mut d = 0;
        while b != target {
            b = self.geo.next(b, step);
            d += 1;
            assert!(d <= self.bucket_count, "bucket {target} is not on the probe sequence of {home}");
        }
        d
    }

    /// Calls `f(key, ptr)` for every key in buckets `[start, end)`, each bucket read
    /// consistently. A rollback on first touch is finished first (`undo.rs`).
    pub fn for_each(&self, start: u64, end: u64, f: impl FnMut(u64, u64)) {
        if self.undo_pending() {
            // An undo that failed was logged; the table's repair reports it.
            let _ = self.undo_all();
        }
        self.for_each_as_is(start, end, f)
    }

    /// [`for_each`](Self::for_each) of the buckets as they are, keys a rollback on first
    /// touch has not reached yet included (statistics).
    fn for_each_as_is(&self, start: u64, end: u64, mut f: impl FnMut(u64, u64)) {
        let mut snapshot = [(0u64, 0u64); SLOTS_PER_BUCKET];
        for b in start..end.min(self.bucket_count) {
            let bucket = self.bucket(b);
            let n = loop {
                let v1 = bucket.version.load(Ordering::Acquire);
                if v1 & 1 == 1 {
                    std::hint::spin_loop();
                    continue;
                }
                let words = bucket.fp_words();
                let mut n = 0;
                for slot in 0..SLOTS_PER_BUCKET {
                    if (words[slot / 8] >> ((slot % 8) * 8)) & 0xff != 0 {
                        let (key, row) = bucket.slot(slot);
                        snapshot[n] = (key, self.ptr_of(row));
                        n += 1;
                    }
                }
                fence(Ordering::Acquire);
                if bucket.version.load(Ordering::Relaxed) == v1 {
                    break n;
                }
            };
            for &(key, ptr) in &snapshot[..n] {
                f(key, ptr);
            }
        }
    }

    /// Histogram of probe lengths: entry i counts keys living i buckets past their home
    /// (the last entry counts all further). Exact up to [`PROBE_SAMPLE_BUCKETS`] buckets;
    /// beyond, estimated from that many buckets spread evenly (stats stay cheap on a
    /// table of billions of rows). It does not wait for a rollback on first touch.
    pub fn probe_histogram(&self) -> Vec<u64> {
        let mut hist = vec![0u64; 8];
        let stride = self.bucket_count.div_ceil(PROBE_SAMPLE_BUCKETS).max(1);
        for b in (0..self.bucket_count).step_by(stride as usize) {
            self.for_each_as_is(b, b + 1, |key, _| {
                let h = self.hash(key);
                let d = self.distance(self.geo.home(h), self.geo.step(h), b);
                let i = (d as usize).min(hist.len() - 1);
                hist[i] += stride;
            });
        }
        hist
    }
}

#[cfg(test)]
mod tests;
