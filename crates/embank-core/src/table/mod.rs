//! A table: the index and the medium of one embedding table under its tiers, and
//! its batch operations. This file holds the handle, the parts it is assembled
//! from (each owning its state and lock: `Config`, `Files`, the `TierStack`,
//! `Training`, the checkpoints, `Repairs`, the lifecycle) and the public batch
//! calls; the work behind them lives beside it, one job per file:
//!
//! | file | job |
//! | --- | --- |
//! | `write.rs` | the write protocol: every change of a key's index slot |
//! | `read.rs` | reads: the lock-free fast path of mapped media and the tiered path (tiers → index → medium) |
//! | `tiered.rs` | writes through the tiers: dirty rows, write-through, write-back, lookahead, pinned loads |
//! | `grow.rs` | room in the index: the load check, the rebuild into a larger index (built in DRAM, written once), the retry loop |
//! | `load.rs` | bulk loads: rows written in runs, the next index built in DRAM and installed once |
//! | `open.rs` | create, open with recovery and rollback, clean close, the maintenance hooks |
//! | `repair.rs` | the background repair after a killed process: index pass, free list, key count |
//! | `export.rs` | full, paged and checkpoint exports, the keys changed since a checkpoint |
//! | `serve.rs` | zero-copy reads for the server |
//! | `evict.rs` | admission and eviction around the batch calls |
//! | `pooled.rs` | `lookup_pooled`: bags pooled through the store's pooled-bag cache |
//! | `stats.rs` | the numbers |
//!
//! Reads take no lock: they pin an epoch, resolve keys in the index (prefetching
//! the home buckets a few keys ahead) and copy rows out. Writes are
//! copy-on-write: new records are written, then published key by key through
//! `write.rs`; old records are retired to the epoch collector.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{MappedRwLockReadGuard, Mutex, RwLock, RwLockReadGuard};

use crate::catalog::{Catalog, MissingDefault, Placement, TableMeta};
use crate::checkpoint::TableCheckpoints;
use crate::error::{Error, ErrorKind, Result};
use crate::index::Index;
use crate::init::Initializer;
use crate::layout::RecordLayout;
use crate::lifecycle::Lifecycle;
use crate::medium::{AnyMedium, Medium, MediumKind};
use crate::optim::{sum_duplicates, Optimizer};
use crate::runtime::Runtime;
use crate::staleness::Holds;
use crate::tier::TierStack;

mod evict;
mod export;
mod grow;
mod load;
mod open;
mod options;
mod pooled;
mod read;
mod repair;
mod serve;
mod state;
mod stats;
mod tiered;
mod write;

pub use crate::pooled::check_bags;
pub(crate) use export::AtExport;
pub use export::ExportCursor;
pub use grow::PlaceReport;
pub use load::{LoadReport, Loader};
pub(crate) use options::RepairMode;
pub(crate) use options::LOAD_FACTOR_TARGET;
pub use options::{validate_name, RecoverStats, TableOptions, TableStats, DIM_MAX};

/// Writer stripes per table: writers of keys in different stripes never wait on each other.
const STRIPES: usize = 1024;
const _: () = assert!(STRIPES.is_power_of_two());

/// The files of an open table.
struct State {
    index: Index,
    medium: AnyMedium,
    /// Which `index.<generation>.ebi` is `index` (the catalog names it too: the rebuild
    /// that bumps it writes the catalog first).
    generation: u64,
}

/// Row counts by where reads found them.
#[derive(Default)]
struct ReadCounters {
    hits: AtomicU64,
    misses: AtomicU64,
    rows_read: AtomicU64,
    lookahead_rows: AtomicU64,
    /// Hot placements done ([`Table::place_hot`]).
    placements: AtomicU64,
}

/// What a table is, fixed at open: the settings of its catalog entry its paths read,
/// resolved. What changes (the learning rate, the index generation) lives with the
/// part that changes it, and the catalog keeps the durable entry.
struct Config {
    id: u32,
    name: Arc<str>,
    dir: PathBuf,
    /// Row dim, optimizer state, element type: what a record holds.
    layout: RecordLayout,
    init: Initializer,
    seed: u64,
    missing: MissingDefault,
    growth: bool,
    load_factor_max: f64,
    medium: MediumKind,
    /// Resolved: never `Auto`.
    placement: Placement,
}

/// The index and the medium, and the locks of their writers.
struct Files {
    /// `None` once the table is closed or dropped.
    state: RwLock<Option<State>>,
    stripes: Box<[Mutex<()>]>,
    /// One write-back at a time per table, so `flush` waits for one in flight elsewhere.
    write_back_lock: Mutex<()>,
}

/// Training: the optimizer (its one copy in memory), the table's training step and the
/// workers' staleness holds.
struct Training {
    optimizer: Mutex<Optimizer>,
    /// The training step of the last update (0: none yet): the bias-correction step of
    /// the optimizers that [use the table's step](Optimizer::uses_table_step), advanced
    /// only for those. Durable in the catalog at `flush` and close, and in each checkpoint
    /// (a rollback returns to the checkpoint's).
    step: AtomicU64,
    /// One `push_grad` at a time per table (read, update, write of each row).
    grad_lock: Mutex<()>,
    /// Staleness holds of workers (`None`: ASP).
    holds: Option<Holds>,
}

/// Repair after a crash.
struct Repairs {
    /// What the open repaired, when it repaired everything itself (a background repair
    /// keeps its own, see `repair`).
    recovered: Option<RecoverStats>,
    /// The background repair after a crash (`None` when the open repaired everything).
    background: Option<Arc<repair::Repair>>,
    /// A rollback on first touch not yet finished (`index/undo.rs`).
    rollback: Mutex<Option<crate::checkpoint::PendingRollback>>,
}

/// A table, assembled from parts that each own their state and lock.
struct Shared {
    config: Config,
    catalog: Arc<Catalog>,
    runtime: Arc<Runtime>,
    files: Files,
    /// The only place the table meets its tiers.
    tiers: TierStack,
    training: Training,
    checkpoints: TableCheckpoints,
    repairs: Repairs,
    /// Admission and eviction state (`None`: the table has neither).
    lifecycle: Option<Lifecycle>,
    /// Sample of the keys reads ask for (automatic hot placement; `None`: off).
    hot: Option<crate::hot::HotSampler>,
    counters: ReadCounters,
}

/// A handle to one table; cheap to clone, usable from many threads.
#[derive(Clone)]
pub struct Table {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table")
            .field("name", &self.shared.config.name)
            .field("dim", &self.shared.config.layout.dim)
            .finish()
    }
}

impl Table {
    pub fn name(&self) -> &str {
        &self.shared.config.name
    }

    pub fn dim(&self) -> usize {
        self.shared.config.layout.dim
    }

    /// The table's id in the catalog.
    pub(crate) fn id(&self) -> u32 {
        self.shared.config.id
    }

    /// What a record holds: the row's dim and element type, the optimizer state.
    pub fn layout(&self) -> RecordLayout {
        self.shared.config.layout
    }

    /// The table's optimizer (with its current learning rate).
    pub fn optimizer(&self) -> Optimizer {
        *self.shared.training.optimizer.lock()
    }

    /// The training step of the table's last update (0: none yet; see
    /// [`push_grad_at`](Self::push_grad_at)). Always 0 for optimizers that count their
    /// steps per row or have none.
    pub fn optimizer_step(&self) -> u64 {
        self.shared.training.step.load(Ordering::Acquire)
    }

    /// Sets the table's step (at open: the catalog's, or a rolled-back checkpoint's).
    pub(crate) fn set_optimizer_step(&self, step: u64) {
        self.shared.training.step.store(step, Ordering::Release);
    }

    /// Writes the table's step into its catalog entry if it differs (flush and close).
    fn save_optimizer_step(&self) -> Result<()> {
        let step = self.optimizer_step();
        if self.shared.catalog.table(self.shared.config.id).is_none_or(|m| m.optimizer_step == step) {
            return Ok(());
        }
        self.update_meta(|m| m.optimizer_step = step)
    }

    /// Changes the optimizer's learning rate; durable at once (the catalog is rewritten).
    pub fn set_lr(&self, lr: f32) -> Result<()> {
        let new = self.optimizer().with_lr(lr)?;
        self.update_meta(|m| m.optimizer = new)?;
        *self.shared.training.optimizer.lock() = new;
        Ok(())
    }

    /// Changes this table's catalog entry, durably (the catalog is rewritten).
    fn update_meta(&self, change: impl FnOnce(&mut TableMeta)) -> Result<()> {
        let id = self.shared.config.id;
        self.shared.catalog.update(|c| {
            let m = c.tables.iter_mut().find(|m| m.id == id).ok_or_else(|| self.dropped())?;
            change(m);
            Ok(())
        })
    }

    fn dropped(&self) -> Error {
        Error::new(ErrorKind::Closed, format!("table {:?} was dropped", self.shared.config.name))
    }

    /// The table's catalog entry (the catalog keeps the one copy; the training step is
    /// the live one, which the catalog gets at `flush` and close).
    pub fn meta(&self) -> TableMeta {
        let id = self.shared.config.id;
        let mut meta = self.shared.catalog.table(id).unwrap_or_else(|| {
            // Dropped from the catalog: its entry as it was is still this handle's.
            let c = &self.shared.config;
            TableMeta {
                id,
                name: c.name.to_string(),
                dim: c.layout.dim as u32,
                dtype: c.layout.dtype,
                init: c.init,
                seed: c.seed,
                growth: c.growth,
                load_factor_max: c.load_factor_max,
                missing: c.missing,
                index_generation: self.shared.files.state.read().as_ref().map_or(0, |s| s.generation),
                grow_count: 0,
                medium: c.medium,
                placement: c.placement,
                optimizer: self.optimizer(),
                staleness_bound: self.staleness_bound(),
                lease_seconds: self.shared.training.holds.as_ref().map_or(60.0, |h| h.lease().as_secs_f64()),
                lifecycle: self.shared.lifecycle.as_ref().map(|l| l.opts.clone()).unwrap_or_default(),
                optimizer_step: 0,
            }
        });
        meta.optimizer_step = self.optimizer_step();
        meta
    }

    /// Live rows.
    pub fn len(&self) -> Result<u64> {
        Ok(self.state()?.index.len())
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Rows of `keys` into `out` (`keys.len() * dim` elements); creates missing rows with the initializer.
    pub fn pull(&self, keys: &[u64], out: &mut [f32]) -> Result<()> {
        self.check_rows("pull", keys.len(), out.len())?;
        if let Some(h) = &self.shared.hot {
            h.observe(keys);
        }
        if let Some(life) = &self.shared.lifecycle {
            return self.pull_lifecycle(life, keys, out);
        }
        if !self.shared.config.layout.has_state() {
            return self.pull_records(keys, out);
        }
        let mut records = vec![0f32; keys.len() * self.shared.config.layout.elems()];
        self.pull_records(keys, &mut records)?;
        self.copy_rows(&records, out);
        Ok(())
    }

    /// Like [`pull`](Self::pull) but never creates rows: missing keys get the table's
    /// missing-row default and `found[i] = false`.
    pub fn lookup(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        if let Some(h) = &self.shared.hot {
            h.observe(keys);
        }
        self.check_rows("lookup", keys.len(), out.len())?;
        if found.len() != keys.len() {
            return Err(Error::invalid(format!("lookup: {} keys but a found-mask of {}", keys.len(), found.len())));
        }
        let layout = self.shared.config.layout;
        let missing = if layout.has_state() {
            let mut records = vec![0f32; keys.len() * layout.elems()];
            let missing = self.lookup_records(keys, &mut records, found)?;
            self.copy_rows(&records, out);
            missing
        } else {
            self.lookup_records(keys, out, found)?
        };
        self.fill_missing(keys, &missing, out);
        if let Some(life) = &self.shared.lifecycle {
            life.touch((0..keys.len()).filter(|&i| found[i]).map(|i| keys[i]));
        }
        Ok(())
    }

    /// Like [`lookup`](Self::lookup) but each row comes as stored: `row_bytes()` bytes
    /// a key (`RecordLayout::row_bytes`) in the table's element type, not decoded to
    /// `f32` (`f32`: the little-endian floats; `f16`: IEEE halves; `int8`: `dim` bytes,
    /// then `scale` and `bias` as `f32`, see [`RecordLayout`](crate::RecordLayout)). For a consumer that
    /// decodes rows itself (a GPU kernel, after a copy of a quarter of the bytes):
    /// [`RecordLayout::decode_row`] gives exactly what [`lookup`](Self::lookup) returns.
    /// Missing keys get the missing default, encoded, and `found[i] = false`. Tables behind
    /// a row cache or a shared tier read their rows decoded and encode them again (within
    /// the type's rounding of the decoded row; exact for `f32` and `f16`).
    pub fn lookup_stored(&self, keys: &[u64], out: &mut [u8], found: &mut [bool]) -> Result<()> {
        let layout = self.shared.config.layout;
        let (rb, dim) = (layout.row_bytes(), layout.dim);
        crate::layout::check_stored_lens(
            &self.shared.config.name,
            layout.dtype,
            dim,
            keys.len(),
            out.len(),
            found.len(),
        )?;
        if self.tiered() {
            let mut rows = vec![0f32; keys.len() * dim];
            self.lookup(keys, &mut rows, found)?;
            crate::layout::encode_rows(layout.dtype, dim, &rows, out);
            return Ok(());
        }
        if let Some(h) = &self.shared.hot {
            h.observe(keys);
        }
        let missing = {
            let st = self.state()?;
            let _pin = crossbeam_epoch::pin();
            self.gather_stored(&st, keys, out, found)?
        };
        if !missing.is_empty() {
            let missing_keys: Vec<u64> = missing.iter().map(|&i| keys[i]).collect();
            let mut rows = vec![0f32; missing.len() * dim];
            self.fill_missing(&missing_keys, &(0..missing.len()).collect::<Vec<_>>(), &mut rows);
            let mut encoded = vec![0u8; missing.len() * rb];
            crate::layout::encode_rows(layout.dtype, dim, &rows, &mut encoded);
            for (row, &i) in encoded.chunks_exact(rb).zip(&missing) {
                out[i * rb..(i + 1) * rb].copy_from_slice(row);
            }
        }
        if let Some(life) = &self.shared.lifecycle {
            life.touch((0..keys.len()).filter(|&i| found[i]).map(|i| keys[i]));
        }
        Ok(())
    }

    /// Bytes of one row as [`lookup_stored`](Self::lookup_stored) returns it.
    pub fn row_bytes(&self) -> usize {
        self.shared.config.layout.row_bytes()
    }

    /// Writes rows (insert or replace). With duplicate keys the last row wins.
    pub fn push(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        self.check_rows("push", keys.len(), rows.len())?;
        if let Some(i) = crate::optim::first_non_finite(rows) {
            return Err(Error::invalid(format!(
                "push: row of key {} holds a non-finite value ({}); nothing was written",
                keys[i / self.dim()],
                rows[i]
            )));
        }
        match &self.shared.lifecycle {
            Some(life) => self.push_lifecycle(life, keys, || self.push_unchecked(keys, rows)),
            None => self.push_unchecked(keys, rows),
        }
    }

    /// [`push`](Self::push) of checked rows: a pushed row starts its optimizer state afresh.
    fn push_unchecked(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        let layout = self.shared.config.layout;
        if !layout.has_state() {
            return self.push_records(keys, rows);
        }
        let (w, d) = (layout.elems(), layout.dim);
        let mut records = vec![0f32; keys.len() * w];
        let opt = self.optimizer();
        for (rec, row) in records.chunks_exact_mut(w).zip(rows.chunks_exact(d)) {
            rec[..d].copy_from_slice(row);
            opt.init_state(&mut rec[d..]);
        }
        self.push_records(keys, &records)
    }

    /// Deletes keys; returns how many were present.
    pub fn delete(&self, keys: &[u64]) -> Result<u64> {
        let n = self.remove(keys)?;
        if let Some(life) = &self.shared.lifecycle {
            life.forget(keys);
        }
        Ok(n)
    }

    /// Applies the table's optimizer to the rows of `keys` with gradients `grads`
    /// (`keys.len() * dim` elements). Gradients of duplicate keys are summed first, so
    /// each row gets one update per call. Missing rows are created with the
    /// initializer, then updated. Non-finite gradients are refused with nothing written.
    ///
    /// The call is a training step of its own: an optimizer that [uses the table's
    /// step](Optimizer::uses_table_step) updates with the table's last step + 1. Where
    /// one training step pushes more than once (several workers or ranks, several
    /// tables some steps skip), pass the step with [`push_grad_at`](Self::push_grad_at).
    pub fn push_grad(&self, keys: &[u64], grads: &[f32]) -> Result<()> {
        self.push_grad_with(keys, grads, false, None)
    }

    /// [`push_grad`](Self::push_grad) as part of training step `step` (counted from 1, as
    /// FBGEMM's `iter`: every row updated in it is bias-corrected with t = `step`, however
    /// many calls the step makes); the table's step becomes `step` if that is later.
    /// `distinct`: as [`push_grad_distinct`](Self::push_grad_distinct). Optimizers that
    /// count steps per row, or have none, ignore it.
    pub fn push_grad_at(&self, keys: &[u64], grads: &[f32], step: u64, distinct: bool) -> Result<()> {
        if step == 0 {
            return Err(Error::invalid("push_grad: training steps count from 1, got step 0; nothing was written"));
        }
        if distinct {
            self.check_distinct(keys);
        }
        self.push_grad_with(keys, grads, distinct, Some(step))
    }

    /// [`push_grad`](Self::push_grad) of keys the caller knows are distinct (a fused
    /// collection's backward deduplicates them): no pass to sum duplicates.
    pub fn push_grad_distinct(&self, keys: &[u64], grads: &[f32]) -> Result<()> {
        self.check_distinct(keys);
        self.push_grad_with(keys, grads, true, None)
    }

    fn check_distinct(&self, keys: &[u64]) {
        strict_assert!(
            keys.iter().collect::<std::collections::HashSet<_>>().len() == keys.len(),
            "push_grad_distinct of keys with duplicates"
        );
    }

    fn push_grad_with(&self, keys: &[u64], grads: &[f32], distinct: bool, step: Option<u64>) -> Result<()> {
        // Read, update and write as one step for checkpoints.
        let _gate = self.shared.runtime.gate.batch();
        self.check_rows("push_grad", keys.len(), grads.len())?;
        let d = self.dim();
        if let Some(i) = crate::optim::first_non_finite(grads) {
            return Err(Error::invalid(format!(
                "push_grad: gradient of key {} holds a non-finite value ({}); nothing was written",
                keys[i / d],
                grads[i]
            )));
        }
        let opt = self.optimizer();
        if self.shared.config.layout.dtype == crate::format::DType::Int8 {
            return Err(Error::new(
                crate::error::ErrorKind::Unsupported,
                format!(
                    "push_grad: table {:?} is int8, a serving type (8-bit rows have no room for small \
                     updates); train in f32 or f16 and serve as int8. Nothing was written",
                    self.shared.config.name
                ),
            ));
        }
        if opt == Optimizer::None {
            return Err(Error::config(format!(
                "push_grad: table {:?} has no optimizer; create it with one (e.g. optimizer=Adagrad)",
                self.shared.config.name
            )));
        }
        use std::borrow::Cow;
        let (uniq, sums): (Cow<'_, [u64]>, Cow<'_, [f32]>) = if distinct {
            (Cow::Borrowed(keys), Cow::Borrowed(grads))
        } else {
            let (u, s) = sum_duplicates(keys, grads, d);
            (Cow::Owned(u), Cow::Owned(s))
        };
        let _one = self.shared.training.grad_lock.lock();
        // The table's step moves (under the gradient lock) only once the update is written.
        let table_step = opt.uses_table_step().then(|| step.unwrap_or(self.optimizer_step() + 1));
        let applied = |_: ()| {
            if let Some(t) = table_step {
                self.shared.training.step.fetch_max(t, Ordering::AcqRel);
            }
        };
        let t = table_step.unwrap_or(0);
        let Some(life) = &self.shared.lifecycle else { return self.apply_grads(&uniq, &sums, opt, t).map(applied) };
        let (uniq, sums) = self.grads_lifecycle(life, uniq.into_owned(), sums.into_owned())?;
        self.apply_grads(&uniq, &sums, opt, t).map(applied)?;
        // A step ends: its rows are touched at the new step (TTL ages count from it).
        life.step();
        life.touch(uniq.iter().copied());
        Ok(())
    }

    /// Reads, updates and writes back the records of distinct `uniq` keys.
    fn apply_grads(&self, uniq: &[u64], sums: &[f32], opt: Optimizer, step: u64) -> Result<()> {
        let (w, d) = (self.shared.config.layout.elems(), self.dim());
        let mut records = vec![0f32; uniq.len() * w];
        self.pull_records(uniq, &mut records)?;
        for (rec, g) in records.chunks_exact_mut(w).zip(sums.chunks_exact(d)) {
            opt.apply(rec, g, step);
        }
        if let Some(i) = crate::optim::first_non_finite(&records) {
            return Err(Error::invalid(format!(
                "push_grad: the update of key {} is not finite (learning rate too large?); nothing was written",
                uniq[i / w]
            )));
        }
        self.push_records(uniq, &records)
    }

    /// [`pull`](Self::pull) by a training worker under the table's staleness bound: each
    /// distinct key gets a hold for `worker` until its [`push_grad_held`](Self::push_grad_held);
    /// a key whose holds already exceed the bound waits for a push (at most `timeout`, then
    /// `Timeout` naming the key). Without a bound (ASP) it is a plain pull.
    pub fn pull_held(&self, worker: u64, keys: &[u64], out: &mut [f32], timeout: std::time::Duration) -> Result<()> {
        self.check_rows("pull", keys.len(), out.len())?;
        let Some(holds) = &self.shared.training.holds else { return self.pull(keys, out) };
        holds.acquire(worker, keys, timeout, &self.shared.config.name)?;
        self.pull(keys, out).inspect_err(|_| holds.give_back(worker, keys))
    }

    /// [`push_grad`](Self::push_grad) by a training worker: once applied, gives back the
    /// worker's hold of each distinct key (if it has one). If the update fails the holds
    /// stay, so the worker can retry.
    pub fn push_grad_held(&self, worker: u64, keys: &[u64], grads: &[f32]) -> Result<()> {
        self.push_grad_held_at(worker, keys, grads, None)
    }

    /// [`push_grad_held`](Self::push_grad_held) as part of training step `step` (see
    /// [`push_grad_at`](Self::push_grad_at); `None`: a step of its own).
    pub fn push_grad_held_at(&self, worker: u64, keys: &[u64], grads: &[f32], step: Option<u64>) -> Result<()> {
        match step {
            Some(s) => self.push_grad_at(keys, grads, s, false),
            None => self.push_grad(keys, grads),
        }?;
        if let Some(holds) = &self.shared.training.holds {
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
        self.shared.training.holds.as_ref().map_or(0, |h| h.release(worker))
    }

    /// The staleness bound (`None`: ASP).
    pub fn staleness_bound(&self) -> Option<u32> {
        self.shared.training.holds.as_ref().map(Holds::bound)
    }

    /// Asks the maintenance thread to load these rows into the row cache (or, on an
    /// uncached mmap table, into the page cache), so a later pull of them hits. Returns
    /// at once; false if the request queue was full and the hint was dropped.
    pub fn lookahead(&self, keys: &[u64]) -> Result<bool> {
        drop(self.state()?);
        if keys.is_empty() {
            return Ok(true);
        }
        Ok(self.shared.runtime.lookahead(self.maintained(), keys.to_vec()))
    }

    /// Makes every write before this call durable: rows first, then the index.
    pub fn flush(&self) -> Result<()> {
        self.save_optimizer_step()?;
        self.write_back_all()?;
        self.shared.checkpoints.flush()?;
        let st = self.state()?;
        let State { index, medium, .. } = &*st;
        medium.flush()?;
        index.flush()
    }

    /// Records held for retained checkpoints.
    pub fn held_records(&self) -> u64 {
        self.shared.checkpoints.held_count()
    }

    // Helpers shared by the files of this module.

    fn state(&self) -> Result<MappedRwLockReadGuard<'_, State>> {
        RwLockReadGuard::try_map(self.shared.files.state.read(), Option::as_ref).map_err(|_| self.closed())
    }

    fn closed(&self) -> Error {
        Error::new(ErrorKind::Closed, format!("table {:?} is closed", self.shared.config.name))
    }

    /// True when reads and writes take the tiered path (row cache and/or block medium)
    /// instead of the mmap fast path.
    #[inline]
    fn tiered(&self) -> bool {
        !self.shared.config.medium.is_mapped() || self.shared.config.placement != Placement::Bypass
    }

    /// The tiers this table reads and writes through.
    #[inline(always)]
    fn tiers(&self) -> &TierStack {
        &self.shared.tiers
    }

    #[inline(always)]
    fn stripe(&self, hash: u64) -> &Mutex<()> {
        // The stripe comes from bits the home bucket does not use first.
        &self.shared.files.stripes[((hash >> 40) as usize) & (STRIPES - 1)]
    }

    fn check_rows(&self, what: &str, keys: usize, rows: usize) -> Result<()> {
        let dim = self.dim();
        if rows != keys * dim {
            return Err(Error::invalid(format!(
                "{what}: table {:?} has dim {dim}, so {keys} keys need {} row elements, got {rows}{}",
                self.shared.config.name,
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

    /// Fills a new record: the initializer's row (as the element type stores it, so a
    /// pull that creates a row returns what later pulls read), then the optimizer's
    /// initial state.
    fn init_record(&self, key: u64, record: &mut [f32]) {
        let (row, state) = record.split_at_mut(self.dim());
        self.shared.config.init.fill(self.shared.config.seed, key, row);
        self.shared.config.layout.round_trip(row);
        self.optimizer().init_state(state);
    }

    /// Copies the row part of each record.
    fn copy_rows(&self, records: &[f32], out: &mut [f32]) {
        let (w, d) = (self.shared.config.layout.elems(), self.dim());
        for (rec, row) in records.chunks_exact(w).zip(out.chunks_exact_mut(d)) {
            row.copy_from_slice(&rec[..d]);
        }
    }

    /// Fills the rows at `positions` with the table's missing-row default.
    fn fill_missing(&self, keys: &[u64], positions: &[usize], out: &mut [f32]) {
        let dim = self.dim();
        for &i in positions {
            let row = &mut out[i * dim..(i + 1) * dim];
            match self.shared.config.missing {
                MissingDefault::Zeros => row.fill(0.0),
                MissingDefault::Value { value } => row.fill(value),
                MissingDefault::Init => self.shared.config.init.fill(self.shared.config.seed, keys[i], row),
            }
        }
    }
}
