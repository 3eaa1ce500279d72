//! A rollback on first touch: the undo of a checkpoint's journal applied to each key
//! before anyone reads or writes it, and to the rest by a background pass.
//!
//! A rollback after a killed process puts every key the journal names back at its record
//! of the checkpoint. Applied before the table serves, it costs one random read of an
//! index page per entry on a cold page cache (~75 k entries/s on a VM disk: 2.6 s for
//! 200 k entries). Here the open only reads the journal (sequentially), keeps its
//! entries in DRAM sorted by their key's home bucket, and marks those buckets pending (a
//! byte per bucket). Every lookup and write starts at its key's home bucket
//! ([`Index::undo_gate`]): if that bucket is pending, the undo of every entry homed
//! there is applied first. A key's undo touches only that key's slot (and the overflow
//! counts of its own probe path), so a key whose undo is done is exactly at the
//! checkpoint whatever the state of other keys. [`Index::undo_all`] applies the rest.
//!
//! Applying an undo uses the index's ungated operations, so it never waits on another
//! bucket's undo: no cycle between two pending buckets can form. A thread that finds
//! a bucket busy (another thread applying it) spins until it is done; the applier holds
//! no bucket lock while it waits for nothing else.
//!
//! Whole-index walks ([`Index::for_each`]) apply every pending undo first.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

use parking_lot::Mutex;

use super::Index;
use crate::error::{Error, ErrorKind, Result};

/// Buckets a page of the index file holds (at most: the header shifts them).
const BUCKETS_PER_PAGE: u64 = 16;

/// Per-bucket state: nothing to undo (or done), pending, being applied.
const CLEAR: u8 = 0;
const PENDING: u8 = 1;
const BUSY: u8 = 2;

/// An entry of a lazy rollback: the key's record at the checkpoint (0: absent there).
#[derive(Clone, Copy, Debug)]
struct Undo {
    home: u64,
    key: u64,
    old: u64,
}

pub(super) struct LazyUndo {
    /// The checkpoint rolled back to (for errors).
    to: u64,
    /// Sorted by home bucket.
    entries: Vec<Undo>,
    state: Box<[AtomicU8]>,
    /// Buckets still pending or busy.
    left: AtomicU64,
    /// False once every bucket is done.
    active: AtomicBool,
    /// The first undo that failed (no slot to return a key to, or no disk for it).
    error: Mutex<Option<Error>>,
}

impl Index {
    /// Starts a rollback on first touch to checkpoint `to`: `entries` are the journal's
    /// `(key, record at the checkpoint)` in append order (a key's first entry wins).
    /// Needs a lazy repair running ([`begin_lazy_repair`](Self::begin_lazy_repair)):
    /// its flag is the one the gate reads. Returns the keys to undo.
    pub fn begin_lazy_undo(&mut self, to: u64, entries: impl IntoIterator<Item = (u64, u64)>) -> u64 {
        assert!(self.lazy.is_some(), "a rollback on first touch runs inside a lazy repair");
        let mut v: Vec<Undo> = entries.into_iter().map(|(key, old)| Undo { home: 0, key, old }).collect();
        // Stable: a key's first entry stays first among its own.
        v.sort_by_key(|u| u.key);
        v.dedup_by_key(|u| u.key);
        for u in &mut v {
            u.home = self.geo.home(self.hash(u.key));
        }
        v.sort_unstable_by_key(|u| u.home);
        // Zeroed pages from the allocator (CLEAR is 0); AtomicU8 has u8's layout.
        let bytes = vec![0u8; self.bucket_count as usize].into_boxed_slice();
        // SAFETY: same size and alignment, and every bit pattern is a valid AtomicU8.
        let state = unsafe { Box::from_raw(Box::into_raw(bytes) as *mut [AtomicU8]) };
        let mut left = 0;
        for u in &v {
            let s = &state[u.home as usize];
            if s.load(Ordering::Relaxed) == CLEAR {
                s.store(PENDING, Ordering::Relaxed);
                left += 1;
            }
        }
        let keys = v.len() as u64;
        self.undo = Some(Box::new(LazyUndo {
            to,
            entries: v,
            state,
            left: AtomicU64::new(left),
            active: AtomicBool::new(left > 0),
            error: Mutex::new(None),
        }));
        keys
    }

    /// Applies the pending undo of the keys homed at `home` before a lookup or write of
    /// a key homed there (see the module docs). One load of the repair flag when no
    /// repair runs.
    #[inline(always)]
    pub(super) fn undo_gate(&self, home: u64) {
        if self.repairing.load(Ordering::Acquire) {
            self.undo_gate_slow(home);
        }
    }

    #[inline(never)]
    fn undo_gate_slow(&self, home: u64) {
        if let Some(u) = &self.undo {
            if u.active.load(Ordering::Acquire) {
                self.ensure_undone(u, home);
            }
        }
    }

    fn ensure_undone(&self, u: &LazyUndo, b: u64) {
        let state = &u.state[b as usize];
        loop {
            match state.load(Ordering::Acquire) {
                CLEAR => return,
                PENDING => {
                    if state.compare_exchange(PENDING, BUSY, Ordering::Acquire, Ordering::Acquire).is_ok() {
                        self.apply_bucket(u, b);
                        // The count first: whoever finds the last bucket clear finds the
                        // rollback over (`undo_all`).
                        if u.left.fetch_sub(1, Ordering::AcqRel) == 1 {
                            u.active.store(false, Ordering::Release);
                        }
                        state.store(CLEAR, Ordering::Release);
                        return;
                    }
                }
                _ => std::hint::spin_loop(),
            }
        }
    }

    fn apply_bucket(&self, u: &LazyUndo, b: u64) {
        let first = u.entries.partition_point(|e| e.home < b);
        for e in u.entries[first..].iter().take_while(|e| e.home == b) {
            if let Err(err) = self.undo_one(u.to, e) {
                tracing::error!(key = e.key, to = u.to, error = %err, "cannot return a key to its checkpoint");
                u.error.lock().get_or_insert(err);
            }
        }
    }

    /// Returns one key to its record at the checkpoint (the eager rollback's step).
    fn undo_one(&self, to: u64, e: &Undo) -> Result<()> {
        let h = self.hash(e.key);
        if e.old == 0 {
            self.remove_ungated(e.key, h);
        } else if self.replace_ungated(e.key, h, e.old).is_none() {
            if !self.insert_new_ungated(e.key, h, e.old)? {
                return Err(Error::new(
                    ErrorKind::Recover,
                    format!("no index slot to return key {} to checkpoint {to}", e.key),
                ));
            }
            // A slot's mark says its key was journaled this interval; the key this slot
            // held before may have been (and removed since), this one was not: its next
            // change must be journaled. (Every other insert is journaled first.)
            let f = self.find_ungated(e.key, h).expect("inserted above, under its bucket's undo");
            self.clear_mark(f.bucket, f.slot);
        }
        Ok(())
    }

    /// The checkpoint records a rollback on first touch returns keys to (each key's
    /// first entry; none while no rollback runs).
    pub fn undo_records(&self) -> impl Iterator<Item = u64> + '_ {
        self.undo.iter().flat_map(|u| u.entries.iter().filter(|e| e.old != 0).map(|e| e.old))
    }

    /// True while keys wait for their undo.
    pub fn undo_pending(&self) -> bool {
        self.undo.as_ref().is_some_and(|u| u.active.load(Ordering::Acquire))
    }

    /// The background part of a rollback on first touch: applies the undo of the
    /// buckets from entry `from` on (of the entries sorted by home bucket) until
    /// `buckets` buckets were passed; returns where to go on (the entry count once all
    /// were passed: every undo is then done, those of other threads waited for).
    pub fn undo_some(&self, from: usize, buckets: u64) -> usize {
        let Some(u) = &self.undo else { return 0 };
        // The chunk's buckets asked from the disk first, all at once (see `will_need`).
        let mut i = from;
        let (mut passed, mut last_page) = (0, u64::MAX);
        while i < u.entries.len() && passed < buckets {
            let home = u.entries[i].home;
            if home / BUCKETS_PER_PAGE != last_page && u.state[home as usize].load(Ordering::Relaxed) == PENDING {
                last_page = home / BUCKETS_PER_PAGE;
                self.will_need(home, home + 1);
            }
            while i < u.entries.len() && u.entries[i].home == home {
                i += 1;
            }
            passed += 1;
        }
        let mut i = from;
        let mut passed = 0;
        while i < u.entries.len() && passed < buckets {
            let home = u.entries[i].home;
            self.ensure_undone(u, home);
            while i < u.entries.len() && u.entries[i].home == home {
                i += 1;
            }
            passed += 1;
        }
        i
    }

    /// Applies every pending undo (waiting for those other threads are applying): the
    /// rollback on first touch is then over. The first undo that failed is the error
    /// (the key it names stays where the killed process left it).
    pub fn undo_all(&self) -> Result<()> {
        let Some(u) = &self.undo else { return Ok(()) };
        if u.active.load(Ordering::Acquire) {
            self.undo_some(0, u64::MAX);
        }
        debug_assert!(!u.active.load(Ordering::Acquire));
        match u.error.lock().as_ref() {
            Some(e) => Err(Error::new(e.kind(), e.to_string())),
            None => Ok(()),
        }
    }
}
