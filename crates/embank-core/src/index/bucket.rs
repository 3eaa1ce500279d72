//! A bucket as it lies in the file: seqlock version, overflow counter, checkpoint marks,
//! fingerprints, keys and row numbers; and the bit tricks that search it.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// Bytes of one bucket.
pub const BUCKET_BYTES: usize = 256;
/// Slots of one bucket: 8 bytes of header, 8 of marks, 24 of fingerprints (17 used), then
/// 17 keys of 8 bytes and 17 row numbers of 4, each slot's two on one cache line (two
/// slots on the first line, five on each of the others): 15.1 bytes a slot (index format
/// 3; 14 slots of `(key, byte offset)`, 18.3 bytes a slot, before).
pub const SLOTS_PER_BUCKET: usize = 17;
/// Slots on the first line, after the header, marks and fingerprints.
const FIRST_LINE_SLOTS: usize = 2;
/// Slots on each later line: five keys, five row numbers, four bytes unused.
const LINE_SLOTS: usize = 5;
/// Longest probe sequence, in buckets, an insert may walk before the table counts as full.
pub const PROBE_BUCKETS_MAX: u64 = 64;
/// Buckets [`Index::probe_histogram`] looks at, at most.
pub const PROBE_SAMPLE_BUCKETS: u64 = 1 << 16;
/// Largest bucket count (2^40 buckets: 2 * 10^13 slots, far beyond any table).
pub const BUCKET_COUNT_MAX: u64 = 1 << 40;

const _: () = assert!(8 + 8 + 24 + FIRST_LINE_SLOTS * 12 == 64 && LINE_SLOTS * 12 + 4 == 64);
const _: () = assert!(FIRST_LINE_SLOTS + 3 * LINE_SLOTS == SLOTS_PER_BUCKET);
const _: () = assert!(SLOTS_PER_BUCKET <= 24 && MARK_SLOT_BITS as usize == SLOTS_PER_BUCKET);
const _: () = assert!(std::mem::size_of::<Bucket>() == BUCKET_BYTES);

/// One bucket as it lies in the file (little-endian, as this build's target).
#[repr(C, align(64))]
pub struct Bucket {
    /// Seqlock: odd while a writer is inside.
    pub(super) version: AtomicU32,
    /// How many keys whose probe sequence passed this bucket live further on.
    pub(super) overflow: AtomicU32,
    /// Checkpoint marks: a 47-bit interval tag and one bit per slot whose key has been
    /// journaled in that interval ([`Index::journaled`]). Meaningful only to the process
    /// that wrote them (tags are per open), so garbage after a restart is harmless.
    pub(super) marks: AtomicU64,
    /// Fingerprints of slots 0..17 (byte i of the 24); 0 = empty. Bytes 17..24 stay 0.
    pub(super) fps: [AtomicU64; 3],
    /// Slots 0 and 1, on the first line.
    first: Slots<FIRST_LINE_SLOTS>,
    /// Slots 2..17, five a line.
    lines: [Line; 3],
}

/// Keys, then their row numbers: the row of a slot is its record number in the table's
/// rows file (the index turns it into the row pointer its callers see, `Index::units`).
#[repr(C)]
struct Slots<const N: usize> {
    keys: [AtomicU64; N],
    rows: [AtomicU32; N],
}

/// A line of five slots (60 bytes, padded to 64).
type Line = Slots<LINE_SLOTS>;
const _: () = assert!(std::mem::size_of::<Line>() == 64 && std::mem::size_of::<Slots<FIRST_LINE_SLOTS>>() == 24);

/// Byte offsets in a bucket of `slot`'s key (u64) and row number (u32), and of its
/// fingerprint (`docs/FORMAT.md`).
pub const fn slot_offsets(slot: usize) -> (usize, usize, usize) {
    assert!(slot < SLOTS_PER_BUCKET);
    let fp = 16 + slot;
    if slot < FIRST_LINE_SLOTS {
        (40 + 8 * slot, 40 + 8 * FIRST_LINE_SLOTS + 4 * slot, fp)
    } else {
        let s = slot - FIRST_LINE_SLOTS;
        let line = 64 * (1 + s / LINE_SLOTS);
        (line + 8 * (s % LINE_SLOTS), line + 8 * LINE_SLOTS + 4 * (s % LINE_SLOTS), fp)
    }
}

/// [`slot_offsets`] by slot, looked up rather than computed on a lookup's path. Padded to
/// 32 entries, so an index below 32 needs no bounds check.
const fn offsets(which: usize) -> [u8; 32] {
    let mut at = [0u8; 32];
    let mut slot = 0;
    while slot < SLOTS_PER_BUCKET {
        let (key, row, _) = slot_offsets(slot);
        at[slot] = if which == 0 { key as u8 } else { row as u8 };
        slot += 1;
    }
    at
}
static KEY_AT: [u8; 32] = offsets(0);
static ROW_AT: [u8; 32] = offsets(1);

/// Where a key sits: bucket, slot and its row pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub bucket: u64,
    pub slot: usize,
    pub ptr: u64,
}

/// What [`Index::recover`] found and repaired.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoverReport {
    pub buckets_interrupted: u64,
    pub slots_dropped: u64,
    pub keys: u64,
}

/// Low bits of a bucket's `marks` word: one per slot.
pub(super) const MARK_SLOT_BITS: u32 = SLOTS_PER_BUCKET as u32;
/// The interval tag in the rest of the word.
pub const MARK_TAG_MASK: u64 = (1 << (64 - MARK_SLOT_BITS)) - 1;

pub(super) const LOW_BYTES: u64 = 0x0101_0101_0101_0101;
pub(super) const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// Bit mask (one bit per slot) of the slots whose fingerprint equals `fp`: one 16-byte
/// compare on x86_64 (SSE2, which every x86_64 CPU has) and a byte compare for slot 16,
/// else [`match_fp_portable`]. The portable loop's exit depends on how many
/// bytes match, a branch a batch lookup mispredicts about once a key.
#[inline(always)]
pub(super) fn match_fp(words: [u64; 3], fp: u8) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_cmpeq_epi8, _mm_movemask_epi8, _mm_set1_epi8, _mm_set_epi64x};
        // SAFETY: SSE2 is part of the x86_64 baseline; no memory is touched.
        let low = unsafe {
            let fps = _mm_set_epi64x(words[1] as i64, words[0] as i64);
            _mm_movemask_epi8(_mm_cmpeq_epi8(fps, _mm_set1_epi8(fp as i8)))
        } as u32
            & 0xffff;
        let w = words[2];
        let high = ((w as u8 == fp) as u32) << 16;
        (low | high) & ((1 << SLOTS_PER_BUCKET) - 1)
    }
    #[cfg(not(target_arch = "x86_64"))]
    match_fp_portable(words, fp)
}

/// [`match_fp`] without vector instructions.
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
#[inline(always)]
pub(super) fn match_fp_portable(words: [u64; 3], fp: u8) -> u32 {
    let pattern = LOW_BYTES.wrapping_mul(fp as u64);
    let mut mask = 0u32;
    for (w, word) in words.into_iter().enumerate() {
        let x = word ^ pattern;
        // Bytes of x that are zero mark equal fingerprints (exact: no false
        // positives above a true zero byte, unlike the shorter borrow trick).
        let y = (x & !HIGH_BITS).wrapping_add(!HIGH_BITS);
        let mut zeros = !(y | x | !HIGH_BITS);
        while zeros != 0 {
            let byte = zeros.trailing_zeros() / 8;
            mask |= 1 << (w as u32 * 8 + byte);
            zeros &= zeros - 1;
        }
    }
    mask & ((1 << SLOTS_PER_BUCKET) - 1)
}

/// Bit mask of empty slots (fingerprint 0).
#[inline(always)]
pub(super) fn empty_slots(words: [u64; 3]) -> u32 {
    match_fp(words, 0)
}

/// [`empty_slots`] byte by byte: the tests' reference.
#[cfg(test)]
pub(super) fn empty_slots_portable(words: [u64; 3]) -> u32 {
    let mut mask = 0u32;
    for (w, word) in words.into_iter().enumerate() {
        for byte in 0..8 {
            if (word >> (byte * 8)) & 0xff == 0 {
                mask |= 1 << (w * 8 + byte);
            }
        }
    }
    mask & ((1 << SLOTS_PER_BUCKET) - 1)
}

impl Bucket {
    /// True when every byte of the bucket is zero: it was never written (its version
    /// moves on every lock).
    pub(super) fn is_zero(&self) -> bool {
        self.version.load(Ordering::Acquire) == 0
            && self.overflow.load(Ordering::Relaxed) == 0
            && self.fps.iter().all(|w| w.load(Ordering::Relaxed) == 0)
            && (0..SLOTS_PER_BUCKET).all(|s| self.slot(s) == (0, 0))
            && self.marks.load(Ordering::Relaxed) == 0
    }

    #[inline(always)]
    pub(super) fn fp_words(&self) -> [u64; 3] {
        [self.fps[0].load(Ordering::Relaxed), self.fps[1].load(Ordering::Relaxed), self.fps[2].load(Ordering::Relaxed)]
    }

    /// The key word of `slot`.
    #[inline(always)]
    pub(super) fn key(&self, slot: usize) -> &AtomicU64 {
        // SAFETY: `KEY_AT` holds the 8-aligned offsets of the key words, inside the bucket.
        unsafe { &*((self as *const Bucket as *const u8).add(KEY_AT[slot] as usize) as *const AtomicU64) }
    }

    /// The row-number word of `slot` (on the key's line).
    #[inline(always)]
    pub(super) fn row(&self, slot: usize) -> &AtomicU32 {
        // SAFETY: as above, 4-aligned row-number words.
        unsafe { &*((self as *const Bucket as *const u8).add(ROW_AT[slot] as usize) as *const AtomicU32) }
    }

    /// The key and row number of `slot` (inside the seqlock or with the bucket locked).
    #[inline(always)]
    pub(super) fn slot(&self, slot: usize) -> (u64, u32) {
        (self.key(slot).load(Ordering::Relaxed), self.row(slot).load(Ordering::Relaxed))
    }

    /// Writes `slot` (the bucket locked; its fingerprint set after).
    #[inline(always)]
    pub(super) fn set_slot(&self, slot: usize, key: u64, row: u32) {
        self.key(slot).store(key, Ordering::Relaxed);
        self.row(slot).store(row, Ordering::Release);
    }

    /// Locks the bucket for writing; returns the even version it had.
    #[inline]
    pub(super) fn lock(&self) -> u32 {
        let mut spins = 0u32;
        loop {
            let v = self.version.load(Ordering::Relaxed);
            if v & 1 == 0
                && self
                    .version
                    .compare_exchange_weak(v, v.wrapping_add(1), Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return v;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    #[inline]
    pub(super) fn unlock(&self, v: u32) {
        self.version.store(v.wrapping_add(2), Ordering::Release);
    }

    pub(super) fn set_fp(&self, slot: usize, fp: u8) {
        let word = &self.fps[slot / 8];
        let shift = (slot % 8) * 8;
        let old = word.load(Ordering::Relaxed);
        word.store((old & !(0xff << shift)) | ((fp as u64) << shift), Ordering::Release);
    }

    pub(super) fn fp(&self, slot: usize) -> u8 {
        (self.fps[slot / 8].load(Ordering::Relaxed) >> ((slot % 8) * 8)) as u8
    }

    /// Consistent read: the slot holding `key` (if any) with its row number, and the
    /// overflow counter.
    #[inline(always)]
    pub(super) fn read(&self, key: u64, fp: u8) -> (Option<(usize, u32)>, u32) {
        loop {
            let v1 = self.version.load(Ordering::Acquire);
            if v1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let mut found = None;
            let mut candidates = match_fp(self.fp_words(), fp);
            while candidates != 0 {
                let slot = candidates.trailing_zeros() as usize;
                candidates &= candidates - 1;
                if self.key(slot).load(Ordering::Relaxed) == key {
                    found = Some((slot, self.row(slot).load(Ordering::Relaxed)));
                    break;
                }
            }
            let overflow = self.overflow.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if self.version.load(Ordering::Relaxed) == v1 {
                return (found, overflow);
            }
        }
    }
}
