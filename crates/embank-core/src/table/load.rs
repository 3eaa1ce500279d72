//! Bulk loads: many rows at once, written in order, indexed once.
//!
//! A [`Loader`] takes batches of rows ([`Loader::push`]) and [`Loader::finish`]es once.
//! Each batch's rows go to records as `push`'s do: free ones first, then one run of
//! records never handed out, so a table without free records (a new one, one that only
//! grew) is written sequentially. Their keys go
//! into the next generation of the index, built in DRAM (`index/build.rs`) from a copy
//! of the table's index taken when the load starts, gathered and put in 2 M at a time
//! in bucket order (`Bulk::index_pending`): the table's keys are kept, a key
//! loaded again points at its new row, a key loaded twice keeps the last row (as `push`
//! does). `finish` journals the loaded keys for the latest checkpoint (as any write
//! does), flushes the rows, writes the new index to its file once and installs it as a
//! growth does: the catalog names the new generation only once it is durable.
//!
//! Crash safety: until the catalog names the new generation, nothing of the table's
//! files that an open trusts has changed: the new index file is a left-over the open
//! removes, and the loaded records, handed out but named by no index, are found free
//! when the free list is rebuilt (every open after a kill rebuilds it). From then on the
//! open finds the new index, whose rows were made durable before it. So a kill reopens
//! the table as before the load or after it, whole. (With a retained checkpoint the
//! reopen goes back to the checkpoint anyway, as after any write: the journal names
//! every loaded key.)
//!
//! The load expects to be the table's only writer: readers go on, but a write of the
//! table between [`Table::loader`] and `finish` (counted by the index, `Index::watch`)
//! makes `finish` refuse, the table as it was. A table with near tiers (a row cache)
//! or a lifecycle loads through `push` instead (its rows must pass its tiers and its
//! admission), and says so in the log.

use std::time::Instant;

use super::options::load_target;
use super::Table;
use crate::error::{Error, ErrorKind, Result};
use crate::index::{buckets_for, Index};
use crate::medium::Medium;

/// Keys told to the tiers and listeners at a time once a load is installed.
const NOTICE_KEYS_MAX: usize = 1 << 16;
/// How many keys ahead a load asks for the index bucket it will insert into.
const PREFETCH_AHEAD: usize = 8;
/// Keys a load gathers before it puts them in the next index, in bucket order
/// ([`Bulk::index_pending`]): 32 bytes each, twice.
const PENDING_KEYS_MAX: usize = 1 << 21;
/// Stretches of buckets the gathered keys are ordered by: a stretch of a 300 M-key
/// index (23 M buckets) is ~350 buckets, 90 KiB, which stay in the core's cache while
/// its keys go in.
const PENDING_STRETCHES: u64 = 1 << 16;
/// A load whose rows take more than 1/this of `MemAvailable` drops them from the page
/// cache once on disk ([`Medium::drop_written`]), [`DROP_BEHIND_BYTES`] behind the last
/// written: they could not all stay cached, and the kernel reclaiming them one by one
/// beside the index being built cost 300 M int8 rows (14 GB, a 7.8 GB index, 24 GiB of
/// RAM) 76 s of writing against 49 s (at 100 M f32 rows it made no difference).
const DROP_ROWS_SHARE_DIVISOR: u64 = 2;
const DROP_BEHIND_BYTES: u64 = 256 << 20;
/// Bytes dropped at a time, at least.
const DROP_STEP_BYTES: u64 = 64 << 20;

/// What a bulk load did ([`Loader::finish`]).
#[derive(Clone, Debug, serde::Serialize)]
pub struct LoadReport {
    /// Rows given (a key given twice counts twice).
    pub rows: u64,
    /// Distinct keys loaded.
    pub keys: u64,
    /// False when the table took the rows through `push` (near tiers, a lifecycle).
    pub bulk: bool,
    /// Seconds from the loader's start to the end of `finish`.
    pub seconds: f64,
    /// Of those, seconds writing rows, putting keys in the next index, and in `finish`
    /// (the rows flushed, the index written and installed).
    pub write_seconds: f64,
    pub index_seconds: f64,
    pub finish_seconds: f64,
}

/// A bulk load of one table in progress (see the module docs). Dropped without
/// [`finish`](Self::finish), or after a failed `push` or `finish`, it leaves the table
/// as it was and hands its records back.
pub struct Loader {
    table: Table,
    started: Instant,
    rows: u64,
    /// `None`: rows go through `push`.
    bulk: Option<Bulk>,
    /// A push failed part way: only dropping the loader is left.
    failed: bool,
    /// The table takes the rows through `push`.
    through_push: bool,
}

/// A batch as given: rows (the state starts afresh) or whole records.
#[derive(Clone, Copy)]
enum Given<'a> {
    Rows(&'a [f32]),
    Records(&'a [f32]),
}

/// The state of a bulk load proper.
struct Bulk {
    /// The next generation, in DRAM (in its mapped file when too large for memory);
    /// taken by `install`.
    index: Option<Index>,
    /// Its file's path.
    path: std::path::PathBuf,
    /// The table's index generation, and its slot changes, when the load started.
    generation: u64,
    changes: u64,
    /// Records handed out before the load: the copied index names only these.
    first_record: u64,
    /// Runs of fresh records the load wrote: `(first record, count)`.
    runs: Vec<(u64, u64)>,
    /// Free records (handed out before the load) the load wrote.
    reused: std::collections::HashSet<u64>,
    /// Records of keys loaded again later in the load: never published.
    superseded: Vec<u64>,
    /// Keys written and not yet in the next index, in the order given: `(key, hash,
    /// row pointer)` ([`Bulk::index_pending`]).
    pending: Vec<(u64, u64, u64)>,
    /// Time spent writing rows and indexing keys.
    write: std::time::Duration,
    index_time: std::time::Duration,
    /// Written rows are dropped from the page cache behind the load (see
    /// [`DROP_ROWS_SHARE_DIVISOR`]): up to this byte of the rows file so far.
    drop_behind: bool,
    dropped_upto: u64,
}

impl Table {
    /// Starts a bulk load of about `rows_hint` rows (the next index is sized for the
    /// table's keys plus these; more only costs a rebuild in DRAM). Waits for a repair
    /// after a crash to end. See [`Loader`].
    pub fn loader(&self, rows_hint: u64) -> Result<Loader> {
        let started = Instant::now();
        if !self.tiers().is_empty() || self.shared.lifecycle.is_some() {
            tracing::info!(
                table = %self.shared.config.name,
                "bulk load through push: the table has a row cache or a lifecycle"
            );
            return Ok(Loader { table: self.clone(), started, rows: 0, bulk: None, failed: false, through_push: true });
        }
        self.wait_repaired();
        // The copy is taken with writers kept out, and counting starts before they
        // come back, so every write after the copy is counted.
        let guard = self.shared.files.state.write();
        let st = guard.as_ref().ok_or_else(|| self.closed())?;
        if !st.index.watch(true) {
            return Err(Error::invalid(format!("table {:?} has a bulk load running already", self.shared.config.name)));
        }
        let built = (|| {
            let live = &st.index;
            // Without growth the table keeps its size (a load that does not fit fails).
            let buckets = match self.shared.config.growth {
                true => buckets_for(live.len() + rows_hint.max(1), load_target(self.shared.config.load_factor_max))
                    .max(live.bucket_count()),
                false => live.bucket_count(),
            };
            let path = super::open::loading_index_path(&self.shared.config.dir, st.generation + 1);
            let index = self.new_index(&path, buckets, live.seed(), live.units())?;
            // An empty table's index is not read: a large, sparse one would fill the page
            // cache with its holes.
            if !live.is_empty() {
                copy_into(&index, live)?;
            }
            Ok::<_, Error>(index)
        })();
        let index = match built {
            Ok(index) => index,
            Err(e) => {
                st.index.watch(false);
                return Err(e);
            }
        };
        let alloc = st.medium.alloc();
        let rows_bytes = rows_hint.saturating_mul(alloc.stride());
        let drop_behind = crate::index::mem_available_bytes().is_some_and(|m| rows_bytes > m / DROP_ROWS_SHARE_DIVISOR);
        let bulk = Bulk {
            drop_behind,
            dropped_upto: alloc.ptr_of(alloc.next_record()),
            path: index.path().to_owned(),
            index: Some(index),
            generation: st.generation,
            changes: st.index.changes(),
            first_record: st.medium.alloc().next_record(),
            runs: Vec::new(),
            reused: Default::default(),
            superseded: Vec::new(),
            pending: Vec::new(),
            write: Default::default(),
            index_time: Default::default(),
        };
        Ok(Loader { table: self.clone(), started, rows: 0, bulk: Some(bulk), failed: false, through_push: false })
    }

    /// Loads `keys` with `rows` (`keys.len() * dim` elements) in one bulk load: a
    /// [`loader`](Self::loader), one push, `finish`.
    pub fn load(&self, keys: &[u64], rows: &[f32]) -> Result<LoadReport> {
        self.check_rows("load", keys.len(), rows.len())?;
        let mut loader = self.loader(keys.len() as u64)?;
        loader.push(keys, rows)?;
        loader.finish()
    }
}

impl Loader {
    /// Adds rows (`keys.len() * dim` elements; the optimizer's state starts afresh, as
    /// with `push`). Rows of the wrong length or holding a non-finite value are refused
    /// before anything is written (the loader stays usable); a failed write (a full disk)
    /// fails the load: drop the loader, the table is as it was.
    pub fn push(&mut self, keys: &[u64], rows: &[f32]) -> Result<()> {
        let table = self.table.clone();
        table.check_rows("load", keys.len(), rows.len())?;
        if let Some(i) = crate::optim::first_non_finite(rows) {
            return Err(Error::invalid(format!(
                "load: row of key {} holds a non-finite value ({}); nothing was written",
                keys[i / table.dim()],
                rows[i]
            )));
        }
        self.push_checked(&table, keys, Given::Rows(rows))
    }

    fn push_checked(&mut self, table: &Table, keys: &[u64], given: Given<'_>) -> Result<()> {
        if self.failed {
            return Err(Error::invalid("load: an earlier batch failed; drop the loader and start again"));
        }
        let result = match (&mut self.bulk, given) {
            (None, Given::Rows(rows)) => table.push(keys, rows),
            (None, Given::Records(records)) => table.push_with_state(keys, records),
            (Some(bulk), given) => bulk.push(table, keys, given),
        };
        match result {
            Ok(()) => {
                self.rows += keys.len() as u64;
                Ok(())
            }
            Err(e) => {
                self.failed = self.bulk.is_some();
                Err(e)
            }
        }
    }

    /// Adds records with their optimizer state (`keys.len() * (dim + state_len)`
    /// elements, as [`Table::push_with_state`] takes them: what a reshard copies). Refused
    /// before anything is written as `push_with_state` refuses; otherwise as
    /// [`push`](Self::push).
    pub fn push_with_state(&mut self, keys: &[u64], records: &[f32]) -> Result<()> {
        let table = self.table.clone();
        table.check_records("load", keys, records)?;
        self.push_checked(&table, keys, Given::Records(records))
    }

    /// Rows pushed so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Makes the load the table's, durable (see the module docs); refuses, the table as
    /// it was, when the table was written meanwhile or an earlier batch failed.
    pub fn finish(mut self) -> Result<LoadReport> {
        if self.failed {
            return Err(Error::invalid("load: an earlier batch failed; nothing of the load was kept"));
        }
        let finishing = Instant::now();
        let (keys, write, index) = match &mut self.bulk {
            None => (self.rows, 0.0, 0.0),
            Some(bulk) => {
                let table = self.table.clone();
                bulk.index_pending(&table)?;
                let keys = bulk.install(&table)?;
                let times = (bulk.write.as_secs_f64(), bulk.index_time.as_secs_f64());
                self.bulk = None;
                (keys, times.0, times.1)
            }
        };
        let report = LoadReport {
            rows: self.rows,
            keys,
            bulk: !self.through_push,
            seconds: self.started.elapsed().as_secs_f64(),
            write_seconds: write,
            index_seconds: index,
            finish_seconds: finishing.elapsed().as_secs_f64(),
        };
        tracing::info!(table = %self.table.shared.config.name, ?report, "bulk load done");
        Ok(report)
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        let Some(mut bulk) = self.bulk.take() else { return };
        drop(bulk.index.take());
        let _ = std::fs::remove_file(&bulk.path);
        if let Ok(st) = self.table.state() {
            if st.generation == bulk.generation {
                st.index.watch(false);
            }
            let alloc = st.medium.alloc();
            let records = bulk.runs.iter().flat_map(|&(first, n)| first..first + n).chain(bulk.reused.iter().copied());
            let ptrs: Vec<u64> = records.map(|r| alloc.ptr_of(r)).collect();
            alloc.release(ptrs);
        }
    }
}

impl Bulk {
    /// True when the load wrote `record`: a fresh one, or a free one it took.
    fn is_loaded(&self, record: u64) -> bool {
        record >= self.first_record || self.reused.contains(&record)
    }

    /// Writes a batch's rows to one fresh run of records and points their keys at them
    /// in the next index.
    fn push(&mut self, table: &Table, keys: &[u64], given: Given<'_>) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let layout = table.shared.config.layout;
        let (w, d) = (layout.elems(), layout.dim);
        let records: std::borrow::Cow<'_, [f32]> = match given {
            Given::Rows(rows) if layout.has_state() => {
                let mut records = vec![0f32; keys.len() * w];
                let opt = table.optimizer();
                for (rec, row) in records.chunks_exact_mut(w).zip(rows.chunks_exact(d)) {
                    rec[..d].copy_from_slice(row);
                    opt.init_state(&mut rec[d..]);
                }
                records.into()
            }
            Given::Rows(records) | Given::Records(records) => records.into(),
        };
        let st = table.state()?;
        let alloc = st.medium.alloc();
        let mut ptrs = Vec::with_capacity(keys.len());
        alloc.allocate(keys.len(), &mut ptrs)?;
        for &ptr in &ptrs {
            let record = alloc.record_of(ptr);
            if record < self.first_record {
                self.reused.insert(record);
            } else {
                match self.runs.last_mut() {
                    Some((first, n)) if *first + *n == record => *n += 1,
                    _ => self.runs.push((record, 1)),
                }
            }
        }
        let items: Vec<(u64, u64, &[f32])> = keys
            .iter()
            .zip(&ptrs)
            .enumerate()
            .map(|(i, (&key, &ptr))| (key, ptr, &records[i * w..(i + 1) * w]))
            .collect();
        let writing = Instant::now();
        st.medium.write_bulk(&items)?;
        if let (true, Some(&(first, n))) = (self.drop_behind, self.runs.last()) {
            let end = alloc.ptr_of(first + n - 1) + alloc.stride();
            let upto = end.saturating_sub(DROP_BEHIND_BYTES);
            if upto >= self.dropped_upto + DROP_STEP_BYTES {
                st.medium.drop_written(self.dropped_upto, upto)?;
                self.dropped_upto = upto;
            }
        }
        self.write += writing.elapsed();
        let index = self.index.as_ref().expect("a bulk load not installed yet");
        self.pending.extend(items.iter().map(|&(key, ptr, _)| (key, index.hash(key), ptr)));
        // `index_pending` reads the state again: a read lock taken twice by one thread
        // waits forever once a writer queues between the two (parking_lot is fair).
        drop(st);
        if self.pending.len() >= PENDING_KEYS_MAX {
            self.index_pending(table)?;
        }
        Ok(())
    }

    /// Puts the gathered keys in the next index, ordered by the stretch of buckets their
    /// home lies in (a stable counting sort: a key given twice keeps its order, so the
    /// last row wins). A key at a time in the order given, each landed at random in an
    /// index far larger than the CPU's caches: at 300 M keys (a 5.9 GB index) that
    /// random walk, not the rows, bounded the load.
    fn index_pending(&mut self, table: &Table) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let indexing = Instant::now();
        let pending = std::mem::take(&mut self.pending);
        let ordered = {
            let index = self.index.as_ref().expect("a bulk load not installed yet");
            let buckets = index.bucket_count();
            let stretch = |hash: u64| (index.home_of(hash) * PENDING_STRETCHES / buckets) as usize;
            let mut starts = vec![0usize; PENDING_STRETCHES as usize + 1];
            for &(_, h, _) in &pending {
                starts[stretch(h) + 1] += 1;
            }
            for i in 1..starts.len() {
                starts[i] += starts[i - 1];
            }
            let mut ordered = vec![(0u64, 0u64, 0u64); pending.len()];
            for &entry in &pending {
                let at = &mut starts[stretch(entry.1)];
                ordered[*at] = entry;
                *at += 1;
            }
            ordered
        };
        drop(pending);
        let st = table.state()?;
        let alloc = st.medium.alloc();
        for (i, &(key, h, ptr)) in ordered.iter().enumerate() {
            let index = self.index.as_ref().expect("a bulk load not installed yet");
            if let Some(&(_, ahead, _)) = ordered.get(i + PREFETCH_AHEAD) {
                index.prefetch(ahead);
            }
            if let Some(old) = index.replace(key, h, ptr) {
                if self.is_loaded(alloc.record_of(old)) {
                    self.superseded.push(old);
                }
                continue;
            }
            loop {
                let index = self.index.as_ref().expect("a bulk load not installed yet");
                if table.has_room(index) && index.insert_new(key, h, ptr)? {
                    break;
                }
                self.grow(table)?;
            }
        }
        self.index_time += indexing.elapsed();
        Ok(())
    }

    /// Rebuilds the next index at twice its size (its own generation's path).
    fn grow(&mut self, table: &Table) -> Result<()> {
        let index = self.index.as_ref().expect("a bulk load not installed yet");
        if !table.shared.config.growth {
            return Err(Error::new(
                ErrorKind::TableFull,
                format!(
                    "load: table {:?} is full: {} keys in {} slots (load factor max {}), and growth is off",
                    table.shared.config.name,
                    index.len(),
                    index.slot_count(),
                    table.shared.config.load_factor_max
                ),
            ));
        }
        let mut buckets = index.bucket_count() * 2;
        loop {
            let next = table.new_index(&self.path, buckets, index.seed(), index.units())?;
            match copy_into(&next, index) {
                Ok(()) => {
                    self.index = Some(next);
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::TableFull => buckets *= 2,
                Err(e) => return Err(e),
            }
        }
    }

    /// Flushes the rows, persists the index, journals the loaded keys and installs it;
    /// then retires the records it replaced and tells the tiers and listeners. Returns
    /// the distinct keys loaded. On failure the loader's drop hands the records back.
    fn install(&mut self, table: &Table) -> Result<u64> {
        let name = &table.shared.config.name;
        // Rows first, then the index, made durable before any lock is taken: reads and
        // writes go on while gigabytes are written. Until the catalog names the new
        // generation its file is a left-over an open removes (and the loader's drop).
        table.state()?.medium.flush()?;
        let index = self.index.take().expect("a bulk load installs once").persist()?;
        let gate = &table.shared.runtime.gate;
        let _gate = gate.batch();
        let mut guard = table.shared.files.state.write();
        let st = guard.as_mut().ok_or_else(|| table.closed())?;
        if st.generation != self.generation || st.index.changes() != self.changes {
            return Err(Error::invalid(format!(
                "load: table {name:?} was written during its bulk load; nothing of the load was kept"
            )));
        }
        // Each loaded key's first change since the latest checkpoint is journaled, and
        // the records the new index no longer names are held or retired, as a write does.
        let interval = gate.interval();
        let checkpoints = &table.shared.checkpoints;
        let (mut held, mut retired, mut keys) = (Vec::new(), Vec::new(), 0u64);
        {
            let alloc = st.medium.alloc();
            let live = &st.index;
            let keys_before = live.len();
            let look = interval != 0 || keys_before > 0;
            let (mut jw, mut journaled) = (None, Ok(()));
            index.for_each(0, index.bucket_count(), |key, ptr| {
                if !self.is_loaded(alloc.record_of(ptr)) || journaled.is_err() {
                    return;
                }
                keys += 1;
                if !look {
                    return;
                }
                let h = live.hash(key);
                match checkpoints.journal_first_change(interval, &mut jw, live, key, h) {
                    Err(e) => journaled = Err(e.context(format!("table {name:?}"))),
                    Ok(keep) => {
                        if let Some(old) = live.get(key, h) {
                            alloc.note_unlinked(old);
                            if keep == Some(old) {
                                held.push(old);
                            } else {
                                retired.push(old);
                            }
                        }
                    }
                }
            });
            journaled?;
        }
        // Rows and index are durable (above); now the index takes its generation's name
        // and the catalog names it (`install_index` syncs the directory first).
        let mut index = index;
        index.rename(&super::open::index_path(&table.shared.config.dir, self.generation + 1))?;
        let grown = index.bucket_count() > st.index.bucket_count();
        table.install_index(st, index, self.generation + 1, grown)?;
        // Installed: the loaded records are the table's now.
        self.runs.clear();
        self.reused.clear();
        let alloc = st.medium.alloc();
        alloc.release(std::mem::take(&mut self.superseded));
        alloc.retire(&crossbeam_epoch::pin(), retired);
        checkpoints.hold(interval, held);
        drop(guard);
        if table.tiers().hears_changes() {
            let st = table.state()?;
            let alloc = st.medium.alloc();
            let mut changed = Vec::with_capacity(NOTICE_KEYS_MAX);
            st.index.for_each(0, st.index.bucket_count(), |key, ptr| {
                if self.is_loaded(alloc.record_of(ptr)) {
                    changed.push(key);
                    if changed.len() == NOTICE_KEYS_MAX {
                        table.tiers().changed(&changed);
                        changed.clear();
                    }
                }
            });
            table.tiers().changed(&changed);
        }
        Ok(keys)
    }
}

/// Inserts every key of `from` into the empty `into`: a `TableFull` error when a key
/// finds no slot.
fn copy_into(into: &Index, from: &Index) -> Result<()> {
    let mut filled = Ok(true);
    from.for_each(0, from.bucket_count(), |key, ptr| {
        if matches!(filled, Ok(true)) {
            filled = into.insert_new(key, into.hash(key), ptr);
        }
    });
    match filled? {
        true => Ok(()),
        false => Err(Error::new(ErrorKind::TableFull, "no slot for a key in the rebuilt index")),
    }
}
