//! The block medium: row records in a data file read and written with
//! `O_DIRECT` through an [`IoEngine`] (io_uring or a pread pool).
//!
//! Layout (`rows.ebb`): a 4096-byte header (same fields as the mmap medium's,
//! magic "EMBKBLKR"), then records of `stride` bytes, `stride` a multiple of
//! the file system's direct-I/O alignment (512 B here), so reading one row is
//! one aligned read of the smallest size the device allows. A record is
//! `key u64 | crc32c u32 | flags u32 | elements`, zero-padded to the stride.
//!
//! Only the header page is memory-mapped (its next-record word must survive a
//! killed process, like the mmap medium's); records are only ever touched by
//! direct I/O. Records are copy-on-write, as on the mmap medium: a write goes
//! to a fresh record, the index is pointed at it, the old record is retired.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};

use super::alloc::RecordAlloc;
use super::codec::RecordCodec;
use super::{encode_in_file_order, merged_requests, ReadItem};
use crate::error::{io_at, Error, ErrorKind, Result};
use crate::format::{self, block_stride, RowsHeader, BLOCK_ROWS_MAGIC, ROWS_HEADER_BYTES};
use crate::io::{direct_io_alignment, AlignedBuf, Dir, IoEngine, IoReq, IoStats};
use crate::layout::RecordLayout;

/// Largest block rows file (same bound as the mmap medium's reservation).
pub const BLOCK_FILE_BYTES_MAX: u64 = 1 << 40;
/// Alignment assumed when the file system does not report one.
const ALIGN_FALLBACK: u32 = 4096;
thread_local! {
    static IO_BUF: RefCell<AlignedBuf> = RefCell::new(AlignedBuf::new(1 << 16));
}

pub struct BlockMedium {
    // `alloc` points into `header_map`: declared first so it is dropped first.
    alloc: RecordAlloc,
    header_map: MmapRaw,
    file: File,
    codec: RecordCodec,
    direct: bool,
    align: u32,
    io: Arc<dyn IoEngine>,
}

fn open_data(path: &Path, create: bool) -> Result<(File, bool)> {
    let mut o = OpenOptions::new();
    o.read(true).write(true);
    if create {
        o.create_new(true);
    }
    match o.clone().custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(path = %path.display(), "file system refuses O_DIRECT; the block medium goes through the page cache");
            let f = o.open(path).map_err(|e| io_at("cannot open block rows file", path, e))?;
            Ok((f, false))
        }
        Err(e) => {
            Err(io_at(if create { "cannot create block rows file" } else { "cannot open block rows file" }, path, e))
        }
    }
}

impl BlockMedium {
    pub fn create(path: &Path, layout: RecordLayout, io: Arc<dyn IoEngine>) -> Result<BlockMedium> {
        let (file, direct) = open_data(path, true)?;
        let align = if direct { direct_io_alignment(file.as_raw_fd()).unwrap_or(ALIGN_FALLBACK) } else { 512 };
        let align = align.max(512);
        if !(ROWS_HEADER_BYTES as u32).is_multiple_of(align) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("direct I/O alignment {align} is larger than the {ROWS_HEADER_BYTES}-byte header"),
            ));
        }
        let elems = layout.elems() as u32;
        let header =
            RowsHeader { dim: elems, dtype: layout.dtype, stride: block_stride(layout.payload_bytes(), align) };
        file.set_len(ROWS_HEADER_BYTES as u64).map_err(|e| io_at("cannot size block rows file", path, e))?;
        let mut buf = AlignedBuf::new(ROWS_HEADER_BYTES);
        header.write_as(buf.as_mut_slice(), &BLOCK_ROWS_MAGIC);
        let req = IoReq { offset: 0, buf: buf.as_mut_ptr(), len: ROWS_HEADER_BYTES };
        io.submit(file.as_raw_fd(), Dir::Write, &[req]).map_err(|e| e.context(path.display().to_string()))?;
        Self::finish_open(path, file, header, layout, direct, align, io)
    }

    /// Opens a block rows file; its header must describe records of `layout`.
    pub fn open(path: &Path, layout: RecordLayout, io: Arc<dyn IoEngine>) -> Result<BlockMedium> {
        let (file, direct) = open_data(path, false)?;
        let len = file.metadata().map_err(|e| io_at("cannot stat block rows file", path, e))?.len();
        if len < ROWS_HEADER_BYTES as u64 {
            return Err(Error::new(ErrorKind::Recover, "block rows file is shorter than its header")
                .context(path.display().to_string()));
        }
        let mut buf = AlignedBuf::new(ROWS_HEADER_BYTES);
        let req = IoReq { offset: 0, buf: buf.as_mut_ptr(), len: ROWS_HEADER_BYTES };
        io.submit(file.as_raw_fd(), Dir::Read, &[req]).map_err(|e| e.context(path.display().to_string()))?;
        let header = RowsHeader::read_block(buf.as_slice()).map_err(|e| e.context(path.display().to_string()))?;
        super::check_header(path, &header, &layout)?;
        let mut align = if direct { direct_io_alignment(file.as_raw_fd()).unwrap_or(ALIGN_FALLBACK) } else { 512 };
        let (file, direct) = if direct && !header.stride.is_multiple_of(align) {
            tracing::warn!(
                path = %path.display(),
                stride = header.stride,
                align,
                "records are not aligned for direct I/O on this file system; reading through the page cache"
            );
            align = 512;
            let f = OpenOptions::new().read(true).write(true).open(path).map_err(|e| io_at("cannot open", path, e))?;
            (f, false)
        } else {
            (file, direct)
        };
        Self::finish_open(path, file, header, layout, direct, align.max(512), io)
    }

    fn finish_open(
        path: &Path,
        file: File,
        header: RowsHeader,
        layout: RecordLayout,
        direct: bool,
        align: u32,
        io: Arc<dyn IoEngine>,
    ) -> Result<BlockMedium> {
        let header_map = MmapOptions::new()
            .len(ROWS_HEADER_BYTES)
            .map_raw(&file)
            .map_err(|e| io_at("cannot map block rows header", path, e))?;
        let grow = file.try_clone().map_err(|e| io_at("cannot duplicate file handle", path, e))?;
        // SAFETY: the word is inside the mapped header page; `header_map` outlives `alloc`.
        let alloc = unsafe {
            let next = header_map.as_ptr().add(format::ROWS_NEXT_RECORD_OFFSET) as *const AtomicU64;
            RecordAlloc::new(path, grow, header.stride as u64, BLOCK_FILE_BYTES_MAX, next)?
        };
        Ok(BlockMedium { alloc, header_map, file, codec: RecordCodec::new(layout), direct, align, io })
    }

    pub fn layout(&self) -> &RecordLayout {
        self.codec.layout()
    }

    pub fn stride(&self) -> u64 {
        self.alloc.stride()
    }

    pub fn alloc(&self) -> &RecordAlloc {
        &self.alloc
    }

    /// True when the file is read with `O_DIRECT` (false where the file system refuses it).
    pub fn direct(&self) -> bool {
        self.direct
    }

    pub fn align(&self) -> u32 {
        self.align
    }

    pub fn io_stats(&self) -> IoStats {
        self.io.stats()
    }

    /// Reads records: each item's record decoded into `out[pos * elems..]`, checking
    /// that the record holds the item's key and matches its checksum.
    pub fn read(&self, items: &[ReadItem], out: &mut [f32]) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let w = self.layout().elems();
        let stride = self.stride() as usize;
        // Read in file order so records adjacent on disk become one request.
        let mut order: Vec<u32> = (0..items.len() as u32).collect();
        order.sort_unstable_by_key(|&i| items[i as usize].ptr);
        IO_BUF.with(|cell| {
            let mut buf = cell.borrow_mut();
            buf.reserve(items.len() * stride);
            let ptrs: Vec<u64> = order.iter().map(|&i| items[i as usize].ptr).collect();
            let reqs = merged_requests(&ptrs, stride, buf.as_mut_ptr());
            self.io.submit(self.file.as_raw_fd(), Dir::Read, &reqs).map_err(|e| e.context(self.where_()))?;
            let bytes = buf.as_slice();
            for (i, &o) in order.iter().enumerate() {
                let it = &items[o as usize];
                let rec = &bytes[i * stride..(i + 1) * stride];
                self.codec.verify(rec, it.key, it.ptr, true, &|| self.where_())?;
                self.codec.decode(rec, &mut out[it.pos * w..(it.pos + 1) * w]);
            }
            Ok(())
        })
    }

    /// Reads one record and says whether it holds `key` and matches its checksum.
    pub fn check(&self, ptr: u64, key: u64) -> Result<bool> {
        let mut row = vec![0f32; self.layout().elems()];
        match self.read(&[ReadItem { key, ptr, pos: 0 }], &mut row) {
            Ok(()) => Ok(true),
            Err(e) if matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::ChecksumMismatch) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Writes records (`ptr`s from [`RecordAlloc::allocate`], not yet published) in one batch.
    pub fn write(&self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let stride = self.stride() as usize;
        IO_BUF.with(|cell| {
            let mut buf = cell.borrow_mut();
            buf.reserve(items.len() * stride);
            // In file order, so freshly allocated (adjacent) records become one request.
            let ptrs =
                encode_in_file_order(&self.codec, items, stride, &mut buf.as_mut_slice()[..items.len() * stride]);
            let reqs = merged_requests(&ptrs, stride, buf.as_mut_ptr());
            self.io.submit(self.file.as_raw_fd(), Dir::Write, &reqs).map_err(|e| e.context(self.where_()))
        })
    }

    /// Makes written records and the header durable (`fdatasync`, msync of the header).
    pub fn flush(&self) -> Result<()> {
        self.file.sync_data().map_err(|e| io_at("cannot sync block rows file", self.alloc.path(), e))?;
        self.header_map.flush().map_err(|e| io_at("cannot sync block rows header", self.alloc.path(), e))
    }

    fn where_(&self) -> String {
        self.alloc.path().display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::super::MERGE_BYTES_MAX;
    use super::*;
    use crate::io::{engine, IoChoice};

    fn roundtrip(choice: IoChoice) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.ebb");
        let io = engine(choice, 32).unwrap();
        let dim = 128;
        let n = 300;
        let rows: Vec<Vec<f32>> = (0..n).map(|i| (0..dim).map(|j| (i * 1000 + j) as f32).collect()).collect();
        let ptrs = {
            let m = BlockMedium::create(&path, RecordLayout::new(dim, 0, crate::format::DType::F32), Arc::clone(&io))
                .unwrap();
            assert_eq!(m.stride() % 512, 0);
            assert_eq!(m.stride(), 1024, "528-byte records of dim 128 take two 512-byte blocks");
            let mut ptrs = Vec::new();
            m.alloc().allocate(n, &mut ptrs).unwrap();
            let items: Vec<(u64, u64, &[f32])> =
                ptrs.iter().enumerate().map(|(i, &p)| (i as u64 + 7, p, rows[i].as_slice())).collect();
            m.write(&items).unwrap();
            m.flush().unwrap();
            ptrs
        };
        let m = BlockMedium::open(&path, RecordLayout::new(dim, 0, crate::format::DType::F32), io).unwrap();
        assert_eq!(m.alloc().next_record(), n as u64);
        let items: Vec<ReadItem> = ptrs
            .iter()
            .enumerate()
            .rev()
            .map(|(i, &p)| ReadItem { key: i as u64 + 7, ptr: p, pos: n - 1 - i })
            .collect();
        let mut out = vec![0f32; n * dim];
        m.read(&items, &mut out).unwrap();
        for i in 0..n {
            assert_eq!(&out[(n - 1 - i) * dim..(n - i) * dim], rows[i].as_slice());
        }
        assert!(m.check(ptrs[3], 10).unwrap());
        assert!(!m.check(ptrs[3], 11).unwrap(), "a record of another key is refused");
        let e = m.read(&[ReadItem { key: 8, ptr: ptrs[0], pos: 0 }], &mut out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
    }

    #[test]
    fn adjacent_records_merge_into_one_request_up_to_a_limit() {
        let mut buf = AlignedBuf::new(4096 * 3000);
        let base = buf.as_mut_ptr();
        let reqs = merged_requests(&[4096, 5120, 6144, 9216, 10240], 1024, base);
        let spans: Vec<(u64, usize)> = reqs.iter().map(|r| (r.offset, r.len)).collect();
        assert_eq!(spans, vec![(4096, 3072), (9216, 2048)]);
        assert_eq!(reqs[1].buf, unsafe { base.add(3 * 1024) });
        let many: Vec<u64> = (0..2048u64).map(|i| 4096 + i * 1024).collect();
        let reqs = merged_requests(&many, 1024, base);
        assert_eq!(reqs.len(), 2, "2 MiB of adjacent records: two 1 MiB requests");
        assert!(reqs.iter().all(|r| r.len == MERGE_BYTES_MAX));
    }

    #[test]
    fn block_medium_roundtrip_pread() {
        roundtrip(IoChoice::Pread);
    }

    #[test]
    fn block_medium_roundtrip_auto() {
        roundtrip(IoChoice::Auto);
    }
}
