//! Records in memory: the view a byte-addressable medium gives of its records, for
//! the lock-free fast path of reads and zero-copy serving.
//!
//! A medium whose records lie at `base + ptr` in this process's address space (a
//! mapped file on the page cache, persistent or CXL memory under DAX) laid out as
//! [`RecordCodec`] lays them out hands out a [`Mapped`] through
//! [`Medium::as_mapped`](super::Medium::as_mapped); the table's fast path then reads
//! it without a call per key into the medium.

use std::marker::PhantomData;

use super::alloc::RecordAlloc;
use super::codec::RecordCodec;

/// Byte-addressable records: `stride`-byte records at byte offsets (`ptr`) from `base`.
#[derive(Clone, Copy)]
pub struct Mapped<'a> {
    base: *mut u8,
    codec: &'a RecordCodec,
    alloc: &'a RecordAlloc,
    _memory: PhantomData<&'a [u8]>,
}

// SAFETY: the memory is shared between threads by design; records are written only by
// the writer that allocated them before they are published, and read after.
unsafe impl Send for Mapped<'_> {}
unsafe impl Sync for Mapped<'_> {}

impl<'a> Mapped<'a> {
    /// # Safety
    /// `base` must be valid for reads and writes of every record `alloc` hands out, for `'a`.
    pub unsafe fn new(base: *mut u8, codec: &'a RecordCodec, alloc: &'a RecordAlloc) -> Mapped<'a> {
        Mapped { base, codec, alloc, _memory: PhantomData }
    }

    #[inline(always)]
    pub(super) fn record_ptr(&self, ptr: u64) -> *mut u8 {
        debug_assert!(ptr + self.alloc.stride() <= self.alloc.file_bytes());
        // SAFETY: callers pass pointers of handed-out records, all inside the memory.
        unsafe { self.base.add(ptr as usize) }
    }

    /// The bytes of a handed-out record (header and payload).
    #[inline(always)]
    pub(super) fn record(&self, ptr: u64) -> &'a [u8] {
        // SAFETY: a handed-out record inside the memory; a published one is immutable
        // until reclaimed, and the caller's epoch guard keeps it from being reclaimed.
        unsafe { std::slice::from_raw_parts(self.record_ptr(ptr), self.codec.record_bytes()) }
    }

    /// Key stored in a record.
    #[inline(always)]
    pub fn key_at(&self, ptr: u64) -> u64 {
        // SAFETY: a handed-out record inside the memory.
        unsafe { u64::from_le((self.record_ptr(ptr) as *const u64).read()) }
    }

    /// Decodes a published record (row and optimizer state) into `out`.
    #[inline(always)]
    pub fn read_into(&self, ptr: u64, out: &mut [f32]) {
        self.codec.decode(self.record(ptr), out)
    }

    /// The stored bytes of a published record's row (for zero-copy serving of `f32` rows).
    #[inline(always)]
    pub fn row_bytes(&self, ptr: u64) -> &'a [u8] {
        &self.codec.payload(self.record(ptr))[..self.codec.layout().row_bytes()]
    }

    /// Hints the CPU to load a record.
    #[inline(always)]
    pub fn prefetch(&self, ptr: u64) {
        self.each_line(ptr, crate::prefetch::prefetch_read)
    }

    /// Calls `hint` with an address in each cache line a record's bytes touch (a record
    /// need not start on a line: strides are multiples of 16 bytes).
    #[inline(always)]
    pub(super) fn each_line(&self, ptr: u64, hint: fn(*const u8)) {
        let p = self.record_ptr(ptr);
        let last = ptr as usize + self.codec.record_bytes() - 1;
        let mut off = 0;
        while ptr as usize + off <= last | 63 {
            // SAFETY: within the record, or in the last line it touches (a prefetch of an
            // address in it does not fault).
            hint(unsafe { p.add(off) });
            off += 64;
        }
    }

    /// True when the record's checksum matches its key and payload.
    pub fn checksum_ok(&self, ptr: u64) -> bool {
        self.codec.checksum_ok(self.record(ptr))
    }
}
