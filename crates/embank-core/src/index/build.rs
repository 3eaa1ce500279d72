//! An index built in DRAM and written to its file once, in order.
//!
//! A rebuild (growth, hot placement, a bulk load) inserts every key of a table into a
//! new generation. Inserted into a mapped file, each key dirties a page at random:
//! the kernel writes the same pages back again and again while the rebuild runs, and
//! each page is first zero-filled to back it (`backing.rs`). Built here instead, the
//! index lives in an anonymous mapping with the file's exact layout (header, then the
//! buckets) and [`Index::persist`] writes it out in one pass: runs of pages that hold
//! anything go out with `pwrite` in chunks of [`PERSIST_CHUNK_BYTES`], all-zero pages
//! are skipped (the file stays sparse; their blocks come when a key is first written
//! there, as for any index), then one `fsync`. The file is then mapped as usual.
//!
//! The file is created (at its full, sparse length) only by [`Index::persist`]: a kill
//! before leaves nothing, a kill during the write a left-over generation that the next
//! open removes, as a rebuild in the mapped file does. [`fits_in_memory`] says when a
//! build may take DRAM: the caller builds in the mapped file otherwise.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::AtomicBool;

use memmap2::MmapOptions;

use super::backing::{Backing, PAGE_BYTES};
use super::{Index, BUCKET_BYTES, BUCKET_COUNT_MAX};
use crate::error::{io_at, Error, Result};
use crate::format::{self, IndexHeader, RowUnits, INDEX_HEADER_BYTES};
use crate::hash::Geometry;

/// Bytes [`Index::persist`] hands one `pwrite` at most.
pub const PERSIST_CHUNK_BYTES: usize = 8 << 20;
const _: () = assert!(PERSIST_CHUNK_BYTES.is_multiple_of(PAGE_BYTES as usize));

/// An index built in DRAM may take at most this share of the memory available
/// (`MemAvailable`). The build holds the index; while it is written the page cache holds
/// it again, but clean once synced, and reclaimable, as a bulk load's rows are (written
/// through the file, their write-back started as they go). A 300 M-key index (8.6 GB)
/// is built in DRAM on a 24 GiB machine.
pub const DRAM_SHARE_DIVISOR: u64 = 2;

/// Bytes of an index file of `bucket_count` buckets.
pub fn index_file_bytes(bucket_count: u64) -> u64 {
    INDEX_HEADER_BYTES as u64 + bucket_count * BUCKET_BYTES as u64
}

/// True when an index of `bucket_count` buckets may be built in DRAM: at most
/// 1/[`DRAM_SHARE_DIVISOR`] of `MemAvailable` (false when that cannot be read).
pub fn fits_in_memory(bucket_count: u64) -> bool {
    match mem_available_bytes() {
        Some(available) => index_file_bytes(bucket_count) <= available / DRAM_SHARE_DIVISOR,
        None => false,
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn mem_available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl Index {
    /// Creates a new, empty index whose buckets live in DRAM until
    /// [`persist`](Self::persist) writes them to `path` (which must not exist then).
    /// Inserts, lookups and iteration work as on a mapped index; `flush` writes nothing.
    pub fn create_in_memory(path: &Path, bucket_count: u64, seed: u64, units: RowUnits) -> Result<Index> {
        if bucket_count == 0 || bucket_count > BUCKET_COUNT_MAX {
            return Err(Error::config(format!("bucket count {bucket_count} must be in 1..=2^40")));
        }
        let bytes = index_file_bytes(bucket_count);
        let mut map = MmapOptions::new()
            .len(bytes as usize)
            .map_anon()
            .map_err(|e| io_at("cannot map memory to build the index", path, e))?;
        // Inserts land at random over the whole build: on 2 MiB pages a key costs a cache
        // miss, not a TLB miss and a page walk besides (refused quietly where the kernel
        // has no transparent huge pages).
        let _ = map.advise(memmap2::Advice::HugePage);
        IndexHeader::new(bucket_count, seed, units).write(&mut map[..INDEX_HEADER_BYTES]);
        let at = format::INDEX_BOOT_ID_OFFSET;
        map[at..at + 16].copy_from_slice(&crate::fsutil::boot_id());
        Ok(Index {
            path: path.to_owned(),
            file: None,
            map,
            backing: Backing::in_memory(bytes),
            bucket_count,
            geo: Geometry::new(bucket_count),
            seed,
            units,
            repairing: AtomicBool::new(false),
            lazy: None,
            undo: None,
            watch: Default::default(),
        })
    }

    /// True for an index built in DRAM and not yet persisted.
    #[cfg(test)]
    pub fn is_in_memory(&self) -> bool {
        self.file.is_none()
    }

    /// Writes an index built in DRAM to its file in one sequential pass (pages that are
    /// all zeros skipped), makes it durable (`fsync`) and maps the file. A mapped index
    /// is returned as it is. A full disk is an `Io` error naming the file (the caller
    /// removes the file).
    pub fn persist(self) -> Result<Index> {
        if self.file.is_some() {
            return Ok(self);
        }
        let path = self.path.clone();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_at("cannot create index file", &path, e))?;
        let written = self.write_out(&file);
        drop((self, file));
        match written {
            Ok(()) => Index::open(&path),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Sizes the new `file` (sparse) and writes every page of the map that holds
    /// anything, in runs of at most [`PERSIST_CHUNK_BYTES`], then `fsync`s it.
    fn write_out(&self, file: &File) -> Result<()> {
        let path = &self.path;
        let bytes: &[u8] = &self.map;
        file.set_len(bytes.len() as u64).map_err(|e| io_at("cannot size index file", path, e))?;
        let page = PAGE_BYTES as usize;
        let page_at = |at: usize| &bytes[at..(at + page).min(bytes.len())];
        let mut at = 0;
        while at < bytes.len() {
            if is_zero(page_at(at)) {
                at += page;
                continue;
            }
            let mut end = at + page;
            while end < bytes.len() && end - at < PERSIST_CHUNK_BYTES && !is_zero(page_at(end)) {
                end += page;
            }
            let end = end.min(bytes.len());
            file.write_all_at(&bytes[at..end], at as u64).map_err(|e| write_error(path, at, end, e))?;
            at = end;
        }
        file.sync_all().map_err(|e| io_at("cannot sync index file", path, e))
    }
}

fn is_zero(bytes: &[u8]) -> bool {
    // SAFETY: any bytes are valid u64s; the ends that are not aligned are checked apart.
    let (head, words, tail) = unsafe { bytes.align_to::<u64>() };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

fn write_error(path: &Path, from: usize, to: usize, e: std::io::Error) -> Error {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
            Error::io(format!("no space left on device for {} (writing bytes {from}..{to})", path.display()), e)
        }
        _ => io_at("cannot write index file", path, e),
    }
}
