//! The tiered path of a table: the DRAM row cache over a medium (block, or
//! mmap with a cache), taken by every table except mmap tables that bypass
//! the cache (those keep the lock-free fast path of `table.rs`).
//!
//! Reads: row cache, then the index, then one batch of medium reads (io_uring
//! on the block medium) for every miss; rows read are admitted into the cache
//! unless the placement is `bypass`.
//!
//! Writes: a push of a row the index already has replaces (or inserts) its
//! cache entry and marks it dirty; nothing reaches the medium until a
//! write-back (maintenance thread, writer back-pressure, `flush`, `close`).
//! Rows new to the index, and every write of a `bypass` table, go through to
//! the medium at once: written to fresh records in one batch, then published
//! in the index (write-around: they enter the cache when first read, so a
//! bulk load does not flush the hot set; a pinned table caches them at once). So a dirty cache entry always belongs to a key the index has,
//! and a table that cannot grow fails the push itself, never a later
//! write-back.
//!
//! Locking: every change of a key's index slot holds the key's stripe lock
//! and, when the table is cached, its cache shard's write lock. A read that
//! missed admits its row only if, under the shard lock, the row is still not
//! cached and the index still points at the record it read; so a stale read
//! never lands in the cache. Dirty entries are never evicted, so a key that is
//! not cached is up to date in the index.

use std::sync::atomic::Ordering;

use super::{Pass, State, Table};
use crate::cache::{DirtyRow, RowCache};
use crate::catalog::Placement;
use crate::error::Result;
use crate::medium::ReadItem;

/// Rows a writer writes back itself when dirty bytes pass the cache's high-water mark.
const WRITE_BACK_BATCH: usize = 4096;
/// Rows per medium read while loading a pinned table.
const PIN_LOAD_CHUNK: usize = 4096;
/// How far ahead of the key being resolved its home bucket is prefetched.
const PREFETCH_KEYS_AHEAD: usize = 8;

impl Table {
    /// The row cache, for tables that use it.
    pub(super) fn cache(&self) -> Option<&RowCache> {
        match self.shared.placement {
            Placement::Cache | Placement::Pin => self.shared.tier.cache.as_deref(),
            Placement::Auto | Placement::Bypass => None,
        }
    }

    fn pinned(&self) -> bool {
        self.shared.placement == Placement::Pin
    }

    /// Cache, index, medium. Returns positions found nowhere; fills `found` if given.
    fn tier_read(
        &self,
        st: &State,
        keys: &[u64],
        out: &mut [f32],
        found: Option<&mut [bool]>,
        count: bool,
    ) -> Result<Vec<usize>> {
        let dim = self.shared.width;
        let id = self.shared.id;
        let cache = self.cache();
        let mut miss: Vec<usize> = Vec::new();
        match cache {
            Some(c) => {
                for (i, &key) in keys.iter().enumerate() {
                    if !c.get(id, key, c.hash(id, key), &mut out[i * dim..(i + 1) * dim]) {
                        miss.push(i);
                    }
                }
            }
            None => miss.extend(0..keys.len()),
        }
        let index = &st.index;
        let hashes: Vec<u64> = miss.iter().map(|&i| index.hash(keys[i])).collect();
        let mut items = Vec::with_capacity(miss.len());
        let mut absent = Vec::new();
        for (j, &i) in miss.iter().enumerate() {
            if j + PREFETCH_KEYS_AHEAD < miss.len() {
                index.prefetch(hashes[j + PREFETCH_KEYS_AHEAD]);
            }
            match index.get(keys[i], hashes[j]) {
                Some(ptr) => items.push(ReadItem { key: keys[i], ptr, pos: i }),
                None => absent.push(i),
            }
        }
        st.medium.read(&items, out)?;
        if let Some(c) = cache {
            let pinned = self.pinned();
            for it in &items {
                let mut l = c.lock(c.hash(id, it.key));
                let row = &mut out[it.pos * dim..(it.pos + 1) * dim];
                if let Some(e) = l.get(id, it.key) {
                    // Cached meanwhile (a push, or another reader): that copy is at least as new.
                    row.copy_from_slice(&e.row);
                } else if index.get(it.key, index.hash(it.key)) == Some(it.ptr) {
                    l.insert(id, it.key, row, false, pinned);
                }
            }
        }
        if let Some(found) = found {
            found.fill(true);
            for &i in &absent {
                found[i] = false;
            }
        }
        let counters = &self.shared.counters;
        counters.rows_read.fetch_add(items.len() as u64, Ordering::Relaxed);
        if count && cache.is_some() {
            counters.hits.fetch_add((keys.len() - miss.len()) as u64, Ordering::Relaxed);
            counters.misses.fetch_add(miss.len() as u64, Ordering::Relaxed);
        }
        Ok(absent)
    }

    pub(super) fn tier_lookup(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<Vec<usize>> {
        let st = self.state()?;
        let _pin = crossbeam_epoch::pin();
        self.tier_read(st.as_ref().unwrap(), keys, out, Some(found), true)
    }

    pub(super) fn tier_pull(&self, keys: &[u64], out: &mut [f32]) -> Result<()> {
        let mut todo = {
            let st = self.state()?;
            let _pin = crossbeam_epoch::pin();
            self.tier_read(st.as_ref().unwrap(), keys, out, None, true)?
        };
        let mut reread = Vec::new();
        while !todo.is_empty() {
            let pass = {
                let st = self.state()?;
                self.tier_create(st.as_ref().unwrap(), keys, &todo, out, &mut reread)?
            };
            match pass {
                Pass::Done => break,
                Pass::NeedRoom(done) => {
                    todo.drain(..done);
                    self.make_room()?;
                }
            }
        }
        if !reread.is_empty() {
            // Created by another writer between our read and our create: read theirs.
            let dim = self.shared.width;
            let sub: Vec<u64> = reread.iter().map(|&i| keys[i]).collect();
            let mut rows = vec![0f32; sub.len() * dim];
            {
                let st = self.state()?;
                let _pin = crossbeam_epoch::pin();
                self.tier_read(st.as_ref().unwrap(), &sub, &mut rows, None, false)?;
            }
            for (j, &i) in reread.iter().enumerate() {
                out[i * dim..(i + 1) * dim].copy_from_slice(&rows[j * dim..(j + 1) * dim]);
            }
        }
        Ok(())
    }

    /// Allocates records and writes `(key, row)`s to them in one batch; nothing is published.
    fn write_records<'a>(&self, st: &State, rows: impl Iterator<Item = (u64, &'a [f32])>) -> Result<Vec<u64>> {
        let rows: Vec<(u64, &[f32])> = rows.collect();
        let alloc = st.medium.alloc();
        let mut ptrs = Vec::new();
        alloc.allocate(rows.len(), &mut ptrs)?;
        let items: Vec<(u64, u64, &[f32])> = rows.iter().zip(&ptrs).map(|(&(k, r), &p)| (k, p, r)).collect();
        if let Err(e) = st.medium.write(&items) {
            alloc.release(ptrs);
            return Err(e);
        }
        Ok(ptrs)
    }

    /// Creates the rows at `positions` with the initializer (written through).
    fn tier_create(
        &self,
        st: &State,
        keys: &[u64],
        positions: &[usize],
        out: &mut [f32],
        reread: &mut Vec<usize>,
    ) -> Result<Pass> {
        let dim = self.shared.width;
        let id = self.shared.id;
        for &i in positions {
            self.init_record(keys[i], &mut out[i * dim..(i + 1) * dim]);
        }
        let ptrs = self.write_records(st, positions.iter().map(|&i| (keys[i], &out[i * dim..(i + 1) * dim])))?;
        let alloc = st.medium.alloc();
        let index = &st.index;
        let cache = self.cache();
        let _pin = crossbeam_epoch::pin();
        let mut jw = None;
        for (j, &i) in positions.iter().enumerate() {
            let key = keys[i];
            let h = index.hash(key);
            let mut w = self.stripe(h).lock();
            let mut l = cache.map(|c| c.lock(c.hash(id, key)));
            let row = &mut out[i * dim..(i + 1) * dim];
            if let Some(e) = l.as_ref().and_then(|l| l.get(id, key)) {
                row.copy_from_slice(&e.row);
                alloc.release(vec![ptrs[j]]);
                continue;
            }
            if index.get(key, h).is_some() {
                alloc.release(vec![ptrs[j]]);
                reread.push(i);
                continue;
            }
            if !self.has_room(index) {
                alloc.release(ptrs[j..].to_vec());
                return Ok(Pass::NeedRoom(j));
            }
            self.journal(&mut jw, &mut w, index, key, h)?;
            if !index.insert_new(key, h, ptrs[j]) {
                alloc.release(ptrs[j..].to_vec());
                return Ok(Pass::NeedRoom(j));
            }
            if let Some(l) = l.as_mut() {
                l.insert(id, key, row, false, self.pinned());
            }
        }
        Ok(Pass::Done)
    }

    pub(super) fn tier_push(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        let dim = self.shared.width;
        let id = self.shared.id;
        let mut through: Vec<usize> = Vec::new();
        match self.cache() {
            None => through.extend(0..keys.len()),
            Some(c) => {
                let st = self.state()?;
                let index = &st.as_ref().unwrap().index;
                let pinned = self.pinned();
                for (i, &key) in keys.iter().enumerate() {
                    let row = &rows[i * dim..(i + 1) * dim];
                    let mut l = c.lock(c.hash(id, key));
                    if l.update_dirty(id, key, row) {
                        continue;
                    }
                    if index.get(key, index.hash(key)).is_some() {
                        l.insert(id, key, row, true, pinned);
                        continue;
                    }
                    through.push(i);
                }
            }
        }
        while !through.is_empty() {
            let pass = {
                let st = self.state()?;
                self.write_through(st.as_ref().unwrap(), keys, rows, &through)?
            };
            match pass {
                Pass::Done => break,
                Pass::NeedRoom(done) => {
                    through.drain(..done);
                    self.make_room()?;
                }
            }
        }
        if let Some(c) = self.cache() {
            // Back-pressure: a writer that outruns write-back writes back itself.
            while c.dirty_bytes() > c.dirty_high() {
                if self.write_back(WRITE_BACK_BATCH)? == 0 {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Writes the rows at `positions` to fresh records and publishes them (insert or replace).
    fn write_through(&self, st: &State, keys: &[u64], rows: &[f32], positions: &[usize]) -> Result<Pass> {
        let dim = self.shared.width;
        let id = self.shared.id;
        let ptrs = self.write_records(st, positions.iter().map(|&i| (keys[i], &rows[i * dim..(i + 1) * dim])))?;
        let alloc = st.medium.alloc();
        let index = &st.index;
        let cache = self.cache();
        let guard = crossbeam_epoch::pin();
        let mut jw = None;
        let (mut retired, mut held) = (Vec::new(), Vec::new());
        let mut result = Pass::Done;
        for (j, &i) in positions.iter().enumerate() {
            let key = keys[i];
            let row = &rows[i * dim..(i + 1) * dim];
            let h = index.hash(key);
            let mut w = self.stripe(h).lock();
            let mut l = cache.map(|c| c.lock(c.hash(id, key)));
            let keep = self.journal(&mut jw, &mut w, index, key, h)?;
            if let Some(old) = index.replace(key, h, ptrs[j]) {
                if keep == Some(old) {
                    held.push(old)
                } else {
                    retired.push(old)
                }
            } else if !self.has_room(index) || !index.insert_new(key, h, ptrs[j]) {
                alloc.release(ptrs[j..].to_vec());
                result = Pass::NeedRoom(j);
                break;
            }
            if let Some(l) = l.as_mut() {
                // Write-around: a written row enters the cache when it is read (a bulk
                // load would otherwise flush the hot set), except in a pinned table.
                if !l.update_clean(id, key, row) && self.pinned() {
                    l.insert(id, key, row, false, true);
                }
            }
        }
        self.settle(alloc, &guard, retired, held);
        Ok(result)
    }

    /// Writes back up to `max` dirty rows of this table; returns how many were taken.
    pub(crate) fn write_back(&self, max: usize) -> Result<usize> {
        let _gate = self.shared.tier.gate.read_recursive();
        self.write_back_locked(max)
    }

    /// [`write_back`](Self::write_back) for a caller that holds the checkpoint gate.
    fn write_back_locked(&self, max: usize) -> Result<usize> {
        let Some(cache) = self.cache() else { return Ok(0) };
        let id = self.shared.id;
        let _one = self.shared.write_back_lock.lock();
        let rows = cache.take_dirty(id, max);
        if rows.is_empty() {
            return Ok(0);
        }
        let mut from = 0;
        loop {
            let pass = match self.state() {
                Ok(st) => self.install_write_back(st.as_ref().unwrap(), &rows[from..]),
                Err(e) => Err(e),
            };
            let err = match pass {
                Ok(Pass::Done) => return Ok(rows.len()),
                Ok(Pass::NeedRoom(done)) => {
                    from += done;
                    match self.make_room() {
                        Ok(()) => continue,
                        Err(e) => e,
                    }
                }
                Err(e) => e,
            };
            cache.requeue(id, rows[from..].iter().map(|r| r.key));
            return Err(err);
        }
    }

    fn install_write_back(&self, st: &State, rows: &[DirtyRow]) -> Result<Pass> {
        let id = self.shared.id;
        let cache = self.cache().expect("write-back needs the cache");
        let ptrs = self.write_records(st, rows.iter().map(|r| (r.key, &r.row[..])))?;
        let alloc = st.medium.alloc();
        let index = &st.index;
        let guard = crossbeam_epoch::pin();
        let mut jw = None;
        let (mut retired, mut held) = (Vec::new(), Vec::new());
        let mut unused = Vec::new();
        let mut result = Pass::Done;
        for (j, r) in rows.iter().enumerate() {
            let h = index.hash(r.key);
            let mut w = self.stripe(h).lock();
            let mut l = cache.lock(cache.hash(id, r.key));
            let current = l.get(id, r.key).is_some_and(|e| e.dirty && e.version == r.version);
            if !current {
                // Deleted, or pushed again since it was copied: the newer state wins.
                unused.push(ptrs[j]);
                continue;
            }
            let keep = self.journal(&mut jw, &mut w, index, r.key, h)?;
            if let Some(old) = index.replace(r.key, h, ptrs[j]) {
                if keep == Some(old) {
                    held.push(old)
                } else {
                    retired.push(old)
                }
            } else if !self.has_room(index) || !index.insert_new(r.key, h, ptrs[j]) {
                unused.extend_from_slice(&ptrs[j..]);
                result = Pass::NeedRoom(j);
                break;
            }
            l.mark_clean(id, r.key, r.version);
        }
        alloc.release(unused);
        self.settle(alloc, &guard, retired, held);
        Ok(result)
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

    /// Asks the maintenance thread to load these rows into the row cache (or, on an
    /// uncached mmap table, into the page cache), so a later pull of them hits. Returns
    /// at once; false if the request queue was full and the hint was dropped.
    pub fn lookahead(&self, keys: &[u64]) -> Result<bool> {
        drop(self.state()?);
        if keys.is_empty() {
            return Ok(true);
        }
        Ok(self.shared.tier.lookahead(self, keys.to_vec()))
    }

    /// Loads rows without creating any (the work behind `lookahead`).
    pub(crate) fn warm(&self, keys: &[u64]) -> Result<()> {
        let dim = self.shared.width;
        let st = self.state()?;
        let st = st.as_ref().unwrap();
        let _pin = crossbeam_epoch::pin();
        let loaded = match (self.cache(), &st.medium) {
            (Some(c), _) => {
                let id = self.shared.id;
                let cold: Vec<u64> = keys.iter().copied().filter(|&k| !c.contains(id, k, c.hash(id, k))).collect();
                let mut scratch = vec![0f32; cold.len() * dim];
                let absent = self.tier_read(st, &cold, &mut scratch, None, false)?;
                cold.len() - absent.len()
            }
            (None, crate::medium::Medium::Mmap(m)) => {
                // Touch each row so its page is resident.
                let mut n = 0;
                let mut sum = 0f32;
                for &k in keys {
                    if let Some(ptr) = st.index.get(k, st.index.hash(k)) {
                        sum += m.row_at(ptr)[0];
                        n += 1;
                    }
                }
                std::hint::black_box(sum);
                n
            }
            (None, crate::medium::Medium::Block(_)) => 0,
        };
        self.shared.counters.lookahead_rows.fetch_add(loaded as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Reads every row of a pinned table into the cache (at open).
    pub(super) fn load_pinned(&self) -> Result<()> {
        let Some(cache) = self.cache() else { return Ok(()) };
        let dim = self.shared.width;
        let id = self.shared.id;
        let t0 = std::time::Instant::now();
        let st = self.state()?;
        let st = st.as_ref().unwrap();
        let _pin = crossbeam_epoch::pin();
        let mut items: Vec<ReadItem> = Vec::with_capacity(PIN_LOAD_CHUNK);
        let mut rows = vec![0f32; PIN_LOAD_CHUNK * dim];
        let mut total = 0u64;
        let mut flush = |items: &mut Vec<ReadItem>, rows: &mut Vec<f32>| -> Result<()> {
            st.medium.read(items, rows)?;
            for it in items.iter() {
                let mut l = cache.lock(cache.hash(id, it.key));
                if l.get(id, it.key).is_none() {
                    l.insert(id, it.key, &rows[it.pos * dim..(it.pos + 1) * dim], false, true);
                }
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
                if let Err(e) = flush(&mut items, &mut rows) {
                    error = Some(e);
                }
            }
        });
        if let Some(e) = error {
            return Err(e);
        }
        flush(&mut items, &mut rows)?;
        let budget = cache.budget();
        if cache.stats().pinned_bytes > budget {
            tracing::warn!(
                table = %self.shared.name,
                pinned_bytes = cache.stats().pinned_bytes,
                budget,
                "pinned rows exceed the row cache budget; other tables get no cache room"
            );
        }
        tracing::info!(table = %self.shared.name, rows = total, seconds = t0.elapsed().as_secs_f64(), "pinned table loaded");
        Ok(())
    }
}
