//! Which pages of the index file have blocks of the file system behind them.
//!
//! The index file is as long as its bucket count asks (`ftruncate`: sparse), but a
//! table of 4 rows and a capacity of 10 M must not take 256 MiB of disk. So the file
//! gets blocks a page at a time, just before the first write into one of the page's
//! buckets ([`Backing::back`]): a key's insert backs every bucket its probe writes. A
//! store through the mapping thus never meets an unbacked page, so a full disk is an
//! `Io` error of the insert, never SIGBUS, and the disk the index takes grows with its
//! keys: about a page per key while keys are fewer than pages, whatever the capacity.
//!
//! A page is backed by writing zeros over it with `pwrite` (`fsutil::zero_fill`) if it
//! reads as zeros; a page that does not was written through the mapping before, so it
//! has its blocks. Zeros, not `fallocate`: the file system allocates at write-back, so
//! pages backed in hash order still end up in few extents (with `fallocate` per 64 KiB
//! a 128 MiB index took 2,049 and twice the CPU to write back), and no store through
//! the mapping has to convert an unwritten extent, which on a full disk can fault. A
//! page that reads as zeros was never written (a bucket's version word moves on every
//! lock), so rewriting it changes nothing a reader sees; it is rewritten also where the
//! file system says it holds data: a write cut short by a full disk can leave pages that
//! read as data but fault when written through a mapping (seen on ext4, 1 KiB blocks).
//!
//! Every other write of a bucket (replace, remove, marks, repairs of a cut-short
//! update, overflow counts) goes to a bucket an insert wrote before, which is backed.
//! Nothing writes a bucket it does not need to: the background repair's pass locks
//! only buckets of backed pages, and passes over pages that are holes (`SEEK_DATA`) or
//! read as zeros (no key lives there); the full repair writes only words that change.
//!
//! One bit per page says this process has seen it backed: set at create for the
//! header's, by [`Backing::back`], and by the repair's pass for pages it finds written.
//! Bits are set under one mutex, so the pass can decide about a page that no writer is
//! backing meanwhile.
//!
//! Where sparse files are not safe or cannot be told from written ones
//! (`fsutil::sparse_files_ok`: tmpfs, where a read of a hole through the mapping takes
//! a page too) the file is allocated whole, as it always was.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use super::bucket::BUCKET_BYTES;
use crate::error::{io_at, Result};
use crate::format::INDEX_HEADER_BYTES;

/// Bytes of the index file backed at a time: a page of memory, 16 buckets (a store
/// through the mapping dirties a whole page, so no less will do). Keys land in buckets
/// by their hash, so an index of `p` pages holding `n` keys takes about
/// `p * (1 - e^(-n/p))` pages. Backing 64 KiB at a time made a default table of 1,000
/// rows (a 32 MiB index) take 20 MiB.
pub const PAGE_BYTES: u64 = 4096;
const _: () = assert!(PAGE_BYTES.is_multiple_of(BUCKET_BYTES as u64), "a bucket never straddles two pages");
const _: () = assert!((INDEX_HEADER_BYTES as u64).is_multiple_of(PAGE_BYTES), "buckets start on a page");

/// The backed pages of one index file.
pub(super) struct Backing {
    /// A bit per page: this process has seen the page backed.
    bits: Box<[AtomicU64]>,
    /// Held while a page is backed (and while the repair's pass decides about one).
    lock: Mutex<()>,
    file_bytes: u64,
}

impl Backing {
    fn empty(file_bytes: u64) -> Backing {
        let pages = file_bytes.div_ceil(PAGE_BYTES);
        Backing { bits: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(), lock: Mutex::new(()), file_bytes }
    }

    /// A new index file of `file_bytes` (already that long): backs the header's page.
    pub(super) fn create(file: &File, path: &Path, file_bytes: u64) -> Result<Backing> {
        if !crate::fsutil::sparse_files_ok(file) {
            return Backing::whole(file, path, file_bytes);
        }
        let backing = Backing::empty(file_bytes);
        backing.back_page(file, path, 0)?;
        Ok(backing)
    }

    /// An existing index file: nothing seen backed yet (pages are checked when first
    /// written), or all of it where sparse files are not kept.
    pub(super) fn open(file: &File, path: &Path, file_bytes: u64) -> Result<Backing> {
        if !crate::fsutil::sparse_files_ok(file) {
            return Backing::whole(file, path, file_bytes);
        }
        Ok(Backing::empty(file_bytes))
    }

    /// An index built in DRAM (`build.rs`): nothing to back until it is written out.
    pub(super) fn in_memory(file_bytes: u64) -> Backing {
        let backing = Backing::empty(file_bytes);
        for page in 0..file_bytes.div_ceil(PAGE_BYTES) {
            backing.set(page);
        }
        backing
    }

    /// Every page backed, now (`fallocate`).
    fn whole(file: &File, path: &Path, file_bytes: u64) -> Result<Backing> {
        crate::fsutil::allocate(file, path, 0, file_bytes)?;
        Ok(Backing::in_memory(file_bytes))
    }

    #[inline(always)]
    fn page_of(bucket: u64) -> u64 {
        (INDEX_HEADER_BYTES as u64 + bucket * BUCKET_BYTES as u64) / PAGE_BYTES
    }

    /// The first bucket of page `page`.
    fn first_bucket(page: u64) -> u64 {
        (page * PAGE_BYTES).saturating_sub(INDEX_HEADER_BYTES as u64) / BUCKET_BYTES as u64
    }

    /// The first bucket of the page after bucket `bucket`'s.
    pub(super) fn next_page_bucket(bucket: u64) -> u64 {
        Self::first_bucket(Self::page_of(bucket) + 1)
    }

    #[inline(always)]
    fn get(&self, page: u64) -> bool {
        self.bits[(page / 64) as usize].load(Ordering::Acquire) & (1 << (page % 64)) != 0
    }

    fn set(&self, page: u64) {
        self.bits[(page / 64) as usize].fetch_or(1 << (page % 64), Ordering::Release);
    }

    /// True when bucket `bucket`'s page is backed.
    #[inline(always)]
    pub(super) fn is_backed(&self, bucket: u64) -> bool {
        self.get(Self::page_of(bucket))
    }

    /// Makes sure bucket `bucket`'s page has blocks before anything writes into it; the
    /// error of a full disk names the file.
    #[inline(always)]
    pub(super) fn back(&self, file: &File, path: &Path, bucket: u64) -> Result<()> {
        let page = Self::page_of(bucket);
        if self.get(page) {
            return Ok(());
        }
        self.back_page(file, path, page)
    }

    #[cold]
    fn back_page(&self, file: &File, path: &Path, page: u64) -> Result<()> {
        let _held = self.lock.lock();
        if self.get(page) {
            return Ok(());
        }
        let (from, to) = (page * PAGE_BYTES, ((page + 1) * PAGE_BYTES).min(self.file_bytes));
        let mut bytes = [0u8; PAGE_BYTES as usize];
        let bytes = &mut bytes[..(to - from) as usize];
        file.read_exact_at(bytes, from).map_err(|e| io_at("cannot read", path, e))?;
        // Writers wait for this (its bit is not set), so the page cannot change meanwhile.
        if bytes.iter().all(|&b| b == 0) {
            crate::fsutil::zero_fill(file, path, from, to)?;
        }
        self.set(page);
        Ok(())
    }

    /// Holds off the backing of pages while the caller decides about one.
    pub(super) fn hold(&self) -> MutexGuard<'_, ()> {
        self.lock.lock()
    }

    /// Marks bucket `bucket`'s page backed: the caller (holding [`hold`](Self::hold)'s
    /// guard) found it written through the mapping before.
    pub(super) fn set_written(&self, _held: &MutexGuard<'_, ()>, bucket: u64) {
        self.set(Self::page_of(bucket));
    }

    /// The first bucket at or after `bucket` whose page may hold data: the next page
    /// with data as `SEEK_DATA` finds it (`bucket` itself where the file system cannot
    /// say), `u64::MAX` when none does.
    pub(super) fn next_data_bucket(&self, file: &File, bucket: u64) -> u64 {
        let from = Self::page_of(bucket) * PAGE_BYTES;
        match crate::fsutil::next_data(file, from, self.file_bytes) {
            None => u64::MAX,
            Some(at) if at / PAGE_BYTES == from / PAGE_BYTES => bucket,
            Some(at) => Self::first_bucket(at / PAGE_BYTES),
        }
    }

    /// Pages this process has seen backed.
    #[cfg(test)]
    pub(super) fn backed_pages(&self) -> u64 {
        self.bits.iter().map(|w| w.load(Ordering::Relaxed).count_ones() as u64).sum()
    }
}
