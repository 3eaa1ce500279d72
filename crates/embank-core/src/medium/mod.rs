//! Persistent media: where row records live.
//!
//! `mmap`: a byte-addressable file mapped into memory (persistent memory, CXL
//! memory, DAX, or the page cache). `block`: a data file on an SSD read and
//! written with `O_DIRECT` through io_uring (or a pread pool). On both, rows
//! are copy-on-write records; a record replaced or deleted is reclaimed once
//! no reader can still see it (`alloc.rs`).

pub mod alloc;
pub mod block;
pub mod codec;
pub mod mapped;
pub mod mmap;

pub use alloc::RecordAlloc;
pub use block::BlockMedium;
pub use codec::RecordCodec;
pub use mapped::Mapped;
pub use mmap::MmapMedium;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::format::RowsHeader;
use crate::io::{IoEngine, IoReq, IoStats};
use crate::layout::RecordLayout;

/// One record to read: its key, where it is, and where its elements go.
#[derive(Clone, Copy, Debug)]
pub struct ReadItem {
    pub key: u64,
    pub ptr: u64,
    /// Record position in the output buffer (`pos * elems` elements in).
    pub pos: usize,
}

/// What a medium tells about itself in a table's stats.
#[derive(Clone, Debug, Default)]
pub struct MediumInfo {
    /// Address space mapped for the rows (the mmap medium reserves more, unbacked).
    pub bytes_mapped: u64,
    /// Block medium: whether the file is read with O_DIRECT, its alignment, the I/O engine's counters.
    pub direct_io: Option<bool>,
    pub io_align: Option<u32>,
    pub io: Option<IoStats>,
}

/// How a store's mapped files are paged (`StoreOptions::mmap_random_access`,
/// `StoreOptions::huge_pages`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapAdvice {
    /// The kernel's default (read-around, large folios where the file system takes them).
    Default,
    /// `MADV_RANDOM`: one page per fault, small folios (a row write dirties 4 KiB).
    Random,
    /// `MADV_HUGEPAGE`: 2 MiB mappings where the kernel and file system allow (fewer TLB
    /// misses on random reads; a row write dirties a whole huge folio).
    Huge,
}

impl MapAdvice {
    /// The `madvise` advice, None for the default.
    pub(crate) fn advice(self) -> Option<memmap2::Advice> {
        match self {
            MapAdvice::Default => None,
            MapAdvice::Random => Some(memmap2::Advice::Random),
            MapAdvice::Huge => Some(memmap2::Advice::HugePage),
        }
    }
}

/// Largest single request when adjacent records are merged.
pub(super) const MERGE_BYTES_MAX: usize = 1 << 20;

/// Requests for records laid out in `buf` in ascending `ptrs` order (one stride each),
/// merging records adjacent in the file into one request of up to 1 MiB.
pub(super) fn merged_requests(ptrs_sorted: &[u64], stride: usize, buf: *mut u8) -> Vec<IoReq> {
    let mut reqs: Vec<IoReq> = Vec::new();
    for (i, &ptr) in ptrs_sorted.iter().enumerate() {
        if let Some(last) = reqs.last_mut() {
            if last.offset + last.len as u64 == ptr && last.len + stride <= MERGE_BYTES_MAX {
                last.len += stride;
                continue;
            }
        }
        // SAFETY: the caller's buffer holds `ptrs_sorted.len()` strides.
        reqs.push(IoReq { offset: ptr, buf: unsafe { buf.add(i * stride) }, len: stride });
    }
    reqs
}

/// Encodes `items` `(key, ptr, record)` into `buf` (one stride each, the padding after
/// each record zeroed) in ascending `ptr` order; returns the pointers in that order.
pub(super) fn encode_in_file_order(
    codec: &RecordCodec,
    items: &[(u64, u64, &[f32])],
    stride: usize,
    buf: &mut [u8],
) -> Vec<u64> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_unstable_by_key(|&i| items[i].1);
    let bytes = codec.record_bytes();
    codec.encode_each(buf.chunks_exact_mut(stride).zip(&order).map(|(rec, &i)| {
        rec[bytes..].fill(0);
        (rec, items[i].0, items[i].2)
    }));
    order.iter().map(|&i| items[i].1).collect()
}

/// How the mmap medium writes a record (`StoreOptions::row_writes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowWrites {
    /// Copied into the mapping: cheapest for the writer. Each page written so is mapped
    /// writable, and the kernel's write-back, to clean it, write-protects it again and
    /// sends a TLB shootdown to every core running this process: readers included.
    #[default]
    Mapped,
    /// Written to the file with `pwrite`, a page at a time: about 2.5 µs a scattered
    /// record more for the writer, but the pages stay mapped read-only, so write-back
    /// interrupts no reader.
    File,
}

impl RowWrites {
    pub fn parse(s: &str) -> Result<RowWrites> {
        match s {
            "mapped" => Ok(RowWrites::Mapped),
            "file" => Ok(RowWrites::File),
            other => Err(Error::config(format!("row_writes must be \"mapped\" or \"file\", not {other:?}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RowWrites::Mapped => "mapped",
            RowWrites::File => "file",
        }
    }
}

/// A persistent medium of row records. Every call carries a batch; records
/// are copy-on-write (written only between allocation and publication).
pub trait Medium: Send + Sync {
    fn kind(&self) -> MediumKind;
    /// Allocation, free list and reclamation of records.
    fn alloc(&self) -> &RecordAlloc;
    /// Decodes the records at `items` into `out` (`items[i].pos * elems` each), checking
    /// each record's key (and checksum where a read could be torn: the block medium).
    fn read(&self, items: &[ReadItem], out: &mut [f32]) -> Result<()>;
    /// Writes unpublished records `(key, ptr, record)` (ptrs from [`alloc`](Self::alloc)).
    fn write(&self, items: &[(u64, u64, &[f32])]) -> Result<()>;
    /// [`write`](Self::write) for a bulk load (`table/load.rs`): many records, mostly in
    /// runs never handed out before. The mapped medium writes them through the file and
    /// starts their write-back; the block medium writes them as it writes any.
    fn write_bulk(&self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        self.write(items)
    }
    /// A bulk load wrote the file's bytes `[from, to)` ([`write_bulk`](Self::write_bulk))
    /// and will not read them: the mapped medium waits for them to reach the disk and
    /// drops them from the page cache, so a load larger than memory does not make the
    /// kernel reclaim pages as it goes. Nothing to do for the block medium (direct I/O).
    fn drop_written(&self, _from: u64, _to: u64) -> Result<()> {
        Ok(())
    }
    /// True when the record at `ptr` holds `key` (and, with `checksum`, matches it).
    fn check(&self, ptr: u64, key: u64, checksum: bool) -> Result<bool>;
    /// Makes written records durable.
    fn flush(&self) -> Result<()>;
    /// Byte-addressable records in memory, for the lock-free fast path and zero-copy
    /// serving; `None` on media read through I/O. A medium that returns `Some` must do so
    /// from its open to its drop, and its [`MediumKind::is_mapped`] says so beforehand.
    fn as_mapped(&self) -> Option<Mapped<'_>> {
        None
    }
    /// How the kernel should page the mapping, where the medium is mapped.
    fn advise(&self, _advice: MapAdvice) {}
    /// How records are written, where the medium is mapped.
    fn set_row_writes(&self, _writes: RowWrites) {}
    fn info(&self) -> MediumInfo;
}

impl Medium for MmapMedium {
    fn kind(&self) -> MediumKind {
        MediumKind::Mmap
    }
    fn alloc(&self) -> &RecordAlloc {
        MmapMedium::alloc(self)
    }
    fn read(&self, items: &[ReadItem], out: &mut [f32]) -> Result<()> {
        MmapMedium::read(self, items, out)
    }
    fn write(&self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        MmapMedium::write(self, items)
    }
    fn write_bulk(&self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        MmapMedium::write_bulk(self, items)
    }
    fn drop_written(&self, from: u64, to: u64) -> Result<()> {
        MmapMedium::drop_written(self, from, to)
    }
    fn check(&self, ptr: u64, key: u64, checksum: bool) -> Result<bool> {
        Ok(self.key_at(ptr) == key && (!checksum || self.checksum_ok(ptr)))
    }
    fn flush(&self) -> Result<()> {
        MmapMedium::flush(self)
    }
    #[inline(always)]
    fn as_mapped(&self) -> Option<Mapped<'_>> {
        Some(self.mapped())
    }
    fn advise(&self, advice: MapAdvice) {
        MmapMedium::advise(self, advice)
    }
    fn set_row_writes(&self, writes: RowWrites) {
        MmapMedium::set_row_writes(self, writes)
    }
    fn info(&self) -> MediumInfo {
        MediumInfo { bytes_mapped: self.alloc().file_bytes(), ..Default::default() }
    }
}

impl Medium for BlockMedium {
    fn kind(&self) -> MediumKind {
        MediumKind::Block
    }
    fn alloc(&self) -> &RecordAlloc {
        BlockMedium::alloc(self)
    }
    fn read(&self, items: &[ReadItem], out: &mut [f32]) -> Result<()> {
        BlockMedium::read(self, items, out)
    }
    fn write(&self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        BlockMedium::write(self, items)
    }
    fn check(&self, ptr: u64, key: u64, _checksum: bool) -> Result<bool> {
        BlockMedium::check(self, ptr, key)
    }
    fn flush(&self) -> Result<()> {
        BlockMedium::flush(self)
    }
    fn info(&self) -> MediumInfo {
        MediumInfo {
            bytes_mapped: crate::format::ROWS_HEADER_BYTES as u64,
            direct_io: Some(self.direct()),
            io_align: Some(self.align()),
            io: Some(self.io_stats()),
        }
    }
}

/// A table's medium: static dispatch over the implementations (the hot path matches
/// once per batch call; callers use the [`Medium`] trait and never the variants).
pub enum AnyMedium {
    Mmap(MmapMedium),
    Block(BlockMedium),
}

/// Delegates a [`Medium`] method to the variant.
macro_rules! delegate {
    ($self:ident, $m:ident => $e:expr) => {
        match $self {
            AnyMedium::Mmap($m) => $e,
            AnyMedium::Block($m) => $e,
        }
    };
}

impl AnyMedium {
    /// The rows file of a medium kind in a table directory.
    pub fn path(dir: &Path, kind: MediumKind) -> PathBuf {
        match kind {
            MediumKind::Mmap => dir.join("rows.ebr"),
            MediumKind::Block => dir.join("rows.ebb"),
        }
    }

    /// Creates the rows file of a new table.
    pub fn create(dir: &Path, kind: MediumKind, layout: RecordLayout, io: &Arc<dyn IoEngine>) -> Result<AnyMedium> {
        let path = Self::path(dir, kind);
        Ok(match kind {
            MediumKind::Mmap => AnyMedium::Mmap(MmapMedium::create(&path, layout)?),
            MediumKind::Block => AnyMedium::Block(BlockMedium::create(&path, layout, Arc::clone(io))?),
        })
    }

    /// Opens the rows file of a table, which must hold records of `layout`.
    pub fn open(dir: &Path, kind: MediumKind, layout: RecordLayout, io: &Arc<dyn IoEngine>) -> Result<AnyMedium> {
        let path = Self::path(dir, kind);
        Ok(match kind {
            MediumKind::Mmap => AnyMedium::Mmap(MmapMedium::open(&path, layout)?),
            MediumKind::Block => AnyMedium::Block(BlockMedium::open(&path, layout, Arc::clone(io))?),
        })
    }
}

impl Medium for AnyMedium {
    fn kind(&self) -> MediumKind {
        delegate!(self, m => m.kind())
    }
    #[inline(always)]
    fn alloc(&self) -> &RecordAlloc {
        delegate!(self, m => Medium::alloc(m))
    }
    fn read(&self, items: &[ReadItem], out: &mut [f32]) -> Result<()> {
        delegate!(self, m => Medium::read(m, items, out))
    }
    fn write(&self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        delegate!(self, m => Medium::write(m, items))
    }
    fn write_bulk(&self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        delegate!(self, m => Medium::write_bulk(m, items))
    }
    fn drop_written(&self, from: u64, to: u64) -> Result<()> {
        delegate!(self, m => Medium::drop_written(m, from, to))
    }
    fn check(&self, ptr: u64, key: u64, checksum: bool) -> Result<bool> {
        delegate!(self, m => Medium::check(m, ptr, key, checksum))
    }
    fn flush(&self) -> Result<()> {
        delegate!(self, m => Medium::flush(m))
    }
    #[inline(always)]
    fn as_mapped(&self) -> Option<Mapped<'_>> {
        delegate!(self, m => Medium::as_mapped(m))
    }
    fn advise(&self, advice: MapAdvice) {
        delegate!(self, m => Medium::advise(m, advice))
    }
    fn set_row_writes(&self, writes: RowWrites) {
        delegate!(self, m => Medium::set_row_writes(m, writes))
    }
    fn info(&self) -> MediumInfo {
        delegate!(self, m => Medium::info(m))
    }
}

/// Checks that a rows file's header describes records of `layout`.
fn check_header(path: &Path, header: &RowsHeader, layout: &RecordLayout) -> Result<()> {
    if header.dim as usize != layout.elems() || header.dtype != layout.dtype {
        return Err(Error::new(ErrorKind::Recover, "rows file dim does not match the catalog")
            .context(path.display().to_string()));
    }
    let needed = crate::format::ROW_HEADER_BYTES + layout.payload_bytes();
    if (header.stride as usize) < needed {
        return Err(Error::new(
            ErrorKind::Recover,
            format!("rows file stride {} is shorter than a record ({needed} bytes)", header.stride),
        )
        .context(path.display().to_string()));
    }
    Ok(())
}

/// Which medium a table's rows live on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MediumKind {
    /// A memory-mapped file (the default).
    #[default]
    Mmap,
    /// A data file read with O_DIRECT through io_uring, under the DRAM row cache.
    Block,
}

impl MediumKind {
    pub fn parse(s: &str) -> Result<MediumKind> {
        match s {
            "mmap" => Ok(MediumKind::Mmap),
            "block" => Ok(MediumKind::Block),
            other => Err(Error::config(format!("unknown medium {other:?}: use mmap or block"))),
        }
    }

    /// True when the medium's records are byte-addressable memory
    /// (`Medium::as_mapped`): reads then take the lock-free fast path unless the table
    /// caches rows, and `placement = auto` leaves the table uncached.
    pub fn is_mapped(self) -> bool {
        match self {
            MediumKind::Mmap => true,
            MediumKind::Block => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MediumKind::Mmap => "mmap",
            MediumKind::Block => "block",
        }
    }
}
