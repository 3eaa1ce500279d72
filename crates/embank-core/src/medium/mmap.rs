//! The mmap medium: fixed-size row records in one mapped file.
//!
//! Layout: a 4096-byte header ([`RowsHeader`]), then records of `stride`
//! bytes: `key u64 | crc32c u32 | flags u32 | dim elements`. A row pointer is
//! the byte offset of its record. Records `[0, next_record)` have been handed
//! out; the rest of the file is spare room. Free records below `next_record`
//! sit in a DRAM free list, saved to `rows.free` at a clean close and rebuilt
//! from the index after a crash.
//!
//! The mapping reserves address space for [`RESERVE_BYTES`] up front (less where the
//! process may not, see [`reserve`]) and the file grows under it with `ftruncate`, so
//! growing never moves a row a reader may be copying.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use super::alloc::RecordAlloc;
use super::codec::RecordCodec;
use super::mapped::Mapped;
use super::ReadItem;
use crate::error::{io_at, Error, ErrorKind, Result};
use crate::format::{self, record_stride, RowsHeader, ROWS_HEADER_BYTES};
use crate::layout::RecordLayout;

/// Address space reserved per rows file (1 TiB); a table's rows cannot outgrow it.
pub const RESERVE_BYTES: u64 = 1 << 40;

/// Smallest reservation [`reserve`] falls back to (or twice the file, if larger).
const RESERVE_BYTES_MIN: u64 = 1 << 30;

/// Maps `file` with [`RESERVE_BYTES`] of address space, or, where the process may not
/// reserve that much (a `ulimit -v`, an instrumenting tool such as valgrind), the most
/// it can of halving steps down to twice the file's length (at least 1 GiB), with a
/// warning: the rows file then cannot grow past that reservation (the allocator says so
/// when it is reached). Returns the mapping and the bytes reserved.
fn reserve(path: &Path, file: &File, len: u64) -> Result<(MmapRaw, u64)> {
    let floor = len.saturating_mul(2).clamp(RESERVE_BYTES_MIN, RESERVE_BYTES);
    let mut bytes = RESERVE_BYTES;
    loop {
        match MmapOptions::new().len(bytes as usize).map_raw(file) {
            Ok(map) => {
                if bytes < RESERVE_BYTES {
                    tracing::warn!(
                        path = %path.display(),
                        reserved_bytes = bytes,
                        "the rows mapping reserves less address space than 1 TiB (the process's address \
                         space is limited: ulimit -v, or a tool like valgrind); the rows file cannot grow past it"
                    );
                }
                return Ok((map, bytes));
            }
            Err(e) if bytes / 2 >= floor => {
                tracing::debug!(error = %e, bytes, "rows mapping refused; trying half");
                bytes /= 2;
            }
            Err(e) => return Err(io_at("cannot map rows file", path, e)),
        }
    }
}

pub struct MmapMedium {
    // `alloc` points into `map`: declared first so it is dropped first.
    alloc: RecordAlloc,
    map: MmapRaw,
    codec: RecordCodec,
    /// [`RowWrites::File`]: records go to the file by `pwrite`, not through the mapping.
    by_file: AtomicBool,
}

// SAFETY: the mapping is shared memory; records are written only by the
// writer that allocated them before they are published, and read after.
unsafe impl Send for MmapMedium {}
unsafe impl Sync for MmapMedium {}

/// How many records ahead [`MmapMedium::write`] prefetches the one it will write.
const WRITE_PREFETCH_AHEAD: usize = 8;

/// The most [`RowWrites::File`](super::RowWrites::File) writes in one `pwrite`, aligned:
/// one small page, so the page cache keeps the file in small folios.
const PAGE: u64 = 4096;

impl MmapMedium {
    pub fn create(path: &Path, layout: RecordLayout) -> Result<MmapMedium> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| io_at("cannot create rows file", path, e))?;
        let elems = layout.elems() as u32;
        let header =
            RowsHeader { dim: elems, dtype: layout.dtype, stride: record_stride(layout.payload_bytes(), layout.dtype) };
        let mut first = vec![0u8; ROWS_HEADER_BYTES];
        header.write(&mut first);
        (&file).write_all(&first).map_err(|e| io_at("cannot write rows header", path, e))?;
        Self::map(path, file, header, layout)
    }

    /// Opens a rows file; its header must describe records of `layout`.
    pub fn open(path: &Path, layout: RecordLayout) -> Result<MmapMedium> {
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
        super::check_header(path, &header, &layout)?;
        Self::map(path, file, header, layout)
    }

    fn map(path: &Path, file: File, header: RowsHeader, layout: RecordLayout) -> Result<MmapMedium> {
        let len = file.metadata().map_err(|e| io_at("cannot stat rows file", path, e))?.len();
        if len > RESERVE_BYTES {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("rows file of {len} bytes exceeds the 1 TiB reservation"),
            ));
        }
        let (map, reserved) = reserve(path, &file, len)?;
        // SAFETY: the word is in the header page of `map`, 8-aligned; `map` outlives `alloc`
        // (same struct, dropped after it).
        let alloc = unsafe {
            let next = map.as_ptr().add(format::ROWS_NEXT_RECORD_OFFSET) as *const AtomicU64;
            RecordAlloc::new(path, file, header.stride as u64, reserved, next)?
        };
        Ok(MmapMedium { alloc, map, codec: RecordCodec::new(layout), by_file: AtomicBool::new(false) })
    }

    #[inline(always)]
    pub fn layout(&self) -> &RecordLayout {
        self.codec.layout()
    }

    pub fn stride(&self) -> u64 {
        self.alloc.stride()
    }

    /// Advises the kernel how to page the rows. `Random` turns off read-around: a page
    /// fault then reads one page instead of a window of neighbours, and the page cache
    /// keeps this file in small folios, so a row write dirties one 4 KiB page rather than
    /// a large folio (costs about 25 % of read throughput when everything is resident).
    /// `Huge` asks for 2 MiB mappings (see `StoreOptions::huge_pages`).
    pub fn advise(&self, advice: super::MapAdvice) {
        if let Some(a) = advice.advice() {
            if let Err(e) = self.map.advise(a) {
                tracing::debug!(error = %e, ?a, "madvise refused for the rows mapping");
            }
        }
    }

    /// How [`write`](Self::write) writes records (see [`RowWrites`]).
    pub fn set_row_writes(&self, writes: super::RowWrites) {
        self.by_file.store(writes == super::RowWrites::File, Ordering::Relaxed);
    }

    /// Allocation, free list and reclamation of records.
    pub fn alloc(&self) -> &RecordAlloc {
        &self.alloc
    }

    /// The records as memory (the fast path's view).
    #[inline(always)]
    pub fn mapped(&self) -> Mapped<'_> {
        // SAFETY: the mapping reserves the allocator's limit, which holds every record
        // the allocator hands out, and lives as long as `self`.
        unsafe { Mapped::new(self.map.as_mut_ptr(), &self.codec, &self.alloc) }
    }

    #[inline(always)]
    fn record_ptr(&self, ptr: u64) -> *mut u8 {
        self.mapped().record_ptr(ptr)
    }

    /// The bytes of a handed-out record (header and payload).
    #[inline(always)]
    fn record(&self, ptr: u64) -> &[u8] {
        self.mapped().record(ptr)
    }

    /// Writes a record. `ptr` must come from the allocator and not be published yet (the
    /// tests'; the medium's writes go through `Medium::write`).
    #[cfg(test)]
    pub fn write_row(&self, ptr: u64, key: u64, record: &[f32]) {
        // SAFETY: the record is ours alone until published; it holds header and payload.
        let out = unsafe { std::slice::from_raw_parts_mut(self.record_ptr(ptr), self.codec.record_bytes()) };
        self.codec.encode(out, key, record);
    }

    /// Key stored in a record.
    #[inline(always)]
    pub fn key_at(&self, ptr: u64) -> u64 {
        self.mapped().key_at(ptr)
    }

    /// Decodes a published record (row and optimizer state) into `out`.
    #[inline(always)]
    pub fn read_into(&self, ptr: u64, out: &mut [f32]) {
        self.mapped().read_into(ptr, out)
    }

    /// Hints the CPU to fetch a record's lines for writing.
    #[inline(always)]
    fn prefetch_for_write(&self, ptr: u64) {
        self.mapped().each_line(ptr, crate::prefetch::prefetch_write)
    }

    /// True when the record's checksum matches its key and payload.
    pub fn checksum_ok(&self, ptr: u64) -> bool {
        self.mapped().checksum_ok(ptr)
    }

    /// Checks that the record at `ptr` holds `key` (and, with `checksum`, its checksum).
    pub fn verify(&self, ptr: u64, key: u64, checksum: bool) -> Result<()> {
        self.codec.verify(self.record(ptr), key, ptr, checksum, &|| self.alloc.path().display().to_string())
    }

    /// Copies records into `out` (`pos * elems` each), checking each record's key.
    pub fn read(&self, items: &[ReadItem], out: &mut [f32]) -> Result<()> {
        let w = self.layout().elems();
        for it in items {
            self.verify(it.ptr, it.key, false)?;
            self.read_into(it.ptr, &mut out[it.pos * w..(it.pos + 1) * w]);
        }
        Ok(())
    }

    /// Writes unpublished records `(key, ptr, record)`.
    pub fn write(&self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        if self.by_file.load(Ordering::Relaxed) {
            return self.write_through_file(items);
        }
        let bytes = self.codec.record_bytes();
        self.codec.encode_each(items.iter().enumerate().map(|(i, &(key, ptr, record))| {
            // Fresh records are often cold (a free one long unused): ask for the lines of
            // a record a few ahead, so the misses overlap instead of stalling each copy.
            if let Some(&(_, ahead, _)) = items.get(i + WRITE_PREFETCH_AHEAD) {
                self.prefetch_for_write(ahead);
            }
            // SAFETY: the record is ours alone until published (the allocator handed it
            // out once, so the batch's records are distinct); it holds header and payload.
            (unsafe { std::slice::from_raw_parts_mut(self.record_ptr(ptr), bytes) }, key, record)
        }));
        Ok(())
    }

    /// [`write`](Self::write) through the file rather than the mapping: the records are
    /// encoded into a buffer in file order (as the block medium does) and each run of
    /// adjacent records, padding included, goes to the file by `pwrite`, a page at a time.
    /// A page this process only reads is mapped read-only, so the kernel's write-back
    /// cleans it without write-protecting a mapping (and without a TLB shootdown to every
    /// core that runs this process).
    fn write_through_file(&self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        self.write_file_runs(items, false)
    }

    /// A bulk load's records (`Medium::write_bulk`): through the file, as
    /// [`RowWrites::File`](super::RowWrites::File) writes them, each run's write-back
    /// started at once, so a load of many gigabytes neither faults a page at a time
    /// through the mapping nor waits on the kernel's dirty-page throttle.
    pub fn write_bulk(&self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        self.write_file_runs(items, true)
    }

    /// A bulk load's bytes `[from, to)` of the file are written: waits for them to reach
    /// the disk and drops them from the page cache (`Medium::drop_written`).
    pub fn drop_written(&self, from: u64, to: u64) -> Result<()> {
        use std::os::fd::AsRawFd;
        if to <= from {
            return Ok(());
        }
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        self.sync_range(from, to - from, flags)?;
        let fd = self.alloc.file().as_raw_fd();
        // Advice only: a refusal costs memory, not correctness.
        // SAFETY: a plain syscall on our open file.
        let _ = unsafe {
            libc::posix_fadvise(fd, from as libc::off_t, (to - from) as libc::off_t, libc::POSIX_FADV_DONTNEED)
        };
        Ok(())
    }

    /// `sync_file_range` of `len` bytes at `offset` of the rows file with `flags`.
    fn sync_range(&self, offset: u64, len: u64, flags: libc::c_uint) -> Result<()> {
        use std::os::fd::AsRawFd;
        let fd = self.alloc.file().as_raw_fd();
        // SAFETY: a plain syscall on our open file; it writes back, it changes nothing.
        let rc = unsafe { libc::sync_file_range(fd, offset as libc::off64_t, len as libc::off64_t, flags) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(io_at("cannot write rows back", self.alloc.path(), e));
        }
        Ok(())
    }

    fn write_file_runs(&self, items: &[(u64, u64, &[f32])], start_writeback: bool) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let stride = self.stride() as usize;
        let mut buf = vec![0u8; items.len() * stride];
        let ptrs = super::encode_in_file_order(&self.codec, items, stride, &mut buf);
        for req in super::merged_requests(&ptrs, stride, buf.as_mut_ptr()) {
            // SAFETY: each request lies in `buf`, which outlives the loop.
            let mut run = unsafe { std::slice::from_raw_parts(req.buf as *const u8, req.len) };
            // One page at a time: a longer write makes the page cache hold the file in
            // large folios, and every later small write walks all of a folio's blocks.
            let mut at = req.offset;
            while !run.is_empty() {
                let n = (PAGE - at % PAGE).min(run.len() as u64) as usize;
                self.alloc
                    .file()
                    .write_all_at(&run[..n], at)
                    .map_err(|e| io_at("cannot write rows", self.alloc.path(), e))?;
                run = &run[n..];
                at += n as u64;
            }
            if start_writeback {
                self.sync_range(req.offset, req.len as u64, libc::SYNC_FILE_RANGE_WRITE)?;
            }
        }
        Ok(())
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
    use crate::format::{DType, ROW_HEADER_BYTES};

    fn f32s(dim: usize) -> RecordLayout {
        RecordLayout::new(dim, 0, DType::F32)
    }

    fn row_at(m: &MmapMedium, ptr: u64) -> Vec<f32> {
        let mut v = vec![0f32; m.layout().elems()];
        m.read_into(ptr, &mut v);
        v
    }

    #[test]
    fn allocate_write_read_reuse() {
        let dir = tempfile::tempdir().unwrap();
        let m = MmapMedium::create(&dir.path().join("rows.ebr"), f32s(5)).unwrap();
        let mut ptrs = Vec::new();
        m.alloc().allocate(3, &mut ptrs).unwrap();
        assert_eq!(ptrs.len(), 3);
        for (i, &p) in ptrs.iter().enumerate() {
            m.write_row(p, i as u64 * 10, &[i as f32; 5]);
        }
        for (i, &p) in ptrs.iter().enumerate() {
            assert_eq!(m.key_at(p), i as u64 * 10);
            assert_eq!(row_at(&m, p), &[i as f32; 5]);
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
        let m = MmapMedium::create(&dir.path().join("rows.ebr"), f32s(8)).unwrap();
        let mut ptrs = Vec::new();
        m.alloc().allocate(1, &mut ptrs).unwrap();
        m.write_row(ptrs[0], 7, &[1.5; 8]);
        unsafe { *m.record_ptr(ptrs[0]).add(ROW_HEADER_BYTES + 3) ^= 0x10 };
        assert!(!m.checksum_ok(ptrs[0]));
    }

    /// `RowWrites::File` writes nothing through the mapping: with the records' pages made
    /// read-only a write through it would fault. Runs of adjacent records, records across
    /// a page boundary and scattered ones all read back, checksums whole, neighbours kept.
    #[test]
    fn file_writes_leave_the_mapping_read_only_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.ebr");
        let m = MmapMedium::create(&path, f32s(100)).unwrap();
        m.set_row_writes(super::super::RowWrites::File);
        let mut ptrs = Vec::new();
        m.alloc().allocate(300, &mut ptrs).unwrap();
        let rows: Vec<Vec<f32>> = (0..300).map(|i| (0..100).map(|j| (i * 1000 + j) as f32).collect()).collect();
        let end = ROWS_HEADER_BYTES as u64 + 300 * m.stride();
        // SAFETY: the records' pages of this test's own mapping; the header page (the
        // allocator's word) stays writable.
        let r = unsafe {
            libc::mprotect(
                m.map.as_mut_ptr().add(ROWS_HEADER_BYTES) as *mut libc::c_void,
                (end as usize - ROWS_HEADER_BYTES).next_multiple_of(4096),
                libc::PROT_READ,
            )
        };
        assert_eq!(r, 0);
        // A run of 40 adjacent records (it crosses pages), then every seventh of the rest
        // in reverse order, then the ones between them.
        let run: Vec<usize> = (0..40).collect();
        let sparse: Vec<usize> = (40..300).filter(|i| i % 7 == 0).rev().collect();
        let others: Vec<usize> = (40..300).filter(|i| i % 7 != 0).collect();
        for part in [&run, &sparse, &others] {
            let items: Vec<(u64, u64, &[f32])> =
                part.iter().map(|&i| (i as u64 + 5, ptrs[i], rows[i].as_slice())).collect();
            m.write(&items).unwrap();
            for &i in part.iter() {
                assert_eq!(m.key_at(ptrs[i]), i as u64 + 5);
                assert_eq!(row_at(&m, ptrs[i]), rows[i]);
            }
        }
        for (i, &p) in ptrs.iter().enumerate() {
            assert!(m.checksum_ok(p), "record {i}");
            assert_eq!(row_at(&m, p), rows[i], "record {i} after its neighbours were written");
        }
        m.flush().unwrap();
        drop(m);
        let m = MmapMedium::open(&path, f32s(100)).unwrap();
        for (i, &p) in ptrs.iter().enumerate() {
            assert_eq!((m.key_at(p), row_at(&m, p)), (i as u64 + 5, rows[i].clone()));
        }
    }

    /// A bulk load's writes (`write_bulk`, through the file with write-back started) read
    /// back through the mapping, before and after their pages are dropped from the page
    /// cache (`drop_written`), and after a reopen.
    #[test]
    fn bulk_writes_read_back_after_their_pages_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.ebr");
        let m = MmapMedium::create(&path, f32s(30)).unwrap();
        let mut ptrs = Vec::new();
        m.alloc().allocate(2000, &mut ptrs).unwrap();
        let rows: Vec<Vec<f32>> = (0..2000).map(|i| (0..30).map(|j| (i * 100 + j) as f32).collect()).collect();
        for part in ptrs.chunks(300).zip(rows.chunks(300)).enumerate() {
            let (c, (ps, rs)) = part;
            let items: Vec<(u64, u64, &[f32])> =
                ps.iter().zip(rs).enumerate().map(|(i, (&p, r))| ((c * 300 + i) as u64, p, r.as_slice())).collect();
            m.write_bulk(&items).unwrap();
        }
        let check = |m: &MmapMedium, when: &str| {
            for (i, &p) in ptrs.iter().enumerate() {
                assert_eq!((m.key_at(p), row_at(m, p)), (i as u64, rows[i].clone()), "record {i} {when}");
                assert!(m.checksum_ok(p), "record {i} {when}");
            }
        };
        check(&m, "as written");
        let end = ptrs[1999] + m.stride();
        m.drop_written(ptrs[0], end).unwrap();
        m.drop_written(end, end).unwrap(); // an empty range
        check(&m, "after its pages were dropped");
        m.flush().unwrap();
        drop(m);
        check(&MmapMedium::open(&path, f32s(30)).unwrap(), "after a reopen");
    }

    #[test]
    fn grows_the_file_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.ebr");
        // Past the first few steps of growth, 16 records at a time.
        let n = (4 * super::super::alloc::GROW_BYTES_MIN / record_stride(256, DType::F32) as u64) as usize + 10;
        {
            let m = MmapMedium::create(&path, f32s(64)).unwrap();
            let mut ptrs = Vec::new();
            for first in (0..n).step_by(16) {
                m.alloc().allocate(16.min(n - first), &mut ptrs).unwrap();
                for (i, &p) in ptrs.iter().enumerate() {
                    let key = (first + i) as u64;
                    m.write_row(p, key, &[key as f32; 64]);
                }
            }
            // The file holds the records and at most one step more.
            let needed = ROWS_HEADER_BYTES as u64 + n as u64 * m.stride();
            let len = std::fs::metadata(&path).unwrap().len();
            assert!(
                len >= needed && len <= needed + super::super::alloc::GROW_BYTES_MIN,
                "rows file of {len} bytes for {needed} bytes of records"
            );
            m.flush().unwrap();
        }
        let m = MmapMedium::open(&path, f32s(64)).unwrap();
        assert_eq!(m.alloc().next_record(), n as u64);
        let last = ROWS_HEADER_BYTES as u64 + (n as u64 - 1) * m.stride();
        assert_eq!(m.key_at(last), n as u64 - 1);
        assert!(m.checksum_ok(last));
    }

    /// A rows file of dim 64 written when f32 records were rounded to whole lines (320
    /// bytes, not today's 272) opens with its own stride, and its records read back and
    /// grow as they did.
    #[test]
    fn a_file_of_the_old_line_stride_reads_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.ebr");
        assert_eq!(record_stride(256, DType::F32), 272);
        let mut first = vec![0u8; ROWS_HEADER_BYTES];
        RowsHeader { dim: 64, dtype: DType::F32, stride: 320 }.write(&mut first);
        std::fs::write(&path, &first).unwrap();
        let n = 1000;
        {
            let m = MmapMedium::open(&path, f32s(64)).unwrap();
            assert_eq!(m.stride(), 320);
            let mut ptrs = Vec::new();
            m.alloc().allocate(n, &mut ptrs).unwrap();
            for (i, &p) in ptrs.iter().enumerate() {
                assert_eq!(p, ROWS_HEADER_BYTES as u64 + i as u64 * 320);
                m.write_row(p, i as u64, &[i as f32; 64]);
            }
            m.flush().unwrap();
        }
        let m = MmapMedium::open(&path, f32s(64)).unwrap();
        assert_eq!((m.stride(), m.alloc().next_record()), (320, n as u64));
        for i in [0u64, 1, 517, n as u64 - 1] {
            let p = ROWS_HEADER_BYTES as u64 + i * 320;
            assert!(m.checksum_ok(p), "record {i}");
            assert_eq!((m.key_at(p), row_at(&m, p)), (i, vec![i as f32; 64]), "record {i}");
        }
    }
}
