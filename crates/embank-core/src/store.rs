//! The store: one directory holding one model's tables.
//!
//! ```text
//! <dir>/LOCK               flock'ed while a process has the store open
//! <dir>/STORE              the catalog (magic, format version, checksum, JSON)
//! <dir>/tables/<id>/index.<generation>.ebi   the table's hash index
//! <dir>/tables/<id>/rows.ebr                 the table's row records (mmap medium)
//! <dir>/tables/<id>/rows.ebb                 the table's row records (block medium)
//! <dir>/tables/<id>/rows.free                free records, saved at a clean close
//! ```

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;
use serde::Serialize;

use crate::catalog::{Catalog, TableMeta, CATALOG_FILE};
use crate::checkpoint::{CheckpointFile, CHECKPOINT_META_BYTES_MAX};
use crate::error::{io_at, Error, ErrorKind, Result};
use crate::io::{FaultPlan, FaultyEngine, IoChoice, IoStats};
use crate::runtime::Runtime;
use crate::table::{validate_name, AtExport, RepairMode, Table, TableOptions, TableStats};
use crate::tier::{CacheStats, RowCache, Tier};

pub use crate::checkpoint::CheckpointInfo;

/// Default budget of the DRAM row cache.
pub const CACHE_BYTES_DEFAULT: u64 = 256 << 20;
/// Default bound on block-medium requests in flight per batch.
pub const IO_DEPTH_DEFAULT: u32 = 128;

/// Options for [`Store::open`].
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Create the store if the directory holds none. Default true.
    pub create: bool,
    /// On open, check every row's checksum and drop rows that fail, as after a power
    /// loss. Default false: after a process crash only interrupted buckets are checked.
    pub verify: bool,
    /// Budget of the DRAM row cache shared by the store's tables (0: no cache).
    /// Memory is taken as rows are cached, not up front. Default 256 MiB.
    pub cache_bytes: u64,
    /// Budget of the pooled-embedding cache of inference bags ([`Table::lookup_pooled`]):
    /// whole id sequences that repeat are answered with their pooled vector. Default 0
    /// (none): a serving option.
    pub pooled_cache_bytes: u64,
    /// Automatic hot placement: tables sample what their reads ask for and the
    /// maintenance thread places each table's hot set in its home index buckets now
    /// and then (`hot.rs`). Default `None` (off): [`Table::place_hot`] places on demand.
    pub hot_placement: Option<crate::hot::HotOptions>,
    /// I/O engine of block media. Default `auto`: io_uring if the kernel allows, else pread.
    pub io_engine: IoChoice,
    /// Most block-medium requests in flight per batch. Default 128.
    pub io_depth: u32,
    /// Map mmap-medium files with `MADV_RANDOM` (no read-around, small page-cache
    /// folios). Default true: without it a row write dirties a whole large folio of
    /// the page cache and 5 % of pushes cut throughput 15-fold (ycsb-b), and once rows
    /// outgrow memory each miss reads a window of pages. Turn it off for a read-only,
    /// fully resident table: reads are then about 25 % faster.
    pub mmap_random_access: bool,
    /// Map the index and mmap-medium rows with transparent huge pages (`MADV_HUGEPAGE`,
    /// instead of `MADV_RANDOM`) where the kernel and the file system allow (ext4 and
    /// tmpfs on recent kernels back file mappings with 2 MiB folios): a random read then
    /// walks far fewer page tables (ycsb-c 10 M x 128 read 1.54x faster, docs/BENCHMARKS.md).
    /// A row write dirties a whole 2 MiB folio, so this is for read-mostly stores (serving
    /// replicas). Default false.
    pub huge_pages: bool,
    /// How mmap-medium records are written ([`RowWrites`](crate::RowWrites)). Default
    /// `Mapped`: copied into the mapping, cheapest for writers. `File`: by `pwrite`, so
    /// the kernel's write-back of the rows never interrupts a reader with a TLB shootdown;
    /// a scattered record costs the writer about 2.5 µs more. On 2 vCPUs with one reader
    /// a replica kept the same share of its reads either way and ingested half as fast
    /// with `File` (docs/BENCHMARKS.md); each shootdown interrupts every core that runs
    /// the process, so `File` is for stores read by many cores while they ingest.
    pub row_writes: crate::medium::RowWrites,
    /// Checkpoints kept for [`Store::restore`]; older ones are dropped (and the rows
    /// they alone needed freed). Default 2.
    pub keep_checkpoints: usize,
    /// After a killed process (same boot), serve at once and repair in the background:
    /// index buckets are repaired when first touched, the rest and the free list by a
    /// background thread (see docs/RELIABILITY.md). Default true. False: the open does
    /// the whole repair first, as after a machine crash, when it always does.
    pub background_repair: bool,
    /// Test hook: the background repair does this many buckets, then sleeps this long.
    #[doc(hidden)]
    pub repair_throttle: Option<(u64, std::time::Duration)>,
    /// Test hook: inject I/O failures into block media.
    #[doc(hidden)]
    pub fault: Option<Arc<FaultPlan>>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            create: true,
            verify: false,
            cache_bytes: CACHE_BYTES_DEFAULT,
            pooled_cache_bytes: 0,
            hot_placement: None,
            io_engine: IoChoice::Auto,
            io_depth: IO_DEPTH_DEFAULT,
            mmap_random_access: true,
            huge_pages: false,
            row_writes: crate::medium::RowWrites::Mapped,
            keep_checkpoints: 2,
            background_repair: true,
            repair_throttle: None,
            fault: None,
        }
    }
}

/// Numbers about a store.
#[derive(Clone, Debug, Serialize)]
pub struct StoreStats {
    pub path: String,
    pub tables: Vec<TableStats>,
    pub rows: u64,
    pub bytes_on_disk: u64,
    pub bytes_mapped: u64,
    /// How mmap-medium rows are written: "mapped" or "file" (`StoreOptions::row_writes`).
    pub row_writes: &'static str,
    /// The DRAM row cache (absent when the store was opened with `cache_bytes = 0`).
    pub cache: Option<CacheStats>,
    /// The pooled-embedding cache (absent when `pooled_cache_bytes` is 0).
    pub pooled: Option<crate::pooled::PooledStats>,
    /// The I/O engine of block media.
    pub io: IoStats,
    pub lookahead_requests: u64,
    /// Lookahead requests dropped because the queue was full.
    pub lookahead_dropped: u64,
    /// The tier shared with other stores, if one is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared_tier: Option<crate::tier::SharedTierStats>,
}

struct Inner {
    ckpts: parking_lot::Mutex<CheckpointFile>,
    /// Checkpoints pinned against retention (by seq, with a count): see [`Store::pin_checkpoint`].
    pins: Arc<parking_lot::Mutex<BTreeMap<u64, usize>>>,
    keep_checkpoints: usize,
    /// How tables opened after a crash (or restored) are repaired.
    repair: RepairMode,
    dir: PathBuf,
    catalog: Arc<Catalog>,
    tables: BTreeMap<String, Table>,
    runtime: Arc<Runtime>,
    _lock: File,
}

/// An open store. Dropping it closes it (flushing every table).
pub struct Store {
    inner: RwLock<Option<Inner>>,
    path: PathBuf,
}

fn tables_dir(dir: &Path) -> PathBuf {
    dir.join("tables")
}

fn table_dir(dir: &Path, id: u32) -> PathBuf {
    tables_dir(dir).join(id.to_string())
}

impl Store {
    /// Opens (or creates) the store in directory `path`. Serves at once: tables
    /// closed cleanly are mapped, not read; tables whose user crashed are repaired
    /// by one pass over their index.
    pub fn open(path: impl AsRef<Path>, options: StoreOptions) -> Result<Store> {
        let dir = path.as_ref().to_owned();
        if !dir.join(CATALOG_FILE).exists() && !options.create {
            return Err(Error::new(ErrorKind::NotFound, format!("no embank store at {}", dir.display())));
        }
        std::fs::create_dir_all(&dir).map_err(|e| io_at("cannot create store directory", &dir, e))?;
        let lock = crate::fsutil::lock_exclusive(&dir.join("LOCK"))?;
        // Only now, under the lock, is the directory's content stable.
        let exists = dir.join(CATALOG_FILE).exists();
        if !exists {
            if !options.create {
                return Err(Error::new(ErrorKind::NotFound, format!("no embank store at {}", dir.display())));
            }
            // STORE is written last when a store is created, so a creation cut short
            // leaves only these behind.
            let foreign: Vec<String> = std::fs::read_dir(&dir)
                .map_err(|e| io_at("cannot list", &dir, e))?
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !matches!(n.as_str(), "LOCK" | "tables" | "STORE.tmp"))
                .collect();
            if !foreign.is_empty() {
                return Err(Error::invalid(format!(
                    "{} is not empty and holds no embank store (found {:?}); refusing to create one there",
                    dir.display(),
                    &foreign[..foreign.len().min(3)]
                )));
            }
        }
        std::fs::create_dir_all(tables_dir(&dir)).map_err(|e| io_at("cannot create", &tables_dir(&dir), e))?;
        let mut io = crate::io::engine(options.io_engine, options.io_depth)?;
        if let Some(plan) = &options.fault {
            io = Arc::new(FaultyEngine { inner: io, plan: Arc::clone(plan) });
        }
        // The near tiers, nearest first: the DRAM row cache when it has a budget.
        let mut near: Vec<Arc<dyn Tier>> = Vec::new();
        if options.cache_bytes > 0 {
            near.push(Arc::new(RowCache::new(options.cache_bytes)));
        }
        let pooled = (options.pooled_cache_bytes > 0)
            .then(|| Arc::new(crate::pooled::PooledCache::new(options.pooled_cache_bytes)));
        if let Some(h) = &options.hot_placement {
            h.validate()?;
        }
        let advice = match (options.huge_pages, options.mmap_random_access) {
            (true, _) => crate::medium::MapAdvice::Huge,
            (false, true) => crate::medium::MapAdvice::Random,
            (false, false) => crate::medium::MapAdvice::Default,
        };
        let runtime = Runtime::new(near, pooled, options.hot_placement.clone(), io, advice, options.row_writes);
        let catalog = Arc::new(if exists { Catalog::open(&dir)? } else { Catalog::create(&dir)? });
        let data = catalog.snapshot();
        // Directories of tables the catalog does not know are left-overs of an
        // interrupted create or drop.
        if let Ok(entries) = std::fs::read_dir(tables_dir(&dir)) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if !data.tables.iter().any(|m| m.id.to_string() == name) {
                    tracing::info!(dir = %entry.path().display(), "removing table directory the catalog does not name");
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
        if options.keep_checkpoints == 0 {
            return Err(Error::config("keep_checkpoints must be at least 1"));
        }
        let mut ckpts = CheckpointFile::load(&dir)?;
        let state = ckpts.state(ckpts.restore_to);
        runtime.gate.interval.store(state.latest, std::sync::atomic::Ordering::Release);
        let repair = RepairMode {
            verify: options.verify,
            background: options.background_repair,
            throttle: options.repair_throttle,
        };
        let mut tables = BTreeMap::new();
        for meta in data.tables {
            let name = meta.name.clone();
            let steps = ckpts.steps_of(meta.id);
            let (catalog, runtime) = (Arc::clone(&catalog), Arc::clone(&runtime));
            let table = Table::open(&table_dir(&dir, meta.id), meta, catalog, repair, runtime, state, &steps)
                .map_err(|e| e.context(format!("table {name:?}")))?;
            tables.insert(name, table);
        }
        if ckpts.restore_to.take().is_some() {
            ckpts.save(&dir)?;
        }
        Ok(Store {
            inner: RwLock::new(Some(Inner {
                ckpts: parking_lot::Mutex::new(ckpts),
                pins: Arc::default(),
                keep_checkpoints: options.keep_checkpoints,
                repair,
                dir: dir.clone(),
                catalog,
                tables,
                runtime,
                _lock: lock,
            })),
            path: dir,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn closed(&self) -> Error {
        Error::new(ErrorKind::Closed, format!("store {} is closed", self.path.display()))
    }

    /// Creates a table; fails with `AlreadyExists` if the name is taken.
    pub fn create_table(&self, name: &str, options: TableOptions) -> Result<Table> {
        validate_name(name)?;
        options.validate()?;
        let mut guard = self.inner.write();
        let inner = guard.as_mut().ok_or_else(|| self.closed())?;
        if inner.tables.contains_key(name) {
            return Err(Error::new(ErrorKind::AlreadyExists, format!("table {name:?} exists already")));
        }
        let id = inner.catalog.snapshot().next_table_id;
        let meta = TableMeta {
            id,
            name: name.to_owned(),
            dim: options.dim,
            dtype: options.dtype,
            init: options.init,
            seed: options.seed,
            growth: options.growth,
            load_factor_max: options.load_factor_max,
            missing: options.missing,
            index_generation: 0,
            grow_count: 0,
            medium: options.medium,
            placement: options.placement,
            optimizer: options.optimizer,
            staleness_bound: options.staleness_bound,
            lease_seconds: options.lease_seconds,
            lifecycle: options.lifecycle.clone(),
            optimizer_step: 0,
        };
        let dir = table_dir(&inner.dir, id);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| io_at("cannot create table directory", &dir, e))?;
        let table =
            Table::create(&dir, meta.clone(), options.capacity, Arc::clone(&inner.catalog), Arc::clone(&inner.runtime))
                .inspect_err(|_| {
                    let _ = std::fs::remove_dir_all(&dir);
                })?;
        inner.catalog.update(|c| {
            c.next_table_id = id + 1;
            c.tables.push(meta);
            Ok(())
        })?;
        inner.tables.insert(name.to_owned(), table.clone());
        Ok(table)
    }

    /// The table called `name`.
    pub fn table(&self, name: &str) -> Result<Table> {
        let guard = self.inner.read();
        let inner = guard.as_ref().ok_or_else(|| self.closed())?;
        inner.tables.get(name).cloned().ok_or_else(|| {
            let names: Vec<&str> = inner.tables.keys().map(|s| s.as_str()).collect();
            Error::new(ErrorKind::NotFound, format!("no table {name:?} in this store (tables: {names:?})"))
        })
    }

    /// Waits until every table's background repair after a crash (if any) is done; see
    /// [`StoreOptions::background_repair`].
    pub fn wait_repaired(&self) -> Result<()> {
        let tables: Vec<Table> = {
            let guard = self.inner.read();
            guard.as_ref().ok_or_else(|| self.closed())?.tables.values().cloned().collect()
        };
        for t in tables {
            t.wait_repaired();
        }
        Ok(())
    }

    /// Names of all tables, sorted.
    pub fn tables(&self) -> Result<Vec<String>> {
        let guard = self.inner.read();
        Ok(guard.as_ref().ok_or_else(|| self.closed())?.tables.keys().cloned().collect())
    }

    /// Deletes a table and its files. Open handles of it fail with `Closed` afterwards.
    pub fn drop_table(&self, name: &str) -> Result<()> {
        let mut guard = self.inner.write();
        let inner = guard.as_mut().ok_or_else(|| self.closed())?;
        let table = inner
            .tables
            .get(name)
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("no table {name:?} in this store")))?;
        let id = table.meta().id;
        inner.catalog.update(|c| {
            c.tables.retain(|m| m.id != id);
            Ok(())
        })?;
        table.detach();
        if let Some(p) = &inner.runtime.pooled {
            p.invalidate_table(id);
        }
        inner.tables.remove(name);
        let dir = table_dir(&inner.dir, id);
        std::fs::remove_dir_all(&dir).map_err(|e| io_at("cannot remove table directory", &dir, e))?;
        Ok(())
    }

    /// Marks a batch boundary: after a crash, reopening returns every table — rows and
    /// optimizer state — to exactly this point, even though later writes reached the
    /// medium; [`restore`](Self::restore) returns to it on demand. Waits for batches in
    /// flight on other threads, writes back dirty cached rows (tables behind the row
    /// cache), then starts a new undo journal per table and records the checkpoint: no
    /// copy of any table. `batch_id`s must increase. The checkpoint survives a process
    /// crash at once and a power loss after the next [`flush`](Self::flush).
    pub fn checkpoint(&self, batch_id: u64) -> Result<()> {
        self.checkpoint_with_meta(batch_id, &[])
    }

    /// [`checkpoint`](Self::checkpoint) that keeps a small opaque blob with the checkpoint
    /// (at most 64 KiB: stream offsets, a trainer's position), returned by
    /// [`checkpoints`](Self::checkpoints), also after a reopen.
    pub fn checkpoint_with_meta(&self, batch_id: u64, meta: &[u8]) -> Result<()> {
        if meta.len() > CHECKPOINT_META_BYTES_MAX {
            return Err(Error::invalid(format!(
                "checkpoint metadata of {} bytes is over the limit of {CHECKPOINT_META_BYTES_MAX}",
                meta.len()
            )));
        }
        let guard = self.inner.read();
        let inner = guard.as_ref().ok_or_else(|| self.closed())?;
        // A rollback on first touch ends first (retention may drop its journal), gate open.
        inner.tables.values().try_for_each(|t| t.finish_rollback())?;
        let _gate = inner.runtime.gate.lock.write();
        let mut file = inner.ckpts.lock();
        if let Some(last) = file.checkpoints.last() {
            if batch_id <= last.batch_id {
                return Err(Error::invalid(format!(
                    "checkpoint batch ids must increase: the latest checkpoint is batch {}, got {batch_id}",
                    last.batch_id
                )));
            }
        }
        for t in inner.tables.values() {
            t.write_back_all_locked()?;
        }
        let seq = file.next_seq.max(1);
        let mut replaced = Vec::with_capacity(inner.tables.len());
        for t in inner.tables.values() {
            replaced.push(t.start_interval(seq)?);
        }
        let unix_seconds =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        // Batches wait at the gate: no table's step moves while it is read.
        let steps =
            inner.tables.values().filter_map(|t| Some((t.id(), t.optimizer_step())).filter(|&(_, s)| s > 0)).collect();
        file.checkpoints.push(CheckpointInfo { batch_id, seq, unix_seconds, meta: meta.to_vec(), steps });
        file.next_seq = seq + 1;
        let mut dropped = Vec::new();
        // Retention drops the oldest first; a pinned checkpoint (and so every later one,
        // whose rollback needs its journal) stays until its pin is dropped.
        // (Pins of checkpoints a restore forgot hold nothing.)
        let oldest_pinned = {
            let pins = inner.pins.lock();
            pins.keys().copied().find(|&s| file.checkpoints.iter().any(|c| c.seq == s)).unwrap_or(u64::MAX)
        };
        while file.checkpoints.len() > inner.keep_checkpoints && file.checkpoints[0].seq < oldest_pinned {
            dropped.push(file.checkpoints.remove(0).seq);
        }
        file.save(&inner.dir)?;
        inner.runtime.gate.interval.store(seq, std::sync::atomic::Ordering::Release);
        // Batches may go on: freeing what the dropped checkpoints held needs no gate (no
        // writer holds records for them any more).
        drop(file);
        drop(_gate);
        for &old in &dropped {
            for t in inner.tables.values() {
                t.drop_interval(old)?;
            }
        }
        for (t, old) in inner.tables.values().zip(replaced) {
            t.housekeep_later(dropped.clone(), old);
        }
        Ok(())
    }

    /// The retained checkpoints, oldest first.
    pub fn checkpoints(&self) -> Result<Vec<CheckpointInfo>> {
        let guard = self.inner.read();
        let inner = guard.as_ref().ok_or_else(|| self.closed())?;
        let file = inner.ckpts.lock();
        Ok(file.checkpoints.clone())
    }

    /// Returns every table to the state of checkpoint `batch_id` and forgets later
    /// checkpoints. Every [`Table`] handle taken before is closed: get them again with
    /// [`table`](Self::table). Tables created or dropped since are not affected (a table
    /// created after the checkpoint comes back empty). A crash during the restore is
    /// finished by the next open.
    pub fn restore(&self, batch_id: u64) -> Result<()> {
        let mut guard = self.inner.write();
        let inner = guard.as_mut().ok_or_else(|| self.closed())?;
        let (state, file_now) = {
            let mut file = inner.ckpts.lock();
            let Some(target) = file.checkpoints.iter().find(|c| c.batch_id == batch_id).map(|c| c.seq) else {
                let kept: Vec<u64> = file.checkpoints.iter().map(|c| c.batch_id).collect();
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!("no retained checkpoint of batch {batch_id} (retained: {kept:?})"),
                ));
            };
            file.checkpoints.retain(|c| c.seq <= target);
            file.restore_to = Some(target);
            file.save(&inner.dir)?;
            (file.state(Some(target)), file.clone())
        };
        for t in inner.tables.values() {
            t.close()?;
            if let Some(p) = &inner.runtime.pooled {
                p.invalidate_table(t.meta().id);
            }
        }
        inner.runtime.gate.interval.store(state.latest, std::sync::atomic::Ordering::Release);
        let mut tables = BTreeMap::new();
        for (name, old) in std::mem::take(&mut inner.tables) {
            let meta = old.meta();
            let (steps, dir) = (file_now.steps_of(meta.id), table_dir(&inner.dir, meta.id));
            let (catalog, runtime, repair) =
                (Arc::clone(&inner.catalog), Arc::clone(&inner.runtime), RepairMode { verify: false, ..inner.repair });
            let t = Table::open(&dir, meta, catalog, repair, runtime, state, &steps)
                .map_err(|e| e.context(format!("restoring table {name:?}")))?;
            tables.insert(name, t);
        }
        inner.tables = tables;
        let mut file = inner.ckpts.lock();
        file.restore_to = None;
        file.save(&inner.dir)
    }

    fn checkpoint_seq(&self, inner: &Inner, batch_id: u64) -> Result<u64> {
        inner.ckpts.lock().seq_of(batch_id)
    }

    /// Table `name` and the seq of its retained checkpoint `batch_id`.
    fn table_at(&self, name: &str, batch_id: u64) -> Result<(Table, u64)> {
        let guard = self.inner.read();
        let inner = guard.as_ref().ok_or_else(|| self.closed())?;
        Ok((self.table(name)?, self.checkpoint_seq(inner, batch_id)?))
    }

    /// Streams every `(key, row)` of table `name` as it was at checkpoint `batch_id`,
    /// while training goes on: a consistent snapshot (what an inference fleet loads).
    /// Fails if the checkpoint is dropped before the export ends.
    pub fn export_checkpoint(
        &self,
        name: &str,
        batch_id: u64,
        chunk_keys: usize,
        f: impl FnMut(&[u64], &[f32]) -> Result<()>,
    ) -> Result<()> {
        let (table, seq) = self.table_at(name, batch_id)?;
        table.export_at(seq, chunk_keys, AtExport::default(), f)?;
        let guard = self.inner.read();
        let inner = guard.as_ref().ok_or_else(|| self.closed())?;
        self.checkpoint_seq(inner, batch_id)
            .map_err(|e| e.context("the checkpoint was dropped during the export; its rows may have been reused"))?;
        Ok(())
    }

    /// One page of table `name` as it was at retained checkpoint `batch_id`, by cursor
    /// (start at [`ExportCursor::START`](crate::ExportCursor::START); `None`: done): what a client pages through over
    /// several requests while the store goes on changing (see `Table::export_page_at`; a
    /// key may come twice, with the same row). Fails with `NotFound` once the checkpoint
    /// is dropped (start again at a newer one).
    pub fn export_checkpoint_page(
        &self,
        name: &str,
        batch_id: u64,
        cursor: crate::ExportCursor,
        chunk_keys: usize,
        keys: &mut Vec<u64>,
        rows: &mut Vec<f32>,
    ) -> Result<Option<crate::ExportCursor>> {
        let (table, seq) = self.table_at(name, batch_id)?;
        let _pin = self.pin_checkpoint(seq)?;
        table.export_page_at(seq, cursor, chunk_keys, keys, rows)
    }

    /// Streams every record of table `name` at retained checkpoint `batch_id`, in chunks of
    /// at most `chunk_keys` keys: `f(keys, records)`, each row then its optimizer state (as
    /// [`Table::push_with_state`] takes them). What `embank reshard` moves. Never holds the
    /// table: memory is one chunk and the keys changed since the checkpoint. Writers of this
    /// store wait until it returns (the checkpoint gate is held: no key changes, no
    /// checkpoint is taken or dropped), so it is for a store at rest; `f` must not write here.
    pub fn export_checkpoint_with_state(
        &self,
        name: &str,
        batch_id: u64,
        chunk_keys: usize,
        f: impl FnMut(&[u64], &[f32]) -> Result<()>,
    ) -> Result<()> {
        let guard = self.inner.read();
        let inner = guard.as_ref().ok_or_else(|| self.closed())?;
        let (table, seq) = (self.table(name)?, self.checkpoint_seq(inner, batch_id)?);
        let _gate = inner.runtime.gate.lock.write();
        table.export_at(seq, chunk_keys, AtExport { with_state: true, writers_held: true }, f)
    }

    /// Looks `keys` of table `name` up as they were at retained checkpoint `batch_id`,
    /// while training goes on: rows of keys present then (`found[i]`), the missing-row
    /// default for the others. The checkpoint is pinned while it is read. Costs a pass
    /// over the undo entries since the checkpoint (the keys changed since) per call.
    pub fn lookup_checkpoint(
        &self,
        name: &str,
        batch_id: u64,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<()> {
        let (table, seq) = self.table_at(name, batch_id)?;
        let _pin = self.pin_checkpoint(seq)?;
        table.lookup_at(seq, keys, out, found)
    }

    /// Keeps the retained checkpoint of seq `seq` (see [`CheckpointInfo::seq`]) from being
    /// dropped by retention while the returned pin lives: later checkpoints are then kept
    /// beyond `keep_checkpoints` too. A [`restore`](Self::restore) to an older checkpoint
    /// still forgets it. What a publisher holds on the last checkpoint it published.
    pub fn pin_checkpoint(&self, seq: u64) -> Result<CheckpointPin> {
        let guard = self.inner.read();
        let inner = guard.as_ref().ok_or_else(|| self.closed())?;
        let file = inner.ckpts.lock();
        if !file.checkpoints.iter().any(|c| c.seq == seq) {
            return Err(Error::new(ErrorKind::NotFound, format!("no retained checkpoint of seq {seq}")));
        }
        *inner.pins.lock().entry(seq).or_default() += 1;
        Ok(CheckpointPin { pins: Arc::clone(&inner.pins), seq })
    }

    /// The changes of table `name` between two retained checkpoints (by seq), as they
    /// were at checkpoint `to`, in chunks: `f(keys, rows, deleted)` gets the rows at `to`
    /// of the keys written since `from` and the keys changed since `from` that are absent
    /// at `to`. `from = None`: every row at `to` (a full snapshot; nothing deleted).
    /// Training may go on meanwhile; the export fails if either checkpoint is dropped
    /// before it ends (pin them). What a publisher sends for checkpoint `to`.
    pub fn export_changes_between(
        &self,
        name: &str,
        from: Option<u64>,
        to: u64,
        chunk_keys: usize,
        mut f: impl FnMut(&[u64], &[f32], &[u64]) -> Result<()>,
    ) -> Result<()> {
        let retained = |seq: u64| -> Result<()> {
            let guard = self.inner.read();
            let inner = guard.as_ref().ok_or_else(|| self.closed())?;
            if inner.ckpts.lock().checkpoints.iter().any(|c| c.seq == seq) {
                Ok(())
            } else {
                Err(Error::new(ErrorKind::NotFound, format!("checkpoint seq {seq} is not retained")))
            }
        };
        if from.is_some_and(|f| f >= to) {
            return Err(Error::invalid(format!("changes between checkpoints: from seq {from:?} must be before {to}")));
        }
        let table = self.table(name)?;
        for seq in from.into_iter().chain([to]) {
            retained(seq)?;
        }
        match from {
            Some(from) => table.changes_between(from, to, chunk_keys, &mut f)?,
            None => table.export_at(to, chunk_keys, AtExport::default(), |keys, rows| f(keys, rows, &[]))?,
        }
        for seq in from.into_iter().chain([to]) {
            retained(seq)
                .map_err(|e| e.context("a checkpoint was dropped during the export; its rows may have been reused"))?;
        }
        Ok(())
    }

    /// The incremental export since checkpoint `batch_id`: the current rows of the keys
    /// of table `name` written since, and the keys deleted since (absent now).
    pub fn export_changes(&self, name: &str, batch_id: u64) -> Result<(Vec<u64>, Vec<f32>, Vec<u64>)> {
        let (table, seq) = self.table_at(name, batch_id)?;
        let keys = table.changed_keys(seq)?;
        let mut rows = vec![0f32; keys.len() * table.dim()];
        let mut found = vec![false; keys.len()];
        table.lookup(&keys, &mut rows, &mut found)?;
        let (mut live, mut live_rows, mut deleted) = (Vec::new(), Vec::new(), Vec::new());
        let d = table.dim();
        for (i, &k) in keys.iter().enumerate() {
            if found[i] {
                live.push(k);
                live_rows.extend_from_slice(&rows[i * d..(i + 1) * d]);
            } else {
                deleted.push(k);
            }
        }
        Ok((live, live_rows, deleted))
    }

    /// Makes every write before this call durable.
    pub fn flush(&self) -> Result<()> {
        let guard = self.inner.read();
        let inner = guard.as_ref().ok_or_else(|| self.closed())?;
        for table in inner.tables.values() {
            table.flush()?;
        }
        CheckpointFile::sync(&inner.dir)
    }

    /// Flushes and closes every table and releases the lock. Idempotent.
    pub fn close(&self) -> Result<()> {
        let Some(inner) = self.inner.write().take() else { return Ok(()) };
        let mut first_error = None;
        for table in inner.tables.values() {
            if let Err(e) = table.close() {
                tracing::error!(table = table.name(), error = %e, "closing table failed");
                first_error.get_or_insert(e);
            }
        }
        inner.runtime.stop();
        drop(inner);
        first_error.map_or(Ok(()), Err)
    }

    pub fn is_closed(&self) -> bool {
        self.inner.read().is_none()
    }

    pub fn stats(&self) -> Result<StoreStats> {
        let guard = self.inner.read();
        let inner = guard.as_ref().ok_or_else(|| self.closed())?;
        let mut tables = Vec::new();
        for t in inner.tables.values() {
            tables.push(t.stats()?);
        }
        let bytes_on_disk = dir_bytes(&inner.dir);
        let runtime = &inner.runtime;
        let shared_tier = runtime.tiers.shared().map(|s| s.stats());
        Ok(StoreStats {
            path: inner.dir.display().to_string(),
            rows: tables.iter().map(|t| t.rows).sum(),
            bytes_mapped: tables.iter().map(|t| t.bytes_mapped).sum(),
            bytes_on_disk,
            row_writes: runtime.row_writes.name(),
            tables,
            cache: runtime.tiers.near().first().map(|c| c.stats()),
            pooled: runtime.pooled.as_ref().map(|p| p.stats()),
            io: runtime.io.stats(),
            lookahead_requests: runtime.lookahead_requests.load(std::sync::atomic::Ordering::Relaxed),
            lookahead_dropped: runtime.lookahead_dropped.load(std::sync::atomic::Ordering::Relaxed),
            shared_tier,
        })
    }

    /// Puts a tier shared with other stores (a Redis Cluster that serving nodes share)
    /// between the row cache and the medium of every table that caches (placement
    /// `cache`), or takes it away with `None`. See [`SharedTier`](crate::SharedTier).
    pub fn set_shared_tier(&self, tier: Option<Arc<dyn crate::tier::SharedTier>>) -> Result<()> {
        let guard = self.inner.read();
        let inner = guard.as_ref().ok_or_else(|| self.closed())?;
        inner.runtime.tiers.set_shared(tier);
        Ok(())
    }

    /// Registers a listener that hears of every batch of changed rows (written,
    /// created or deleted) of this store's tables, after the change: the hook of a
    /// cache outside the store (a GPU cache of rows) that must drop what changed.
    pub fn add_change_listener(&self, listener: Arc<dyn crate::tier::Listener>) -> Result<()> {
        let guard = self.inner.read();
        let inner = guard.as_ref().ok_or_else(|| self.closed())?;
        inner.runtime.tiers.add_listener(listener);
        Ok(())
    }
}

/// Bytes the files below `dir` occupy on disk (allocated blocks, not apparent size).
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    for entry in entries.flatten() {
        let Ok(md) = entry.metadata() else { continue };
        if md.is_dir() {
            total += dir_bytes(&entry.path());
        } else {
            total += md.blocks() * 512;
        }
    }
    total
}

/// A retained checkpoint kept from retention while this lives ([`Store::pin_checkpoint`]).
#[derive(Debug)]
pub struct CheckpointPin {
    pins: Arc<parking_lot::Mutex<BTreeMap<u64, usize>>>,
    seq: u64,
}

impl CheckpointPin {
    /// The pinned checkpoint's seq.
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

impl Drop for CheckpointPin {
    fn drop(&mut self) {
        let mut pins = self.pins.lock();
        if let Some(n) = pins.get_mut(&self.seq) {
            *n -= 1;
            if *n == 0 {
                pins.remove(&self.seq);
            }
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::error!(error = %e, "closing store on drop failed");
        }
    }
}
