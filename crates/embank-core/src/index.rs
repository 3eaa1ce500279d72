//! The one-read persistent hash index (after PETHash).
//!
//! A single level of 256-byte buckets in a memory-mapped file. A bucket holds
//! a seqlock version, an overflow counter, one-byte fingerprints and 14 slots
//! of `(key, row pointer)`. A key lives in its home bucket or, when that was
//! full at insert time, further along a probe sequence whose odd step comes
//! from the key's hash; every bucket passed on the way counts it in its
//! overflow counter, so a lookup stops at the key or at the first bucket
//! whose counter is zero. In the common case a lookup reads one bucket.
//!
//! Concurrency: readers never lock. They read a bucket between two loads of
//! its version and retry while it is odd or changed. Writers lock a single
//! bucket at a time by making its version odd. Callers serialise writers of
//! the *same key* (the table holds a striped lock per key), so a key is never
//! inserted twice.
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
use std::sync::atomic::{fence, AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering};

use memmap2::{MmapMut, MmapOptions};

use crate::error::{io_at, Error, ErrorKind, Result};
use crate::format::{self, IndexHeader, INDEX_HEADER_BYTES};
use crate::hash::{fingerprint, home_bucket, key_hash, probe_step};

/// Bytes of one bucket.
pub const BUCKET_BYTES: usize = 256;
/// Slots of one bucket: 8 bytes of header, 16 of fingerprints, 14 * 16 of slots, 8 reserved.
pub const SLOTS_PER_BUCKET: usize = 14;
/// Longest probe sequence, in buckets, an insert may walk before the table counts as full.
pub const PROBE_BUCKETS_MAX: u64 = 64;
/// Buckets [`Index::probe_histogram`] looks at, at most.
pub const PROBE_SAMPLE_BUCKETS: u64 = 1 << 16;
/// Largest bucket count (2^40 buckets: 15 * 10^12 slots, far beyond any table).
pub const BUCKET_COUNT_MAX: u64 = 1 << 40;

const _: () = assert!(8 + 16 + SLOTS_PER_BUCKET * 16 + 8 == BUCKET_BYTES);
const _: () = assert!(SLOTS_PER_BUCKET <= 16);
const _: () = assert!(std::mem::size_of::<Bucket>() == BUCKET_BYTES);

/// One bucket as it lies in the file (little-endian, as this build's target).
#[repr(C, align(64))]
pub struct Bucket {
    /// Seqlock: odd while a writer is inside.
    version: AtomicU32,
    /// How many keys whose probe sequence passed this bucket live further on.
    overflow: AtomicU32,
    /// Fingerprints of slots 0..14 (byte i of the 16); 0 = empty. Bytes 14, 15 stay 0.
    fps: [AtomicU64; 2],
    /// `(key, row pointer)` per slot.
    slots: [[AtomicU64; 2]; SLOTS_PER_BUCKET],
    /// Checkpoint marks: a 50-bit interval tag and one bit per slot whose key has been
    /// journaled in that interval ([`Index::journaled`]). Meaningful only to the process
    /// that wrote them (tags are per open), so garbage after a restart is harmless.
    marks: AtomicU64,
}

/// Where a key sits: bucket, slot and its row pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub bucket: u64,
    pub slot: usize,
    pub ptr: u64,
}

/// What [`Index::recover`] found and repaired.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoverReport {
    pub buckets_interrupted: u64,
    pub slots_dropped: u64,
    pub keys: u64,
}

/// Low bits of a bucket's `marks` word: one per slot.
const MARK_SLOT_BITS: u32 = SLOTS_PER_BUCKET as u32;
/// The interval tag in the rest of the word.
pub const MARK_TAG_MASK: u64 = (1 << (64 - MARK_SLOT_BITS)) - 1;

const LOW_BYTES: u64 = 0x0101_0101_0101_0101;
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// Bit mask (one bit per slot) of the slots whose fingerprint equals `fp`.
#[inline(always)]
fn match_fp(words: [u64; 2], fp: u8) -> u32 {
    let pattern = LOW_BYTES.wrapping_mul(fp as u64);
    let mut mask = 0u32;
    for (w, word) in words.into_iter().enumerate() {
        let x = word ^ pattern;
        // Bytes of x that are zero mark equal fingerprints (exact: no false
        // positives above a true zero byte, unlike the shorter borrow trick).
        let y = (x & !HIGH_BITS).wrapping_add(!HIGH_BITS);
        let mut zeros = !(y | x | !HIGH_BITS);
        while zeros != 0 {
            let byte = zeros.trailing_zeros() / 8;
            mask |= 1 << (w as u32 * 8 + byte);
            zeros &= zeros - 1;
        }
    }
    mask & ((1 << SLOTS_PER_BUCKET) - 1)
}

/// Bit mask of empty slots.
#[inline(always)]
fn empty_slots(words: [u64; 2]) -> u32 {
    let mut mask = 0u32;
    for (w, word) in words.into_iter().enumerate() {
        for byte in 0..8 {
            if (word >> (byte * 8)) & 0xff == 0 {
                mask |= 1 << (w * 8 + byte);
            }
        }
    }
    mask & ((1 << SLOTS_PER_BUCKET) - 1)
}

impl Bucket {
    #[inline(always)]
    fn fp_words(&self) -> [u64; 2] {
        [self.fps[0].load(Ordering::Relaxed), self.fps[1].load(Ordering::Relaxed)]
    }

    /// Locks the bucket for writing; returns the even version it had.
    #[inline]
    fn lock(&self) -> u32 {
        let mut spins = 0u32;
        loop {
            let v = self.version.load(Ordering::Relaxed);
            if v & 1 == 0
                && self
                    .version
                    .compare_exchange_weak(v, v.wrapping_add(1), Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return v;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    #[inline]
    fn unlock(&self, v: u32) {
        self.version.store(v.wrapping_add(2), Ordering::Release);
    }

    fn set_fp(&self, slot: usize, fp: u8) {
        let word = &self.fps[slot / 8];
        let shift = (slot % 8) * 8;
        let old = word.load(Ordering::Relaxed);
        word.store((old & !(0xff << shift)) | ((fp as u64) << shift), Ordering::Release);
    }

    fn fp(&self, slot: usize) -> u8 {
        (self.fps[slot / 8].load(Ordering::Relaxed) >> ((slot % 8) * 8)) as u8
    }

    /// Consistent read: the slot holding `key` (if any) and the overflow counter.
    #[inline(always)]
    fn read(&self, key: u64, fp: u8) -> (Option<(usize, u64)>, u32) {
        loop {
            let v1 = self.version.load(Ordering::Acquire);
            if v1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let mut found = None;
            let mut candidates = match_fp(self.fp_words(), fp);
            while candidates != 0 {
                let slot = candidates.trailing_zeros() as usize;
                candidates &= candidates - 1;
                if self.slots[slot][0].load(Ordering::Relaxed) == key {
                    found = Some((slot, self.slots[slot][1].load(Ordering::Relaxed)));
                    break;
                }
            }
            let overflow = self.overflow.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if self.version.load(Ordering::Relaxed) == v1 {
                return (found, overflow);
            }
        }
    }
}

/// The index of one table: a mapped file of buckets.
pub struct Index {
    path: PathBuf,
    _file: File,
    map: MmapMut,
    bucket_count: u64,
    bucket_mask: u64,
    seed: u64,
    /// True while buckets are repaired on first touch (see the module docs).
    repairing: AtomicBool,
    lazy: Option<Box<LazyRepair>>,
}

/// Per-bucket repair state of a lazy repair.
const UNCHECKED: u8 = 0;
const BUSY: u8 = 1;
const DONE: u8 = 2;

/// The state of a repair on first touch.
struct LazyRepair {
    /// Per bucket: `UNCHECKED`, `BUSY` (being repaired), `DONE`.
    state: Box<[AtomicU8]>,
    /// Buckets below it have been counted by the background pass.
    cursor: AtomicU64,
    /// Keys the background pass counted (each bucket when it passed it).
    counted: AtomicU64,
    /// Keys inserted into counted buckets since, less those removed from them.
    delta: AtomicI64,
    buckets_interrupted: AtomicU64,
    slots_dropped: AtomicU64,
}

// SAFETY: all shared mutation goes through atomics in the mapping.
unsafe impl Send for Index {}
unsafe impl Sync for Index {}

/// Buckets needed so that `capacity` keys fill at most `load` of the slots.
pub fn buckets_for(capacity: u64, load: f64) -> u64 {
    let slots = (capacity.max(1) as f64 / load).ceil() as u64;
    slots.div_ceil(SLOTS_PER_BUCKET as u64).next_power_of_two().clamp(1, BUCKET_COUNT_MAX)
}

impl Index {
    /// Creates a new, empty index file (fails if it exists).
    pub fn create(path: &Path, bucket_count: u64, seed: u64) -> Result<Index> {
        if !bucket_count.is_power_of_two() || bucket_count > BUCKET_COUNT_MAX {
            return Err(Error::config(format!("bucket count {bucket_count} must be a power of two <= 2^40")));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| io_at("cannot create index file", path, e))?;
        let bytes = INDEX_HEADER_BYTES as u64 + bucket_count * BUCKET_BYTES as u64;
        crate::fsutil::allocate(&file, path, 0, bytes).inspect_err(|_| {
            let _ = std::fs::remove_file(path);
        })?;
        let mut map =
            unsafe { MmapOptions::new().map_mut(&file) }.map_err(|e| io_at("cannot map index file", path, e))?;
        let header = IndexHeader::new(bucket_count, seed);
        header.write(&mut map[..INDEX_HEADER_BYTES]);
        // A new index is in use (dirty) from the start, by this boot.
        let at = format::INDEX_BOOT_ID_OFFSET;
        map[at..at + 16].copy_from_slice(&crate::fsutil::boot_id());
        let index = Index {
            path: path.to_owned(),
            _file: file,
            map,
            bucket_count,
            bucket_mask: bucket_count - 1,
            seed,
            repairing: AtomicBool::new(false),
            lazy: None,
        };
        Ok(index)
    }

    /// Maps an existing index file and checks its header.
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
        let want = INDEX_HEADER_BYTES as u64 + header.bucket_count * BUCKET_BYTES as u64;
        if len != want {
            return Err(Error::new(ErrorKind::Recover, format!("index file has {len} bytes, its header says {want}"))
                .context(path.display().to_string()));
        }
        Ok(Index {
            path: path.to_owned(),
            _file: file,
            map,
            bucket_count: header.bucket_count,
            bucket_mask: header.bucket_count - 1,
            seed: header.seed,
            repairing: AtomicBool::new(false),
            lazy: None,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
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

    /// Turns off read-around for the mapping (see `MmapMedium::advise_random`).
    pub fn advise_random(&self) {
        let _ = self.map.advise(memmap2::Advice::Random);
    }

    pub fn file_bytes(&self) -> u64 {
        self.map.len() as u64
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
        home_bucket(hash, self.bucket_mask)
    }

    /// Hints the CPU to load the home bucket of a hash.
    #[inline(always)]
    pub fn prefetch(&self, hash: u64) {
        let b = self.raw_bucket(home_bucket(hash, self.bucket_mask)) as *const Bucket as *const u8;
        crate::prefetch::prefetch_read(b);
        // Inserts fill the lowest free slot, so most keys sit in slots 0..6: the first
        // two cache lines. SAFETY: the bucket is 256 bytes long.
        crate::prefetch::prefetch_read(unsafe { b.add(64) });
    }

    /// Lock-free lookup.
    #[inline]
    pub fn get(&self, key: u64, hash: u64) -> Option<u64> {
        self.find(key, hash).map(|f| f.ptr)
    }

    /// Hints the CPU to load the line of the home bucket's checkpoint marks (the last of
    /// the bucket's four), which a write's first-change check reads after its lookup.
    #[inline(always)]
    pub fn prefetch_marks(&self, hash: u64) {
        let b = self.raw_bucket(home_bucket(hash, self.bucket_mask));
        crate::prefetch::prefetch_read(&b.marks as *const AtomicU64 as *const u8);
    }

    /// Whether the key at `(bucket, slot)` is marked journaled in the interval `tag`
    /// (50 bits). Callers hold the key's writer lock, so its slot does not change.
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

    /// Lock-free lookup, returning where the key sits.
    #[inline]
    pub fn find(&self, key: u64, hash: u64) -> Option<Found> {
        let fp = fingerprint(hash);
        let step = probe_step(hash, self.bucket_mask);
        let mut b = home_bucket(hash, self.bucket_mask);
        for _ in 0..self.bucket_count {
            let (found, overflow) = self.bucket(b).read(key, fp);
            if let Some((slot, ptr)) = found {
                return Some(Found { bucket: b, slot, ptr });
            }
            if overflow == 0 {
                return None;
            }
            b = (b + step) & self.bucket_mask;
        }
        None
    }

    /// Inserts a key the caller knows is absent (and holds the key's writer lock).
    /// Returns `false` when no free slot lies within [`PROBE_BUCKETS_MAX`] buckets.
    pub fn insert_new(&self, key: u64, hash: u64, ptr: u64) -> bool {
        strict_assert!(ptr != 0);
        strict_assert!(self.find(key, hash).is_none(), "key {key} inserted twice");
        let fp = fingerprint(hash);
        let step = probe_step(hash, self.bucket_mask);
        let home = home_bucket(hash, self.bucket_mask);
        let mut b = home;
        let probes_max = PROBE_BUCKETS_MAX.min(self.bucket_count);
        for probe in 0..probes_max {
            let bucket = self.bucket(b);
            let v = bucket.lock();
            let empty = empty_slots(bucket.fp_words());
            if empty != 0 {
                let slot = empty.trailing_zeros() as usize;
                bucket.slots[slot][0].store(key, Ordering::Relaxed);
                bucket.slots[slot][1].store(ptr, Ordering::Release);
                bucket.set_fp(slot, fp);
                if self.repairing.load(Ordering::Acquire) {
                    self.count_change(b, 1);
                }
                bucket.unlock(v);
                self.add_len(1);
                return true;
            }
            // Count the key in every bucket it passes, before it lands further on.
            bucket.overflow.fetch_add(1, Ordering::Relaxed);
            bucket.unlock(v);
            if probe + 1 == probes_max {
                // Give up: take back the counts.
                self.uncount(home, step, probe + 1);
                return false;
            }
            b = (b + step) & self.bucket_mask;
        }
        false
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
            b = (b + step) & self.bucket_mask;
        }
    }

    /// Points an existing key at a new row; returns the old pointer, or None if absent.
    /// The caller holds the key's writer lock.
    pub fn replace(&self, key: u64, hash: u64, ptr: u64) -> Option<u64> {
        let found = self.find(key, hash)?;
        let bucket = self.bucket(found.bucket);
        let v = bucket.lock();
        let old = bucket.slots[found.slot][1].swap(ptr, Ordering::AcqRel);
        strict_assert_eq!(bucket.slots[found.slot][0].load(Ordering::Relaxed), key);
        bucket.unlock(v);
        Some(old)
    }

    /// Removes a key; returns its row pointer. The caller holds the key's writer lock.
    pub fn remove(&self, key: u64, hash: u64) -> Option<u64> {
        let found = self.find(key, hash)?;
        let bucket = self.bucket(found.bucket);
        let v = bucket.lock();
        strict_assert_eq!(bucket.slots[found.slot][0].load(Ordering::Relaxed), key);
        bucket.set_fp(found.slot, 0);
        let old = bucket.slots[found.slot][1].swap(0, Ordering::AcqRel);
        bucket.slots[found.slot][0].store(0, Ordering::Relaxed);
        if self.repairing.load(Ordering::Acquire) {
            self.count_change(found.bucket, -1);
        }
        bucket.unlock(v);
        self.add_len(-1);
        // Only after the key is gone: it no longer passes the buckets before it.
        let home = home_bucket(hash, self.bucket_mask);
        let step = probe_step(hash, self.bucket_mask);
        let distance = self.distance(home, step, found.bucket);
        self.uncount(home, step, distance);
        Some(old)
    }

    /// Buckets from `home` to `target` along a probe sequence.
    fn distance(&self, home: u64, step: u64, target: u64) -> u64 {
        let mut b = home;
        let mut d = 0;
        while b != target {
            b = (b + step) & self.bucket_mask;
            d += 1;
            assert!(d <= self.bucket_count, "bucket {target} is not on the probe sequence of {home}");
        }
        d
    }

    /// Calls `f(key, ptr)` for every key in buckets `[start, end)`, each bucket read consistently.
    pub fn for_each(&self, start: u64, end: u64, mut f: impl FnMut(u64, u64)) {
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
                        snapshot[n] = (
                            bucket.slots[slot][0].load(Ordering::Relaxed),
                            bucket.slots[slot][1].load(Ordering::Relaxed),
                        );
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
    /// table of billions of rows).
    pub fn probe_histogram(&self) -> Vec<u64> {
        let mut hist = vec![0u64; 8];
        let stride = self.bucket_count.div_ceil(PROBE_SAMPLE_BUCKETS).max(1);
        for b in (0..self.bucket_count).step_by(stride as usize) {
            self.for_each(b, b + 1, |key, _| {
                let h = self.hash(key);
                let d = self.distance(home_bucket(h, self.bucket_mask), probe_step(h, self.bucket_mask), b);
                let i = (d as usize).min(hist.len() - 1);
                hist[i] += stride;
            });
        }
        hist
    }

    /// Clears slots without a fingerprint and drops those whose fingerprint does not
    /// match their key, that point nowhere, or that `keep` refuses; returns how many
    /// were dropped. The caller owns the bucket (exclusive access or its repair).
    fn clean_slots(&self, bucket: &Bucket, mut keep: impl FnMut(u64, u64) -> bool) -> u64 {
        let mut dropped = 0;
        for slot in 0..SLOTS_PER_BUCKET {
            let fp = bucket.fp(slot);
            let key = bucket.slots[slot][0].load(Ordering::Relaxed);
            let ptr = bucket.slots[slot][1].load(Ordering::Relaxed);
            if fp == 0 {
                if key != 0 || ptr != 0 {
                    bucket.slots[slot][0].store(0, Ordering::Relaxed);
                    bucket.slots[slot][1].store(0, Ordering::Relaxed);
                }
                continue;
            }
            if !(ptr != 0 && fingerprint(self.hash(key)) == fp && keep(key, ptr)) {
                dropped += 1;
                bucket.set_fp(slot, 0);
                bucket.slots[slot][0].store(0, Ordering::Relaxed);
                bucket.slots[slot][1].store(0, Ordering::Relaxed);
            }
        }
        dropped
    }

    /// Starts a repair on first touch (see the module docs). Only for an index a killed
    /// process left in this boot ([`opened_in_this_boot`](Self::opened_in_this_boot)):
    /// buckets are then whole except those with an odd version. Until
    /// [`finish_lazy_repair`](Self::finish_lazy_repair), [`len`](Self::len) may be off
    /// by the inserts and removes the kill cut short.
    pub fn begin_lazy_repair(&mut self) {
        let n = self.bucket_count as usize;
        // Zeroed pages from the allocator (UNCHECKED is 0); AtomicU8 has u8's layout.
        let bytes = vec![0u8; n].into_boxed_slice();
        // SAFETY: same size and alignment, and every bit pattern is a valid AtomicU8.
        let state = unsafe { Box::from_raw(Box::into_raw(bytes) as *mut [AtomicU8]) };
        self.lazy = Some(Box::new(LazyRepair {
            state,
            cursor: AtomicU64::new(0),
            counted: AtomicU64::new(0),
            delta: AtomicI64::new(0),
            buckets_interrupted: AtomicU64::new(0),
            slots_dropped: AtomicU64::new(0),
        }));
        self.repairing.store(true, Ordering::Release);
    }

    /// True while a repair on first touch runs.
    pub fn is_repairing(&self) -> bool {
        self.repairing.load(Ordering::Acquire)
    }

    /// Repairs bucket `b` unless that is done; waits while another thread repairs it.
    fn ensure_repaired(&self, lazy: &LazyRepair, b: u64) {
        let state = &lazy.state[b as usize];
        loop {
            match state.load(Ordering::Acquire) {
                DONE => return,
                UNCHECKED => {
                    if state.compare_exchange(UNCHECKED, BUSY, Ordering::Acquire, Ordering::Acquire).is_ok() {
                        self.repair_one(lazy, b);
                        state.store(DONE, Ordering::Release);
                        return;
                    }
                }
                _ => std::hint::spin_loop(),
            }
        }
    }

    /// Repairs one bucket a killed process may have left locked: an odd version means
    /// an update was cut short there; its slots are cleaned and the bucket unlocked.
    fn repair_one(&self, lazy: &LazyRepair, b: u64) {
        let bucket = self.raw_bucket(b);
        let v = bucket.version.load(Ordering::Acquire);
        if v & 1 == 0 {
            return;
        }
        let dropped = self.clean_slots(bucket, |_, _| true);
        lazy.buckets_interrupted.fetch_add(1, Ordering::Relaxed);
        lazy.slots_dropped.fetch_add(dropped, Ordering::Relaxed);
        bucket.version.store(v.wrapping_add(1), Ordering::Release);
    }

    /// A writer changed the key count of bucket `b` (it holds the bucket's lock): if the
    /// background pass already counted that bucket, the change goes into its delta.
    fn count_change(&self, b: u64, d: i64) {
        if let Some(lazy) = &self.lazy {
            if b < lazy.cursor.load(Ordering::Acquire) {
                lazy.delta.fetch_add(d, Ordering::Relaxed);
            }
        }
    }

    /// The background pass of a lazy repair over buckets `[start, end)`, which must
    /// continue where the last call stopped: repairs each bucket, counts its keys and
    /// calls `f(key, ptr)` for each, under the bucket's lock.
    pub fn repair_scan(&self, start: u64, end: u64, mut f: impl FnMut(u64, u64)) {
        let lazy = self.lazy.as_ref().expect("repair_scan without begin_lazy_repair");
        assert_eq!(start, lazy.cursor.load(Ordering::Acquire), "repair_scan must continue where it stopped");
        for b in start..end.min(self.bucket_count) {
            self.ensure_repaired(lazy, b);
            let bucket = self.raw_bucket(b);
            let v = bucket.lock();
            let mut n = 0;
            for slot in 0..SLOTS_PER_BUCKET {
                if bucket.fp(slot) != 0 {
                    n += 1;
                    f(bucket.slots[slot][0].load(Ordering::Relaxed), bucket.slots[slot][1].load(Ordering::Relaxed));
                }
            }
            lazy.counted.fetch_add(n, Ordering::Relaxed);
            lazy.cursor.store(b + 1, Ordering::Release);
            bucket.unlock(v);
        }
    }

    /// Ends a lazy repair once [`repair_scan`](Self::repair_scan) has passed every
    /// bucket: sets the exact key count. No insert or remove may run meanwhile (the
    /// table holds every writer stripe).
    pub fn finish_lazy_repair(&self) -> RecoverReport {
        let lazy = self.lazy.as_ref().expect("finish_lazy_repair without begin_lazy_repair");
        assert_eq!(lazy.cursor.load(Ordering::Acquire), self.bucket_count, "the background pass is not done");
        let keys = (lazy.counted.load(Ordering::Relaxed) as i64 + lazy.delta.load(Ordering::Relaxed)).max(0) as u64;
        self.word(format::INDEX_LEN_OFFSET).store(keys, Ordering::Relaxed);
        self.repairing.store(false, Ordering::Release);
        RecoverReport {
            buckets_interrupted: lazy.buckets_interrupted.load(Ordering::Relaxed),
            slots_dropped: lazy.slots_dropped.load(Ordering::Relaxed),
            keys,
        }
    }

    /// Repairs the index after a crash; needs exclusive access.
    ///
    /// Every bucket with an odd version (an update cut short) is unlocked, and
    /// `keep(key, ptr, interrupted)` decides for each occupied slot whether it
    /// stays: a slot whose fingerprint does not match its key is dropped.
    /// Overflow counters and the key count are then recomputed exactly.
    pub fn recover(&self, mut keep: impl FnMut(u64, u64, bool) -> bool) -> RecoverReport {
        let mut report = RecoverReport::default();
        for b in 0..self.bucket_count {
            let bucket = self.raw_bucket(b);
            let v = bucket.version.load(Ordering::Relaxed);
            let interrupted = v & 1 == 1;
            if interrupted {
                report.buckets_interrupted += 1;
                bucket.version.store(v.wrapping_add(1), Ordering::Relaxed);
            }
            bucket.overflow.store(0, Ordering::Relaxed);
            report.slots_dropped += self.clean_slots(bucket, |key, ptr| keep(key, ptr, interrupted));
        }
        // Recount overflow along each key's probe path.
        let mut keys = 0;
        for b in 0..self.bucket_count {
            let bucket = self.raw_bucket(b);
            for slot in 0..SLOTS_PER_BUCKET {
                if bucket.fp(slot) == 0 {
                    continue;
                }
                keys += 1;
                let h = self.hash(bucket.slots[slot][0].load(Ordering::Relaxed));
                let (home, step) = (home_bucket(h, self.bucket_mask), probe_step(h, self.bucket_mask));
                let mut p = home;
                while p != b {
                    self.raw_bucket(p).overflow.fetch_add(1, Ordering::Relaxed);
                    p = (p + step) & self.bucket_mask;
                }
            }
        }
        self.word(format::INDEX_LEN_OFFSET).store(keys, Ordering::Relaxed);
        report.keys = keys;
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn new_index(dir: &tempfile::TempDir, buckets: u64) -> Index {
        Index::create(&dir.path().join("i"), buckets, 99).unwrap()
    }

    #[test]
    fn fp_matching() {
        let words = [0x0000_0300_0503_0001u64, 0x0000_0000_0000_0300];
        assert_eq!(match_fp(words, 3), (1 << 2) | (1 << 5) | (1 << 9));
        assert_eq!(match_fp(words, 1), 1);
        let empty = empty_slots(words);
        assert_eq!(empty & 0b1, 0);
        assert_ne!(empty & 0b10, 0);
    }

    #[test]
    fn fills_a_tiny_index_completely() {
        let dir = tempfile::tempdir().unwrap();
        let index = new_index(&dir, 4);
        let slots = index.slot_count();
        for key in 0..slots {
            let h = index.hash(key);
            assert!(index.insert_new(key, h, key + 1), "key {key} of {slots}");
        }
        assert!(!index.insert_new(slots, index.hash(slots), 7), "a full index took one more key");
        for key in 0..slots {
            assert_eq!(index.get(key, index.hash(key)), Some(key + 1));
        }
        assert_eq!(index.len(), slots);
        // Remove everything; every overflow counter must return to zero.
        for key in 0..slots {
            assert_eq!(index.remove(key, index.hash(key)), Some(key + 1));
        }
        for b in 0..index.bucket_count() {
            assert_eq!(index.bucket(b).overflow.load(Ordering::Relaxed), 0, "bucket {b}");
        }
        assert!(index.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(u64, u64),
        Remove(u64),
        Recover,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..300u64, 1..u64::MAX).prop_map(|(k, p)| Op::Put(k, p)),
            3 => (0..300u64).prop_map(Op::Remove),
            1 => Just(Op::Recover),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        /// The index behaves as a HashMap, including after a recovery pass.
        #[test]
        fn behaves_like_a_hashmap(ops in proptest::collection::vec(op(), 1..400)) {
            let dir = tempfile::tempdir().unwrap();
            let index = new_index(&dir, 32);
            let mut model: HashMap<u64, u64> = HashMap::new();
            for (i, op) in ops.iter().enumerate() {
                match *op {
                    Op::Put(k, p) => {
                        let h = index.hash(k);
                        if index.replace(k, h, p).is_none() {
                            prop_assert!(index.insert_new(k, h, p), "step {}: insert failed", i);
                        }
                        model.insert(k, p);
                    }
                    Op::Remove(k) => {
                        prop_assert_eq!(index.remove(k, index.hash(k)), model.remove(&k), "step {}", i);
                    }
                    Op::Recover => {
                        let report = index.recover(|_, _, _| true);
                        prop_assert_eq!(report.keys, model.len() as u64);
                        prop_assert_eq!(report.slots_dropped, 0);
                    }
                }
                prop_assert_eq!(index.len(), model.len() as u64, "step {}", i);
            }
            for k in 0..300u64 {
                prop_assert_eq!(index.get(k, index.hash(k)), model.get(&k).copied(), "key {}", k);
            }
            let mut seen = HashMap::new();
            index.for_each(0, index.bucket_count(), |k, p| { seen.insert(k, p); });
            prop_assert_eq!(seen, model);
        }
    }

    #[test]
    fn reopen_keeps_keys_and_recover_unlocks_interrupted_buckets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("i");
        {
            let index = Index::create(&path, 16, 3).unwrap();
            for key in 0..100 {
                assert!(index.insert_new(key, index.hash(key), 1000 + key));
            }
            // Simulate a writer killed inside bucket 5.
            index.bucket(5).version.fetch_add(1, Ordering::Relaxed);
        }
        let index = Index::open(&path).unwrap();
        assert_eq!(index.seed(), 3);
        let report = index.recover(|key, ptr, _| ptr == 1000 + key && key != 7);
        assert_eq!(report.buckets_interrupted, 1);
        assert_eq!(report.slots_dropped, 1);
        assert_eq!(report.keys, 99);
        for key in 0..100 {
            let want = if key == 7 { None } else { Some(1000 + key) };
            assert_eq!(index.get(key, index.hash(key)), want, "key {key}");
        }
    }

    #[test]
    fn open_rejects_truncated_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("i");
        drop(Index::create(&path, 16, 3).unwrap());
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(INDEX_HEADER_BYTES as u64 + 100).unwrap();
        let err = Index::open(&path).err().unwrap();
        assert_eq!(err.kind(), ErrorKind::Recover, "{err}");
    }
}
