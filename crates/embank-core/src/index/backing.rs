//! Which parts of the index file have blocks of the file system behind them.
//!
//! The index file is as long as its bucket count asks (`ftruncate`: sparse), but a
//! table of 4 rows and a capacity of 10 M must not take 256 MiB of disk. So the file
//! is backed with blocks (`fallocate`) a chunk of [`CHUNK_BYTES`] at a time, just
//! before the first write into one of the chunk's buckets ([`Backing::back`]): a key's
//! insert backs every bucket its probe writes. A store through the mapping thus never
//! meets an unbacked page, so a full disk is an `Io` error of the insert, never SIGBUS
//! (`fsutil::allocate`), and the disk the index takes grows with its keys.
//!
//! Every other write of a bucket (replace, remove, marks, repairs of a cut-short
//! update, overflow counts) goes to a bucket an insert wrote before, so it is backed.
//! Nothing writes a bucket it does not need to: the background repair's pass skips
//! chunks with no blocks ([`Backing::is_backed`]; they hold no key), and the full
//! repair writes a word only when it changes.
//!
//! One bit per chunk says it is backed: set at open for the chunks that hold data
//! (`SEEK_DATA`; a file system that cannot say counts as all data), at create for the
//! header's, and by [`Backing::back`]. Bits are set under one mutex, so the background
//! repair can skip a chunk no writer is backing meanwhile.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use super::bucket::BUCKET_BYTES;
use crate::error::Result;
use crate::format::INDEX_HEADER_BYTES;

/// Bytes of the index file backed at a time: 256 buckets. A table of a few keys takes
/// one chunk per key (and the header's), whatever its capacity.
pub const CHUNK_BYTES: u64 = 64 << 10;
const _: () = assert!(CHUNK_BYTES.is_multiple_of(BUCKET_BYTES as u64), "a bucket never straddles two chunks");
const _: () = assert!(CHUNK_BYTES.is_multiple_of(INDEX_HEADER_BYTES as u64), "the header fills whole pages of chunk 0");

/// The backed chunks of one index file.
pub(super) struct Backing {
    /// One bit per chunk: the chunk has blocks.
    bits: Box<[AtomicU64]>,
    /// Held while a chunk is backed (and while the repair's pass decides to skip one).
    lock: Mutex<()>,
    file_bytes: u64,
}

impl Backing {
    fn empty(file_bytes: u64) -> Backing {
        let chunks = file_bytes.div_ceil(CHUNK_BYTES);
        Backing {
            bits: (0..chunks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            lock: Mutex::new(()),
            file_bytes,
        }
    }

    /// A new index file of `file_bytes` (already that long): backs the header's chunk.
    pub(super) fn create(file: &File, path: &Path, file_bytes: u64) -> Result<Backing> {
        let backing = Backing::empty(file_bytes);
        backing.back_chunk(file, path, 0)?;
        Ok(backing)
    }

    /// An existing index file: the chunks that hold data count as backed. A chunk the
    /// file system reports as a hole reads as zeros: no key lives there.
    pub(super) fn open(file: &File, file_bytes: u64) -> Backing {
        let backing = Backing::empty(file_bytes);
        let fd = file.as_raw_fd();
        let mut at = 0u64;
        while at < file_bytes {
            // SAFETY: lseek on a descriptor we own.
            let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
            if data < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::ENXIO) {
                    // The file system cannot say (or failed to): count the rest as data.
                    backing.mark(at, file_bytes);
                }
                break; // ENXIO: no data after `at`
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
            let end = if hole < 0 { file_bytes } else { (hole as u64).min(file_bytes) };
            backing.mark(data as u64, end);
            if end <= data as u64 {
                backing.mark(data as u64, file_bytes);
                break;
            }
            at = end;
        }
        backing
    }

    /// Sets the bits of the chunks overlapping bytes `[from, to)`.
    fn mark(&self, from: u64, to: u64) {
        if to <= from {
            return;
        }
        for chunk in from / CHUNK_BYTES..to.div_ceil(CHUNK_BYTES) {
            self.bits[(chunk / 64) as usize].fetch_or(1 << (chunk % 64), Ordering::Release);
        }
    }

    #[inline(always)]
    fn chunk_of(bucket: u64) -> u64 {
        (INDEX_HEADER_BYTES as u64 + bucket * BUCKET_BYTES as u64) / CHUNK_BYTES
    }

    /// The first bucket of the chunk after bucket `bucket`'s.
    pub(super) fn next_chunk_bucket(bucket: u64) -> u64 {
        ((Self::chunk_of(bucket) + 1) * CHUNK_BYTES - INDEX_HEADER_BYTES as u64) / BUCKET_BYTES as u64
    }

    #[inline(always)]
    fn chunk_backed(&self, chunk: u64) -> bool {
        self.bits[(chunk / 64) as usize].load(Ordering::Acquire) & (1 << (chunk % 64)) != 0
    }

    /// True when bucket `bucket`'s chunk has blocks.
    #[inline(always)]
    pub(super) fn is_backed(&self, bucket: u64) -> bool {
        self.chunk_backed(Self::chunk_of(bucket))
    }

    /// Makes sure bucket `bucket`'s chunk has blocks before anything writes into it; the
    /// error of a full disk names the file.
    #[inline(always)]
    pub(super) fn back(&self, file: &File, path: &Path, bucket: u64) -> Result<()> {
        let chunk = Self::chunk_of(bucket);
        if self.chunk_backed(chunk) {
            return Ok(());
        }
        self.back_chunk(file, path, chunk)
    }

    #[cold]
    fn back_chunk(&self, file: &File, path: &Path, chunk: u64) -> Result<()> {
        let _g = self.lock.lock();
        if self.chunk_backed(chunk) {
            return Ok(());
        }
        let from = chunk * CHUNK_BYTES;
        crate::fsutil::allocate(file, path, from, (from + CHUNK_BYTES).min(self.file_bytes))?;
        self.bits[(chunk / 64) as usize].fetch_or(1 << (chunk % 64), Ordering::Release);
        Ok(())
    }

    /// Holds off [`back`](Self::back) of unbacked chunks while the caller decides about one.
    pub(super) fn hold(&self) -> MutexGuard<'_, ()> {
        self.lock.lock()
    }

    /// Chunks with blocks.
    #[cfg(test)]
    pub(super) fn backed_chunks(&self) -> u64 {
        self.bits.iter().map(|w| w.load(Ordering::Relaxed).count_ones() as u64).sum()
    }
}
