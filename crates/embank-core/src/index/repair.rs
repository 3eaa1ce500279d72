//! Repair of an index a killed process left: the full pass ([`Index::recover`]) and
//! the repair on first touch with its background scan (see the module docs of `index`).

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicU8, Ordering};

use super::bucket::{Bucket, RecoverReport, SLOTS_PER_BUCKET};
use super::Index;
use crate::format;
use crate::hash::fingerprint;

/// Per-bucket repair state of a lazy repair.
pub(super) const UNCHECKED: u8 = 0;
pub(super) const BUSY: u8 = 1;
pub(super) const DONE: u8 = 2;

/// The state of a repair on first touch.
pub(super) struct LazyRepair {
    /// Per bucket: `UNCHECKED`, `BUSY` (being repaired), `DONE`.
    state: Box<[AtomicU8]>,
    /// Buckets below it have been counted by the background pass.
    cursor: AtomicU64,
    /// Keys the background pass counted (each bucket when it passed it).
    counted: AtomicU64,
    /// Keys inserted into counted buckets since, less those removed from them.
    delta: AtomicI64,
    buckets_interrupted: AtomicU64,
    slots_dropped: AtomicU64,
}

impl Index {
    /// Clears slots without a fingerprint and drops those whose fingerprint does not
    /// match their key, that point nowhere, or that `keep` refuses; returns how many
    /// were dropped. The caller owns the bucket (exclusive access or its repair).
    pub(super) fn clean_slots(&self, bucket: &Bucket, mut keep: impl FnMut(u64, u64) -> bool) -> u64 {
        let mut dropped = 0;
        for slot in 0..SLOTS_PER_BUCKET {
            let fp = bucket.fp(slot);
            let (key, row) = bucket.slot(slot);
            if fp == 0 {
                if key != 0 || row != 0 {
                    bucket.set_slot(slot, 0, 0);
                }
                continue;
            }
            // Every row number is a row (0 included); `keep` checks it was handed out.
            if !(fingerprint(self.hash(key)) == fp && keep(key, self.ptr_of(row))) {
                dropped += 1;
                bucket.set_fp(slot, 0);
                bucket.set_slot(slot, 0, 0);
            }
        }
        dropped
    }

    /// Starts a repair on first touch (see the module docs). Only for an index a killed
    /// process left in this boot ([`opened_in_this_boot`](Self::opened_in_this_boot)):
    /// buckets are then whole except those with an odd version. Until
    /// [`finish_lazy_repair`](Self::finish_lazy_repair), [`len`](Self::len) may be off
    /// by the inserts and removes the kill cut short.
    pub fn begin_lazy_repair(&mut self) {
        let n = self.bucket_count as usize;
        // Zeroed pages from the allocator (UNCHECKED is 0); AtomicU8 has u8's layout.
        let bytes = vec![0u8; n].into_boxed_slice();
        // SAFETY: same size and alignment, and every bit pattern is a valid AtomicU8.
        let state = unsafe { Box::from_raw(Box::into_raw(bytes) as *mut [AtomicU8]) };
        self.lazy = Some(Box::new(LazyRepair {
            state,
            cursor: AtomicU64::new(0),
            counted: AtomicU64::new(0),
            delta: AtomicI64::new(0),
            buckets_interrupted: AtomicU64::new(0),
            slots_dropped: AtomicU64::new(0),
        }));
        self.repairing.store(true, Ordering::Release);
    }

    /// Repairs bucket `b` unless that is done; waits while another thread repairs it.
    pub(super) fn ensure_repaired(&self, lazy: &LazyRepair, b: u64) {
        let state = &lazy.state[b as usize];
        loop {
            match state.load(Ordering::Acquire) {
                DONE => return,
                UNCHECKED => {
                    if state.compare_exchange(UNCHECKED, BUSY, Ordering::Acquire, Ordering::Acquire).is_ok() {
                        self.repair_one(lazy, b);
                        state.store(DONE, Ordering::Release);
                        return;
                    }
                }
                _ => std::hint::spin_loop(),
            }
        }
    }

    /// Repairs one bucket a killed process may have left locked: an odd version means
    /// an update was cut short there; its slots are cleaned and the bucket unlocked.
    pub(super) fn repair_one(&self, lazy: &LazyRepair, b: u64) {
        let bucket = self.raw_bucket(b);
        let v = bucket.version.load(Ordering::Acquire);
        if v & 1 == 0 {
            return;
        }
        let dropped = self.clean_slots(bucket, |_, _| true);
        lazy.buckets_interrupted.fetch_add(1, Ordering::Relaxed);
        lazy.slots_dropped.fetch_add(dropped, Ordering::Relaxed);
        bucket.version.store(v.wrapping_add(1), Ordering::Release);
    }

    /// A writer changed the key count of bucket `b` (it holds the bucket's lock): if the
    /// background pass already counted that bucket, the change goes into its delta.
    pub(super) fn count_change(&self, b: u64, d: i64) {
        if let Some(lazy) = &self.lazy {
            if b < lazy.cursor.load(Ordering::Acquire) {
                lazy.delta.fetch_add(d, Ordering::Relaxed);
            }
        }
    }

    /// The background pass of a lazy repair over buckets `[start, end)`, which must
    /// continue where the last call stopped: repairs each bucket, counts its keys and
    /// calls `f(key, ptr)` for each, under the bucket's lock. Locking a bucket writes it,
    /// so only buckets of pages with blocks are locked (see `backing.rs`): pages that are
    /// holes, or read as zeros, hold no key and are passed over untouched.
    pub fn repair_scan(&self, start: u64, end: u64, mut f: impl FnMut(u64, u64)) {
        let lazy = self.lazy.as_ref().expect("repair_scan without begin_lazy_repair");
        assert_eq!(start, lazy.cursor.load(Ordering::Acquire), "repair_scan must continue where it stopped");
        let end = end.min(self.bucket_count);
        let mut b = start;
        while b < end {
            if !self.backing.is_backed(b) {
                // No writer backs the page while this decides (an insert backs its
                // bucket's page first): one that backs it later finds the cursor past
                // its bucket and counts its change in the delta.
                let held = self.backing.hold();
                if !self.backing.is_backed(b) {
                    let data = match &self.file {
                        Some(file) => self.backing.next_data_bucket(file, b),
                        None => b,
                    };
                    let page_end = super::Backing::next_page_bucket(b);
                    let skip_to = if data > b {
                        Some(data) // holes up to there
                    } else if (b..page_end.min(self.bucket_count)).all(|i| self.raw_bucket(i).is_zero()) {
                        Some(page_end) // never written
                    } else {
                        self.backing.set_written(&held, b);
                        None
                    };
                    if let Some(to) = skip_to {
                        let to = to.min(end);
                        lazy.cursor.store(to, Ordering::Release);
                        b = to;
                        continue;
                    }
                }
            }
            self.scan_bucket(lazy, b, &mut f);
            b += 1;
        }
    }

    /// Repairs bucket `b` and counts its keys (the pass's cursor is at `b`).
    fn scan_bucket(&self, lazy: &LazyRepair, b: u64, f: &mut impl FnMut(u64, u64)) {
        self.ensure_repaired(lazy, b);
        let bucket = self.raw_bucket(b);
        let v = bucket.lock();
        let mut n = 0;
        for slot in 0..SLOTS_PER_BUCKET {
            if bucket.fp(slot) != 0 {
                n += 1;
                let (key, row) = bucket.slot(slot);
                f(key, self.ptr_of(row));
            }
        }
        lazy.counted.fetch_add(n, Ordering::Relaxed);
        lazy.cursor.store(b + 1, Ordering::Release);
        bucket.unlock(v);
    }

    /// Ends a lazy repair once [`repair_scan`](Self::repair_scan) has passed every
    /// bucket: sets the exact key count. No insert or remove may run meanwhile (the
    /// table holds every writer stripe).
    pub fn finish_lazy_repair(&self) -> RecoverReport {
        let lazy = self.lazy.as_ref().expect("finish_lazy_repair without begin_lazy_repair");
        assert_eq!(lazy.cursor.load(Ordering::Acquire), self.bucket_count, "the background pass is not done");
        let keys = (lazy.counted.load(Ordering::Relaxed) as i64 + lazy.delta.load(Ordering::Relaxed)).max(0) as u64;
        self.word(format::INDEX_LEN_OFFSET).store(keys, Ordering::Relaxed);
        self.repairing.store(false, Ordering::Release);
        RecoverReport {
            buckets_interrupted: lazy.buckets_interrupted.load(Ordering::Relaxed),
            slots_dropped: lazy.slots_dropped.load(Ordering::Relaxed),
            keys,
        }
    }

    /// Repairs the index after a crash; needs exclusive access.
    ///
    /// Every bucket with an odd version (an update cut short) is unlocked, and
    /// `keep(key, ptr, interrupted)` decides for each occupied slot whether it
    /// stays: a slot whose fingerprint does not match its key is dropped.
    /// Overflow counters and the key count are then recomputed exactly.
    pub fn recover(&self, mut keep: impl FnMut(u64, u64, bool) -> bool) -> RecoverReport {
        let mut report = RecoverReport::default();
        for b in 0..self.bucket_count {
            let bucket = self.raw_bucket(b);
            let v = bucket.version.load(Ordering::Relaxed);
            let interrupted = v & 1 == 1;
            if interrupted {
                report.buckets_interrupted += 1;
                bucket.version.store(v.wrapping_add(1), Ordering::Relaxed);
            }
            // Only a word that changes is written: a write to a part of the file without
            // blocks would give it blocks (see `backing.rs`).
            if bucket.overflow.load(Ordering::Relaxed) != 0 {
                bucket.overflow.store(0, Ordering::Relaxed);
            }
            report.slots_dropped += self.clean_slots(bucket, |key, ptr| keep(key, ptr, interrupted));
        }
        // Recount overflow along each key's probe path.
        let mut keys = 0;
        for b in 0..self.bucket_count {
            let bucket = self.raw_bucket(b);
            for slot in 0..SLOTS_PER_BUCKET {
                if bucket.fp(slot) == 0 {
                    continue;
                }
                keys += 1;
                let h = self.hash(bucket.key(slot).load(Ordering::Relaxed));
                let (home, step) = (self.geo.home(h), self.geo.step(h));
                let mut p = home;
                while p != b {
                    self.raw_bucket(p).overflow.fetch_add(1, Ordering::Relaxed);
                    p = self.geo.next(p, step);
                }
            }
        }
        self.word(format::INDEX_LEN_OFFSET).store(keys, Ordering::Relaxed);
        report.keys = keys;
        report
    }
}
