//! The `train` workload's memory pattern without a store: what keeping a checkpoint's
//! old rows costs on this machine, whoever keeps them.
//!
//! A store that updates rows copy-on-write (embank: a new record per update, the
//! replaced one reused) keeps a checkpoint's state by not reusing the record a key had
//! at the checkpoint until the checkpoint is dropped; a store that updates in place
//! keeps it by copying the old row aside at the key's first change. Either way each
//! first change after a checkpoint puts a row's bytes into memory no cache holds.
//! [`checkpoint_pattern`] replays the bench's own key streams on its threads over a
//! flat array of records — no index, no checksums, a stripe lock per key as any
//! concurrent store takes — three ways: no checkpoints; old records held for two
//! retained checkpoints (embank's way); old rows copied into a sequential undo log with
//! non-temporal stores (the in-place way). The ratios between them are the floor of
//! what checkpoints cost on this pattern, measured in the same run as the engines.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::limits::prefetch_lines;

/// Header bytes of a pattern record (a store's record header: key and version).
const HEADER: usize = 16;
/// Stripe locks over the keys.
const STRIPES: usize = 1 << 12;
/// Checkpoints retained (a first change's old record is held until the checkpoint
/// after next is taken), as a store keeps by default.
const RETAINED: u32 = 2;
/// Slices each way is measured in, the ways taking turns.
const ROUNDS: usize = 4;

/// Keys/s of the `train` pattern three ways (see the module docs).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct CheckpointPattern {
    /// Bytes from one record to the next (the engine's record stride).
    pub record_bytes: usize,
    /// A checkpoint after every this many of thread 0's batches.
    pub every: usize,
    /// No checkpoints: every replaced record is reused, most recently freed first.
    pub none_keys_per_second: f64,
    /// Old records held: a key's first change in an interval keeps its old record
    /// until two more checkpoints are taken; its new record is one freed earlier.
    pub held_keys_per_second: f64,
    /// Old rows copied: a key's first change copies its old record into a sequential
    /// undo log (non-temporal stores), then the old record is reused as usual.
    pub copied_keys_per_second: f64,
    /// Of the keys written with checkpoints, the fraction that were first changes.
    pub first_change_fraction: f64,
}

impl CheckpointPattern {
    /// The cheaper way to keep the old rows, as a fraction of no checkpoints.
    pub fn best_ratio(&self) -> f64 {
        self.held_keys_per_second.max(self.copied_keys_per_second) / self.none_keys_per_second
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    None,
    Held,
    Copied,
}

/// Memory the pattern needs for `keys` records of `stride` bytes with a checkpoint every
/// `every` batches of `batch` keys on `threads` threads: the live records, each thread's
/// spare records and undo log, and a shared reserve.
pub fn bytes_needed(keys: u64, stride: usize, every: usize, batch: usize, threads: usize) -> u64 {
    let (spare, undo) = per_thread(keys, every, batch);
    (keys + 2 * spare * threads as u64 + undo * threads as u64) * stride as u64
}

/// Spare records and undo-log records per thread.
fn per_thread(keys: u64, every: usize, batch: usize) -> (u64, u64) {
    let interval = (every * batch) as u64;
    // Held records of up to RETAINED + 1 intervals, and some slack for a thread running
    // ahead of thread 0's intervals.
    let spare = (interval * (RETAINED as u64 + 2)).min(2 * keys) + 4 * batch as u64 + 1024;
    let undo = (2 * interval).min(keys).max(batch as u64);
    (spare, undo)
}

struct Records {
    base: *mut u8,
    stride: usize,
}

// SAFETY: a record is written only by the thread that owns it (taken from its own free
// list) and read under the stripe lock of the key whose `loc` points at it.
unsafe impl Sync for Records {}

impl Records {
    fn at(&self, r: u32) -> *mut u8 {
        // SAFETY: callers pass record numbers below the allocation's count.
        unsafe { self.base.add(r as usize * self.stride) }
    }
}

/// Runs the pattern with the bench's `batches` (one key stream per thread, replayed in
/// batches of `batch`), `seconds` measured per way in all, in [`ROUNDS`] slices taken in
/// turn, each after its share of `warmup` seconds (from a fresh state). Returns `None`
/// when the records would not fit the 32-bit record numbers, or a thread ran out of
/// spare records and the shared reserve (a thread far ahead of thread 0's checkpoints).
pub fn checkpoint_pattern(
    keys: u64,
    stride: usize,
    batches: &[Vec<u64>],
    batch: usize,
    every: usize,
    warmup: f64,
    seconds: f64,
) -> Option<CheckpointPattern> {
    let threads = batches.len().max(1);
    let every = every.max(1);
    let stride = stride.max(HEADER + 4).div_ceil(16) * 16;
    let (spare, undo) = per_thread(keys, every, batch);
    // The live records, each thread's spares, then a shared reserve of as many again.
    let records = keys + 2 * spare * threads as u64;
    if records >= u32::MAX as u64 {
        return None;
    }
    let mut mem = vec![0u8; records as usize * stride];
    // First touch of every page now, not in a measured phase.
    for page in mem.chunks_mut(4096) {
        page[0] = 1;
    }
    let mut undo_logs: Vec<Vec<u8>> = (0..threads).map(|_| vec![1u8; undo as usize * stride]).collect();
    let recs = Records { base: mem.as_mut_ptr(), stride };
    let loc: Vec<AtomicU32> = (0..keys).map(|k| AtomicU32::new(k as u32)).collect();
    let marks: Vec<AtomicU32> = (0..keys).map(|_| AtomicU32::new(0)).collect();
    let stripes: Vec<Mutex<()>> = (0..STRIPES).map(|_| Mutex::new(())).collect();
    let dry = std::sync::atomic::AtomicBool::new(false);
    // One way for `warmup` + `seconds`: (keys/s measured, first-change fraction, seconds measured).
    let mut run = |mode: Mode, warmup: f64, seconds: f64| -> (f64, f64, f64) {
        for (k, l) in loc.iter().enumerate() {
            l.store(k as u32, Ordering::Relaxed);
        }
        for m in &marks {
            m.store(0, Ordering::Relaxed);
        }
        let epoch = AtomicU32::new(1);
        let overflow = AtomicU64::new(keys + spare * threads as u64);
        let (counted, firsts) = (AtomicU64::new(0), AtomicU64::new(0));
        let start = Instant::now();
        let measure_from = start + Duration::from_secs_f64(warmup.max(0.0));
        let deadline = measure_from + Duration::from_secs_f64(seconds.max(0.1));
        std::thread::scope(|s| {
            for (t, (stream, log)) in batches.iter().zip(undo_logs.iter_mut()).enumerate() {
                let (recs, loc, marks, stripes, epoch) = (&recs, &loc, &marks, &stripes, &epoch);
                let (counted, firsts, dry, overflow) = (&counted, &firsts, &dry, &overflow);
                s.spawn(move || {
                    let first_spare = keys + spare * t as u64;
                    let mut free: VecDeque<u32> = (first_spare..first_spare + spare).map(|r| r as u32).collect();
                    let mut held: VecDeque<(u32, Vec<u32>)> = VecDeque::new();
                    let mut seen = 1u32;
                    let mut undo_at = 0usize;
                    let dim = (stride - HEADER) / 4;
                    let mut out = vec![0f32; batch * dim];
                    let n = (stream.len() / batch).max(1);
                    let (mut i, mut done, mut first, mut measuring) = (0usize, 0u64, 0u64, false);
                    'batches: loop {
                        let now = Instant::now();
                        if now >= deadline {
                            break;
                        }
                        if !measuring && now >= measure_from {
                            (measuring, done, first) = (true, 0, 0);
                        }
                        let ks = &stream[(i % n) * batch..((i % n + 1) * batch).min(stream.len())];
                        let e = epoch.load(Ordering::Acquire);
                        if e != seen {
                            seen = e;
                            while held.front().is_some_and(|&(tag, _)| tag + RETAINED <= e) {
                                // Records a dropped checkpoint held: the cold end of the free list.
                                for r in held.pop_front().map(|(_, v)| v).unwrap_or_default() {
                                    free.push_front(r);
                                }
                            }
                            undo_at = 0;
                        }
                        // The pull: each key's row out of its record.
                        for (j, &k) in ks.iter().enumerate() {
                            if let Some(&a) = ks.get(j + 8) {
                                prefetch_lines(recs.at(loc[a as usize].load(Ordering::Relaxed)), stride, false);
                            }
                            let _g = stripes[k as usize % STRIPES].lock();
                            let r = loc[k as usize].load(Ordering::Relaxed);
                            // SAFETY: `r` is `k`'s record under its stripe lock; `out` has room.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    recs.at(r).add(HEADER) as *const f32,
                                    out.as_mut_ptr().add(j * dim),
                                    dim,
                                )
                            };
                        }
                        for x in out[..ks.len() * dim].iter_mut() {
                            *x -= 0.001;
                        }
                        // The push: each key's new row into a fresh record.
                        for (j, &k) in ks.iter().enumerate() {
                            if free.len() > 8 {
                                prefetch_lines(recs.at(free[free.len() - 9]), stride, true);
                            }
                            let _g = stripes[k as usize % STRIPES].lock();
                            let is_first = mode != Mode::None && marks[k as usize].swap(e, Ordering::Relaxed) != e;
                            let Some(new) = free.pop_back().or_else(|| {
                                // A thread ahead of thread 0's checkpoints: the shared reserve
                                // (a store would grow its file).
                                let r = overflow.fetch_add(1, Ordering::Relaxed);
                                (r < records).then_some(r as u32)
                            }) else {
                                // Out of spare records (sized for the retained intervals):
                                // the measurement would not be of this pattern.
                                dry.store(true, Ordering::Relaxed);
                                break 'batches;
                            };
                            let p = recs.at(new);
                            // SAFETY: `new` came off this thread's free list; `out` holds the row.
                            unsafe {
                                (p as *mut u64).write_unaligned(k);
                                std::ptr::copy_nonoverlapping(
                                    out.as_ptr().add(j * dim),
                                    p.add(HEADER) as *mut f32,
                                    dim,
                                );
                            }
                            let old = loc[k as usize].swap(new, Ordering::Relaxed);
                            first += is_first as u64;
                            match (mode, is_first) {
                                (Mode::Held, true) => match held.back_mut() {
                                    Some((tag, v)) if *tag == e => v.push(old),
                                    _ => held.push_back((e, vec![old])),
                                },
                                (Mode::Copied, true) => {
                                    let at = (undo_at % undo as usize) * stride;
                                    undo_at += 1;
                                    // SAFETY: `old` is `k`'s replaced record, still under its lock.
                                    unsafe { stream_copy(recs.at(old), log[at..at + stride].as_mut_ptr(), stride) };
                                    free.push_back(old);
                                }
                                _ => free.push_back(old),
                            }
                        }
                        if mode == Mode::Copied {
                            store_fence();
                        }
                        done += ks.len() as u64;
                        i += 1;
                        if t == 0 && mode != Mode::None && i.is_multiple_of(every) {
                            epoch.fetch_add(1, Ordering::AcqRel);
                        }
                    }
                    if measuring {
                        counted.fetch_add(done, Ordering::Relaxed);
                        firsts.fetch_add(first, Ordering::Relaxed);
                    }
                });
            }
        });
        let elapsed = Instant::now().saturating_duration_since(measure_from).as_secs_f64().max(1e-9);
        let n = counted.load(Ordering::Relaxed);
        (n as f64 / elapsed, firsts.load(Ordering::Relaxed) as f64 / n.max(1) as f64, elapsed)
    };
    // The three ways in turn, in short slices, so a change in what the machine's
    // neighbours take of the shared cache and memory falls on all three alike.
    let modes = [Mode::None, Mode::Held, Mode::Copied];
    let mut totals = [(0.0f64, 0.0f64); 3];
    let mut first = (0.0, 0.0);
    for _ in 0..ROUNDS {
        for (m, total) in modes.iter().zip(totals.iter_mut()) {
            let (rate, firsts, secs) = run(*m, warmup / ROUNDS as f64, seconds / ROUNDS as f64);
            *total = (total.0 + rate * secs, total.1 + secs);
            if *m == Mode::Held {
                first = (first.0 + firsts * rate * secs, first.1 + rate * secs);
            }
        }
    }
    if dry.load(Ordering::Relaxed) {
        return None;
    }
    let rate = |i: usize| totals[i].0 / totals[i].1.max(1e-9);
    Some(CheckpointPattern {
        record_bytes: stride,
        every,
        none_keys_per_second: rate(0),
        held_keys_per_second: rate(1),
        copied_keys_per_second: rate(2),
        first_change_fraction: first.0 / first.1.max(1.0),
    })
}

/// Copies `len` bytes (a multiple of 16) around the caches where the CPU can.
///
/// # Safety
/// Both ranges valid for `len` bytes; `dst` 16-byte aligned on x86_64.
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        if (dst as usize).is_multiple_of(16) {
            for at in (0..len).step_by(16) {
                _mm_stream_si128(dst.add(at) as *mut __m128i, _mm_loadu_si128(src.add(at) as *const __m128i));
            }
            return;
        }
    }
    std::ptr::copy_nonoverlapping(src, dst, len);
}

fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a fence has no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_runs_and_counts_first_changes() {
        // Two threads of 8 batches of 100 keys over 1,000 keys; a checkpoint every 4 batches.
        let batches: Vec<Vec<u64>> = (0..2).map(|t| (0..800).map(|i| (i * 7 + t * 13) % 1000).collect()).collect();
        let p = checkpoint_pattern(1000, 576, &batches, 100, 4, 0.0, 0.2).expect("fits");
        assert_eq!(p.record_bytes, 576);
        assert!(p.none_keys_per_second > 0.0 && p.held_keys_per_second > 0.0 && p.copied_keys_per_second > 0.0);
        // Every interval changes some keys for the first time, and repeats others.
        assert!(p.first_change_fraction > 0.0 && p.first_change_fraction < 1.0, "{p:?}");
        assert!(p.best_ratio() > 0.0);
    }

    #[test]
    fn spare_records_cover_held_intervals() {
        let (spare, undo) = per_thread(2_000_000, 100, 500);
        assert!(spare >= 50_000 * (RETAINED as u64 + 1), "{spare}");
        assert_eq!(undo, 100_000);
        assert!(bytes_needed(2_000_000, 576, 100, 500, 2) < 3 << 30);
    }
}
