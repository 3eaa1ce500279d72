//! The mmap medium: fixed-size row records in one mapped file.
//!
//! Layout: a 4096-byte header ([`RowsHeader`]), then records of `stride`
//! bytes: `key u64 | crc32c u32 | flags u32 | dim elements`. A row pointer is
//! the byte offset of its record. Records `[0, next_record)` have been handed
//! out; the rest of the file is spare room. Free records below `next_record`
//! sit in a DRAM free list, saved to `rows.free` at a clean close and rebuilt
//! from the index after a crash.
//!
//! The mapping reserves address space for [`RESERVE_BYTES`] up front and the
//! file grows under it with `ftruncate`, so growing never moves a row a
//! reader may be copying.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_epoch::Guard;
use memmap2::{MmapOptions, MmapRaw};
use parking_lot::Mutex;

use crate::error::{io_at, Error, ErrorKind, Result};
use crate::format::{self, record_stride, DType, RowsHeader, ROWS_HEADER_BYTES, ROW_HEADER_BYTES};

/// Address space reserved per rows file (1 TiB); a table's rows cannot outgrow it.
pub const RESERVE_BYTES: u64 = 1 << 40;
/// Smallest step the file grows by.
pub const GROW_BYTES_MIN: u64 = 16 << 20;

/// Free records, and how many retired records still wait for their grace period.
#[derive(Default)]
pub struct FreeList {
    records: Mutex<Vec<u64>>,
    pending: AtomicU64,
}

pub struct MmapMedium {
    path: PathBuf,
    file: File,
    map: MmapRaw,
    header: RowsHeader,
    stride: u64,
    /// Records the file currently has room for.
    file_records: AtomicU64,
    grow_lock: Mutex<()>,
    free: Arc<FreeList>,
}

// SAFETY: the mapping is shared memory; records are written only by the
// writer that allocated them before they are published, and read after.
unsafe impl Send for MmapMedium {}
unsafe impl Sync for MmapMedium {}

impl MmapMedium {
    pub fn create(path: &Path, dim: u32, dtype: DType) -> Result<MmapMedium> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| io_at("cannot create rows file", path, e))?;
        let header = RowsHeader { dim, dtype, stride: record_stride(dim, dtype) };
        let mut first = vec![0u8; ROWS_HEADER_BYTES];
        header.write(&mut first);
        (&file).write_all(&first).map_err(|e| io_at("cannot write rows header", path, e))?;
        Self::map(path, file, header)
    }

    pub fn open(path: &Path) -> Result<MmapMedium> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| io_at("cannot open rows file", path, e))?;
        let mut first = vec![0u8; ROWS_HEADER_BYTES];
        use std::io::Read;
        (&file).read_exact(&mut first).map_err(|e| {
            Error::new(ErrorKind::Recover, "rows file is shorter than its header")
                .with_source(e)
                .context(path.display().to_string())
        })?;
        let header = RowsHeader::read(&first).map_err(|e| e.context(path.display().to_string()))?;
        Self::map(path, file, header)
    }

    fn map(path: &Path, file: File, header: RowsHeader) -> Result<MmapMedium> {
        let len = file.metadata().map_err(|e| io_at("cannot stat rows file", path, e))?.len();
        if len > RESERVE_BYTES {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("rows file of {len} bytes exceeds the 1 TiB reservation"),
            ));
        }
        let map = MmapOptions::new()
            .len(RESERVE_BYTES as usize)
            .map_raw(&file)
            .map_err(|e| io_at("cannot map rows file", path, e))?;
        let stride = header.stride as u64;
        let medium = MmapMedium {
            path: path.to_owned(),
            file,
            map,
            header,
            stride,
            file_records: AtomicU64::new(len.saturating_sub(ROWS_HEADER_BYTES as u64) / stride),
            grow_lock: Mutex::new(()),
            free: Arc::new(FreeList::default()),
        };
        let next = medium.next_record();
        if next > medium.file_records.load(Ordering::Relaxed) {
            return Err(Error::new(
                ErrorKind::Recover,
                format!(
                    "rows file holds {} records but {next} were handed out",
                    medium.file_records.load(Ordering::Relaxed)
                ),
            )
            .context(path.display().to_string()));
        }
        Ok(medium)
    }

    pub fn dim(&self) -> usize {
        self.header.dim as usize
    }

    pub fn stride(&self) -> u64 {
        self.stride
    }

    fn next_record_word(&self) -> &AtomicU64 {
        // SAFETY: inside the header page, 8-aligned.
        unsafe { &*(self.map.as_ptr().add(format::ROWS_NEXT_RECORD_OFFSET) as *const AtomicU64) }
    }

    /// Records handed out so far (live, free, or retired).
    pub fn next_record(&self) -> u64 {
        self.next_record_word().load(Ordering::Acquire)
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
    fn ptr_of(&self, record: u64) -> u64 {
        ROWS_HEADER_BYTES as u64 + record * self.stride
    }

    #[inline(always)]
    fn record_of(&self, ptr: u64) -> u64 {
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
            let first = self.next_record_word().fetch_add(rest, Ordering::AcqRel);
            if let Err(e) = self.ensure_records(first + rest) {
                // Hand back what was taken from the free list; the bumped range stays leaked
                // until the next recovery scan (the file could not grow anyway).
                self.release(std::mem::take(out));
                return Err(e);
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
        let grow_records = (GROW_BYTES_MIN / self.stride).max(have / 4).max(1);
        let want = records.max(have + grow_records);
        let bytes = ROWS_HEADER_BYTES as u64 + want * self.stride;
        if bytes > RESERVE_BYTES {
            return Err(Error::new(ErrorKind::TableFull, "rows file reached its 1 TiB reservation"));
        }
        self.file.set_len(bytes).map_err(|e| io_at("cannot grow rows file", &self.path, e))?;
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
    pub fn retire(&self, guard: &Guard, ptrs: Vec<u64>) {
        if ptrs.is_empty() {
            return;
        }
        let records: Vec<u64> = ptrs.into_iter().map(|p| self.record_of(p)).collect();
        let free = Arc::clone(&self.free);
        free.pending.fetch_add(records.len() as u64, Ordering::AcqRel);
        guard.defer(move || {
            let n = records.len() as u64;
            free.records.lock().extend(records);
            free.pending.fetch_sub(n, Ordering::AcqRel);
        });
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

    #[inline(always)]
    fn record_ptr(&self, ptr: u64) -> *mut u8 {
        debug_assert!(ptr + self.stride <= self.file_bytes());
        // SAFETY: callers pass pointers of handed-out records, all inside the file.
        unsafe { self.map.as_mut_ptr().add(ptr as usize) }
    }

    /// Writes a record. `ptr` must come from [`allocate`](Self::allocate) and not be published yet.
    #[inline]
    pub fn write_row(&self, ptr: u64, key: u64, row: &[f32]) {
        debug_assert_eq!(row.len(), self.dim());
        let p = self.record_ptr(ptr);
        // SAFETY: the record is ours alone until published; it holds the header and dim elements.
        unsafe {
            let data = std::slice::from_raw_parts(row.as_ptr() as *const u8, std::mem::size_of_val(row));
            let mut crc = crc32c::crc32c(&key.to_le_bytes());
            crc = crc32c::crc32c_append(crc, data);
            (p as *mut u64).write(key.to_le());
            (p.add(8) as *mut u32).write(crc.to_le());
            (p.add(12) as *mut u32).write(0);
            std::ptr::copy_nonoverlapping(data.as_ptr(), p.add(ROW_HEADER_BYTES), data.len());
        }
    }

    /// Key stored in a record.
    #[inline(always)]
    pub fn key_at(&self, ptr: u64) -> u64 {
        // SAFETY: a handed-out record inside the file.
        unsafe { u64::from_le((self.record_ptr(ptr) as *const u64).read()) }
    }

    /// Elements of a published record.
    #[inline(always)]
    pub fn row_at(&self, ptr: u64) -> &[f32] {
        // SAFETY: a published record is immutable until reclaimed, and the caller's
        // epoch guard keeps it from being reclaimed.
        unsafe { std::slice::from_raw_parts(self.record_ptr(ptr).add(ROW_HEADER_BYTES) as *const f32, self.dim()) }
    }

    /// Hints the CPU to load a record.
    #[inline(always)]
    pub fn prefetch(&self, ptr: u64) {
        let p = self.record_ptr(ptr);
        let mut off = 0;
        while off < self.stride as usize {
            // SAFETY: within the record.
            crate::prefetch::prefetch_read(unsafe { p.add(off) });
            off += 64;
        }
    }

    /// True when the record's checksum matches its key and elements.
    pub fn checksum_ok(&self, ptr: u64) -> bool {
        let p = self.record_ptr(ptr);
        // SAFETY: a handed-out record.
        unsafe {
            let stored = u32::from_le((p.add(8) as *const u32).read());
            let mut crc = crc32c::crc32c(std::slice::from_raw_parts(p, 8));
            crc = crc32c::crc32c_append(crc, std::slice::from_raw_parts(p.add(ROW_HEADER_BYTES), self.dim() * 4));
            crc == stored
        }
    }

    /// Writes every record handed out so far and the header to the file (msync).
    pub fn flush(&self) -> Result<()> {
        let used = (ROWS_HEADER_BYTES as u64 + self.next_record() * self.stride).min(self.file_bytes());
        self.map.flush_range(0, used as usize).map_err(|e| io_at("cannot sync rows file", &self.path, e))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_write_read_reuse() {
        let dir = tempfile::tempdir().unwrap();
        let m = MmapMedium::create(&dir.path().join("rows.ebr"), 5, DType::F32).unwrap();
        let mut ptrs = Vec::new();
        m.allocate(3, &mut ptrs).unwrap();
        assert_eq!(ptrs.len(), 3);
        for (i, &p) in ptrs.iter().enumerate() {
            m.write_row(p, i as u64 * 10, &[i as f32; 5]);
        }
        for (i, &p) in ptrs.iter().enumerate() {
            assert_eq!(m.key_at(p), i as u64 * 10);
            assert_eq!(m.row_at(p), &[i as f32; 5]);
            assert!(m.checksum_ok(p));
            assert!(m.is_valid_ptr(p));
        }
        assert!(!m.is_valid_ptr(ptrs[2] + m.stride()));
        assert!(!m.is_valid_ptr(ptrs[0] + 1));
        m.release(vec![ptrs[1]]);
        let mut again = Vec::new();
        m.allocate(2, &mut again).unwrap();
        assert_eq!(again[0], ptrs[1], "a free record is reused first");
        assert_eq!(m.next_record(), 4);
    }

    #[test]
    fn checksum_catches_a_flipped_bit() {
        let dir = tempfile::tempdir().unwrap();
        let m = MmapMedium::create(&dir.path().join("rows.ebr"), 8, DType::F32).unwrap();
        let mut ptrs = Vec::new();
        m.allocate(1, &mut ptrs).unwrap();
        m.write_row(ptrs[0], 7, &[1.5; 8]);
        unsafe { *m.record_ptr(ptrs[0]).add(ROW_HEADER_BYTES + 3) ^= 0x10 };
        assert!(!m.checksum_ok(ptrs[0]));
    }

    #[test]
    fn grows_the_file_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.ebr");
        let n = (GROW_BYTES_MIN / record_stride(64, DType::F32) as u64) as usize + 10;
        {
            let m = MmapMedium::create(&path, 64, DType::F32).unwrap();
            let mut ptrs = Vec::new();
            m.allocate(n, &mut ptrs).unwrap();
            for (i, &p) in ptrs.iter().enumerate() {
                m.write_row(p, i as u64, &[i as f32; 64]);
            }
            m.flush().unwrap();
        }
        let m = MmapMedium::open(&path).unwrap();
        assert_eq!(m.next_record(), n as u64);
        let last = ROWS_HEADER_BYTES as u64 + (n as u64 - 1) * m.stride();
        assert_eq!(m.key_at(last), n as u64 - 1);
        assert!(m.checksum_ok(last));
    }
}
