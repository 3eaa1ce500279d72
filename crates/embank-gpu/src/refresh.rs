//! The whole cache's refresh: every cached key read again from the table.
//!
//! The cache's keys are copied down once; then, a chunk of `REFRESH_CHUNK` live slots at a
//! time, reader threads (started once for the whole refresh) each write their share of
//! the chunk's keys, slots, bucket versions, found flags and rows straight into one of two
//! pinned buffers, and the host copies the buffer up and launches the refresh kernel on
//! the cache's side stream while the readers fill the other buffer.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::time::Instant;

use embank_core::{DType, Error, ErrorKind, Result, TableApi};

use crate::args::{bytes_of, RefreshArgs};
use crate::device::Kernel;
use crate::mem::{align, Host, Scratch};
use crate::{Inner, Refreshed, C_REFRESH_CHANGED, LOCKED_KEY};

/// A chunk buffer's most bytes (rows, slots, keys, versions, found flags): chunks of wide
/// rows hold fewer than `refresh_chunk` rows (64 k rows of dim 128 f32: 35 MB).
const REFRESH_BUFFER_BYTES: usize = 40 << 20;

/// A chunk buffer's bytes for `n` rows: rows, slots, keys, versions, found flags.
fn chunk_bytes(n: usize, row_bytes: usize) -> usize {
    align(n * row_bytes, 8) + n * 8 * 2 + n * 4 + align(n, 8) + 256
}

/// Where one reader's share of a chunk goes in the chunk's pinned buffer.
#[derive(Clone, Copy)]
struct Out {
    rows: *mut u8,
    slots: *mut u64,
    keys: *mut u64,
    vers: *mut u32,
    found: *mut u8,
}

// SAFETY: each `Out` points at a disjoint part of a pinned buffer that only its reader
// writes, and the host touches the buffer again only after every reader has answered.
unsafe impl Send for Out {}

/// One reader's share of a chunk: the slots it reads, and where their bytes go.
struct Piece<'a> {
    part: &'a [usize],
    at: Out,
}

/// What every reader reads from: the snapshot of the cache's keys and bucket versions.
#[derive(Clone, Copy)]
struct Source<'a> {
    table: &'a dyn TableApi,
    keys: &'a [u64],
    vers: &'a [u32],
    slots_a_bucket: usize,
    row_bytes: usize,
    /// The cache holds f32 rows of a table stored otherwise: read them decoded.
    decoded: bool,
}

impl Source<'_> {
    fn read(&self, p: Piece<'_>) -> Result<()> {
        let n = p.part.len();
        // SAFETY: `p.at` points at `n` keys, slots, versions and found flags and `n` rows of
        // the chunk's pinned buffer, this reader's alone (see `Out`), 8-aligned for the
        // keys and slots, 4-aligned for the versions and for f32 rows (whole rows from a
        // 256-aligned base); the found flags are zeroed before they are seen as `bool`.
        let (keys, slots, vers, found, rows) = unsafe {
            std::ptr::write_bytes(p.at.found, 0, n);
            (
                std::slice::from_raw_parts_mut(p.at.keys, n),
                std::slice::from_raw_parts_mut(p.at.slots, n),
                std::slice::from_raw_parts_mut(p.at.vers, n),
                std::slice::from_raw_parts_mut(p.at.found.cast::<bool>(), n),
                std::slice::from_raw_parts_mut(p.at.rows, n * self.row_bytes),
            )
        };
        for (j, &i) in p.part.iter().enumerate() {
            keys[j] = self.keys[i];
            slots[j] = i as u64;
            vers[j] = self.vers[i / self.slots_a_bucket];
        }
        if self.decoded {
            // SAFETY: 4-aligned (above), whole f32 rows.
            let f = unsafe { std::slice::from_raw_parts_mut(rows.as_mut_ptr().cast::<f32>(), rows.len() / 4) };
            self.table.lookup(keys, f, found)
        } else {
            self.table.lookup_stored(keys, rows, found)
        }
    }
}

/// A refresh's pinned and device buffers: allocated by the first refresh (pinned memory
/// is slow to allocate: tens of milliseconds for the two chunk buffers), kept for the
/// next, freed at `close` (two chunk buffers of at most `REFRESH_BUFFER_BYTES` each, on
/// the host, pinned, and on the device; the key snapshot: 8 bytes a slot and 4 a bucket,
/// pinned). A refresh that fails frees its buffers.
pub(crate) struct Kept {
    snap: Host,
    bufs: [Scratch; 2],
}

impl Kept {
    /// Waits for the last uses and frees the events (the buffers free themselves).
    pub(crate) fn free(self, dev: &std::sync::Arc<dyn crate::device::Device>) {
        for s in &self.bufs {
            let _ = dev.wait(s.done);
        }
        for s in self.bufs {
            // SAFETY: waited above.
            unsafe {
                dev.drop_event(s.done);
                dev.drop_event(s.copied);
            }
        }
    }
}

impl Inner {
    pub(crate) fn refresh(&self) -> Result<Refreshed> {
        self.check_open()?;
        let _cx = self.dev.enter()?;
        let t0 = Instant::now();
        let slots_total = self.desc.n_buckets as usize * self.desc.slots as usize;
        let nb = self.desc.n_buckets as usize;
        let taken = self.refreshing.lock().take(); // not held while allocating
        let mut kept = match taken {
            Some(k) => k,
            None => {
                let per = self.chunk_rows(slots_total);
                let bytes = chunk_bytes(per, self.row_bytes);
                Kept {
                    snap: Host::new(&self.dev, slots_total * 8 + nb * 4)?,
                    bufs: [Scratch::new(&self.dev, bytes, self.side)?, Scratch::new(&self.dev, bytes, self.side)?],
                }
            }
        };
        let r = self.refresh_with(&mut kept, t0);
        if r.is_err() {
            // A copy may be queued after a buffer's last `done` (a launch that failed
            // after it): mark both after everything queued, wait, and free them.
            for s in &kept.bufs {
                let _ = self.dev.record(s.done, self.side);
            }
            kept.free(&self.dev);
            return r;
        }
        let other = self.refreshing.lock().replace(kept);
        if let Some(other) = other {
            other.free(&self.dev); // two refreshes at once: keep one set
        }
        r
    }

    /// Rows a chunk: `refresh_chunk`, fewer for wide rows (a chunk buffer holds at most
    /// `REFRESH_BUFFER_BYTES`), at most the cache's slots.
    fn chunk_rows(&self, slots_total: usize) -> usize {
        let by_bytes = (REFRESH_BUFFER_BYTES / (self.row_bytes + 21)).max(1);
        self.opts.refresh_chunk.min(by_bytes).max(1).min(slots_total.max(1))
    }

    fn refresh_with(&self, kept: &mut Kept, t0: Instant) -> Result<Refreshed> {
        let slots_total = self.desc.n_buckets as usize * self.desc.slots as usize;
        let nb = self.desc.n_buckets as usize;
        let snap = &kept.snap;
        let bufs = &mut kept.bufs;
        {
            let mut st = self.state.lock();
            self.enter_ordered(&mut st, self.side)?;
            self.apply_pending(&mut st, self.side)?;
            // SAFETY: `snap` is this refresh's (taken from `refreshing`) until it returns,
            // after the wait below.
            unsafe {
                self.dev.dtoh(snap.ptr, self.desc.keys, slots_total * 8, self.side)?;
                self.dev.dtoh(snap.ptr.add(slots_total * 8), self.desc.versions, nb * 4, self.side)?;
            }
            self.mark(&mut st, self.order, self.side)?;
        }
        self.dev.wait(self.order)?;
        let before = self.counters()?[C_REFRESH_CHANGED];
        // SAFETY: the copies above are done, and nothing writes `snap` until this refresh
        // returns.
        let (keys, vers) = unsafe {
            (
                std::slice::from_raw_parts(snap.ptr.cast::<u64>().cast_const(), slots_total),
                std::slice::from_raw_parts(snap.ptr.add(slots_total * 8).cast::<u32>().cast_const(), nb),
            )
        };
        let live: Vec<usize> = (0..slots_total).filter(|&i| keys[i] < LOCKED_KEY).collect();
        let setup_seconds = t0.elapsed().as_secs_f64();
        let rb = self.row_bytes;
        let per = self.chunk_rows(slots_total).min(live.len().max(1));
        let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).clamp(1, 16);
        let source = Source {
            table: &*self.table,
            keys,
            vers,
            slots_a_bucket: self.desc.slots as usize,
            row_bytes: rb,
            decoded: self.stored == 0 && self.table.meta().dtype != DType::F32,
        };
        let mut moved = (slots_total * 8 + nb * 4) as u64;
        let (mut read_seconds, mut wait_seconds) = (0.0, 0.0);
        std::thread::scope(|scope| -> Result<()> {
            let (answer, answers) = mpsc::channel::<Result<()>>();
            let mut readers = Vec::with_capacity(threads);
            for _ in 0..threads {
                let (give, pieces) = mpsc::channel::<Piece<'_>>();
                let answer = answer.clone();
                std::thread::Builder::new()
                    .name("embank-refresh".into())
                    .spawn_scoped(scope, move || {
                        for p in pieces {
                            let r = catch_unwind(AssertUnwindSafe(|| source.read(p)))
                                .unwrap_or_else(|_| Err(Error::new(ErrorKind::Corrupt, "a refresh reader panicked")));
                            if answer.send(r).is_err() {
                                return;
                            }
                        }
                    })
                    .map_err(|e| Error::new(ErrorKind::Io, format!("a refresh reader did not start: {e}")))?;
                readers.push(give);
            }
            drop(answer);
            for (ci, part) in live.chunks(per).enumerate() {
                let s = &mut bufs[ci % 2];
                let w = Instant::now();
                self.dev.wait(s.done)?;
                wait_seconds += w.elapsed().as_secs_f64();
                let n = part.len();
                let rows_off = 0;
                let slots_off = align(n * rb, 8);
                let keys_off = slots_off + 8 * n;
                let vers_off = keys_off + 8 * n;
                let found_off = vers_off + 4 * n;
                let end = found_off + n;
                let per_reader = n.div_ceil(threads).max(self.opts.refresh_chunk / 64).max(1);
                let base = s.host.ptr;
                let r = Instant::now();
                let mut given = 0;
                for (t, piece) in part.chunks(per_reader).enumerate() {
                    let j = t * per_reader;
                    // SAFETY: offsets inside the chunk's layout (`end` <= the buffer's size).
                    let at = unsafe {
                        Out {
                            rows: base.add(rows_off + j * rb),
                            slots: base.add(slots_off).cast::<u64>().add(j),
                            keys: base.add(keys_off).cast::<u64>().add(j),
                            vers: base.add(vers_off).cast::<u32>().add(j),
                            found: base.add(found_off + j),
                        }
                    };
                    readers[t]
                        .send(Piece { part: piece, at })
                        .map_err(|_| Error::new(ErrorKind::Corrupt, "a refresh reader stopped"))?;
                    given += 1;
                }
                let mut failed = None;
                for _ in 0..given {
                    match answers.recv() {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            failed.get_or_insert(e);
                        }
                        Err(_) => return Err(Error::new(ErrorKind::Corrupt, "a refresh reader stopped")),
                    }
                }
                read_seconds += r.elapsed().as_secs_f64();
                if let Some(e) = failed {
                    return Err(e);
                }
                let d = s.dev_buf.ptr;
                let mut st = self.state.lock();
                self.enter_ordered(&mut st, self.side)?;
                // SAFETY: unchanged until `done` (waited before the next write).
                unsafe { self.dev.htod(d, s.host.ptr, end, self.side)? };
                let args = RefreshArgs {
                    c: self.desc_now(&st),
                    slots: d + slots_off as u64,
                    keys: d + keys_off as u64,
                    vers: d + vers_off as u64,
                    found: d + found_off as u64,
                    rows: d + rows_off as u64,
                    n: n as u64,
                    stored: self.stored,
                    row_bytes: rb as u32,
                };
                self.dev.launch(Kernel::Refresh, n as u64 * 32, bytes_of(&args), self.side)?;
                self.dev.record(s.done, self.side)?;
                self.mark(&mut st, self.order, self.side)?;
                moved += end as u64;
            }
            Ok(())
        })?;
        let w = Instant::now();
        for s in bufs.iter() {
            self.dev.wait(s.done)?;
        }
        let changed = self.counters()?[C_REFRESH_CHANGED] - before;
        wait_seconds += w.elapsed().as_secs_f64();
        let seconds = t0.elapsed().as_secs_f64();
        let r = Refreshed {
            rows: live.len() as u64,
            changed,
            bytes: moved,
            seconds,
            setup_seconds,
            read_seconds,
            wait_seconds,
            threads: threads as u64,
        };
        let mut stats = self.stats.lock();
        stats.refreshes += 1;
        stats.refresh_rows += r.rows;
        stats.refresh_changed += r.changed;
        stats.refresh_bytes += r.bytes;
        stats.refresh_seconds += seconds;
        Ok(r)
    }
}
