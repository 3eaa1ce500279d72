//! Record allocation shared by both media: fixed-stride records after a
//! 4096-byte header, a bump pointer (`next record`, a word of the header that
//! lives in shared memory so it survives a killed process), a DRAM free list
//! saved at a clean close and rebuilt from the index after a crash, and
//! epoch-deferred reclamation of replaced records.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_epoch::Guard;
use parking_lot::Mutex;

use crate::error::{io_at, Error, ErrorKind, Result};
use crate::format::{self, ROWS_HEADER_BYTES};

/// Retired batches at least this large are handed to the epoch collector's shared
/// queue at once (see `retire_at`).
const RETIRE_FLUSH_RECORDS: usize = 256;

/// Smallest step a rows file grows by: a table of a few rows takes a few pages.
pub const GROW_BYTES_MIN: u64 = 64 << 10;
/// Largest step a rows file grows by.
pub const GROW_BYTES_MAX: u64 = 1 << 30;
/// A rows file grows by this share of its size (between the two bounds), so the room it
/// holds beyond its records stays under an eighth of it, and a large table grows in few
/// steps (each one `fallocate` under the grow lock).
pub const GROW_DIVISOR: u64 = 8;
const _: () = assert!(GROW_BYTES_MIN < GROW_BYTES_MAX && GROW_DIVISOR >= 2);

/// Free records, and how many retired records still wait for their grace period.
#[derive(Default)]
pub struct FreeList {
    records: Mutex<Vec<u64>>,
    pending: AtomicU64,
}

pub struct RecordAlloc {
    path: PathBuf,
    file: File,
    stride: u64,
    /// Largest the file may grow to.
    limit_bytes: u64,
    /// The `next record` word in the file's mapped header.
    next: *const AtomicU64,
    /// Records the file currently has room for.
    file_records: AtomicU64,
    grow_lock: Mutex<()>,
    free: Arc<FreeList>,
    /// True while the free list is rebuilt in the background after a crash.
    rebuilding: AtomicBool,
    rebuild: Mutex<Option<Rebuild>>,
}

/// A free list rebuilt in the background: records below `limit` (those handed out
/// before the crash) are free unless the index or a checkpoint holds them, or a
/// writer unlinked them during the rebuild (they reach the free list the usual way).
struct Rebuild {
    limit: u64,
    unlinked: Vec<u64>,
}

// SAFETY: `next` points into a shared mapping its owner keeps alive as long as this.
unsafe impl Send for RecordAlloc {}
unsafe impl Sync for RecordAlloc {}

impl RecordAlloc {
    /// `next` must point at the header's next-record word in a mapping that outlives `self`.
    pub(crate) unsafe fn new(
        path: &Path,
        file: File,
        stride: u64,
        limit_bytes: u64,
        next: *const AtomicU64,
    ) -> Result<RecordAlloc> {
        let len = file.metadata().map_err(|e| io_at("cannot stat rows file", path, e))?.len();
        let alloc = RecordAlloc {
            path: path.to_owned(),
            file,
            stride,
            limit_bytes,
            next,
            file_records: AtomicU64::new(len.saturating_sub(ROWS_HEADER_BYTES as u64) / stride),
            grow_lock: Mutex::new(()),
            free: Arc::new(FreeList::default()),
            rebuilding: AtomicBool::new(false),
            rebuild: Mutex::new(None),
        };
        let next = alloc.next_record();
        if next > alloc.file_records.load(Ordering::Relaxed) {
            return Err(Error::new(
                ErrorKind::Recover,
                format!(
                    "rows file holds {} records but {next} were handed out",
                    alloc.file_records.load(Ordering::Relaxed)
                ),
            )
            .context(path.display().to_string()));
        }
        Ok(alloc)
    }

    /// The rows file.
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn stride(&self) -> u64 {
        self.stride
    }

    fn next_word(&self) -> &AtomicU64 {
        // SAFETY: see `new`.
        unsafe { &*self.next }
    }

    /// Records handed out so far (live, free, or retired).
    pub fn next_record(&self) -> u64 {
        self.next_word().load(Ordering::Acquire)
    }

    pub fn free_records(&self) -> u64 {
        self.free.records.lock().len() as u64
    }

    /// Retired records still waiting for readers to move on.
    pub fn pending_records(&self) -> u64 {
        self.free.pending.load(Ordering::Acquire)
    }

    pub fn file_bytes(&self) -> u64 {
        ROWS_HEADER_BYTES as u64 + self.file_records.load(Ordering::Acquire) * self.stride
    }

    #[inline(always)]
    pub fn ptr_of(&self, record: u64) -> u64 {
        ROWS_HEADER_BYTES as u64 + record * self.stride
    }

    #[inline(always)]
    pub fn record_of(&self, ptr: u64) -> u64 {
        (ptr - ROWS_HEADER_BYTES as u64) / self.stride
    }

    /// True when `ptr` names a record that has been handed out.
    pub fn is_valid_ptr(&self, ptr: u64) -> bool {
        ptr >= ROWS_HEADER_BYTES as u64
            && (ptr - ROWS_HEADER_BYTES as u64).is_multiple_of(self.stride)
            && self.record_of(ptr) < self.next_record()
    }

    /// Hands out `n` fresh records, reusing free ones first.
    pub fn allocate(&self, n: usize, out: &mut Vec<u64>) -> Result<()> {
        out.clear();
        {
            let mut free = self.free.records.lock();
            let take = n.min(free.len());
            let start = free.len() - take;
            out.extend(free.drain(start..).map(|r| self.ptr_of(r)));
        }
        let rest = (n - out.len()) as u64;
        if rest > 0 {
            // The file is grown to hold the records before the bump pointer moves past them,
            // so the pointer never names records the file lacks (a full disk fails the grow
            // and leaves the pointer where it was).
            let mut first = self.next_word().load(Ordering::Acquire);
            loop {
                if let Err(e) = self.ensure_records(first + rest) {
                    // Hand back what was taken from the free list.
                    self.release(std::mem::take(out));
                    return Err(e);
                }
                match self.next_word().compare_exchange_weak(first, first + rest, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break,
                    Err(now) => first = now,
                }
            }
            out.extend((first..first + rest).map(|r| self.ptr_of(r)));
        }
        Ok(())
    }

    fn ensure_records(&self, records: u64) -> Result<()> {
        if records <= self.file_records.load(Ordering::Acquire) {
            return Ok(());
        }
        let _g = self.grow_lock.lock();
        let have = self.file_records.load(Ordering::Acquire);
        if records <= have {
            return Ok(());
        }
        let had = ROWS_HEADER_BYTES as u64 + have * self.stride;
        let grow_bytes = (had / GROW_DIVISOR).clamp(GROW_BYTES_MIN, GROW_BYTES_MAX);
        // The index names a row by a 32-bit number (`format::RowUnits`).
        let rows_max = crate::format::RowUnits::ROWS_MAX;
        if records > rows_max {
            return Err(Error::new(
                ErrorKind::TableFull,
                format!("rows file {} holds {rows_max} rows, the most one table of a store holds: shard the table over more stores", self.path.display()),
            ));
        }
        let want = records.max(have + (grow_bytes / self.stride).max(1)).min(rows_max);
        let bytes = ROWS_HEADER_BYTES as u64 + want * self.stride;
        if bytes > self.limit_bytes {
            return Err(Error::new(
                ErrorKind::TableFull,
                format!("rows file {} reached its limit of {} bytes", self.path.display(), self.limit_bytes),
            ));
        }
        crate::fsutil::allocate(&self.file, &self.path, had, bytes)?;
        self.file_records.store(want, Ordering::Release);
        Ok(())
    }

    /// Returns never-published records to the free list at once.
    pub fn release(&self, ptrs: Vec<u64>) {
        if ptrs.is_empty() {
            return;
        }
        let mut free = self.free.records.lock();
        free.extend(ptrs.into_iter().map(|p| self.record_of(p)));
    }

    /// Frees records that readers may still see, once every reader pinned now has moved on.
    /// They are reused first (the free list is a stack: just-replaced records are likely
    /// still in the CPU cache).
    pub fn retire(&self, guard: &Guard, ptrs: Vec<u64>) {
        self.retire_at(guard, ptrs, false)
    }

    /// Like [`retire`](Self::retire), but the records are reused last: records a checkpoint
    /// held for a long time are cold, and writing into them first would evict hot rows.
    pub fn retire_cold(&self, guard: &Guard, ptrs: Vec<u64>) {
        self.retire_at(guard, ptrs, true)
    }

    fn retire_at(&self, guard: &Guard, ptrs: Vec<u64>, cold: bool) {
        if ptrs.is_empty() {
            return;
        }
        let records: Vec<u64> = ptrs.into_iter().map(|p| self.record_of(p)).collect();
        let large = records.len() >= RETIRE_FLUSH_RECORDS;
        let free = Arc::clone(&self.free);
        free.pending.fetch_add(records.len() as u64, Ordering::AcqRel);
        guard.defer(move || {
            let n = records.len() as u64;
            let mut list = free.records.lock();
            if cold {
                list.splice(0..0, records);
            } else {
                list.extend(records);
            }
            drop(list);
            free.pending.fetch_sub(n, Ordering::AcqRel);
        });
        if large {
            // A thread's deferred frees wait in its own bag until 64 of them fill it: a
            // thread that retires rarely (the one dropping a checkpoint's held records, a
            // quiet connection) would keep large batches from the free list for minutes
            // while writers grow the file. Hand them to the shared queue now.
            guard.flush();
        }
    }

    /// Waits (bounded) until retired records have reached the free list.
    pub fn drain_retired(&self) {
        for _ in 0..10_000 {
            if self.pending_records() == 0 {
                return;
            }
            crossbeam_epoch::pin().flush();
            std::thread::yield_now();
        }
        tracing::warn!(
            pending = self.pending_records(),
            "retired rows still pending at close; they are reclaimed at the next recovery"
        );
    }

    fn free_path(&self) -> PathBuf {
        self.path.with_extension("free")
    }

    /// Saves the free list (after draining retired records) for the next clean open.
    pub fn save_free_list(&self, generation: u64) -> Result<()> {
        self.drain_retired();
        let records = self.free.records.lock().clone();
        let bytes = format::encode_free_list(generation, &records);
        crate::fsutil::write_atomic(&self.free_path(), &bytes)
    }

    /// Loads the free list saved at a clean close; false if it is missing, stale or damaged.
    pub fn load_free_list(&self, generation: u64) -> bool {
        let Ok(bytes) = std::fs::read(self.free_path()) else { return false };
        match format::decode_free_list(&bytes) {
            Ok((g, records)) if g == generation && records.iter().all(|&r| r < self.next_record()) => {
                *self.free.records.lock() = records;
                true
            }
            Ok(_) => false,
            Err(e) => {
                tracing::warn!(path = %self.free_path().display(), error = %e, "ignoring damaged free list");
                false
            }
        }
    }

    /// Rebuilds the free list: every handed-out record not in `live` (bitmap by record) is free.
    pub fn rebuild_free_list(&self, live: &[u64]) {
        let next = self.next_record();
        let mut free = self.free.records.lock();
        free.clear();
        for r in (0..next).rev() {
            if live[(r / 64) as usize] & (1 << (r % 64)) == 0 {
                free.push(r);
            }
        }
    }

    /// Starts rebuilding the free list in the background: until
    /// [`finish_rebuild`](Self::finish_rebuild), writers take fresh records (or ones
    /// retired meanwhile) and report every record they unlink
    /// ([`note_unlinked`](Self::note_unlinked)). Returns the records a live bitmap must
    /// cover.
    pub fn begin_rebuild(&self) -> u64 {
        // A free list loaded at open is not used: the rebuild finds every free record.
        self.free.records.lock().clear();
        let limit = self.next_record();
        *self.rebuild.lock() = Some(Rebuild { limit, unlinked: vec![0; limit.div_ceil(64) as usize] });
        self.rebuilding.store(true, Ordering::Release);
        limit
    }

    /// A writer took `ptr` out of the index (it is held or retired): during a background
    /// rebuild it must not also be found free.
    #[inline]
    pub fn note_unlinked(&self, ptr: u64) {
        if self.rebuilding.load(Ordering::Acquire) {
            if let Some(r) = self.rebuild.lock().as_mut() {
                let rec = self.record_of(ptr);
                if rec < r.limit {
                    r.unlinked[(rec / 64) as usize] |= 1 << (rec % 64);
                }
            }
        }
    }

    /// Ends a background rebuild: every record below the limit that is neither in `live`
    /// (the index and the checkpoints, as the background pass saw them) nor unlinked
    /// since becomes free. No writer may publish meanwhile (the table holds every writer
    /// stripe). Returns the records freed.
    pub fn finish_rebuild(&self, live: &[u64]) -> u64 {
        let Some(r) = self.rebuild.lock().take() else { return 0 };
        self.rebuilding.store(false, Ordering::Release);
        let mut free = self.free.records.lock();
        let before = free.len();
        for rec in (0..r.limit).rev() {
            let (w, bit) = ((rec / 64) as usize, 1u64 << (rec % 64));
            if live[w] & bit == 0 && r.unlinked[w] & bit == 0 {
                free.push(rec);
            }
        }
        strict_assert!(
            {
                let mut all = free.clone();
                all.sort_unstable();
                all.windows(2).all(|w| w[0] != w[1])
            },
            "a record is on the free list twice after the background rebuild"
        );
        (free.len() - before) as u64
    }

    /// Sets the bit of `ptr`'s record if it lies below `limit` (records handed out after
    /// a background rebuild began are not its business).
    pub fn mark_below(&self, bitmap: &mut [u64], limit: u64, ptr: u64) {
        let r = self.record_of(ptr);
        if r < limit {
            bitmap[(r / 64) as usize] |= 1 << (r % 64);
        }
    }

    /// Bitmap sized for every handed-out record.
    pub fn new_bitmap(&self) -> Vec<u64> {
        vec![0u64; self.next_record().div_ceil(64) as usize]
    }

    /// Sets the bit of `ptr`'s record.
    pub fn mark(&self, bitmap: &mut [u64], ptr: u64) {
        let r = self.record_of(ptr);
        bitmap[(r / 64) as usize] |= 1 << (r % 64);
    }
}
