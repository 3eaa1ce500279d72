//! A table's life: creation of its files, opening (with recovery after a crash and
//! rollback to a checkpoint), the clean close, and the hooks the store's
//! maintenance thread calls (`Maintained`).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Mutex, RwLock};

use super::options::{load_target, RecoverStats, RepairMode};
use super::repair::{self, Repair};
use super::{Config, Files, ReadCounters, Repairs, Shared, State, Table, Training, STRIPES};
use crate::catalog::{Catalog, Placement, TableMeta};
use crate::checkpoint::{self, CheckpointState, PendingRollback, TableCheckpoints};
use crate::error::{Error, Result};
use crate::index::{buckets_for, Index, RecoverReport};
use crate::lifecycle::Lifecycle;
use crate::medium::{AnyMedium, Medium};
use crate::runtime::{Maintained, Runtime};
use crate::staleness::Holds;
use crate::tier::{TierStack, TierUse};

pub(super) fn index_path(dir: &Path, generation: u64) -> PathBuf {
    dir.join(format!("index.{generation}.ebi"))
}

/// Where a bulk load builds and persists the next generation before it is installed
/// (renamed to [`index_path`]): a name no growth uses, so neither removes the other's
/// file. A left-over like any other index of another generation.
pub(super) fn loading_index_path(dir: &Path, generation: u64) -> PathBuf {
    dir.join(format!("index.{generation}.load.ebi"))
}

/// Resolves `Auto` and checks that a cached placement has a cache to use.
fn resolve_placement(meta: &TableMeta, runtime: &Runtime, creating: bool) -> Result<Placement> {
    let has_cache = !runtime.tiers.near().is_empty();
    Ok(match (meta.placement, meta.medium) {
        (Placement::Auto, m) if !m.is_mapped() && has_cache => Placement::Cache,
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

/// The store's paging advice on a table's mappings.
fn advise(runtime: &Runtime, st: &State) {
    st.index.advise(runtime.mmap_advice);
    st.medium.advise(runtime.mmap_advice);
    st.medium.set_row_writes(runtime.row_writes);
}

/// Index files of other generations are left-overs of an interrupted rebuild.
fn remove_other_indexes(dir: &Path, generation: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let current = index_path(dir, generation);
    for entry in entries.flatten() {
        let p = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("index.") && name.ends_with(".ebi") && p != current {
            tracing::info!(path = %p.display(), "removing index left by an interrupted rebuild");
            let _ = std::fs::remove_file(&p);
        }
    }
}

/// After a crash (or with `verify`, or for a rollback): repairs the index, rolls back to
/// a checkpoint if asked, rebuilds the free list from the index and the held records.
fn recover(
    dir: &Path,
    name: &str,
    (index, medium): (&Index, &AnyMedium),
    verify_all: bool,
    rollback_to: Option<u64>,
    ckpt: CheckpointState,
) -> Result<RecoverStats> {
    let t0 = Instant::now();
    let alloc = medium.alloc();
    tracing::info!(table = %name, "table was not closed cleanly; repairing index and free list");
    // On a mapped medium every slot's record key is checked (a memory read); elsewhere
    // that would be one read per row, so only interrupted buckets' records are read
    // (and every record with `verify`).
    let mapped = medium.as_mapped().is_some();
    let mut io_error = None;
    let report = index.recover(|key, ptr, interrupted| {
        if !alloc.is_valid_ptr(ptr) {
            return false;
        }
        if !(mapped || interrupted || verify_all) {
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
        return Err(e.context(format!("recovering table {name:?}")));
    }
    if let Some(to) = rollback_to {
        checkpoint::rollback(dir, index, to).map_err(|e| e.context(format!("table {name:?}")))?;
    }
    let mut live = alloc.new_bitmap();
    index.for_each(0, index.bucket_count(), |_, ptr| alloc.mark(&mut live, ptr));
    for ptrs in checkpoint::held_records(dir, ckpt)?.values() {
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
        ..Default::default()
    };
    tracing::info!(table = %name, ?stats, "repair done");
    Ok(stats)
}

/// What an open that repairs in the background hands the repair thread.
struct Background {
    repair: Arc<Repair>,
    live: Vec<u64>,
    limit: u64,
    /// A rollback on first touch, which the thread finishes before its pass.
    rollback: Option<PendingRollback>,
}

/// How the index's row numbers map to the medium's row pointers.
fn row_units(medium: &AnyMedium) -> crate::format::RowUnits {
    let alloc = medium.alloc();
    crate::format::RowUnits { base: alloc.ptr_of(0), unit: alloc.stride() }
}

/// After a killed process of this boot (or for a restore of a clean table): starts the
/// repair on first touch, rolls back to a checkpoint if asked (touching only the
/// journaled keys' buckets), and starts the free list's rebuild, which the background
/// thread finishes (`repair.rs`).
fn begin_background_repair(
    dir: &Path,
    name: &str,
    index: &mut Index,
    medium: &AnyMedium,
    rollback_to: Option<u64>,
    ckpt: CheckpointState,
) -> Result<Background> {
    let t0 = Instant::now();
    tracing::info!(table = %name, "table was not closed cleanly by a process of this boot; serving while it is repaired");
    index.begin_lazy_repair();
    let mut rollback = None;
    if let Some(to) = rollback_to {
        // A key goes back to the checkpoint when first touched: the open reads the
        // journal, not an index page per entry (`index/undo.rs`).
        rollback = checkpoint::begin_lazy_rollback(dir, index, to).map_err(|e| e.context(format!("table {name:?}")))?;
        if rollback.is_none() {
            checkpoint::rollback(dir, index, to).map_err(|e| e.context(format!("table {name:?}")))?;
        }
    }
    let ckpt = CheckpointState { undoing: rollback, ..ckpt };
    let alloc = medium.alloc();
    let limit = alloc.begin_rebuild();
    let mut live = vec![0u64; limit.div_ceil(64) as usize];
    for ptrs in checkpoint::held_records(dir, ckpt)?.values() {
        for &p in ptrs {
            alloc.mark_below(&mut live, limit, p);
        }
    }
    // The records a rollback on first touch returns keys to are live (kept even where an
    // undo fails: the next open's rollback needs them).
    for p in index.undo_records() {
        alloc.mark_below(&mut live, limit, p);
    }
    let open = RecoverStats {
        seconds: t0.elapsed().as_secs_f64(),
        rollback_on_touch: rollback.is_some(),
        ..Default::default()
    };
    Ok(Background { repair: Repair::new(open), live, limit, rollback })
}

impl Table {
    /// Creates the files of a new table in `dir` (which must exist and be empty).
    pub(crate) fn create(
        dir: &Path,
        meta: TableMeta,
        capacity: u64,
        catalog: Arc<Catalog>,
        runtime: Arc<Runtime>,
    ) -> Result<Table> {
        let placement = resolve_placement(&meta, &runtime, true)?;
        let medium = AnyMedium::create(dir, meta.medium, meta.layout(), &runtime.io)?;
        let index = Index::create(
            &index_path(dir, meta.index_generation),
            buckets_for(capacity, load_target(meta.load_factor_max)),
            meta.seed,
            row_units(&medium),
        )?;
        index.flush()?;
        medium.flush()?;
        let checkpoints = TableCheckpoints::create(dir, runtime.gate.interval())?;
        crate::fsutil::sync_dir(dir)?;
        let st = State { index, medium, generation: meta.index_generation };
        advise(&runtime, &st);
        Ok(Self::new(dir, meta, st, catalog, (None, None, None), runtime, placement, checkpoints))
    }

    /// Opens the files of a table; repairs them first if the last user did not close cleanly.
    /// `checkpoint_steps`: the table's training step at each retained checkpoint, by seq
    /// (a rollback returns to it; absent: 0).
    pub(crate) fn open(
        dir: &Path,
        meta: TableMeta,
        catalog: Arc<Catalog>,
        mode: RepairMode,
        runtime: Arc<Runtime>,
        ckpt: CheckpointState,
        checkpoint_steps: &std::collections::BTreeMap<u64, u64>,
    ) -> Result<Table> {
        let placement = resolve_placement(&meta, &runtime, false)?;
        remove_other_indexes(dir, meta.index_generation);
        let medium = AnyMedium::open(dir, meta.medium, meta.layout(), &runtime.io)
            .map_err(|e| e.context(dir.display().to_string()))?;
        let mut index = Index::open_for_rows(&index_path(dir, meta.index_generation), row_units(&medium))?;
        let closed_cleanly = index.was_closed_cleanly();
        let clean = closed_cleanly && medium.alloc().load_free_list(index.free_list_generation());
        // After a crash the table returns to its latest checkpoint; a restore to the one asked.
        let rollback_to = ckpt.restore_to.or((!clean && ckpt.latest > 0).then_some(ckpt.latest));
        let needs_repair = !clean || mode.verify || rollback_to.is_some();
        // A process killed in this boot left every write in the page cache: buckets are
        // whole but for those it was changing, so the table can serve while they are found.
        let background =
            needs_repair && mode.background && !mode.verify && (closed_cleanly || index.opened_in_this_boot());
        let (recovered, background) = if background {
            let b = begin_background_repair(dir, &meta.name, &mut index, &medium, rollback_to, ckpt)?;
            (None, Some(b)) // its stats live in the repair (`recover_stats`)
        } else if needs_repair {
            (Some(recover(dir, &meta.name, (&index, &medium), mode.verify, rollback_to, ckpt)?), None)
        } else {
            (None, None)
        };
        let st = State { index, medium, generation: meta.index_generation };
        let rollback = background.as_ref().and_then(|b| b.rollback);
        let checkpoints = TableCheckpoints::open(dir, CheckpointState { undoing: rollback, ..ckpt }, &st.index)?;
        st.index.mark_open()?;
        advise(&runtime, &st);
        let repair = background.as_ref().map(|b| Arc::clone(&b.repair));
        let step = match rollback_to {
            Some(seq) => checkpoint_steps.get(&seq).copied().unwrap_or(0),
            None => meta.optimizer_step,
        };
        let table = Self::new(dir, meta, st, catalog, (recovered, repair, rollback), runtime, placement, checkpoints);
        table.set_optimizer_step(step);
        if let Some(b) = background {
            repair::spawn(&table, b.repair, b.live, b.limit, mode.throttle);
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
        (recovered, repair, rollback): (Option<RecoverStats>, Option<Arc<Repair>>, Option<PendingRollback>),
        runtime: Arc<Runtime>,
        placement: Placement,
        checkpoints: TableCheckpoints,
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
        let config = Config {
            id: meta.id,
            name: Arc::from(meta.name.as_str()),
            dir: dir.to_owned(),
            layout: meta.layout(),
            init: meta.init,
            seed: meta.seed,
            missing: meta.missing,
            growth: meta.growth,
            load_factor_max: meta.load_factor_max,
            medium: meta.medium,
            placement,
        };
        let uses = TierUse {
            near: matches!(placement, Placement::Cache | Placement::Pin),
            shared: placement == Placement::Cache,
            pinned: placement == Placement::Pin,
        };
        let tiers =
            TierStack::new(Arc::clone(&runtime.tiers), uses, config.id, Arc::clone(&config.name), config.layout);
        let table = Table {
            shared: Arc::new(Shared {
                config,
                catalog,
                runtime: Arc::clone(&runtime),
                files: Files {
                    state: RwLock::new(Some(state)),
                    stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
                    write_back_lock: Mutex::new(()),
                },
                tiers,
                training: Training {
                    optimizer: Mutex::new(meta.optimizer),
                    step: AtomicU64::new(meta.optimizer_step),
                    grad_lock: Mutex::new(()),
                    holds,
                },
                checkpoints,
                repairs: Repairs { recovered, background: repair, rollback: Mutex::new(rollback) },
                lifecycle,
                hot: runtime.hot.as_ref().map(crate::hot::HotSampler::new),
                counters: ReadCounters::default(),
            }),
        };
        runtime.register(table.maintained());
        table
    }

    /// The maintenance thread's handle (does not keep the table alive).
    pub(super) fn maintained(&self) -> std::sync::Weak<dyn Maintained> {
        let weak: std::sync::Weak<Shared> = Arc::downgrade(&self.shared);
        weak
    }

    /// Flushes, saves the free list and marks the files closed cleanly. Further calls
    /// on any handle of this table fail with `Closed`.
    pub(crate) fn close(&self) -> Result<()> {
        if self.shared.files.state.read().is_none() {
            return Ok(());
        }
        // The free list and the key count are whole only once a background repair is done.
        self.wait_repaired();
        // A rollback that could not return every key leaves the table not closed cleanly
        // (the next open rolls back again, and says why it cannot).
        self.finish_rollback()?;
        self.save_optimizer_step()?;
        self.write_back_all()?;
        let mut guard = self.shared.files.state.write();
        let Some(st) = guard.take() else { return Ok(()) };
        self.tiers().drop_table();
        st.medium.flush()?;
        let generation = st.index.free_list_generation() + 1;
        st.medium.alloc().save_free_list(generation)?;
        st.medium.flush()?;
        st.index.mark_closed(generation)?;
        Ok(())
    }

    /// Closes without saving anything (the table is being dropped).
    pub(crate) fn detach(&self) {
        self.shared.files.state.write().take();
        self.tiers().drop_table();
    }

    /// Starts the interval of checkpoint `seq` (the store's gate is held exclusively):
    /// returns the journal it replaces.
    pub(crate) fn start_interval(&self, seq: u64) -> Result<Option<Arc<crate::journal::Journal>>> {
        self.shared.checkpoints.start_interval(seq)
    }

    /// Checkpoint `seq` is no longer retained: records held for it return to the
    /// allocator, coldest last (its journal is deleted by the housekeeping job).
    pub(crate) fn drop_interval(&self, seq: u64) -> Result<()> {
        let freed = self.shared.checkpoints.drop_interval(seq);
        if !freed.is_empty() {
            let st = self.state()?;
            let guard = crossbeam_epoch::pin();
            st.medium.alloc().retire_cold(&guard, freed);
        }
        Ok(())
    }

    /// Hands post-checkpoint file work to the maintenance thread.
    pub(crate) fn housekeep_later(&self, dropped: Vec<u64>, old: Option<Arc<crate::journal::Journal>>) {
        let me: Arc<dyn Maintained> = Arc::clone(&self.shared) as Arc<dyn Maintained>;
        self.shared.runtime.housekeep(me, dropped, old);
    }
}

/// The table as the maintenance thread sees it (`runtime.rs` does not import the table).
impl Maintained for Shared {
    fn name(&self) -> String {
        self.config.name.to_string()
    }

    fn write_back(self: Arc<Self>, max: usize) -> Result<usize> {
        Table { shared: self }.write_back(max)
    }

    fn has_ttl(&self) -> bool {
        self.lifecycle.as_ref().is_some_and(|l| l.opts.ttl_steps.is_some() || l.opts.ttl_seconds.is_some())
    }

    fn evict_expired(self: Arc<Self>) -> Result<u64> {
        Table { shared: self }.evict_expired()
    }

    fn warm(self: Arc<Self>, keys: &[u64]) -> Result<()> {
        Table { shared: self }.warm(keys)
    }

    fn hot_round(self: Arc<Self>, opts: &crate::hot::HotOptions) -> Result<bool> {
        let Some(sampler) = &self.hot else { return Ok(false) };
        {
            let mut last = sampler.last_round.lock();
            if last.is_some_and(|t| t.elapsed().as_secs_f64() < opts.every_seconds) {
                return Ok(false);
            }
            *last = Some(std::time::Instant::now());
        }
        let top = sampler.top(opts.keys);
        if top.is_empty() {
            return Ok(false);
        }
        let table = Table { shared: self };
        let (home, _) = table.home_fraction(&top)?;
        if home >= opts.min_home_fraction {
            return Ok(false);
        }
        table.place_hot(&top)?;
        Ok(true)
    }

    fn housekeep(self: Arc<Self>, dropped: &[u64]) {
        let open = self.files.state.read().is_some();
        self.checkpoints.housekeep(dropped, open, &self.config.name);
    }
}
