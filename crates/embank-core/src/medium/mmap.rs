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
use std::path::Path;
use std::sync::atomic::AtomicU64;

use memmap2::{MmapOptions, MmapRaw};

use super::alloc::RecordAlloc;
use crate::error::{io_at, Error, ErrorKind, Result};
use crate::format::{self, record_stride, DType, RowsHeader, ROWS_HEADER_BYTES, ROW_HEADER_BYTES};

/// Address space reserved per rows file (1 TiB); a table's rows cannot outgrow it.
pub const RESERVE_BYTES: u64 = 1 << 40;

pub struct MmapMedium {
    // `alloc` points into `map`: declared first so it is dropped first.
    alloc: RecordAlloc,
    map: MmapRaw,
    header: RowsHeader,
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
        // SAFETY: the word is in the header page of `map`, 8-aligned; `map` outlives `alloc`
        // (same struct, dropped after it).
        let alloc = unsafe {
            let next = map.as_ptr().add(format::ROWS_NEXT_RECORD_OFFSET) as *const AtomicU64;
            RecordAlloc::new(path, file, header.stride as u64, RESERVE_BYTES, next)?
        };
        Ok(MmapMedium { alloc, map, header })
    }

    pub fn dim(&self) -> usize {
        self.header.dim as usize
    }

    pub fn stride(&self) -> u64 {
        self.alloc.stride()
    }

    /// Turns off read-around (`MADV_RANDOM`): a page fault then reads one page instead of
    /// a window of neighbours, and the page cache keeps this file in small folios, so a
    /// row write dirties one 4 KiB page rather than a large folio. Costs about 25 % of
    /// read throughput when everything is resident (see `StoreOptions::mmap_random_access`).
    pub fn advise_random(&self) {
        if let Err(e) = self.map.advise(memmap2::Advice::Random) {
            tracing::debug!(error = %e, "madvise(MADV_RANDOM) refused for the rows mapping");
        }
    }

    /// Allocation, free list and reclamation of records.
    pub fn alloc(&self) -> &RecordAlloc {
        &self.alloc
    }

    #[inline(always)]
    fn record_ptr(&self, ptr: u64) -> *mut u8 {
        debug_assert!(ptr + self.stride() <= self.alloc.file_bytes());
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
        while off < self.stride() as usize {
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
        let used = (ROWS_HEADER_BYTES as u64 + self.alloc.next_record() * self.stride()).min(self.alloc.file_bytes());
        self.map.flush_range(0, used as usize).map_err(|e| io_at("cannot sync rows file", self.alloc.path(), e))
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
        m.alloc().allocate(3, &mut ptrs).unwrap();
        assert_eq!(ptrs.len(), 3);
        for (i, &p) in ptrs.iter().enumerate() {
            m.write_row(p, i as u64 * 10, &[i as f32; 5]);
        }
        for (i, &p) in ptrs.iter().enumerate() {
            assert_eq!(m.key_at(p), i as u64 * 10);
            assert_eq!(m.row_at(p), &[i as f32; 5]);
            assert!(m.checksum_ok(p));
            assert!(m.alloc().is_valid_ptr(p));
        }
        assert!(!m.alloc().is_valid_ptr(ptrs[2] + m.stride()));
        assert!(!m.alloc().is_valid_ptr(ptrs[0] + 1));
        m.alloc().release(vec![ptrs[1]]);
        let mut again = Vec::new();
        m.alloc().allocate(2, &mut again).unwrap();
        assert_eq!(again[0], ptrs[1], "a free record is reused first");
        assert_eq!(m.alloc().next_record(), 4);
    }

    #[test]
    fn checksum_catches_a_flipped_bit() {
        let dir = tempfile::tempdir().unwrap();
        let m = MmapMedium::create(&dir.path().join("rows.ebr"), 8, DType::F32).unwrap();
        let mut ptrs = Vec::new();
        m.alloc().allocate(1, &mut ptrs).unwrap();
        m.write_row(ptrs[0], 7, &[1.5; 8]);
        unsafe { *m.record_ptr(ptrs[0]).add(ROW_HEADER_BYTES + 3) ^= 0x10 };
        assert!(!m.checksum_ok(ptrs[0]));
    }

    #[test]
    fn grows_the_file_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.ebr");
        let n = (super::super::alloc::GROW_BYTES_MIN / record_stride(64, DType::F32) as u64) as usize + 10;
        {
            let m = MmapMedium::create(&path, 64, DType::F32).unwrap();
            let mut ptrs = Vec::new();
            m.alloc().allocate(n, &mut ptrs).unwrap();
            for (i, &p) in ptrs.iter().enumerate() {
                m.write_row(p, i as u64, &[i as f32; 64]);
            }
            m.flush().unwrap();
        }
        let m = MmapMedium::open(&path).unwrap();
        assert_eq!(m.alloc().next_record(), n as u64);
        let last = ROWS_HEADER_BYTES as u64 + (n as u64 - 1) * m.stride();
        assert_eq!(m.key_at(last), n as u64 - 1);
        assert!(m.checksum_ok(last));
    }
}
