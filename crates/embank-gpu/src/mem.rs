//! Device and pinned memory, the per-call scratch, and where a lookup's find and fill put
//! their data in it.

use std::sync::Arc;

use embank_core::Result;

use crate::device::{Device, Event, Stream};
use crate::PAYLOAD_HEAD;

// ---- memory ----

/// Device memory, freed on drop.
pub(crate) struct Buffer {
    pub(crate) dev: Arc<dyn Device>,
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
}

impl Buffer {
    pub(crate) fn new(dev: &Arc<dyn Device>, bytes: usize) -> Result<Buffer> {
        let ptr = dev.alloc(bytes)?;
        Ok(Buffer { dev: dev.clone(), ptr, bytes })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // A last owner may drop it on any thread: the device's context made current.
        let _cx = self.dev.enter();
        // SAFETY: ours; owners drop buffers only after the launches using them are done.
        unsafe { self.dev.free(self.ptr, self.bytes) }
    }
}

/// Pinned host memory, mapped into the device's address space, freed on drop.
pub(crate) struct Host {
    pub(crate) dev: Arc<dyn Device>,
    pub(crate) ptr: *mut u8,
    pub(crate) bytes: usize,
    /// Its address on the device (a kernel writes there, the host reads `ptr`).
    pub(crate) dev_ptr: u64,
}

// SAFETY: a plain allocation; access is governed by its owner (a scratch held by one
// caller at a time).
unsafe impl Send for Host {}

impl Host {
    pub(crate) fn new(dev: &Arc<dyn Device>, bytes: usize) -> Result<Host> {
        let ptr = dev.alloc_host(bytes)?;
        let dev_ptr = match dev.host_device_ptr(ptr) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: just allocated, unused.
                unsafe { dev.free_host(ptr, bytes) };
                return Err(e);
            }
        };
        Ok(Host { dev: dev.clone(), ptr, bytes, dev_ptr })
    }
    pub(crate) fn slice_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.bytes, "pinned buffer overrun: {off} + {len} > {}", self.bytes);
        // SAFETY: in bounds; &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
    pub(crate) fn u64s(&mut self, off: usize, n: usize) -> &mut [u64] {
        assert!(off.is_multiple_of(8));
        let b = self.slice_mut(off, n * 8);
        // SAFETY: 8-aligned (the allocation is 256-aligned, off a multiple of 8).
        unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast(), n) }
    }
    pub(crate) fn u32s(&mut self, off: usize, n: usize) -> &mut [u32] {
        assert!(off.is_multiple_of(4));
        let b = self.slice_mut(off, n * 4);
        // SAFETY: 4-aligned.
        unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast(), n) }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _cx = self.dev.enter();
        // SAFETY: ours; owners drop it only after the copies using it are done.
        unsafe { self.dev.free_host(self.ptr, self.bytes) }
    }
}

/// A grown-on-demand pair of device and pinned buffers, and the event after its last
/// use on the device: whoever takes it next waits for that before writing to it.
pub(crate) struct Scratch {
    pub(crate) dev_buf: Buffer,
    pub(crate) host: Host,
    pub(crate) done: Event,
    pub(crate) copied: Event,
    /// The event after the scratch's last use on the device (`copied` or `done`).
    pub(crate) last: Event,
    /// Which of the payload's two miss counts the next find uses (it zeroes the other).
    pub(crate) parity: u32,
}

impl Scratch {
    /// Its payload counts zeroed on `stream` (the cache's own: not the legacy default
    /// stream, which would wait for every blocking stream's work, PyTorch's included).
    pub(crate) fn new(dev: &Arc<dyn Device>, bytes: usize, stream: Stream) -> Result<Scratch> {
        let done = dev.event()?;
        let mut s = Scratch {
            dev_buf: Buffer::new(dev, bytes)?,
            host: Host::new(dev, bytes)?,
            done,
            copied: dev.event()?,
            last: done,
            parity: 0,
        };
        s.zero_counts(dev, stream)?;
        Ok(s)
    }
    /// The payload's miss counts start at zero (the first user waits for `done`).
    pub(crate) fn zero_counts(&mut self, dev: &Arc<dyn Device>, stream: Stream) -> Result<()> {
        dev.memset(self.dev_buf.ptr, 0, 8 * PAYLOAD_HEAD, stream)?;
        dev.record(self.done, stream)?;
        self.last = self.done;
        Ok(())
    }
    /// Room for `bytes` on both sides (waits for the last use before growing).
    pub(crate) fn reserve(&mut self, dev: &Arc<dyn Device>, bytes: usize, stream: Stream) -> Result<()> {
        if self.dev_buf.bytes >= bytes && self.host.bytes >= bytes {
            return Ok(());
        }
        dev.wait(self.last)?;
        let bytes = bytes.max(2 * self.dev_buf.bytes);
        self.dev_buf = Buffer::new(dev, bytes)?;
        self.host = Host::new(dev, bytes)?;
        self.parity = 0;
        self.zero_counts(dev, stream)
    }
}

pub(crate) fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Where a lookup's find puts its misses in a scratch: the payload (two counts, then
/// key, version, score a miss) and the misses' places.
pub(crate) struct FindLayout {
    pub(crate) payload: usize,
    pub(crate) miss_at: usize,
    pub(crate) miss_w: usize,
    pub(crate) end: usize,
}

impl FindLayout {
    pub(crate) fn new(n: usize) -> FindLayout {
        let miss_at = 8 * (PAYLOAD_HEAD + 3 * n);
        let miss_w = miss_at + 4 * n;
        FindLayout { payload: 0, miss_at, miss_w, end: align(miss_w + 4 * n, 256) }
    }
}

/// Where a fill's inputs go in a scratch (after `base`), in the order the host writes
/// them: rows first (the table writes them straight there), then the arrays.
pub(crate) struct FillLayout {
    pub(crate) rows: usize,
    pub(crate) row_of: usize,
    pub(crate) keys: usize,
    pub(crate) key_score: usize,
    pub(crate) key_row: usize,
    pub(crate) key_ver: usize,
    pub(crate) groups: usize,
    pub(crate) end: usize,
}

impl FillLayout {
    /// For `answers` misses, `uniq` rows fetched, `ins` keys inserted in `groups` buckets.
    pub(crate) fn new(
        base: usize,
        row_bytes: usize,
        answers: usize,
        uniq: usize,
        ins: usize,
        groups: usize,
    ) -> FillLayout {
        let rows = base;
        let keys = align(rows + uniq * row_bytes, 8);
        let key_score = keys + 8 * ins;
        let row_of = key_score + 8 * ins;
        let key_row = row_of + 4 * answers;
        let key_ver = key_row + 4 * ins;
        let groups_at = key_ver + 4 * ins;
        let end = align(groups_at + 4 * (groups + 1), 256);
        FillLayout { rows, row_of, keys, key_score, key_row, key_ver, groups: groups_at, end }
    }
    pub(crate) fn most(base: usize, row_bytes: usize, n: usize) -> usize {
        FillLayout::new(base, row_bytes, n, n, n, n).end
    }
}
