//! The whole cache's refresh: every cached key read again from the table.

use std::time::Instant;

use embank_core::{DType, Error, ErrorKind, Result};

use crate::args::{bytes_of, RefreshArgs};
use crate::device::Kernel;
use crate::mem::{align, Host, Scratch};
use crate::{Inner, Refreshed, C_REFRESH_CHANGED, LOCKED_KEY, REFRESH_CHUNK};

impl Inner {
    pub(crate) fn refresh(&self) -> Result<Refreshed> {
        self.check_open()?;
        self.dev.enter()?;
        let t0 = Instant::now();
        let slots_total = self.desc.n_buckets as usize * self.desc.slots as usize;
        let nb = self.desc.n_buckets as usize;
        let mut snap = Host::new(&self.dev, slots_total * 8 + nb * 4)?;
        {
            let mut st = self.state.lock();
            self.enter_ordered(&mut st, self.side)?;
            self.apply_pending(&mut st, self.side)?;
            // SAFETY: `snap` lives until the wait below.
            unsafe {
                self.dev.dtoh(snap.ptr, self.desc.keys, slots_total * 8, self.side)?;
                self.dev.dtoh(snap.ptr.add(slots_total * 8), self.desc.versions, nb * 4, self.side)?;
            }
            self.mark(&mut st, self.order, self.side)?;
        }
        self.dev.wait(self.order)?;
        let before = self.counters()?[C_REFRESH_CHANGED];
        let keys: Vec<u64> = snap.u64s(0, slots_total).to_vec();
        let vers: Vec<u32> = snap.u32s(slots_total * 8, nb).to_vec();
        drop(snap);
        let live: Vec<usize> = (0..slots_total).filter(|&i| keys[i] < LOCKED_KEY).collect();
        let rb = self.row_bytes;
        // Two buffers alternate: the table's read of one chunk overlaps the copy and the
        // launch of the one before.
        let chunk_bytes = |n: usize| align(n * rb, 8) + n * 8 * 2 + n * 4 + align(n, 8) + 256;
        let per = REFRESH_CHUNK.min(live.len().max(1));
        let mut bufs = [Scratch::new(&self.dev, chunk_bytes(per))?, Scratch::new(&self.dev, chunk_bytes(per))?];
        let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).clamp(1, 16);
        let mut moved = (slots_total * 8 + nb * 4) as u64;
        for (ci, part) in live.chunks(per).enumerate() {
            let s = &mut bufs[ci % 2];
            self.dev.wait(s.done)?;
            let n = part.len();
            let rows_off = 0;
            let slots_off = align(n * rb, 8);
            let keys_off = slots_off + 8 * n;
            let vers_off = keys_off + 8 * n;
            let found_off = vers_off + 4 * n;
            let end = found_off + n;
            let ks: Vec<u64> = part.iter().map(|&i| keys[i]).collect();
            let mut found = vec![false; n];
            {
                let rows = s.host.slice_mut(rows_off, n * rb);
                let per_thread = n.div_ceil(threads).max(1024);
                let f32_rows = self.stored == 0 && self.table.meta().dtype != DType::F32;
                std::thread::scope(|scope| -> Result<()> {
                    let mut handles = Vec::new();
                    for ((kc, rc), fc) in
                        ks.chunks(per_thread).zip(rows.chunks_mut(per_thread * rb)).zip(found.chunks_mut(per_thread))
                    {
                        let table = &self.table;
                        handles.push(scope.spawn(move || -> Result<()> {
                            if f32_rows {
                                // SAFETY: 4-aligned (chunks of whole f32 rows from a
                                // 256-aligned base).
                                let f = unsafe {
                                    std::slice::from_raw_parts_mut(rc.as_mut_ptr().cast::<f32>(), rc.len() / 4)
                                };
                                table.lookup(kc, f, fc)
                            } else {
                                table.lookup_stored(kc, rc, fc)
                            }
                        }));
                    }
                    for h in handles {
                        h.join().map_err(|_| Error::new(ErrorKind::Corrupt, "a refresh reader panicked"))??;
                    }
                    Ok(())
                })?;
            }
            let sd = self.desc.slots as usize;
            s.host.u64s(slots_off, n).iter_mut().zip(part).for_each(|(d, &i)| *d = i as u64);
            s.host.u64s(keys_off, n).copy_from_slice(&ks);
            s.host.u32s(vers_off, n).iter_mut().zip(part).for_each(|(d, &i)| *d = vers[i / sd]);
            s.host.slice_mut(found_off, n).iter_mut().zip(&found).for_each(|(d, &f)| *d = u8::from(f));
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
        for s in &bufs {
            self.dev.wait(s.done)?;
        }
        let changed = self.counters()?[C_REFRESH_CHANGED] - before;
        for s in bufs {
            // SAFETY: waited above.
            unsafe {
                self.dev.drop_event(s.done);
                self.dev.drop_event(s.copied);
            }
        }
        let seconds = t0.elapsed().as_secs_f64();
        let r = Refreshed { rows: live.len() as u64, changed, bytes: moved, seconds };
        let mut stats = self.stats.lock();
        stats.refreshes += 1;
        stats.refresh_rows += r.rows;
        stats.refresh_changed += r.changed;
        stats.refresh_bytes += r.bytes;
        stats.refresh_seconds += seconds;
        Ok(r)
    }
}
