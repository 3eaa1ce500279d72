//! The staged (pipelined) lookup of a batch: each stage runs over the whole batch before
//! the next, so every line a stage reads was asked for a batch earlier.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use super::bucket::{match_fp, SLOTS_PER_BUCKET};
use super::{Bucket, Index};
use crate::hash::fingerprint;

/// What the second stage of a pipelined lookup hands the third: the home bucket's
/// version, whether keys overflow it, and its slots whose fingerprint matches.
#[derive(Clone, Copy, Debug)]
pub struct Probe(u64);
/// Keys [`Index::get_staged`] should be given at once, at most: the lines it fetches (a
/// bucket's first line, a slot's) and the rows its caller prefetches stay in the core's
/// cache between stages.
pub const STAGED_KEYS_MAX: usize = 256;
/// A probe's mark for a key left to [`Index::get`] (its bucket was being written).
const PROBE_SLOW: u64 = u64::MAX;
/// The bit of a probe that says keys overflow the home bucket (below it: the slots whose
/// fingerprint matches; above 32: the bucket's version).
const PROBE_OVERFLOW_BIT: u32 = 24;
const _: () = assert!(SLOTS_PER_BUCKET <= PROBE_OVERFLOW_BIT as usize);
const _: () = assert!(STAGED_KEYS_MAX <= 256, "get_staged keeps positions in a u8");

/// What the last stage of a staged lookup found in the home bucket.
enum Staged {
    Found(u64),
    Absent,
    /// Past the home bucket, or the bucket changed between the stages: [`Index::get`].
    Further,
}

impl Index {
    /// First stage of a pipelined lookup ([`Index::probe_home`], then
    /// [`Index::probe_slots`]): prefetches the first line of the key's home bucket, the
    /// one holding its seqlock version, overflow counter and fingerprints.
    #[inline(always)]
    pub fn probe_start(&self, hash: u64) {
        crate::prefetch::prefetch_read(self.raw_bucket(self.geo.home(hash)) as *const Bucket as *const u8);
    }

    /// Second stage: reads the home bucket's version, overflow counter and fingerprints
    /// (prefetched by [`Index::probe_start`]) and prefetches the slots whose fingerprint
    /// matches, so a lookup fetches one or two of its bucket's four lines. Returns what
    /// [`Index::probe_slots`] needs.
    #[inline(always)]
    pub fn probe_home(&self, hash: u64) -> Probe {
        let home = self.geo.home(hash);
        self.undo_gate(home);
        let bucket = self.bucket(home);
        let v1 = bucket.version.load(Ordering::Acquire);
        if v1 & 1 == 1 {
            return Probe(PROBE_SLOW);
        }
        let candidates = match_fp(bucket.fp_words(), fingerprint(hash));
        let overflow = (bucket.overflow.load(Ordering::Relaxed) != 0) as u64;
        let mut c = candidates;
        while c != 0 {
            let slot = c.trailing_zeros() as usize;
            c &= c - 1;
            // The slot's line (its key and row number).
            crate::prefetch::prefetch_read(bucket.key(slot) as *const AtomicU64 as *const u8);
        }
        Probe((v1 as u64) << 32 | overflow << PROBE_OVERFLOW_BIT | candidates as u64)
    }

    /// Last stage: the key's row pointer. Reads the candidate slots, then the version
    /// again: [`Bucket::read`]'s seqlock read spread over the stages (version with
    /// acquire, fingerprints, overflow and slots, a fence, the version). A key past its
    /// home bucket, or in a bucket a writer changed meanwhile, takes [`Index::get`].
    #[cfg(test)]
    #[inline(always)]
    pub fn probe_slots(&self, key: u64, hash: u64, probe: Probe) -> Option<u64> {
        match self.probe_home_slots(key, hash, probe) {
            Staged::Found(ptr) => Some(ptr),
            Staged::Absent => None,
            Staged::Further => self.get(key, hash),
        }
    }

    /// [`Index::probe_slots`] without the fall-back: `Further` where the key may lie past
    /// its home bucket or the bucket changed between the stages.
    #[inline(always)]
    fn probe_home_slots(&self, key: u64, hash: u64, probe: Probe) -> Staged {
        let word = probe.0;
        if word == PROBE_SLOW {
            return Staged::Further;
        }
        let bucket = self.raw_bucket(self.geo.home(hash));
        let mut row = None;
        let mut c = (word & ((1 << SLOTS_PER_BUCKET) - 1)) as u32;
        while c != 0 {
            let slot = c.trailing_zeros() as usize;
            c &= c - 1;
            if bucket.key(slot).load(Ordering::Relaxed) == key {
                row = Some(bucket.row(slot).load(Ordering::Relaxed));
                break;
            }
        }
        fence(Ordering::Acquire);
        if bucket.version.load(Ordering::Relaxed) != (word >> 32) as u32 {
            return Staged::Further;
        }
        match row {
            Some(row) => Staged::Found(self.ptr_of(row)),
            None if word & 1 << PROBE_OVERFLOW_BIT == 0 => Staged::Absent,
            None => Staged::Further,
        }
    }

    /// Lock-free lookup of a batch, each stage of [`Index::probe_start`],
    /// [`Index::probe_home`] and [`Index::probe_slots`] run over the whole batch before
    /// the next, so every line a stage reads was asked for a batch earlier. `ptrs[i]`
    /// becomes key `i`'s row pointer, 0 when absent. Keys not in their home bucket have
    /// their next bucket prefetched by the last stage and are read by [`Index::get`]
    /// after it, rather than waiting on that bucket inside it. Give it at most
    /// [`STAGED_KEYS_MAX`] keys: the lines fetched stay in the core's cache. Callers
    /// prefetch the rows in a pass of their own once it returns: prefetching each row as
    /// its pointer was read, inside the last stage, was 6-11 % slower (ycsb-c 10 M x 128,
    /// f32 and int8, two alternating pairs each): the row's nine lines filled the core's
    /// misses in flight while the stage still waited on slot lines.
    #[inline]
    pub fn get_staged(&self, keys: &[u64], hashes: &[u64], ptrs: &mut [u64]) {
        let n = keys.len();
        debug_assert!(hashes.len() == n && ptrs.len() == n);
        assert!(n <= STAGED_KEYS_MAX, "get_staged takes at most {STAGED_KEYS_MAX} keys, not {n}");
        for &h in hashes {
            self.probe_start(h);
        }
        // The probes wait in `ptrs` until their pointers replace them.
        for i in 0..n {
            ptrs[i] = self.probe_home(hashes[i]).0;
        }
        let mut further = [0u8; STAGED_KEYS_MAX];
        let mut further_len = 0;
        for i in 0..n {
            ptrs[i] = match self.probe_home_slots(keys[i], hashes[i], Probe(ptrs[i])) {
                Staged::Found(ptr) => ptr,
                Staged::Absent => 0,
                Staged::Further => {
                    let next = self.geo.next(self.geo.home(hashes[i]), self.geo.step(hashes[i]));
                    self.prefetch_bucket(next);
                    further[further_len] = i as u8;
                    further_len += 1;
                    0
                }
            };
        }
        for &i in &further[..further_len] {
            let i = i as usize;
            if let Some(ptr) = self.get(keys[i], hashes[i]) {
                ptrs[i] = ptr;
            }
        }
    }
}
