//! A table: the index and the medium of one embedding table, and its batch operations.
//!
//! Reads (`pull` of existing rows, `lookup`, `export`) take no lock: they pin
//! an epoch, resolve keys in the index (prefetching the home buckets a few
//! keys ahead) and copy rows out of the medium. Writes are copy-on-write: a
//! new record is written, then the key's slot is pointed at it under the
//! key's stripe lock, and the old record is retired to the epoch collector.
//! Growth rebuilds the index into a file twice the size under the table's
//! exclusive lock; rows never move.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use serde::Serialize;

use crate::catalog::{Catalog, MissingDefault, Placement, TableMeta};
use crate::error::{Error, ErrorKind, Result};
use crate::format::DType;
use crate::index::{buckets_for, Index, RecoverReport, SLOTS_PER_BUCKET};
use crate::init::Initializer;
use crate::io::IoStats;
use crate::journal::{self, Journal};
use crate::lifecycle::{Lifecycle, LifecycleOptions, LifecycleStats};
use crate::medium::{BlockMedium, Medium, MediumKind, MmapMedium, ReadItem};
use crate::optim::{sum_duplicates, Optimizer};
use crate::staleness::Holds;
use crate::tier::Tier;

#[path = "tiered.rs"]
mod tiered;

/// Largest `dim` a table may have.
pub const DIM_MAX: u32 = 4096;
/// Longest table name.
pub const NAME_BYTES_MAX: usize = 128;
/// Writer stripes per table: writers of keys in different stripes never wait on each other.
const STRIPES: usize = 1024;
/// How far ahead of the key being resolved its home bucket is prefetched.
const PREFETCH_KEYS_AHEAD: usize = 8;
/// Distinguishes the tables opened by one process (see `Shared::mark_nonce`).
static MARK_NONCE: AtomicU64 = AtomicU64::new(0);
/// Load the index is sized for at creation and after each rebuild.
const LOAD_FACTOR_TARGET: f64 = 0.7;
/// A full table (`max_rows`) evicts `max_rows / EVICT_SLACK_DIVISOR` rows more than it must.
const EVICT_SLACK_DIVISOR: u64 = 32;

const _: () = assert!(STRIPES.is_power_of_two());
const _: () = assert!(LOAD_FACTOR_TARGET < 0.95);

/// Options of a new table. Every field has a default (see [`TableOptions::new`]).
///
/// Deserializable (a server's config file, a remote `create_table`): absent fields take
/// their defaults, unknown fields are refused, `dim` is required (0 fails validation).
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TableOptions {
    /// Elements per row, 1 to 4096. Required.
    pub dim: u32,
    /// Element type. Default `f32` (the only one so far).
    pub dtype: DType,
    /// Value of never-written rows. Default zeros.
    pub init: Initializer,
    /// Seeds the initializer and the index hash. Default 0.
    pub seed: u64,
    /// Rows the index is sized for at creation. Default 1 Mi.
    pub capacity: u64,
    /// Grow the index when it fills. Default true; turn off for serving, where a
    /// full table then answers `TableFull`.
    pub growth: bool,
    /// Fill of the index's slots that triggers growth (or `TableFull`). Default 0.9.
    pub load_factor_max: f64,
    /// What `lookup` returns for missing keys. Default zeros.
    pub missing: MissingDefault,
    /// Where rows live: `mmap` (default) or `block` (O_DIRECT + io_uring under the row cache).
    pub medium: MediumKind,
    /// Whether rows go through the store's DRAM row cache. Default `auto`: cached on
    /// the block medium, straight from the mapping on the mmap medium.
    pub placement: Placement,
    /// Server-side optimizer applied by `push_grad`. Default none.
    pub optimizer: Optimizer,
    /// Bounded staleness of workers' pulls ([`Table::pull_held`]): `None` = ASP
    /// (default: nothing waits), `Some(0)` = BSP, `Some(k)` = SSP with bound k.
    pub staleness_bound: Option<u32>,
    /// A worker silent this long loses its holds. Default 60 s.
    pub lease_seconds: f64,
    /// Admission by access count, eviction by TTL and by capacity. Default none.
    pub lifecycle: LifecycleOptions,
}

impl Default for TableOptions {
    /// The defaults with `dim` 0, which [`validate`](Self::validate) refuses: set it.
    fn default() -> Self {
        TableOptions::new(0)
    }
}

impl TableOptions {
    pub fn new(dim: u32) -> Self {
        TableOptions {
            dim,
            dtype: DType::F32,
            init: Initializer::Zeros,
            seed: 0,
            capacity: 1 << 20,
            growth: true,
            load_factor_max: 0.9,
            missing: MissingDefault::Zeros,
            medium: MediumKind::Mmap,
            placement: Placement::Auto,
            optimizer: Optimizer::None,
            staleness_bound: None,
            lease_seconds: 60.0,
            lifecycle: LifecycleOptions::default(),
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.dim == 0 || self.dim > DIM_MAX {
            return Err(Error::config(format!("dim must be between 1 and {DIM_MAX}, got {}", self.dim)));
        }
        if self.capacity == 0 {
            return Err(Error::config("capacity must be at least 1"));
        }
        if !(self.load_factor_max > LOAD_FACTOR_TARGET && self.load_factor_max <= 0.98) {
            return Err(Error::config(format!(
                "load_factor_max must be in ({LOAD_FACTOR_TARGET}, 0.98], got {}",
                self.load_factor_max
            )));
        }
        self.init.validate()?;
        self.optimizer.validate()?;
        if !(self.lease_seconds.is_finite() && self.lease_seconds > 0.0) {
            return Err(Error::config(format!("lease_seconds must be positive, got {}", self.lease_seconds)));
        }
        self.lifecycle.validate()?;
        if let MissingDefault::Value { value } = self.missing {
            if value.is_nan() {
                return Err(Error::config("missing-row default value is NaN"));
            }
        }
        Ok(())
    }
}

/// Checks a table name: 1 to 128 bytes of letters, digits, `_`, `-`, `.`, not starting with `.`.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= NAME_BYTES_MAX
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "bad table name {name:?}: use 1 to {NAME_BYTES_MAX} letters, digits, '_', '-' or '.', not starting with '.'"
        )))
    }
}

/// Numbers about one table.
#[derive(Clone, Debug, Serialize)]
pub struct TableStats {
    pub name: String,
    pub dim: u32,
    pub dtype: &'static str,
    pub rows: u64,
    /// Rows the table holds before it grows (or reports `TableFull`).
    pub capacity: u64,
    pub slots: u64,
    pub buckets: u64,
    pub load_factor: f64,
    pub growth: bool,
    pub grow_count: u64,
    pub index_bytes: u64,
    pub rows_file_bytes: u64,
    /// Address space mapped for the files (the rows file reserves more, unbacked).
    pub bytes_mapped: u64,
    pub records_used: u64,
    pub records_free: u64,
    pub records_pending: u64,
    /// Keys living 0, 1, ..., 7+ buckets past their home bucket.
    pub probe_histogram: Vec<u64>,
    /// What recovery repaired when the table was opened after a crash.
    pub recovered: Option<RecoverStats>,
    /// `mmap` or `block`.
    pub medium: &'static str,
    /// Placement in effect (`auto` resolved): `cache`, `pin` or `bypass`.
    pub placement: &'static str,
    /// Block medium: whether the file is read with O_DIRECT, and its alignment.
    pub direct_io: Option<bool>,
    pub io_align: Option<u32>,
    /// Block medium: the store's I/O engine and its counters (shared by all block tables).
    pub io: Option<IoStats>,
    /// Row-cache hits and misses of this table's reads (cached placements).
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub cache_hit_rate: Option<f64>,
    pub optimizer: Optimizer,
    /// Rows read from the medium by pulls, lookups and lookaheads.
    pub medium_rows_read: u64,
    pub lookahead_rows: u64,
    /// Staleness bound (`None`: ASP), holds outstanding and workers holding any.
    pub staleness_bound: Option<u32>,
    pub holds_outstanding: u64,
    pub holding_workers: u64,
    /// Admission and eviction counters (tables with a lifecycle option).
    pub lifecycle: Option<LifecycleStats>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RecoverStats {
    pub buckets_interrupted: u64,
    pub slots_dropped: u64,
    pub records_freed: u64,
    pub seconds: f64,
}

struct State {
    index: Index,
    medium: Medium,
}

#[derive(Default)]
struct TierCounters {
    hits: AtomicU64,
    misses: AtomicU64,
    rows_read: AtomicU64,
    lookahead_rows: AtomicU64,
}

struct Shared {
    id: u32,
    /// Elements of a row as users see it (`width` counts the record's elements:
    /// the row and its optimizer state).
    row_dim: usize,
    optimizer: Mutex<Optimizer>,
    /// One `push_grad` at a time per table (read, update, write of each row).
    grad_lock: Mutex<()>,
    medium_kind: MediumKind,
    /// Resolved: never `Auto`.
    placement: Placement,
    tier: Arc<Tier>,
    counters: TierCounters,
    /// One write-back at a time per table, so `flush` waits for one in flight elsewhere.
    write_back_lock: Mutex<()>,
    meta: Mutex<TableMeta>,
    name: String,
    /// Elements of a record: the row, then its optimizer state.
    width: usize,
    init: Initializer,
    seed: u64,
    growth: bool,
    load_factor_max: f64,
    missing: MissingDefault,
    dir: PathBuf,
    catalog: Arc<Catalog>,
    /// `None` once the table is closed or dropped.
    state: RwLock<Option<State>>,
    stripes: Box<[Mutex<StripeLog>]>,
    /// Mixed into the index's checkpoint-mark tags: marks left by an earlier open never match.
    mark_nonce: u64,
    /// Undo journal of the latest checkpoint's interval (`None` before any checkpoint).
    journal: RwLock<Option<Arc<Journal>>>,
    /// An empty journal ready to become the next checkpoint's.
    spare: Mutex<Option<Journal>>,
    /// Records live at a retained checkpoint and since replaced, by the checkpoint's seq:
    /// kept from reuse until that checkpoint is dropped.
    held: Mutex<std::collections::BTreeMap<u64, Vec<u64>>>,
    recovered: Option<RecoverStats>,
    /// Staleness holds of workers (`None`: ASP).
    holds: Option<Holds>,
    /// Admission and eviction state (`None`: the table has neither).
    lifecycle: Option<Lifecycle>,
}

/// A handle to one table; cheap to clone, usable from many threads.
#[derive(Clone)]
pub struct Table {
    shared: Arc<Shared>,
}

/// A handle that does not keep the table alive (held by the maintenance thread).
#[derive(Clone)]
pub struct WeakTable(Weak<Shared>);

impl WeakTable {
    pub fn upgrade(&self) -> Option<Table> {
        self.0.upgrade().map(|shared| Table { shared })
    }
}

/// Where an export continues: the index generation it started on and a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportCursor {
    pub generation: u64,
    pub bucket: u64,
}

impl ExportCursor {
    /// The start of a table.
    pub const START: ExportCursor = ExportCursor { generation: u64::MAX, bucket: 0 };
}

/// The bytes of `f32`s as stored and sent: little-endian (embank builds only for
/// little-endian targets, see `lib.rs`).
fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: any f32 is 4 initialized bytes; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Keys of one stripe journaled since the latest checkpoint (`seq`), guarded by the
/// stripe's lock, so a key's first change after a checkpoint is journaled exactly once.
/// A writer stripe's lock (no state of its own).
pub(crate) struct StripeLog;

/// What a table needs to know about the store's checkpoints when it opens.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CheckpointState {
    /// Seq of the latest checkpoint (0: none).
    pub latest: u64,
    /// Seq of the oldest retained checkpoint.
    pub oldest: u64,
    /// Roll back to this checkpoint whatever state the table was left in (a restore).
    pub restore_to: Option<u64>,
}

/// Outcome of a write pass that may need the index to grow first.
enum Pass {
    Done,
    /// Stopped before item `.0` because the index has no room.
    NeedRoom(usize),
}

fn index_path(dir: &Path, generation: u64) -> PathBuf {
    dir.join(format!("index.{generation}.ebi"))
}

fn rows_path(dir: &Path, kind: MediumKind) -> PathBuf {
    match kind {
        MediumKind::Mmap => dir.join("rows.ebr"),
        MediumKind::Block => dir.join("rows.ebb"),
    }
}

/// Applies the undo journals of checkpoints `to` and later, newest first and each in
/// reverse (so every key's earliest entry wins): the index then maps every key to its
/// record at checkpoint `to`. Journal `to` is emptied (new changes start from there), the
/// later ones deleted. Each journal is deleted only once applied, so a crash in between
/// applies it again (applying is idempotent).
fn rollback(dir: &Path, index: &Index, to: u64) -> Result<()> {
    let seqs: Vec<u64> = journal::list(dir).into_iter().filter(|&s| s >= to).collect();
    for &seq in seqs.iter().rev() {
        let j = Journal::open(dir, seq)?;
        let entries = j.entries();
        for e in entries.iter().rev() {
            let h = index.hash(e.key);
            if e.old == 0 {
                index.remove(e.key, h);
            } else if index.replace(e.key, h, e.old).is_none() && !index.insert_new(e.key, h, e.old) {
                return Err(Error::new(
                    ErrorKind::Recover,
                    format!("no index slot to return key {} to checkpoint {to}", e.key),
                ));
            }
        }
        index.flush()?;
        tracing::info!(seq, entries = entries.len(), to, "undo journal applied");
        if seq == to {
            j.clear()?;
        } else {
            j.remove();
        }
    }
    Ok(())
}

/// Records kept for the retained checkpoints: those the journals name.
fn held_records(dir: &Path, ckpt: CheckpointState) -> Result<std::collections::BTreeMap<u64, Vec<u64>>> {
    let mut held = std::collections::BTreeMap::new();
    for seq in journal::list(dir) {
        if seq < ckpt.oldest || seq > ckpt.latest {
            continue;
        }
        let v: Vec<u64> = Journal::open(dir, seq)?.entries().iter().filter(|e| e.old != 0).map(|e| e.old).collect();
        if !v.is_empty() {
            held.insert(seq, v);
        }
    }
    Ok(held)
}

/// Resolves `Auto` and checks that a cached placement has a cache to use.
fn resolve_placement(meta: &TableMeta, tier: &Tier, creating: bool) -> Result<Placement> {
    let has_cache = tier.cache.is_some();
    Ok(match (meta.placement, meta.medium) {
        (Placement::Auto, MediumKind::Block) if has_cache => Placement::Cache,
        (Placement::Auto, _) => Placement::Bypass,
        (p @ (Placement::Cache | Placement::Pin), _) if !has_cache => {
            if creating {
                return Err(Error::config(format!(
                    "table {:?}: placement {} needs the store's row cache; open the store with cache_bytes > 0",
                    meta.name,
                    p.name()
                )));
            }
            tracing::warn!(table = %meta.name, placement = p.name(), "store has no row cache; table reads bypass it");
            Placement::Bypass
        }
        (p, _) => p,
    })
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table").field("name", &self.shared.name).field("dim", &self.shared.row_dim).finish()
    }
}

impl Table {
    /// Creates the files of a new table in `dir` (which must exist and be empty).
    pub(crate) fn create(
        dir: &Path,
        meta: TableMeta,
        capacity: u64,
        catalog: Arc<Catalog>,
        tier: Arc<Tier>,
    ) -> Result<Table> {
        let placement = resolve_placement(&meta, &tier, true)?;
        let buckets = buckets_for(capacity, LOAD_FACTOR_TARGET);
        let index = Index::create(&index_path(dir, meta.index_generation), buckets, meta.seed)?;
        let path = rows_path(dir, meta.medium);
        let medium = match meta.medium {
            MediumKind::Mmap => Medium::Mmap(MmapMedium::create(&path, record_dim(&meta) as u32, meta.dtype)?),
            MediumKind::Block => {
                Medium::Block(BlockMedium::create(&path, record_dim(&meta) as u32, meta.dtype, Arc::clone(&tier.io))?)
            }
        };
        index.flush()?;
        medium.flush()?;
        let seq = tier.interval.load(Ordering::Acquire);
        let journal = if seq > 0 { Some(Arc::new(Journal::create(dir, seq)?)) } else { None };
        crate::fsutil::sync_dir(dir)?;
        advise(&tier, &index, &medium);
        let table =
            Self::new(dir, meta, State { index, medium }, catalog, None, tier, placement, journal, Default::default());
        Ok(table)
    }

    /// Opens the files of a table; repairs them first if the last user did not close cleanly.
    pub(crate) fn open(
        dir: &Path,
        meta: TableMeta,
        catalog: Arc<Catalog>,
        verify_all: bool,
        tier: Arc<Tier>,
        ckpt: CheckpointState,
    ) -> Result<Table> {
        let placement = resolve_placement(&meta, &tier, false)?;
        // Index files of other generations are left-overs of an interrupted rebuild.
        if let Ok(entries) = std::fs::read_dir(dir) {
            let current = index_path(dir, meta.index_generation);
            for entry in entries.flatten() {
                let p = entry.path();
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with("index.") && name.ends_with(".ebi") && p != current {
                    tracing::info!(path = %p.display(), "removing index left by an interrupted rebuild");
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
        let index = Index::open(&index_path(dir, meta.index_generation))?;
        let path = rows_path(dir, meta.medium);
        let medium = match meta.medium {
            MediumKind::Mmap => Medium::Mmap(MmapMedium::open(&path)?),
            MediumKind::Block => Medium::Block(BlockMedium::open(&path, Arc::clone(&tier.io))?),
        };
        if medium.dim() != record_dim(&meta) {
            return Err(Error::new(ErrorKind::Recover, "rows file dim does not match the catalog")
                .context(dir.display().to_string()));
        }
        let alloc = medium.alloc();
        let clean = index.was_closed_cleanly() && alloc.load_free_list(index.free_list_generation());
        let mut recovered = None;
        // After a crash the table returns to its latest checkpoint; a restore to the one asked.
        let rollback_to = ckpt.restore_to.or((!clean && ckpt.latest > 0).then_some(ckpt.latest));
        if !clean || verify_all || rollback_to.is_some() {
            let t0 = Instant::now();
            let name = meta.name.clone();
            tracing::info!(table = %name, "table was not closed cleanly; repairing index and free list");
            // On the mmap medium every slot's record key is checked (a memory read); on the
            // block medium that would be one read per row, so only interrupted buckets'
            // records are read (and every record with `verify`).
            let block = matches!(medium, Medium::Block(_));
            let mut io_error = None;
            let report = index.recover(|key, ptr, interrupted| {
                if !alloc.is_valid_ptr(ptr) {
                    return false;
                }
                if block && !(interrupted || verify_all) {
                    return true;
                }
                match medium.check(ptr, key, interrupted || verify_all) {
                    Ok(ok) => ok,
                    Err(e) => {
                        io_error.get_or_insert(e);
                        true
                    }
                }
            });
            if let Some(e) = io_error {
                return Err(e.context(format!("recovering table {:?}", meta.name)));
            }
            if let Some(to) = rollback_to {
                rollback(dir, &index, to).map_err(|e| e.context(format!("table {:?}", meta.name)))?;
            }
            let mut live = alloc.new_bitmap();
            index.for_each(0, index.bucket_count(), |_, ptr| alloc.mark(&mut live, ptr));
            for ptrs in held_records(dir, ckpt)?.values() {
                for &p in ptrs {
                    alloc.mark(&mut live, p);
                }
            }
            alloc.rebuild_free_list(&live);
            let RecoverReport { buckets_interrupted, slots_dropped, .. } = report;
            let stats = RecoverStats {
                buckets_interrupted,
                slots_dropped,
                records_freed: alloc.free_records(),
                seconds: t0.elapsed().as_secs_f64(),
            };
            tracing::info!(table = %name, ?stats, "repair done");
            recovered = Some(stats);
        }
        // Journals of dropped checkpoints, or of one whose creation was cut short, are left-overs.
        for seq in journal::list(dir) {
            if seq < ckpt.oldest || seq > ckpt.latest {
                let _ = std::fs::remove_file(journal::path_of(dir, seq));
            }
        }
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".ebj.tmp") || name == "undo.spare.ebj" {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        index.mark_open()?;
        advise(&tier, &index, &medium);
        let held = held_records(dir, ckpt)?;
        let journal = match ckpt.latest {
            0 => None,
            seq if journal::path_of(dir, seq).exists() => Some(Arc::new(Journal::open(dir, seq)?)),
            seq => Some(Arc::new(Journal::create(dir, seq)?)),
        };
        let table = Self::new(dir, meta, State { index, medium }, catalog, recovered, tier, placement, journal, held);
        // Keys already journaled in the current interval are not journaled again.
        if let Some(j) = table.shared.journal.read().as_ref() {
            let st = table.state()?;
            let index = &st.as_ref().unwrap().index;
            let tag = crate::hash::splitmix64(table.shared.mark_nonce ^ j.seq());
            for e in j.entries() {
                if let Some(f) = index.find(e.key, index.hash(e.key)) {
                    index.mark_journaled(f.bucket, f.slot, tag);
                }
            }
        }
        if placement == Placement::Pin {
            table.load_pinned()?;
        }
        Ok(table)
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        dir: &Path,
        meta: TableMeta,
        state: State,
        catalog: Arc<Catalog>,
        recovered: Option<RecoverStats>,
        tier: Arc<Tier>,
        placement: Placement,
        journal: Option<Arc<Journal>>,
        held: std::collections::BTreeMap<u64, Vec<u64>>,
    ) -> Table {
        let lease = std::time::Duration::from_secs_f64(meta.lease_seconds);
        let holds = meta.staleness_bound.map(|k| Holds::new(k, lease));
        let lifecycle = meta.lifecycle.any().then(|| {
            let mut keys = Vec::new();
            if meta.lifecycle.evicts() {
                state.index.for_each(0, u64::MAX, |k, _| keys.push(k));
            }
            Lifecycle::new(meta.lifecycle.clone(), keys)
        });
        let table = Table {
            shared: Arc::new(Shared {
                id: meta.id,
                row_dim: meta.dim as usize,
                optimizer: Mutex::new(meta.optimizer),
                grad_lock: Mutex::new(()),
                medium_kind: meta.medium,
                placement,
                tier: Arc::clone(&tier),
                counters: TierCounters::default(),
                write_back_lock: Mutex::new(()),
                name: meta.name.clone(),
                width: record_dim(&meta),
                init: meta.init,
                seed: meta.seed,
                growth: meta.growth,
                load_factor_max: meta.load_factor_max,
                missing: meta.missing,
                meta: Mutex::new(meta),
                dir: dir.to_owned(),
                catalog,
                state: RwLock::new(Some(state)),
                stripes: (0..STRIPES).map(|_| Mutex::new(StripeLog)).collect(),
                mark_nonce: crate::hash::splitmix64(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos() as u64)
                        ^ (std::process::id() as u64) << 32
                        ^ MARK_NONCE.fetch_add(1, Ordering::Relaxed),
                ),
                journal: RwLock::new(journal),
                spare: Mutex::new(None),
                held: Mutex::new(held),
                recovered,
                holds,
                lifecycle,
            }),
        };
        tier.register(&table);
        table
    }

    pub(crate) fn downgrade(&self) -> WeakTable {
        WeakTable(Arc::downgrade(&self.shared))
    }

    /// True when reads and writes take the tiered path (row cache and/or block medium)
    /// instead of the mmap fast path.
    fn tiered(&self) -> bool {
        self.shared.medium_kind == MediumKind::Block || self.shared.placement != Placement::Bypass
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    pub fn dim(&self) -> usize {
        self.shared.row_dim
    }

    /// The table's optimizer (with its current learning rate).
    pub fn optimizer(&self) -> Optimizer {
        *self.shared.optimizer.lock()
    }

    /// Changes the optimizer's learning rate; durable at once (the catalog is rewritten).
    pub fn set_lr(&self, lr: f32) -> Result<()> {
        let new = self.optimizer().with_lr(lr)?;
        let id = self.shared.id;
        let meta = self.shared.catalog.update(|c| {
            let m = c
                .tables
                .iter_mut()
                .find(|m| m.id == id)
                .ok_or_else(|| Error::new(ErrorKind::Closed, "table was dropped"))?;
            m.optimizer = new;
            Ok(m.clone())
        })?;
        *self.shared.meta.lock() = meta;
        *self.shared.optimizer.lock() = new;
        Ok(())
    }

    /// Whether records carry optimizer state after the row.
    fn has_state(&self) -> bool {
        self.shared.width != self.shared.row_dim
    }

    /// Fills a new record: the initializer's row, then the optimizer's initial state.
    pub(crate) fn init_record(&self, key: u64, record: &mut [f32]) {
        let (row, state) = record.split_at_mut(self.shared.row_dim);
        self.shared.init.fill(self.shared.seed, key, row);
        self.optimizer().init_state(state);
    }

    pub fn meta(&self) -> TableMeta {
        self.shared.meta.lock().clone()
    }

    fn state(&self) -> Result<RwLockReadGuard<'_, Option<State>>> {
        let guard = self.shared.state.read();
        if guard.is_none() {
            return Err(Error::new(ErrorKind::Closed, format!("table {:?} is closed", self.shared.name)));
        }
        Ok(guard)
    }

    /// Live rows.
    pub fn len(&self) -> Result<u64> {
        Ok(self.state()?.as_ref().unwrap().index.len())
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    fn check_rows(&self, what: &str, keys: usize, rows: usize) -> Result<()> {
        let dim = self.shared.row_dim;
        if rows != keys * dim {
            return Err(Error::invalid(format!(
                "{what}: table {:?} has dim {dim}, so {keys} keys need {} row elements, got {rows}{}",
                self.shared.name,
                keys * dim,
                if keys > 0 && rows.is_multiple_of(keys) {
                    format!(" (rows of dim {})", rows / keys)
                } else {
                    String::new()
                }
            )));
        }
        Ok(())
    }

    #[inline(always)]
    fn stripe(&self, hash: u64) -> &Mutex<StripeLog> {
        // The stripe comes from bits the home bucket does not use first.
        &self.shared.stripes[((hash >> 40) as usize) & (STRIPES - 1)]
    }

    /// Resolves every key (lock-free, prefetching), copying found rows into `out`.
    /// Returns the positions of keys that were not found.
    fn gather(&self, st: &State, keys: &[u64], out: &mut [f32], found: Option<&mut [bool]>) -> Result<Vec<usize>> {
        let dim = self.shared.width;
        let (index, medium) = (&st.index, mmap_of(&st.medium));
        let n = keys.len();
        let mut hashes = Vec::with_capacity(n);
        hashes.extend(keys.iter().map(|&k| index.hash(k)));
        let mut ptrs = vec![0u64; n];
        let mut missing = Vec::new();
        for i in 0..n {
            if i + PREFETCH_KEYS_AHEAD < n {
                index.prefetch(hashes[i + PREFETCH_KEYS_AHEAD]);
            }
            match index.get(keys[i], hashes[i]) {
                Some(ptr) => {
                    medium.prefetch(ptr);
                    ptrs[i] = ptr;
                }
                None => missing.push(i),
            }
        }
        let mut corrupt = None;
        for i in 0..n {
            let ptr = ptrs[i];
            if ptr == 0 {
                continue;
            }
            if medium.key_at(ptr) != keys[i] {
                corrupt = Some(i);
                continue;
            }
            out[i * dim..(i + 1) * dim].copy_from_slice(medium.row_at(ptr));
        }
        if let Some(found) = found {
            for (i, &p) in ptrs.iter().enumerate() {
                found[i] = p != 0;
            }
        }
        if let Some(i) = corrupt {
            return Err(Error::corrupt(format!(
                "table {:?}: the index points key {} at a record of another key",
                self.shared.name, keys[i]
            )));
        }
        Ok(missing)
    }

    /// Rows of `keys` into `out` (`keys.len() * dim` elements); creates missing rows with the initializer.
    pub fn pull(&self, keys: &[u64], out: &mut [f32]) -> Result<()> {
        self.check_rows("pull", keys.len(), out.len())?;
        if let Some(life) = &self.shared.lifecycle {
            return self.pull_lifecycle(life, keys, out);
        }
        if !self.has_state() {
            return self.pull_records(keys, out);
        }
        let mut records = vec![0f32; keys.len() * self.shared.width];
        self.pull_records(keys, &mut records)?;
        self.copy_rows(&records, out);
        Ok(())
    }

    /// [`pull`](Self::pull) of a table with admission or eviction: existing rows are read,
    /// missing ones admitted (or answered with the initializer's row, unstored), room made
    /// for the admitted ones, then they are created.
    fn pull_lifecycle(&self, life: &Lifecycle, keys: &[u64], out: &mut [f32]) -> Result<()> {
        let _gate = self.shared.tier.gate.read_recursive();
        let (w, d) = (self.shared.width, self.shared.row_dim);
        let mut records = vec![0f32; keys.len() * w];
        let mut found = vec![false; keys.len()];
        self.lookup_records(keys, &mut records, &mut found)?;
        let missing: Vec<usize> = (0..keys.len()).filter(|&i| !found[i]).collect();
        if !missing.is_empty() {
            let missing_keys: Vec<u64> = missing.iter().map(|&i| keys[i]).collect();
            let admit = if life.opts.admits() { life.admit(&missing_keys) } else { vec![true; missing.len()] };
            let (mut new_pos, mut new_keys) = (Vec::new(), Vec::new());
            for (j, &i) in missing.iter().enumerate() {
                if admit[j] {
                    new_pos.push(i);
                    new_keys.push(keys[i]);
                } else {
                    self.init_record(keys[i], &mut records[i * w..(i + 1) * w]);
                }
            }
            if !new_keys.is_empty() {
                self.make_room_for(life, &new_keys, keys)?;
                let mut created = vec![0f32; new_keys.len() * w];
                self.pull_records(&new_keys, &mut created)?;
                for (j, &i) in new_pos.iter().enumerate() {
                    records[i * w..(i + 1) * w].copy_from_slice(&created[j * w..(j + 1) * w]);
                }
                for &i in &new_pos {
                    found[i] = true;
                }
            }
        }
        life.touch((0..keys.len()).filter(|&i| found[i]).map(|i| keys[i]));
        if w == d {
            out.copy_from_slice(&records);
        } else {
            self.copy_rows(&records, out);
        }
        Ok(())
    }

    /// Whole records of the keys that exist (never creates); `found[i]` tells which.
    fn lookup_records(&self, keys: &[u64], records: &mut [f32], found: &mut [bool]) -> Result<()> {
        if self.tiered() {
            self.tier_lookup(keys, records, found)?;
        } else {
            let st = self.state()?;
            let _pin = crossbeam_epoch::pin();
            self.gather(st.as_ref().unwrap(), keys, records, Some(found))?;
        }
        Ok(())
    }

    /// Evicts rows until `new` keys (distinct or not, some possibly present by now) fit
    /// under `max_rows`; never evicts a key of `batch`.
    fn make_room_for(&self, life: &Lifecycle, new: &[u64], batch: &[u64]) -> Result<()> {
        let Some(max) = life.opts.max_rows else { return Ok(()) };
        let distinct: std::collections::HashSet<u64> = new.iter().copied().collect();
        if distinct.len() as u64 > max {
            return Err(Error::invalid(format!(
                "table {:?}: a batch creates {} rows, more than max_rows ({max}); nothing was created",
                self.shared.name,
                distinct.len()
            )));
        }
        let _one = life.evicting.lock();
        let len = self.len()?;
        if len + distinct.len() as u64 <= max {
            return Ok(());
        }
        // Evict a little more than needed, so a full table does not evict on every batch.
        let n = (len + distinct.len() as u64 - max + max / EVICT_SLACK_DIVISOR) as usize;
        let spare: std::collections::HashSet<u64> = batch.iter().copied().collect();
        let victims = life.victims(n, &spare);
        let gone = self.delete(&victims)?;
        life.count_evicted(false, gone);
        Ok(())
    }

    /// Evicts every row of a table with a TTL that was not touched within it; returns how
    /// many. The store's maintenance thread calls it about once a second; call it to
    /// evict at a point of your choosing (after a batch, say).
    pub fn evict_expired(&self) -> Result<u64> {
        let Some(life) = &self.shared.lifecycle else { return Ok(0) };
        let _gate = self.shared.tier.gate.read_recursive();
        let _one = life.evicting.lock();
        let victims = life.expired();
        if victims.is_empty() {
            return Ok(0);
        }
        let gone = self.delete(&victims)?;
        life.count_evicted(true, gone);
        Ok(gone)
    }

    /// Whether the maintenance thread should sweep this table for expired rows.
    pub(crate) fn has_ttl(&self) -> bool {
        self.shared.lifecycle.as_ref().is_some_and(|l| l.opts.ttl_steps.is_some() || l.opts.ttl_seconds.is_some())
    }

    /// Copies the row part of each record.
    fn copy_rows(&self, records: &[f32], out: &mut [f32]) {
        let (w, d) = (self.shared.width, self.shared.row_dim);
        for (rec, row) in records.chunks_exact(w).zip(out.chunks_exact_mut(d)) {
            row.copy_from_slice(&rec[..d]);
        }
    }

    /// Records (row and optimizer state) of `keys`, created if missing.
    fn pull_records(&self, keys: &[u64], out: &mut [f32]) -> Result<()> {
        // Pulls may create rows: a checkpoint sees all of a batch or none of it.
        let _gate = self.shared.tier.gate.read_recursive();
        if self.tiered() {
            return self.tier_pull(keys, out);
        }
        let missing = {
            let st = self.state()?;
            let _pin = crossbeam_epoch::pin();
            self.gather(st.as_ref().unwrap(), keys, out, None)?
        };
        if missing.is_empty() {
            return Ok(());
        }
        let mut from = 0;
        loop {
            let pass = {
                let st = self.state()?;
                self.create_missing(st.as_ref().unwrap(), keys, &missing[from..], out)?
            };
            match pass {
                Pass::Done => return Ok(()),
                Pass::NeedRoom(done) => {
                    from += done;
                    self.make_room()?;
                }
            }
        }
    }

    /// Creates (or, if another writer got there first, reads) the rows at `positions`.
    fn create_missing(&self, st: &State, keys: &[u64], positions: &[usize], out: &mut [f32]) -> Result<Pass> {
        let dim = self.shared.width;
        let (index, medium) = (&st.index, mmap_of(&st.medium));
        let alloc = medium.alloc();
        let _pin = crossbeam_epoch::pin();
        let mut jw = None;
        let mut ptrs = Vec::new();
        alloc.allocate(positions.len(), &mut ptrs)?;
        let mut unused = ptrs.into_iter();
        for (done, &i) in positions.iter().enumerate() {
            let key = keys[i];
            let h = index.hash(key);
            let row = &mut out[i * dim..(i + 1) * dim];
            let mut w = self.stripe(h).lock();
            if let Some(ptr) = index.get(key, h) {
                row.copy_from_slice(medium.row_at(ptr));
                continue;
            }
            if !self.has_room(index) {
                alloc.release(unused.collect());
                return Ok(Pass::NeedRoom(done));
            }
            self.init_record(key, row);
            let ptr = unused.next().expect("one record allocated per position");
            medium.write_row(ptr, key, row);
            self.journal(&mut jw, &mut w, index, key, h)?;
            if !index.insert_new(key, h, ptr) {
                alloc.release(std::iter::once(ptr).chain(unused).collect());
                return Ok(Pass::NeedRoom(done));
            }
        }
        alloc.release(unused.collect());
        Ok(Pass::Done)
    }

    /// Like [`pull`](Self::pull) but never creates rows: missing keys get the table's
    /// missing-row default and `found[i] = false`.
    pub fn lookup(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        self.check_rows("lookup", keys.len(), out.len())?;
        if found.len() != keys.len() {
            return Err(Error::invalid(format!("lookup: {} keys but a found-mask of {}", keys.len(), found.len())));
        }
        let mut records = if self.has_state() { vec![0f32; keys.len() * self.shared.width] } else { Vec::new() };
        let buf: &mut [f32] = if self.has_state() { &mut records } else { &mut *out };
        let missing = if self.tiered() {
            self.tier_lookup(keys, buf, found)?
        } else {
            let st = self.state()?;
            let _pin = crossbeam_epoch::pin();
            self.gather(st.as_ref().unwrap(), keys, buf, Some(found))?
        };
        if self.has_state() {
            self.copy_rows(&records, out);
        }
        self.fill_missing(keys, &missing, out);
        if let Some(life) = &self.shared.lifecycle {
            life.touch((0..keys.len()).filter(|&i| found[i]).map(|i| keys[i]));
        }
        Ok(())
    }

    /// Fills the rows at `positions` with the table's missing-row default.
    fn fill_missing(&self, keys: &[u64], positions: &[usize], out: &mut [f32]) {
        let dim = self.shared.row_dim;
        for &i in positions {
            let row = &mut out[i * dim..(i + 1) * dim];
            match self.shared.missing {
                MissingDefault::Zeros => row.fill(0.0),
                MissingDefault::Value { value } => row.fill(value),
                MissingDefault::Init => self.shared.init.fill(self.shared.seed, keys[i], row),
            }
        }
    }

    /// Writes rows (insert or replace). With duplicate keys the last row wins.
    pub fn push(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        self.check_rows("push", keys.len(), rows.len())?;
        if let Some(i) = rows.iter().position(|x| !x.is_finite()) {
            return Err(Error::invalid(format!(
                "push: row of key {} holds a non-finite value ({}); nothing was written",
                keys[i / self.shared.row_dim],
                rows[i]
            )));
        }
        if let Some(life) = &self.shared.lifecycle {
            let _gate = self.shared.tier.gate.read_recursive();
            life.written(keys);
            if life.opts.max_rows.is_some() {
                let mut records = vec![0f32; keys.len() * self.shared.width];
                let mut found = vec![false; keys.len()];
                self.lookup_records(keys, &mut records, &mut found)?;
                let new: Vec<u64> = (0..keys.len()).filter(|&i| !found[i]).map(|i| keys[i]).collect();
                if !new.is_empty() {
                    self.make_room_for(life, &new, keys)?;
                }
            }
            self.push_unchecked(keys, rows)?;
            life.touch(keys.iter().copied());
            return Ok(());
        }
        self.push_unchecked(keys, rows)
    }

    /// [`push`](Self::push) of checked rows.
    fn push_unchecked(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        if !self.has_state() {
            return self.push_records(keys, rows);
        }
        // A pushed row starts its optimizer state afresh.
        let (w, d) = (self.shared.width, self.shared.row_dim);
        let mut records = vec![0f32; keys.len() * w];
        let opt = self.optimizer();
        for (rec, row) in records.chunks_exact_mut(w).zip(rows.chunks_exact(d)) {
            rec[..d].copy_from_slice(row);
            opt.init_state(&mut rec[d..]);
        }
        self.push_records(keys, &records)
    }

    /// Applies the table's optimizer to the rows of `keys` with gradients `grads`
    /// (`keys.len() * dim` elements). Gradients of duplicate keys are summed first, so
    /// each row gets one update per call. Missing rows are created with the
    /// initializer, then updated. Non-finite gradients are refused with nothing written.
    /// [`pull`](Self::pull) by a training worker under the table's staleness bound: each
    /// distinct key gets a hold for `worker` until its [`push_grad_held`](Self::push_grad_held);
    /// a key whose holds already exceed the bound waits for a push (at most `timeout`, then
    /// `Timeout` naming the key). Without a bound (ASP) it is a plain pull.
    pub fn pull_held(&self, worker: u64, keys: &[u64], out: &mut [f32], timeout: std::time::Duration) -> Result<()> {
        self.check_rows("pull", keys.len(), out.len())?;
        let Some(holds) = &self.shared.holds else { return self.pull(keys, out) };
        holds.acquire(worker, keys, timeout, &self.shared.name)?;
        self.pull(keys, out).inspect_err(|_| holds.give_back(worker, keys))
    }

    /// [`push_grad`](Self::push_grad) by a training worker: once applied, gives back the
    /// worker's hold of each distinct key (if it has one). If the update fails the holds
    /// stay, so the worker can retry.
    pub fn push_grad_held(&self, worker: u64, keys: &[u64], grads: &[f32]) -> Result<()> {
        self.push_grad(keys, grads)?;
        if let Some(holds) = &self.shared.holds {
            let mut uniq = keys.to_vec();
            uniq.sort_unstable();
            uniq.dedup();
            holds.give_back(worker, &uniq);
        }
        Ok(())
    }

    /// Gives back every hold of `worker` (a worker that stops, or dies and is noticed).
    /// Returns how many holds it had.
    pub fn release(&self, worker: u64) -> u64 {
        self.shared.holds.as_ref().map_or(0, |h| h.release(worker))
    }

    /// The staleness bound (`None`: ASP).
    pub fn staleness_bound(&self) -> Option<u32> {
        self.shared.holds.as_ref().map(Holds::bound)
    }

    pub fn push_grad(&self, keys: &[u64], grads: &[f32]) -> Result<()> {
        // Read, update and write as one step for checkpoints.
        let _gate = self.shared.tier.gate.read_recursive();
        self.check_rows("push_grad", keys.len(), grads.len())?;
        let d = self.shared.row_dim;
        if let Some(i) = grads.iter().position(|x| !x.is_finite()) {
            return Err(Error::invalid(format!(
                "push_grad: gradient of key {} holds a non-finite value ({}); nothing was written",
                keys[i / d],
                grads[i]
            )));
        }
        let opt = self.optimizer();
        if opt == Optimizer::None {
            return Err(Error::config(format!(
                "push_grad: table {:?} has no optimizer; create it with one (e.g. optimizer=Adagrad)",
                self.shared.name
            )));
        }
        let (mut uniq, mut sums) = sum_duplicates(keys, grads, d);
        let w = self.shared.width;
        let _one = self.shared.grad_lock.lock();
        let life = self.shared.lifecycle.as_ref();
        if let Some(life) = life.filter(|l| l.opts.admits() || l.opts.max_rows.is_some()) {
            let mut records = vec![0f32; uniq.len() * w];
            let mut found = vec![false; uniq.len()];
            self.lookup_records(&uniq, &mut records, &mut found)?;
            if life.opts.admits() {
                // Rows not admitted (or evicted since their pull) take no update.
                let dropped = found.iter().filter(|&&f| !f).count();
                if dropped > 0 {
                    life.dropped_grads(dropped as u64);
                    let (mut k2, mut g2) = (Vec::with_capacity(uniq.len()), Vec::with_capacity(sums.len()));
                    for (i, &k) in uniq.iter().enumerate() {
                        if found[i] {
                            k2.push(k);
                            g2.extend_from_slice(&sums[i * d..(i + 1) * d]);
                        }
                    }
                    (uniq, sums) = (k2, g2);
                }
            } else {
                let new: Vec<u64> = (0..uniq.len()).filter(|&i| !found[i]).map(|i| uniq[i]).collect();
                if !new.is_empty() {
                    self.make_room_for(life, &new, &uniq)?;
                }
            }
        }
        let result = self.apply_grads(&uniq, &sums, opt);
        if let Some(life) = life {
            if result.is_ok() {
                // A step ends: its rows are touched at the new step (TTL ages count from it).
                life.step();
                life.touch(uniq.iter().copied());
            }
        }
        result
    }

    /// Reads, updates and writes back the records of distinct `uniq` keys.
    fn apply_grads(&self, uniq: &[u64], sums: &[f32], opt: Optimizer) -> Result<()> {
        let (w, d) = (self.shared.width, self.shared.row_dim);
        let mut records = vec![0f32; uniq.len() * w];
        self.pull_records(uniq, &mut records)?;
        for (rec, g) in records.chunks_exact_mut(w).zip(sums.chunks_exact(d)) {
            opt.apply(rec, g);
        }
        if let Some(i) = records.iter().position(|x| !x.is_finite()) {
            return Err(Error::invalid(format!(
                "push_grad: the update of key {} is not finite (learning rate too large?); nothing was written",
                uniq[i / w]
            )));
        }
        self.push_records(uniq, &records)
    }

    /// Writes whole records (row and optimizer state).
    fn push_records(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        let _gate = self.shared.tier.gate.read_recursive();
        if self.tiered() {
            return self.tier_push(keys, rows);
        }
        let mut from = 0;
        loop {
            let pass = {
                let st = self.state()?;
                self.push_pass(st.as_ref().unwrap(), &keys[from..], &rows[from * self.shared.width..])?
            };
            match pass {
                Pass::Done => return Ok(()),
                Pass::NeedRoom(done) => {
                    from += done;
                    self.make_room()?;
                }
            }
        }
    }

    fn push_pass(&self, st: &State, keys: &[u64], rows: &[f32]) -> Result<Pass> {
        let dim = self.shared.width;
        let (index, medium) = (&st.index, mmap_of(&st.medium));
        let alloc = medium.alloc();
        let guard = crossbeam_epoch::pin();
        let mut jw = None;
        let mut ptrs = Vec::new();
        alloc.allocate(keys.len(), &mut ptrs)?;
        let (mut retired, mut held) = (Vec::new(), Vec::new());
        let mut result = Pass::Done;
        for (i, &key) in keys.iter().enumerate() {
            let ptr = ptrs[i];
            medium.write_row(ptr, key, &rows[i * dim..(i + 1) * dim]);
            let h = index.hash(key);
            let mut w = self.stripe(h).lock();
            let keep = self.journal(&mut jw, &mut w, index, key, h)?;
            if let Some(old) = index.replace(key, h, ptr) {
                if keep == Some(old) {
                    held.push(old)
                } else {
                    retired.push(old)
                }
            } else if !self.has_room(index) || !index.insert_new(key, h, ptr) {
                alloc.release(ptrs[i..].to_vec());
                result = Pass::NeedRoom(i);
                break;
            }
        }
        self.settle(alloc, &guard, retired, held);
        Ok(result)
    }

    /// Deletes keys; returns how many were present.
    pub fn delete(&self, keys: &[u64]) -> Result<u64> {
        let _gate = self.shared.tier.gate.read_recursive();
        let st = self.state()?;
        let State { index, medium } = st.as_ref().unwrap();
        let cache = self.cache();
        let guard = crossbeam_epoch::pin();
        let mut jw = None;
        let (mut retired, mut held) = (Vec::new(), Vec::new());
        for &key in keys {
            let h = index.hash(key);
            let mut w = self.stripe(h).lock();
            let keep = self.journal(&mut jw, &mut w, index, key, h)?;
            // With a row cache, index changes also hold the key's cache shard (see tiered.rs).
            let _c = cache.map(|c| {
                let mut l = c.lock(c.hash(self.shared.id, key));
                l.remove(self.shared.id, key);
                l
            });
            if let Some(ptr) = index.remove(key, h) {
                if keep == Some(ptr) {
                    held.push(ptr)
                } else {
                    retired.push(ptr)
                }
            }
        }
        let n = (retired.len() + held.len()) as u64;
        self.settle(medium.alloc(), &guard, retired, held);
        if let Some(life) = &self.shared.lifecycle {
            life.forget(keys);
        }
        Ok(n)
    }

    /// Under the key's stripe lock, before its index slot changes (with the store's
    /// checkpoint gate held): journals the key's current record if this is its first
    /// change since the latest checkpoint, and returns that record, which the caller must
    /// hold (not retire) since the checkpoint still needs it.
    fn journal(
        &self,
        jw: &mut Option<journal::Writer>,
        _w: &mut StripeLog,
        index: &Index,
        key: u64,
        h: u64,
    ) -> Result<Option<u64>> {
        let seq = self.shared.tier.interval.load(Ordering::Acquire);
        if seq == 0 {
            return Ok(None);
        }
        // A key present in the index is journaled once per interval: a mark in its bucket
        // (a line the lookup just read) says so. An absent key is always journaled (as
        // absent); it can only enter a slot that way, so a marked slot's key was journaled.
        // Duplicate entries (a key deleted and created again) are harmless: every reader
        // of a journal takes a key's first entry.
        let found = index.find(key, h);
        let tag = crate::hash::splitmix64(self.shared.mark_nonce ^ seq);
        if let Some(f) = found {
            if index.journaled(f.bucket, f.slot, tag) {
                return Ok(None);
            }
        }
        if jw.as_ref().is_none_or(|j| j.seq() != seq) {
            match self.shared.journal.read().as_ref() {
                Some(j) if j.seq() == seq => *jw = Some(journal::Writer::new(Arc::clone(j))),
                _ => {
                    return Err(Error::corrupt(format!(
                        "table {:?} has no journal for checkpoint {seq}",
                        self.shared.name
                    )))
                }
            }
        }
        jw.as_mut().expect("set above").append(key, found.map_or(0, |f| f.ptr))?;
        if let Some(f) = found {
            index.mark_journaled(f.bucket, f.slot, tag);
        }
        Ok(found.map(|f| f.ptr))
    }

    /// Retires replaced records, except those a retained checkpoint needs (`held`).
    fn settle(
        &self,
        alloc: &crate::medium::alloc::RecordAlloc,
        guard: &crossbeam_epoch::Guard,
        retired: Vec<u64>,
        held: Vec<u64>,
    ) {
        alloc.retire(guard, retired);
        if !held.is_empty() {
            let seq = self.shared.tier.interval.load(Ordering::Acquire);
            self.shared.held.lock().entry(seq).or_default().extend(held);
        }
    }

    /// Starts the interval of checkpoint `seq` (the store's checkpoint gate is held
    /// exclusively): a new, empty undo journal — the spare prepared after the last
    /// checkpoint, renamed — and returns the one it replaces.
    pub(crate) fn start_interval(&self, seq: u64) -> Result<Option<Arc<Journal>>> {
        let spare = self.shared.spare.lock().take();
        let j = match spare {
            Some(sp) => sp.adopt(&self.shared.dir, seq)?,
            None => Journal::create(&self.shared.dir, seq)?,
        };
        Ok(self.shared.journal.write().replace(Arc::new(j)))
    }

    /// After a checkpoint, off the caller's thread: deletes the journals of dropped
    /// checkpoints and prepares the next spare journal.
    pub(crate) fn housekeep(&self, dropped: &[u64]) {
        for &seq in dropped {
            let _ = std::fs::remove_file(journal::path_of(&self.shared.dir, seq));
        }
        let mut spare = self.shared.spare.lock();
        if spare.is_none() && self.shared.state.read().is_some() {
            match Journal::create_spare(&self.shared.dir) {
                Ok(j) => *spare = Some(j),
                Err(e) => tracing::warn!(table = %self.shared.name, error = %e, "cannot prepare a spare undo journal"),
            }
        }
    }

    /// Checkpoint `seq` is no longer retained: records held for it return to the
    /// allocator (its journal is deleted by [`housekeep`](Self::housekeep)).
    pub(crate) fn drop_interval(&self, seq: u64) -> Result<()> {
        let freed = self.shared.held.lock().remove(&seq).unwrap_or_default();
        if !freed.is_empty() {
            let st = self.state()?;
            let guard = crossbeam_epoch::pin();
            st.as_ref().unwrap().medium.alloc().retire_cold(&guard, freed);
        }
        Ok(())
    }

    /// Records held for retained checkpoints.
    pub fn held_records(&self) -> u64 {
        self.shared.held.lock().values().map(|v| v.len() as u64).sum()
    }

    fn has_room(&self, index: &Index) -> bool {
        (index.len() + 1) as f64 <= self.shared.load_factor_max * index.slot_count() as f64
    }

    /// Grows the index, or says why it cannot.
    fn make_room(&self) -> Result<()> {
        let mut guard = self.shared.state.write();
        let st = guard
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Closed, format!("table {:?} is closed", self.shared.name)))?;
        let rows = st.index.len();
        if !self.shared.growth {
            return Err(Error::new(
                ErrorKind::TableFull,
                format!(
                    "table {:?} is full: {rows} rows in {} slots (load factor max {}), and growth is off",
                    self.shared.name,
                    st.index.slot_count(),
                    self.shared.load_factor_max
                ),
            ));
        }
        let t0 = Instant::now();
        let old_buckets = st.index.bucket_count();
        let mut buckets = buckets_for(rows.max(1) * 2, LOAD_FACTOR_TARGET).max(old_buckets * 2);
        let generation = self.shared.meta.lock().index_generation + 1;
        let path = index_path(&self.shared.dir, generation);
        let index = loop {
            let _ = std::fs::remove_file(&path);
            let index = Index::create(&path, buckets, st.index.seed())?;
            let mut ok = true;
            st.index.for_each(0, st.index.bucket_count(), |key, ptr| {
                ok = ok && index.insert_new(key, index.hash(key), ptr);
            });
            if ok {
                break index;
            }
            buckets *= 2;
        };
        if index.len() != rows {
            return Err(Error::corrupt(format!(
                "rebuild of table {:?} saw {} rows, expected {rows}",
                self.shared.name,
                index.len()
            )));
        }
        index.flush()?;
        crate::fsutil::sync_dir(&self.shared.dir)?;
        let id = self.shared.meta.lock().id;
        let meta = self.shared.catalog.update(|c| {
            let m = c
                .tables
                .iter_mut()
                .find(|m| m.id == id)
                .ok_or_else(|| Error::corrupt("table vanished from the catalog"))?;
            m.index_generation = generation;
            m.grow_count += 1;
            Ok(m.clone())
        })?;
        let old_path = st.index.path().to_owned();
        if self.shared.tier.mmap_random {
            index.advise_random();
        }
        st.index = index;
        let _ = std::fs::remove_file(&old_path);
        *self.shared.meta.lock() = meta;
        tracing::info!(
            table = %self.shared.name,
            rows,
            buckets_from = old_buckets,
            buckets_to = buckets,
            seconds = t0.elapsed().as_secs_f64(),
            "table index grown"
        );
        Ok(())
    }

    /// Streams every `(key, row)` in chunks of at most `chunk_keys` keys. The table stays
    /// readable and writable meanwhile (its lock is held per chunk, not across `f`); a row
    /// written during the export may appear in its old or new form. If the index is rebuilt
    /// (the table grew) between two chunks the export stops with an error, since bucket
    /// positions changed. Checks each row's checksum.
    pub fn export(&self, chunk_keys: usize, mut f: impl FnMut(&[u64], &[f32]) -> Result<()>) -> Result<()> {
        let mut keys = Vec::new();
        let mut rows = Vec::new();
        let mut cursor = ExportCursor::START;
        loop {
            let next = self.export_page(cursor, chunk_keys, &mut keys, &mut rows)?;
            if !keys.is_empty() {
                f(&keys, &rows)?;
            }
            match next {
                Some(c) => cursor = c,
                None => return Ok(()),
            }
        }
    }

    /// One page of an export: clears `keys` and `rows`, fills them with at most
    /// `chunk_keys` rows (at least one bucket's worth) from `cursor` on, and returns
    /// where the next page starts (`None` when the table is done). Pages of one export
    /// may be fetched by different calls (a remote client pages through a table this
    /// way); a page from a cursor of an older index generation fails with
    /// `Unsupported` (the table grew; start again).
    pub fn export_page(
        &self,
        cursor: ExportCursor,
        chunk_keys: usize,
        keys: &mut Vec<u64>,
        rows: &mut Vec<f32>,
    ) -> Result<Option<ExportCursor>> {
        let chunk_keys = chunk_keys.max(SLOTS_PER_BUCKET);
        let dim = self.shared.width;
        keys.clear();
        rows.clear();
        if cursor.bucket == 0 {
            // Dirty cached rows are newer than the medium: write them back first.
            self.write_back_all()?;
        }
        let mut records = Vec::with_capacity((chunk_keys + SLOTS_PER_BUCKET) * dim);
        let mut bucket = cursor.bucket;
        let next = {
            let st = self.state()?;
            let State { index, medium } = st.as_ref().unwrap();
            let current = self.shared.meta.lock().index_generation;
            let generation = if cursor == ExportCursor::START { current } else { cursor.generation };
            if generation != current {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("table {:?} grew during the export; run the export again", self.shared.name),
                ));
            }
            let _pin = crossbeam_epoch::pin();
            let mut bad = None;
            let mut items = Vec::new();
            while bucket < index.bucket_count() && keys.len() + SLOTS_PER_BUCKET <= chunk_keys {
                index.for_each(bucket, bucket + 1, |key, ptr| match medium {
                    Medium::Mmap(m) => {
                        if m.key_at(ptr) != key || !m.checksum_ok(ptr) {
                            bad = Some(key);
                            return;
                        }
                        keys.push(key);
                        records.extend_from_slice(m.row_at(ptr));
                    }
                    Medium::Block(_) => {
                        items.push(ReadItem { key, ptr, pos: keys.len() });
                        keys.push(key);
                    }
                });
                bucket += 1;
            }
            if !items.is_empty() {
                records.resize(keys.len() * dim, 0.0);
                medium.read(&items, &mut records)?;
            }
            if let Some(key) = bad {
                return Err(Error::new(
                    ErrorKind::ChecksumMismatch,
                    format!("table {:?}: row of key {key} fails its checksum", self.shared.name),
                ));
            }
            (bucket < index.bucket_count()).then_some(ExportCursor { generation, bucket })
        };
        if self.has_state() {
            rows.resize(keys.len() * self.shared.row_dim, 0.0);
            self.copy_rows(&records, rows);
        } else {
            *rows = records;
        }
        Ok(next)
    }

    /// Reads the records at `items` (key, record) into rows of the user's dim, checking
    /// that each record holds its key (and on the mmap medium its checksum).
    fn read_records(&self, st: &State, items: &[(u64, u64)], rows: &mut Vec<f32>) -> Result<()> {
        let (w, d) = (self.shared.width, self.shared.row_dim);
        let mut records = vec![0f32; items.len() * w];
        match &st.medium {
            Medium::Mmap(m) => {
                for (i, &(key, ptr)) in items.iter().enumerate() {
                    if m.key_at(ptr) != key || !m.checksum_ok(ptr) {
                        return Err(Error::new(
                            ErrorKind::ChecksumMismatch,
                            format!("table {:?}: record of key {key} fails its check", self.shared.name),
                        ));
                    }
                    records[i * w..(i + 1) * w].copy_from_slice(m.row_at(ptr));
                }
            }
            Medium::Block(_) => {
                let reads: Vec<ReadItem> =
                    items.iter().enumerate().map(|(pos, &(key, ptr))| ReadItem { key, ptr, pos }).collect();
                st.medium.read(&reads, &mut records)?;
            }
        }
        rows.clear();
        rows.resize(items.len() * d, 0.0);
        self.copy_rows(&records, rows);
        Ok(())
    }

    /// The first undo entry of each key in the journals of checkpoints `seq` and later:
    /// each key's record at checkpoint `seq` (0: absent), for keys changed since.
    /// `open` keeps the journals mapped between calls: only journals of checkpoints taken
    /// since the last call are opened; the entries of every one are read again (the
    /// current one grows).
    fn changed_since(
        &self,
        seq: u64,
        open: &mut std::collections::BTreeMap<u64, Journal>,
        first: &mut HashMap<u64, u64>,
    ) {
        for j in journal::list(&self.shared.dir).into_iter().filter(|&s| s >= seq) {
            if let std::collections::btree_map::Entry::Vacant(v) = open.entry(j) {
                // A journal deleted meanwhile belongs to a dropped checkpoint: the caller checks.
                if let Ok(journal) = Journal::open(&self.shared.dir, j) {
                    v.insert(journal);
                }
            }
        }
        for journal in open.values() {
            for e in journal.entries() {
                first.entry(e.key).or_insert(e.old);
            }
        }
    }

    /// Streams every `(key, row)` as of checkpoint `seq` (rows and their values then),
    /// while the table keeps changing: the current index gives each key's record unless
    /// the key changed since the checkpoint, in which case its undo entry gives the record
    /// it had (kept from reuse while the checkpoint is retained). Keys deleted since come
    /// from their entries. Memory: the keys changed since the checkpoint and the keys
    /// emitted.
    pub(crate) fn export_at(
        &self,
        seq: u64,
        chunk_keys: usize,
        mut f: impl FnMut(&[u64], &[f32]) -> Result<()>,
    ) -> Result<()> {
        let chunk_keys = chunk_keys.max(SLOTS_PER_BUCKET);
        let mut first = HashMap::new();
        let mut journals = std::collections::BTreeMap::new();
        let mut emitted = std::collections::HashSet::new();
        let mut bucket = 0u64;
        let generation = self.shared.meta.lock().index_generation;
        let mut rows = Vec::new();
        loop {
            let mut pairs = Vec::with_capacity(chunk_keys + SLOTS_PER_BUCKET);
            let (keys, done) = {
                let st = self.state()?;
                let st = st.as_ref().unwrap();
                if self.shared.meta.lock().index_generation != generation {
                    return Err(Error::new(
                        ErrorKind::Unsupported,
                        format!("table {:?} grew during the export; run the export again", self.shared.name),
                    ));
                }
                let _pin = crossbeam_epoch::pin();
                while bucket < st.index.bucket_count() && pairs.len() + SLOTS_PER_BUCKET <= chunk_keys {
                    st.index.for_each(bucket, bucket + 1, |key, ptr| pairs.push((key, ptr)));
                    bucket += 1;
                }
                // Read the journals after the index: an index change is journaled before it
                // happens, so every changed key the page saw has its entry by now.
                self.changed_since(seq, &mut journals, &mut first);
                let mut items = Vec::with_capacity(pairs.len());
                for (key, ptr) in pairs {
                    let ptr = first.get(&key).copied().unwrap_or(ptr);
                    if ptr != 0 && emitted.insert(key) {
                        items.push((key, ptr));
                    }
                }
                self.read_records(st, &items, &mut rows)?;
                (items.into_iter().map(|(k, _)| k).collect::<Vec<u64>>(), bucket >= st.index.bucket_count())
            };
            if !keys.is_empty() {
                f(&keys, &rows)?;
            }
            if done {
                break;
            }
        }
        // Keys deleted (or moved past the cursor) since the checkpoint.
        let rest: Vec<(u64, u64)> =
            first.iter().filter(|(k, &old)| old != 0 && !emitted.contains(*k)).map(|(&k, &p)| (k, p)).collect();
        for chunk in rest.chunks(chunk_keys) {
            let st = self.state()?;
            let _pin = crossbeam_epoch::pin();
            self.read_records(st.as_ref().unwrap(), chunk, &mut rows)?;
            let keys: Vec<u64> = chunk.iter().map(|&(k, _)| k).collect();
            drop(st);
            f(&keys, &rows)?;
        }
        Ok(())
    }

    /// Keys changed since checkpoint `seq` (written, created or deleted): what an
    /// incremental export sends.
    pub(crate) fn changed_keys(&self, seq: u64) -> Result<Vec<u64>> {
        let mut first = HashMap::new();
        self.changed_since(seq, &mut std::collections::BTreeMap::new(), &mut first);
        let mut keys: Vec<u64> = first.into_keys().collect();
        keys.sort_unstable();
        Ok(keys)
    }

    /// Calls `f` with the rows of `keys` borrowed from the mapped file, without copying
    /// them (for a server that sends rows straight from the medium with vectored writes).
    /// Each item of `f`'s slice is one row's `dim * 4` bytes, little-endian `f32`, in key
    /// order; rows the table does not hold point into a scratch buffer (with `create`,
    /// rows made by the initializer and stored, as [`pull`](Self::pull) does; without,
    /// the missing-row default, as [`lookup`](Self::lookup) does) and `found` says which.
    ///
    /// The table's read lock and an epoch guard are held while `f` runs: a row overwritten
    /// meanwhile keeps its old bytes (copy-on-write) until `f` returns, so `f` should not
    /// block for long. Returns `Ok(None)` without calling `f` when the table's rows are not
    /// directly addressable (block medium, or rows behind the row cache); use
    /// [`pull`](Self::pull)/[`lookup`](Self::lookup) then (also the answer, rarely,
    /// when a key is deleted while its missing neighbours are being created).
    pub fn with_rows<R>(
        &self,
        keys: &[u64],
        create: bool,
        f: impl FnOnce(&[&[u8]], &[bool]) -> R,
    ) -> Result<Option<R>> {
        // Tables with admission or eviction keep books of every access: the copying path.
        if self.tiered() || self.shared.lifecycle.is_some() {
            return Ok(None);
        }
        let (w, d) = (self.shared.width, self.shared.row_dim);
        let n = keys.len();
        let st = self.state()?;
        let State { index, medium } = st.as_ref().unwrap();
        let medium = mmap_of(medium);
        let _pin = crossbeam_epoch::pin();
        let mut ptrs = vec![0u64; n];
        let mut missing = Vec::new();
        for (i, &key) in keys.iter().enumerate() {
            if i + PREFETCH_KEYS_AHEAD < n {
                index.prefetch(index.hash(keys[i + PREFETCH_KEYS_AHEAD]));
            }
            match index.get(key, index.hash(key)) {
                Some(ptr) if medium.key_at(ptr) == key => {
                    // The kernel copies the rows out later: have them in cache by then.
                    medium.prefetch(ptr);
                    ptrs[i] = ptr
                }
                Some(_) => {
                    return Err(Error::corrupt(format!(
                        "table {:?}: the index points key {key} at a record of another key",
                        self.shared.name
                    )))
                }
                None => missing.push(i),
            }
        }
        let mut scratch = vec![0f32; missing.len() * d];
        if !missing.is_empty() {
            let missing_keys: Vec<u64> = missing.iter().map(|&i| keys[i]).collect();
            if create {
                // Creating rows takes writer locks and may grow the index: not under our read lock.
                drop(st);
                Table::pull(self, &missing_keys, &mut scratch)?;
                return self.with_rows_created(keys, &missing, &scratch, f);
            }
            let positions: Vec<usize> = (0..missing.len()).collect();
            self.fill_missing(&missing_keys, &positions, &mut scratch);
        }
        let mut found = vec![true; n];
        let mut slices: Vec<&[u8]> = Vec::with_capacity(n);
        let mut next_missing = missing.iter().peekable();
        let mut m = 0;
        for (i, &ptr) in ptrs.iter().enumerate() {
            if next_missing.peek() == Some(&&i) {
                next_missing.next();
                found[i] = false;
                slices.push(f32_bytes(&scratch[m * d..(m + 1) * d]));
                m += 1;
            } else {
                let rec = medium.row_at(ptr);
                debug_assert_eq!(rec.len(), w);
                slices.push(f32_bytes(&rec[..d]));
            }
        }
        Ok(Some(f(&slices, &found)))
    }

    /// Second half of [`with_rows`](Self::with_rows) with `create`, once the missing rows
    /// exist: resolves every key again; a key deleted in between is sent as created.
    fn with_rows_created<R>(
        &self,
        keys: &[u64],
        missing: &[usize],
        created: &[f32],
        f: impl FnOnce(&[&[u8]], &[bool]) -> R,
    ) -> Result<Option<R>> {
        let d = self.shared.row_dim;
        let st = self.state()?;
        let State { index, medium } = st.as_ref().unwrap();
        let medium = mmap_of(medium);
        let _pin = crossbeam_epoch::pin();
        let mut found = vec![true; keys.len()];
        for &i in missing {
            found[i] = false;
        }
        let mut slices: Vec<&[u8]> = Vec::with_capacity(keys.len());
        let mut m = 0;
        for (i, &key) in keys.iter().enumerate() {
            let fallback = !found[i];
            if fallback {
                m += 1;
            }
            match index.get(key, index.hash(key)) {
                Some(ptr) if medium.key_at(ptr) == key => slices.push(f32_bytes(&medium.row_at(ptr)[..d])),
                _ if fallback => slices.push(f32_bytes(&created[(m - 1) * d..m * d])),
                // Deleted between the two passes: let the caller take the copying path.
                _ => return Ok(None),
            }
        }
        Ok(Some(f(&slices, &found)))
    }

    /// Makes every write before this call durable: rows first, then the index.
    pub fn flush(&self) -> Result<()> {
        self.write_back_all()?;
        if let Some(j) = self.shared.journal.read().as_ref() {
            j.flush()?;
        }
        let st = self.state()?;
        let State { index, medium } = st.as_ref().unwrap();
        medium.flush()?;
        index.flush()
    }

    /// Flushes, saves the free list and marks the files closed cleanly. Further calls
    /// on any handle of this table fail with `Closed`.
    pub(crate) fn close(&self) -> Result<()> {
        if self.shared.state.read().is_none() {
            return Ok(());
        }
        self.write_back_all()?;
        let mut guard = self.shared.state.write();
        let Some(st) = guard.take() else { return Ok(()) };
        if let Some(c) = self.cache() {
            c.remove_table(self.shared.id);
        }
        st.medium.flush()?;
        let generation = st.index.free_list_generation() + 1;
        st.medium.alloc().save_free_list(generation)?;
        st.medium.flush()?;
        st.index.mark_closed(generation)?;
        Ok(())
    }

    /// Closes without saving anything (the table is being dropped).
    pub(crate) fn detach(&self) {
        self.shared.state.write().take();
        if let Some(c) = self.cache() {
            c.remove_table(self.shared.id);
        }
    }

    pub fn stats(&self) -> Result<TableStats> {
        let st = self.state()?;
        let State { index, medium } = st.as_ref().unwrap();
        let rows = index.len();
        let meta = self.meta();
        let c = &self.shared.counters;
        let (hits, misses) = (c.hits.load(Ordering::Relaxed), c.misses.load(Ordering::Relaxed));
        Ok(TableStats {
            name: self.shared.name.clone(),
            dim: self.shared.row_dim as u32,
            dtype: meta.dtype.name(),
            rows,
            capacity: (self.shared.load_factor_max * index.slot_count() as f64) as u64,
            slots: index.slot_count(),
            buckets: index.bucket_count(),
            load_factor: rows as f64 / index.slot_count() as f64,
            growth: self.shared.growth,
            grow_count: meta.grow_count,
            index_bytes: index.file_bytes(),
            rows_file_bytes: medium.alloc().file_bytes(),
            bytes_mapped: index.file_bytes()
                + match medium {
                    Medium::Mmap(m) => m.alloc().file_bytes(),
                    Medium::Block(_) => crate::format::ROWS_HEADER_BYTES as u64,
                },
            records_used: medium.alloc().next_record(),
            records_free: medium.alloc().free_records(),
            records_pending: medium.alloc().pending_records(),
            probe_histogram: index.probe_histogram(),
            recovered: self.shared.recovered.clone(),
            medium: medium.kind().name(),
            placement: self.shared.placement.name(),
            direct_io: match medium {
                Medium::Block(m) => Some(m.direct()),
                Medium::Mmap(_) => None,
            },
            io_align: match medium {
                Medium::Block(m) => Some(m.align()),
                Medium::Mmap(_) => None,
            },
            io: match medium {
                Medium::Block(m) => Some(m.engine().stats()),
                Medium::Mmap(_) => None,
            },
            optimizer: self.optimizer(),
            cache_hits: hits,
            cache_misses: misses,
            cache_hit_rate: (hits + misses > 0 && self.shared.placement != Placement::Bypass)
                .then(|| hits as f64 / (hits + misses) as f64),
            medium_rows_read: c.rows_read.load(Ordering::Relaxed),
            lookahead_rows: c.lookahead_rows.load(Ordering::Relaxed),
            staleness_bound: self.staleness_bound(),
            holds_outstanding: self.shared.holds.as_ref().map_or(0, |h| h.outstanding().0),
            holding_workers: self.shared.holds.as_ref().map_or(0, |h| h.outstanding().1),
            lifecycle: self.shared.lifecycle.as_ref().map(Lifecycle::stats),
        })
    }
}

/// The mmap medium of a table on the fast path (only mmap tables without a cache take it).
#[inline(always)]
fn mmap_of(m: &Medium) -> &MmapMedium {
    match m {
        Medium::Mmap(m) => m,
        Medium::Block(_) => unreachable!("block tables take the tiered path"),
    }
}

/// Elements of a table's records: the row, then its optimizer state.
fn record_dim(meta: &TableMeta) -> usize {
    meta.dim as usize + meta.optimizer.state_len(meta.dim as usize)
}

/// `MADV_RANDOM` on a table's mappings when the store asks for it.
fn advise(tier: &Tier, index: &Index, medium: &Medium) {
    if tier.mmap_random {
        index.advise_random();
        if let Medium::Mmap(m) = medium {
            m.advise_random();
        }
    }
}
