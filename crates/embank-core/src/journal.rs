//! Undo journals of checkpoints: `undo.<seq>.ebj` in a table's directory.
//!
//! While checkpoint `seq` is the latest, the first change of each key appends
//! `(key, record pointer the key had at the checkpoint, seq)` to journal `seq` — before
//! the index changes, so a process killed at any instruction never has an index change
//! whose undo entry is missing. Rolling back to checkpoint `s` applies journals `>= s`
//! newest first, each in reverse, so each key's earliest entry wins. The records the
//! entries point at are kept (not reused) while their checkpoint is retained.
//!
//! Appending is a few stores into a shared mapping (the page cache; no system call), so
//! it survives a SIGKILL like every other write of the store; `flush` makes it durable.
//!
//! ```text
//! header (64 bytes): magic "EMBKUNDO", version u32, entry bytes u32 (32), next u64
//!                    (entries handed out), rolled-back u64 (entries before it were
//!                    undone by a rollback to this checkpoint; 0 in older files), zeros
//! entry (32 bytes):  key u64, old pointer u64 (0 = the key was absent), seq u64,
//!                    check u64 = mix(key, old, seq) | 1 (0 = never completed)
//! ```

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};
use parking_lot::Mutex;

use crate::error::{io_at, Error, ErrorKind, Result};

const MAGIC: &[u8; 8] = b"EMBKUNDO";
const VERSION: u32 = 1;
const HEADER: u64 = 64;
const ENTRY: u64 = 32;
/// Address space reserved per journal: 2^31 entries.
const RESERVE: u64 = 64 << 30;
/// A new journal's size, and the least it grows by: a table whose checkpoints change
/// few keys keeps small journals.
const GROW_BYTES_MIN: u64 = 64 << 10;
/// The most it grows by at a time; below that, it doubles.
const GROW_BYTES_MAX: u64 = 16 << 20;
const _: () = assert!(GROW_BYTES_MIN > HEADER && GROW_BYTES_MIN < GROW_BYTES_MAX && GROW_BYTES_MAX < RESERVE);

/// A dropped checkpoint's journal up to this size becomes the next spare (see
/// [`Journal::recycle`]); a larger one is deleted.
const RECYCLE_BYTES_MAX: u64 = 64 << 20;

/// Slots a batch reserves at a time.
const SLOTS_PER_RESERVE: u64 = 32;

/// A batch's writer: reserves slots in runs, so the shared counter is touched once per
/// run instead of once per entry.
pub struct Writer {
    journal: std::sync::Arc<Journal>,
    next: u64,
    end: u64,
}

impl Writer {
    pub fn new(journal: std::sync::Arc<Journal>) -> Writer {
        Writer { journal, next: 0, end: 0 }
    }

    pub fn seq(&self) -> u64 {
        self.journal.seq
    }

    pub fn append(&mut self, key: u64, old: u64) -> Result<()> {
        if self.next == self.end {
            self.next = self.journal.reserve(SLOTS_PER_RESERVE)?;
            self.end = self.next + SLOTS_PER_RESERVE;
        }
        self.journal.write(self.next, key, old);
        self.next += 1;
        Ok(())
    }
}

/// One undo entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub key: u64,
    /// The key's record at the checkpoint; 0 if it had none.
    pub old: u64,
    pub seq: u64,
}

fn check(e: &Entry) -> u64 {
    let mut z = e.key ^ e.old.rotate_left(21) ^ e.seq.rotate_left(42) ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) | 1
}

pub struct Journal {
    path: PathBuf,
    seq: u64,
    file: File,
    map: MmapRaw,
    /// Bytes of the file (grows under `grow`).
    len: AtomicU64,
    grow: Mutex<()>,
}

// SAFETY: the mapping is shared memory; each entry is written by the one appender that
// reserved its slot, and read only at open (single-threaded) or after the writers stopped.
unsafe impl Send for Journal {}
unsafe impl Sync for Journal {}

pub fn path_of(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("undo.{seq}.ebj"))
}

/// Sequence numbers of the journals in `dir`.
pub fn list(dir: &Path) -> Vec<u64> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(seq) = name.strip_prefix("undo.").and_then(|s| s.strip_suffix(".ebj")) {
                if let Ok(seq) = seq.parse() {
                    out.push(seq);
                }
            }
        }
    }
    out.sort_unstable();
    out
}

impl Journal {
    /// Creates an empty journal (replacing any file of that name). The file appears
    /// under its name only with its header written (created as `.tmp`, then renamed), so
    /// a process killed meanwhile leaves no journal without one.
    pub fn create(dir: &Path, seq: u64) -> Result<Journal> {
        let path = path_of(dir, seq);
        let tmp = path.with_extension("ebj.tmp");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| io_at("cannot create undo journal", &tmp, e))?;
        crate::fsutil::allocate(&file, &tmp, 0, GROW_BYTES_MIN).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
        let j = Self::map(path.clone(), seq, file, GROW_BYTES_MIN)?;
        // SAFETY: the header lies in the mapping.
        unsafe {
            let p = j.map.as_mut_ptr();
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), p, 8);
            (p.add(8) as *mut u32).write(VERSION.to_le());
            (p.add(12) as *mut u32).write((ENTRY as u32).to_le());
        }
        std::fs::rename(&tmp, &path).map_err(|e| io_at("cannot name undo journal", &path, e))?;
        Ok(j)
    }

    /// Creates an empty spare journal, `undo.spare.ebj`, to become the next checkpoint's
    /// journal with [`adopt`](Self::adopt) (one rename on the checkpoint's path).
    pub fn create_spare(dir: &Path) -> Result<Journal> {
        // Created under a seq no checkpoint has (a left-over is deleted at open), then renamed.
        let mut j = Self::create(dir, u64::MAX)?;
        let spare = dir.join("undo.spare.ebj");
        std::fs::rename(&j.path, &spare).map_err(|e| io_at("cannot name spare undo journal", &spare, e))?;
        j.path = spare;
        Ok(j)
    }

    /// Turns the journal of a dropped checkpoint into the spare: renamed to
    /// `undo.spare.ebj`, its header's counters zeroed. Its file keeps its size and its
    /// pages stay in the page cache, so the next interval's appends write into memory
    /// the kernel already has (a fresh file faults in and zero-fills every page). The old
    /// entries stay behind the new ones but carry the old seq, which every check word
    /// covers: a reader of the adopted journal skips them. `None` if the file is larger
    /// than is worth keeping, or cannot be opened (the caller deletes it).
    pub fn recycle(dir: &Path, seq: u64) -> Option<Journal> {
        let mut j = Self::open(dir, seq).ok()?;
        if j.len.load(Ordering::Acquire) > RECYCLE_BYTES_MAX {
            return None;
        }
        let spare = dir.join("undo.spare.ebj");
        std::fs::rename(&j.path, &spare).ok()?;
        j.path = spare;
        // Renamed first: a process killed from here on leaves a spare, deleted at open.
        j.rolled_back_word().store(0, Ordering::Release);
        j.next().store(0, Ordering::Release);
        Some(j)
    }

    /// Makes a spare (empty) journal the journal of checkpoint `seq`.
    pub fn adopt(mut self, dir: &Path, seq: u64) -> Result<Journal> {
        debug_assert_eq!(self.next().load(Ordering::Acquire), 0);
        let path = path_of(dir, seq);
        std::fs::rename(&self.path, &path).map_err(|e| io_at("cannot name undo journal", &path, e))?;
        self.path = path;
        self.seq = seq;
        Ok(self)
    }

    pub fn open(dir: &Path, seq: u64) -> Result<Journal> {
        let path = path_of(dir, seq);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io_at("cannot open undo journal", &path, e))?;
        let len = file.metadata().map_err(|e| io_at("cannot stat undo journal", &path, e))?.len();
        if !(HEADER..=RESERVE).contains(&len) {
            return Err(Error::new(ErrorKind::Recover, format!("undo journal {} has {len} bytes", path.display())));
        }
        let j = Self::map(path, seq, file, len)?;
        // SAFETY: the header lies in the mapping.
        let (magic, version) = unsafe {
            let p = j.map.as_ptr();
            (std::slice::from_raw_parts(p, 8).to_vec(), u32::from_le((p.add(8) as *const u32).read()))
        };
        if magic != MAGIC || version != VERSION {
            return Err(Error::new(
                ErrorKind::FormatVersion,
                format!("{} is not an undo journal of format version {VERSION}", j.path.display()),
            ));
        }
        Ok(j)
    }

    fn map(path: PathBuf, seq: u64, file: File, len: u64) -> Result<Journal> {
        let map = MmapOptions::new()
            .len(RESERVE as usize)
            .map_raw(&file)
            .map_err(|e| io_at("cannot map undo journal", &path, e))?;
        Ok(Journal { path, seq, file, map, len: AtomicU64::new(len), grow: Mutex::new(()) })
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    fn next(&self) -> &AtomicU64 {
        // SAFETY: 8-aligned word of the header page, inside the mapping for its lifetime.
        unsafe { &*(self.map.as_ptr().add(16) as *const AtomicU64) }
    }

    fn rolled_back_word(&self) -> &AtomicU64 {
        // SAFETY: as `next`.
        unsafe { &*(self.map.as_ptr().add(24) as *const AtomicU64) }
    }

    /// Entries before this one were undone by a rollback to this journal's checkpoint:
    /// every key they name was put back at its record of that checkpoint (which is then
    /// live, not held). They still say what each key held at the checkpoint.
    pub fn rolled_back(&self) -> u64 {
        u64::from_le(self.rolled_back_word().load(Ordering::Acquire))
    }

    /// Records that a rollback has applied every entry so far (see
    /// [`rolled_back`](Self::rolled_back)).
    pub fn mark_rolled_back(&self) {
        let n = self.next().load(Ordering::Acquire);
        self.rolled_back_word().store(n.to_le(), Ordering::Release);
    }

    /// Records that a rollback has applied every entry before `end` (a rollback on
    /// first touch, which new entries followed while it ran).
    pub fn mark_rolled_back_to(&self, end: u64) {
        self.rolled_back_word().store(end.max(self.rolled_back()).to_le(), Ordering::Release);
    }

    /// Entries handed out so far (completed or not): where the next one goes.
    pub fn appended(&self) -> u64 {
        self.next().load(Ordering::Acquire)
    }

    /// The completed entries appended since the last rollback to this checkpoint.
    pub fn entries_since_rollback(&self) -> Vec<Entry> {
        self.entries_from(self.rolled_back())
    }

    /// The completed entries from `first` on, none a rollback undid.
    pub fn entries_since(&self, first: u64) -> Vec<Entry> {
        self.entries_from(first.max(self.rolled_back()))
    }

    /// Appends one entry (the tests'; the table reserves and writes slots itself).
    #[cfg(test)]
    pub fn append(&self, key: u64, old: u64) -> Result<()> {
        let i = self.reserve(1)?;
        self.write(i, key, old);
        Ok(())
    }

    /// Hands out `n` consecutive slots (the file grown to hold them); returns the first.
    /// Slots never written stay zero and are skipped when read.
    pub fn reserve(&self, n: u64) -> Result<u64> {
        let i = self.next().fetch_add(n, Ordering::AcqRel);
        let end = HEADER + (i + n) * ENTRY;
        if end > self.len.load(Ordering::Acquire) {
            let _g = self.grow.lock();
            let len = self.len.load(Ordering::Acquire);
            if end > len {
                if end > RESERVE {
                    return Err(Error::new(ErrorKind::Unsupported, "undo journal is full: take a checkpoint"));
                }
                let new = (end + len.clamp(GROW_BYTES_MIN, GROW_BYTES_MAX)).min(RESERVE);
                crate::fsutil::allocate(&self.file, &self.path, len, new)?;
                self.len.store(new, Ordering::Release);
            }
        }
        Ok(i)
    }

    /// Writes entry `i` (a slot from [`reserve`](Self::reserve), written once).
    pub fn write(&self, i: u64, key: u64, old: u64) {
        let e = Entry { key, old, seq: self.seq };
        // SAFETY: slot i was handed to this caller alone and lies inside the file.
        unsafe {
            let p = self.map.as_mut_ptr().add((HEADER + i * ENTRY) as usize) as *mut u64;
            p.write(key.to_le());
            p.add(1).write(old.to_le());
            p.add(2).write(self.seq.to_le());
            // The check word last: an entry without it was never completed.
            (*(p.add(3) as *const AtomicU64)).store(check(&e).to_le(), Ordering::Release);
        }
    }

    /// Every completed entry, in append order.
    pub fn entries(&self) -> Vec<Entry> {
        self.entries_from(0)
    }

    fn entries_from(&self, first: u64) -> Vec<Entry> {
        let len = self.len.load(Ordering::Acquire);
        let n = self.next().load(Ordering::Acquire).min((len - HEADER) / ENTRY);
        let mut out = Vec::with_capacity(n.saturating_sub(first) as usize);
        for i in first.min(n)..n {
            // SAFETY: inside the file.
            let e = unsafe {
                let p = self.map.as_ptr().add((HEADER + i * ENTRY) as usize) as *const u64;
                let e = Entry {
                    key: u64::from_le(p.read()),
                    old: u64::from_le(p.add(1).read()),
                    seq: u64::from_le(p.add(2).read()),
                };
                (e, u64::from_le((*(p.add(3) as *const AtomicU64)).load(Ordering::Acquire)))
            };
            if e.1 == check(&e.0) && e.0.seq == self.seq {
                out.push(e.0);
            }
        }
        out
    }

    /// Forgets every entry (after the journal was applied; the tests').
    #[cfg(test)]
    pub fn clear(&self) -> Result<()> {
        let _g = self.grow.lock();
        self.next().store(0, Ordering::Release);
        self.file.set_len(HEADER).map_err(|e| io_at("cannot truncate undo journal", &self.path, e))?;
        crate::fsutil::allocate(&self.file, &self.path, HEADER, GROW_BYTES_MIN)?;
        self.len.store(GROW_BYTES_MIN, Ordering::Release);
        Ok(())
    }

    pub fn flush(&self) -> Result<()> {
        self.map.flush().map_err(|e| io_at("cannot sync undo journal", &self.path, e))
    }

    /// Deletes the file.
    pub fn remove(self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_grow_and_clear() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::create(dir.path(), 3).unwrap();
        let n = 3 * GROW_BYTES_MIN / ENTRY + 100; // past the first sizes
        for k in 0..n {
            j.append(k, k * 2).unwrap();
        }
        drop(j);
        let j = Journal::open(dir.path(), 3).unwrap();
        let e = j.entries();
        assert_eq!(e.len() as u64, n);
        assert_eq!(e[7], Entry { key: 7, old: 14, seq: 3 });
        assert_eq!(list(dir.path()), vec![3]);
        j.clear().unwrap();
        assert!(j.entries().is_empty());
        j.append(1, 0).unwrap();
        assert_eq!(j.entries(), vec![Entry { key: 1, old: 0, seq: 3 }]);
    }

    #[test]
    fn a_recycled_journal_shows_only_the_entries_of_its_new_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::create(dir.path(), 4).unwrap();
        for k in 0..100 {
            j.append(k, k + 1).unwrap();
        }
        j.mark_rolled_back();
        j.append(500, 0).unwrap();
        drop(j);
        let spare = Journal::recycle(dir.path(), 4).unwrap();
        assert!(list(dir.path()).is_empty(), "the dropped journal is renamed to the spare");
        assert!(dir.path().join("undo.spare.ebj").exists());
        let j = spare.adopt(dir.path(), 9).unwrap();
        assert_eq!(j.rolled_back(), 0);
        assert!(j.entries().is_empty(), "old entries carry the old seq");
        j.append(7, 70).unwrap();
        // A slot reserved over an old entry and never written (a killed writer).
        j.next().fetch_add(1, Ordering::AcqRel);
        j.append(8, 0).unwrap();
        drop(j);
        let j = Journal::open(dir.path(), 9).unwrap();
        assert_eq!(j.entries(), vec![Entry { key: 7, old: 70, seq: 9 }, Entry { key: 8, old: 0, seq: 9 }]);
        assert_eq!(j.entries_since_rollback().len(), 2);
        assert_eq!(list(dir.path()), vec![9]);
    }

    #[test]
    fn an_entry_without_its_check_word_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::create(dir.path(), 1).unwrap();
        j.append(5, 6).unwrap();
        // A slot handed out whose writer was killed before finishing: zeros.
        j.next().fetch_add(1, Ordering::AcqRel);
        j.append(8, 9).unwrap();
        let keys: Vec<u64> = j.entries().iter().map(|e| e.key).collect();
        assert_eq!(keys, vec![5, 8]);
    }
}
