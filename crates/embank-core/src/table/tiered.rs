//! Writes through the tiers: a push of a row the index already has replaces (or
//! inserts) its tier entry and marks it dirty — no I/O until a write-back
//! (maintenance thread, writer back-pressure, `flush`, `close`). Rows new to the
//! index, and every write of a table without tiers (`bypass`, or the mmap fast
//! path), go through to the medium at once: written to fresh records in one
//! batch, then published (write-around: they enter the tiers when first read,
//! so a bulk load does not flush the hot set; a pinned table caches them at
//! once). So a dirty entry always belongs to a key the index has, and a table
//! that cannot grow fails the push itself, never a later write-back.
//!
//! A write-back publishes a dirty row only if the tier still holds the version
//! it copied (a cache-wide counter), so a write-back racing a newer push or a
//! delete never installs old bytes. Dirty entries are never evicted, so a key
//! that is not in a tier is up to date in the index.
//!
//! Also here: `lookahead`'s background load and the load of a pinned table.

use std::sync::atomic::Ordering;

use super::write::{Change, Notice, Outcome, RecordWriter};
use super::Table;
use crate::error::Result;
use crate::medium::{Medium, ReadItem};
use crate::tier::DirtyRow;

/// Rows a writer writes back itself when dirty bytes pass the cache's high-water mark.
const WRITE_BACK_BATCH: usize = 4096;
/// Rows per medium read while loading a pinned table.
const PIN_LOAD_CHUNK: usize = 4096;
/// How many keys ahead a publish loop prefetches the index lines of the key it will publish.
const PUBLISH_AHEAD: usize = super::read::PREFETCH_KEYS_AHEAD;

impl Table {
    /// Writes whole records (row and optimizer state).
    pub(super) fn push_records(&self, keys: &[u64], records: &[f32]) -> Result<()> {
        let notice = Notice::new(self.tiers());
        let _gate = self.shared.runtime.gate.batch();
        let tiers = self.tiers();
        let through: Vec<usize> = if tiers.is_empty() {
            (0..keys.len()).collect()
        } else {
            let st = self.state()?;
            let index = &st.index;
            let mut through = Vec::new();
            tiers.write_dirty(keys, records, &mut |key| index.get(key, index.hash(key)).is_some(), &mut through);
            // The rows that stay in the tier join the batch's notice.
            let mut skip = through.iter().peekable();
            let dirty: Vec<u64> =
                keys.iter().enumerate().filter(|&(i, _)| skip.next_if_eq(&&i).is_none()).map(|(_, &k)| k).collect();
            notice.add(&dirty);
            through
        };
        if !through.is_empty() {
            self.write_through(keys, records, &through, &notice)?;
        }
        // Back-pressure: a writer that outruns write-back writes back itself.
        while tiers.dirty_over_high() {
            if self.write_back(WRITE_BACK_BATCH)? == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Writes the records at `positions` to fresh records and publishes them (insert or
    /// replace; with duplicate keys the last wins).
    fn write_through(&self, keys: &[u64], records: &[f32], positions: &[usize], notice: &Notice) -> Result<()> {
        let w = self.shared.config.layout.elems();
        self.with_room(|st, from| {
            let todo = &positions[from..];
            let ptrs = self.write_records(st, todo.iter().map(|&i| (keys[i], &records[i * w..(i + 1) * w])))?;
            let mut p = RecordWriter::new(self, st, Some(notice));
            for (j, &i) in todo.iter().enumerate() {
                if let Some(&ahead) = todo.get(j + PUBLISH_AHEAD) {
                    p.prefetch(keys[ahead]);
                }
                let record = &records[i * w..(i + 1) * w];
                if p.publish(keys[i], Change::Upsert(ptrs[j]), |_| false, |tiers| tiers.written(record))?
                    == Outcome::NoRoom
                {
                    p.unused(&ptrs[j + 1..]);
                    p.finish();
                    return Ok(Some(j));
                }
            }
            p.finish();
            Ok(None)
        })
    }

    /// Writes back up to `max` dirty rows of this table; returns how many were taken.
    pub(super) fn write_back(&self, max: usize) -> Result<usize> {
        let _gate = self.shared.runtime.gate.batch();
        self.write_back_locked(max)
    }

    /// [`write_back`](Self::write_back) for a caller that holds the checkpoint gate.
    fn write_back_locked(&self, max: usize) -> Result<usize> {
        let tiers = self.tiers();
        if tiers.is_empty() {
            return Ok(0);
        }
        let _one = self.shared.files.write_back_lock.lock();
        let rows = tiers.take_dirty(max);
        if rows.is_empty() {
            return Ok(0);
        }
        let mut progress = 0;
        let result = self.with_room_from(&mut progress, |st, from| {
            let todo: &[DirtyRow] = &rows[from..];
            let ptrs = self.write_records(st, todo.iter().map(|r| (r.key, &r.row[..])))?;
            // Rows readers already see in a tier: no notice.
            let mut p = RecordWriter::new(self, st, None);
            for (j, r) in todo.iter().enumerate() {
                if let Some(ahead) = todo.get(j + PUBLISH_AHEAD) {
                    p.prefetch(ahead.key);
                }
                // Deleted, or pushed again since it was copied: the newer state wins.
                let outcome = p.publish(
                    r.key,
                    Change::Upsert(ptrs[j]),
                    |tiers| !tiers.dirty_at(r.version),
                    |tiers| tiers.written_back(r.version),
                )?;
                if outcome == Outcome::NoRoom {
                    p.unused(&ptrs[j + 1..]);
                    p.finish();
                    return Ok(Some(j));
                }
            }
            p.finish();
            Ok(None)
        });
        match result {
            Ok(()) => Ok(rows.len()),
            Err(e) => {
                let rest: Vec<u64> = rows[progress..].iter().map(|r| r.key).collect();
                tiers.requeue(&rest);
                Err(e)
            }
        }
    }

    /// Writes back every dirty row of this table.
    pub(crate) fn write_back_all(&self) -> Result<()> {
        while self.write_back(WRITE_BACK_BATCH)? > 0 {}
        Ok(())
    }

    /// [`write_back_all`](Self::write_back_all) under the checkpoint gate held exclusively.
    pub(crate) fn write_back_all_locked(&self) -> Result<()> {
        while self.write_back_locked(WRITE_BACK_BATCH)? > 0 {}
        Ok(())
    }

    /// Loads rows without creating any (the work behind `lookahead`).
    pub(super) fn warm(&self, keys: &[u64]) -> Result<()> {
        let w = self.shared.config.layout.elems();
        let st = self.state()?;
        let st = &*st;
        let _pin = crossbeam_epoch::pin();
        let tiers = self.tiers();
        let loaded = if !tiers.is_empty() {
            let cold = tiers.absent(keys);
            let mut scratch = vec![0f32; cold.len() * w];
            let absent = self.tier_read(st, &cold, &mut scratch, None, false)?;
            cold.len() - absent.len()
        } else if let Some(m) = st.medium.as_mapped() {
            // Touch each row so its page is resident.
            let mut n = 0;
            let mut sum = 0u64;
            for &k in keys {
                if let Some(ptr) = st.index.get(k, st.index.hash(k)) {
                    sum = sum.wrapping_add(m.key_at(ptr)) ^ m.row_bytes(ptr).first().copied().unwrap_or(0) as u64;
                    n += 1;
                }
            }
            std::hint::black_box(sum);
            n
        } else {
            0
        };
        self.shared.counters.lookahead_rows.fetch_add(loaded as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Reads every row of a pinned table into its tiers (at open).
    pub(super) fn load_pinned(&self) -> Result<()> {
        let tiers = self.tiers();
        if tiers.is_empty() {
            return Ok(());
        }
        let w = self.shared.config.layout.elems();
        let t0 = std::time::Instant::now();
        let st = self.state()?;
        let st = &*st;
        let _pin = crossbeam_epoch::pin();
        let mut items: Vec<ReadItem> = Vec::with_capacity(PIN_LOAD_CHUNK);
        let mut rows = vec![0f32; PIN_LOAD_CHUNK * w];
        let mut total = 0u64;
        let mut load = |items: &mut Vec<ReadItem>, rows: &mut Vec<f32>| -> Result<()> {
            st.medium.read(items, rows)?;
            for it in items.iter() {
                tiers.locked(it.key, |locks| locks.load(&rows[it.pos * w..(it.pos + 1) * w]));
            }
            total += items.len() as u64;
            items.clear();
            Ok(())
        };
        let mut error = None;
        st.index.for_each(0, st.index.bucket_count(), |key, ptr| {
            if error.is_some() {
                return;
            }
            items.push(ReadItem { key, ptr, pos: items.len() });
            if items.len() == PIN_LOAD_CHUNK {
                if let Err(e) = load(&mut items, &mut rows) {
                    error = Some(e);
                }
            }
        });
        if let Some(e) = error {
            return Err(e);
        }
        load(&mut items, &mut rows)?;
        let stats = tiers.stats().expect("a table with tiers");
        let budget = stats.budget_bytes;
        if stats.pinned_bytes > budget {
            tracing::warn!(
                table = %self.shared.config.name,
                pinned_bytes = stats.pinned_bytes,
                budget,
                "pinned rows exceed the row cache budget; other tables get no cache room"
            );
        }
        tracing::info!(table = %self.shared.config.name, rows = total, seconds = t0.elapsed().as_secs_f64(), "pinned table loaded");
        Ok(())
    }
}
