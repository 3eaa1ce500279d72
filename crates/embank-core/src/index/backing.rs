//! Which parts of the index file have blocks of the file system behind them.
//!
//! The index file is as long as its bucket count asks (`ftruncate`: sparse), but a
//! table of 4 rows and a capacity of 10 M must not take 256 MiB of disk. So the file
//! is backed with blocks a chunk of [`CHUNK_BYTES`] at a time, just before the first
//! write into one of the chunk's buckets ([`Backing::back`]): a key's insert backs
//! every bucket its probe writes. A store through the mapping thus never meets an
//! unbacked page, so a full disk is an `Io` error of the insert, never SIGBUS, and the
//! disk the index takes grows with its keys. A chunk is backed by writing zeros over
//! every page of it that reads as zeros (`fsutil::zero_fill`), not with `fallocate`:
//! the file system allocates at write-back, so chunks backed in hash order still end up
//! in few extents (with `fallocate` each was one, and writing them back took twice the
//! CPU), and no write through the mapping has to convert an unwritten extent on a full
//! disk. A page that reads as zeros was never written (a bucket's version word moves on
//! every lock), so rewriting it changes nothing a reader can see; and it is rewritten
//! also where the file system says it has data: a write cut short by a full disk can
//! leave pages that read as data but fault when written through a mapping (seen on ext4
//! with 1 KiB blocks).
//!
//! Every other write of a bucket (replace, remove, marks, repairs of a cut-short
//! update, overflow counts) goes to a bucket an insert wrote before, which is backed.
//! Nothing writes a bucket it does not need to: the background repair's pass backs a
//! chunk before it locks its buckets (or, on a full disk, locks only buckets that are
//! not all zeros: those were written, so they are backed) and skips chunks without
//! data, and the full repair writes only words that change.
//!
//! One bit per chunk says it is backed: set at open for the chunks wholly data
//! (`SEEK_DATA`), at create for the header's, and by [`Backing::back`]. A chunk with
//! data and holes at open (a backing cut short by a full disk, or a file written before
//! the index was sparse) is partly backed: the repair's pass backs it before writing
//! it. Bits are set under one mutex, so the repair's pass can decide about a chunk no
//! writer is backing.
//!
//! Where sparse files are not safe or cannot be told from written ones
//! (`fsutil::sparse_files_ok`: tmpfs, where a read of a hole through the mapping takes
//! a page of the file system too) the file is allocated whole, as it always was.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use super::bucket::BUCKET_BYTES;
use crate::error::Result;
use crate::format::INDEX_HEADER_BYTES;

/// Bytes of the index file backed at a time: a page, 16 buckets (a write through the
/// mapping dirties a whole page, so no less will do). Keys land in buckets by their hash,
/// so an index of `p` pages holding `n` keys takes about `p * (1 - e^(-n/p))` pages: a
/// page per key while keys are few, whatever the capacity. Chunks of 64 KiB made a
/// table of 1,000 rows in a default table (a 32 MiB index) take 20 MiB.
pub const CHUNK_BYTES: u64 = 4096;
/// A page of memory: the unit a file's bytes are mapped and written back in.
const PAGE_BYTES: u64 = 4096;
const _: () = assert!(CHUNK_BYTES.is_multiple_of(BUCKET_BYTES as u64), "a bucket never straddles two chunks");
const _: () = assert!(CHUNK_BYTES.is_multiple_of(INDEX_HEADER_BYTES as u64), "the header fills whole pages of chunk 0");
const _: () = assert!(PAGE_BYTES.is_multiple_of(BUCKET_BYTES as u64) && CHUNK_BYTES.is_multiple_of(PAGE_BYTES));

/// A bit per chunk.
struct ChunkBits(Box<[AtomicU64]>);

impl ChunkBits {
    fn new(chunks: u64) -> ChunkBits {
        ChunkBits((0..chunks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
    }

    #[inline(always)]
    fn get(&self, chunk: u64) -> bool {
        self.0[(chunk / 64) as usize].load(Ordering::Acquire) & (1 << (chunk % 64)) != 0
    }

    fn set(&self, chunk: u64) {
        self.0[(chunk / 64) as usize].fetch_or(1 << (chunk % 64), Ordering::Release);
    }

    #[cfg(test)]
    fn count(&self) -> u64 {
        self.0.iter().map(|w| w.load(Ordering::Relaxed).count_ones() as u64).sum()
    }
}

/// The backed chunks of one index file.
pub(super) struct Backing {
    /// The chunk has blocks (or the file system's promise of them) for every byte.
    backed: ChunkBits,
    /// The chunk held data and holes at open: only its holes are filled.
    partial: ChunkBits,
    /// Held while a chunk is backed (and while the repair's pass decides about one).
    lock: Mutex<()>,
    file_bytes: u64,
}

impl Backing {
    fn empty(file_bytes: u64) -> Backing {
        let chunks = file_bytes.div_ceil(CHUNK_BYTES);
        Backing { backed: ChunkBits::new(chunks), partial: ChunkBits::new(chunks), lock: Mutex::new(()), file_bytes }
    }

    /// A new index file of `file_bytes` (already that long): backs the header's chunk.
    pub(super) fn create(file: &File, path: &Path, file_bytes: u64) -> Result<Backing> {
        if !crate::fsutil::sparse_files_ok(file) {
            return Backing::whole(file, path, file_bytes);
        }
        let backing = Backing::empty(file_bytes);
        backing.back_chunk(file, path, 0)?;
        Ok(backing)
    }

    /// An existing index file: the chunks wholly data count as backed, those with data
    /// and holes as partly. A chunk without data reads as zeros: no key lives there.
    pub(super) fn open(file: &File, path: &Path, file_bytes: u64) -> Result<Backing> {
        if !crate::fsutil::sparse_files_ok(file) {
            return Backing::whole(file, path, file_bytes);
        }
        let backing = Backing::empty(file_bytes);
        for (from, to) in crate::fsutil::data_ranges(file, 0, file_bytes) {
            let (first, last) = (from / CHUNK_BYTES, (to - 1) / CHUNK_BYTES);
            for chunk in first..=last {
                let (start, end) = (chunk * CHUNK_BYTES, ((chunk + 1) * CHUNK_BYTES).min(file_bytes));
                if from <= start && end <= to {
                    backing.backed.set(chunk);
                } else {
                    backing.partial.set(chunk);
                }
            }
        }
        Ok(backing)
    }

    /// Every chunk backed, now (`fallocate`).
    fn whole(file: &File, path: &Path, file_bytes: u64) -> Result<Backing> {
        crate::fsutil::allocate(file, path, 0, file_bytes)?;
        let backing = Backing::empty(file_bytes);
        for chunk in 0..file_bytes.div_ceil(CHUNK_BYTES) {
            backing.backed.set(chunk);
        }
        Ok(backing)
    }

    #[inline(always)]
    fn chunk_of(bucket: u64) -> u64 {
        Self::offset_of(bucket) / CHUNK_BYTES
    }

    #[inline(always)]
    fn offset_of(bucket: u64) -> u64 {
        INDEX_HEADER_BYTES as u64 + bucket * BUCKET_BYTES as u64
    }

    /// The first bucket of the chunk after bucket `bucket`'s.
    pub(super) fn next_chunk_bucket(bucket: u64) -> u64 {
        ((Self::chunk_of(bucket) + 1) * CHUNK_BYTES - INDEX_HEADER_BYTES as u64) / BUCKET_BYTES as u64
    }

    /// True when bucket `bucket`'s chunk is backed.
    #[inline(always)]
    pub(super) fn is_backed(&self, bucket: u64) -> bool {
        self.backed.get(Self::chunk_of(bucket))
    }

    /// True when bucket `bucket`'s chunk held data and holes at open.
    pub(super) fn is_partial(&self, bucket: u64) -> bool {
        self.partial.get(Self::chunk_of(bucket))
    }

    /// Makes sure bucket `bucket`'s chunk has blocks before anything writes into it; the
    /// error of a full disk names the file.
    #[inline(always)]
    pub(super) fn back(&self, file: &File, path: &Path, bucket: u64) -> Result<()> {
        let chunk = Self::chunk_of(bucket);
        if self.backed.get(chunk) {
            return Ok(());
        }
        self.back_chunk(file, path, chunk)
    }

    #[cold]
    fn back_chunk(&self, file: &File, path: &Path, chunk: u64) -> Result<()> {
        let held = self.lock.lock();
        self.back_chunk_held(&held, file, path, chunk)
    }

    /// [`back`](Self::back) for a caller holding [`hold`](Self::hold)'s guard.
    pub(super) fn back_held(&self, held: &MutexGuard<'_, ()>, file: &File, path: &Path, bucket: u64) -> Result<()> {
        self.back_chunk_held(held, file, path, Self::chunk_of(bucket))
    }

    fn back_chunk_held(&self, _held: &MutexGuard<'_, ()>, file: &File, path: &Path, chunk: u64) -> Result<()> {
        if self.backed.get(chunk) {
            return Ok(());
        }
        let (from, to) = (chunk * CHUNK_BYTES, ((chunk + 1) * CHUNK_BYTES).min(self.file_bytes));
        if !self.partial.get(chunk) {
            // No data at open, none written since (writes wait for this): zeros throughout.
            crate::fsutil::zero_fill(file, path, from, to)?;
            self.backed.set(chunk);
            return Ok(());
        }
        let mut bytes = vec![0u8; (to - from) as usize];
        file.read_exact_at(&mut bytes, from).map_err(|e| crate::error::io_at("cannot read", path, e))?;
        // Runs of pages that read as zeros, each rewritten with one write.
        let mut run: Option<u64> = None;
        for (i, page) in bytes.chunks(PAGE_BYTES as usize).enumerate() {
            let at = from + i as u64 * PAGE_BYTES;
            let zero = page.iter().all(|&b| b == 0);
            match (zero, run) {
                (true, None) => run = Some(at),
                (false, Some(start)) => {
                    crate::fsutil::zero_fill(file, path, start, at)?;
                    run = None;
                }
                _ => {}
            }
        }
        if let Some(start) = run {
            crate::fsutil::zero_fill(file, path, start, to)?;
        }
        self.backed.set(chunk);
        Ok(())
    }

    /// Holds off the backing of chunks while the caller decides about one.
    pub(super) fn hold(&self) -> MutexGuard<'_, ()> {
        self.lock.lock()
    }

    /// Chunks backed.
    #[cfg(test)]
    pub(super) fn backed_chunks(&self) -> u64 {
        self.backed.count()
    }
}
