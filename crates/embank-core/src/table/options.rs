//! A table's options (what `create_table` takes and the catalog keeps), its name
//! rules and the numbers it reports.

use serde::Serialize;

use crate::catalog::{MissingDefault, Placement};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::init::Initializer;
use crate::io::IoStats;
use crate::lifecycle::{LifecycleOptions, LifecycleStats};
use crate::medium::MediumKind;
use crate::optim::Optimizer;

/// Largest `dim` a table may have.
pub const DIM_MAX: u32 = 4096;
/// Longest table name.
pub const NAME_BYTES_MAX: usize = 128;
/// Load the index is sized for at creation and after each rebuild: 19.8 bytes a key with
/// 17-slot buckets, 97.7 % of keys in their home bucket (2 M random keys; 14-slot buckets
/// at 0.7: 26.1 bytes, 98.2 %; `docs/BENCHMARKS.md`, "Scale").
pub(crate) const LOAD_FACTOR_TARGET: f64 = 0.76;
/// Lowest `load_factor_max` taken (the target before 17-slot buckets: a table made with
/// one opens as before; growth doubles the index, so a maximum under the target grows a
/// table a little before its capacity, never over and over).
const LOAD_FACTOR_MAX_MIN: f64 = 0.7;

const _: () = assert!(LOAD_FACTOR_TARGET < 0.95 && LOAD_FACTOR_MAX_MIN <= LOAD_FACTOR_TARGET);

/// The load a table's index is sized for: the target, or a little under the table's
/// `load_factor_max` where that is set below it (a table of growth off then holds its
/// capacity, as it did when the target was 0.7).
pub(crate) fn load_target(load_factor_max: f64) -> f64 {
    LOAD_FACTOR_TARGET.min(load_factor_max - 0.02)
}

/// Options of a new table. Every field has a default (see [`TableOptions::new`]).
///
/// Deserializable (a server's config file, a remote `create_table`): absent fields take
/// their defaults, unknown fields are refused, `dim` is required (0 fails validation).
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TableOptions {
    /// Elements per row, 1 to 4096. Required.
    pub dim: u32,
    /// Element type of stored rows: `f32` (default), `f16` (IEEE half, round to
    /// nearest even) or `int8` (row-wise 8-bit with an `f32` scale and bias, for
    /// serving: no optimizer). The API takes and returns `f32` for every type.
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
    /// Bounded staleness of workers' pulls ([`Table::pull_held`](crate::Table::pull_held)): `None` = ASP
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

    /// Options from a JSON object of the fields above (absent ones take their defaults),
    /// as the Python package and remote clients send them; errors name the field.
    pub fn from_json(json: &str) -> Result<TableOptions> {
        let value: serde_json::Value =
            serde_json::from_str(json).map_err(|e| Error::config(format!("bad table options {json:?}: {e}")))?;
        // The named parsers give the clearest errors for the names users type.
        if let Some(m) = value.get("medium").and_then(|v| v.as_str()) {
            MediumKind::parse(m)?;
        }
        if let Some(p) = value.get("placement").and_then(|v| v.as_str()) {
            Placement::parse(p)?;
        }
        let mut value = value;
        if let Some(d) = value.get("dtype").and_then(|v| v.as_str()) {
            // Accept the aliases (`float32`, `float16`, `half`) and name the choices on a typo.
            let name = DType::parse(d)?.name();
            value["dtype"] = serde_json::Value::String(name.to_owned());
        }
        serde_json::from_value(value).map_err(|e| Error::config(format!("bad table options: {e}")))
    }

    pub fn validate(&self) -> Result<()> {
        if self.dim == 0 || self.dim > DIM_MAX {
            return Err(Error::config(format!("dim must be between 1 and {DIM_MAX}, got {}", self.dim)));
        }
        if self.capacity == 0 {
            return Err(Error::config("capacity must be at least 1"));
        }
        if !(self.load_factor_max > LOAD_FACTOR_MAX_MIN && self.load_factor_max <= 0.98) {
            return Err(Error::config(format!(
                "load_factor_max must be in ({LOAD_FACTOR_MAX_MIN}, 0.98], got {}",
                self.load_factor_max
            )));
        }
        self.init.validate()?;
        self.optimizer.validate()?;
        if self.dtype == DType::Int8 && self.optimizer != Optimizer::None {
            return Err(Error::config(format!(
                "an int8 table is for serving and takes no optimizer (got {}): train in f32 or f16, \
                 then serve int8 rows (`embank import --dtype int8`, or push the trained rows)",
                self.optimizer.name()
            )));
        }
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
    /// Bytes from one record to the next on the medium (header, row as its dtype
    /// stores it, optimizer state, padding).
    pub record_bytes: u64,
    /// Address space mapped for the files (the rows file reserves more, unbacked).
    pub bytes_mapped: u64,
    pub records_used: u64,
    pub records_free: u64,
    pub records_pending: u64,
    /// Keys living 0, 1, ..., 7+ buckets past their home bucket (estimated from 64 Ki
    /// buckets on larger indexes).
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
    /// Hot placements done since the table was opened.
    pub hot_placements: u64,
    /// Staleness bound (`None`: ASP), holds outstanding and workers holding any.
    pub staleness_bound: Option<u32>,
    pub holds_outstanding: u64,
    pub holding_workers: u64,
    /// Admission and eviction counters (tables with a lifecycle option).
    pub lifecycle: Option<LifecycleStats>,
}

/// What recovery repaired after a crash.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RecoverStats {
    pub buckets_interrupted: u64,
    pub slots_dropped: u64,
    pub records_freed: u64,
    /// Seconds the open spent repairing before the table served.
    pub seconds: f64,
    /// True when the repair went on in the background after the open (a killed
    /// process in this boot; see `StoreOptions::background_repair`).
    pub background: bool,
    /// True while the background repair still runs: the counts above are final, and
    /// the row count exact, once it is false.
    pub pending: bool,
    /// Seconds from the open until the background repair finished.
    pub background_seconds: Option<f64>,
    /// True when the rollback to the latest checkpoint went on after the open: each key
    /// the journal names was returned to the checkpoint when first read or written, the
    /// rest by the background repair before its pass (see `index/undo.rs`).
    pub rollback_on_touch: bool,
    /// Seconds from the open until every key was back at the checkpoint (a rollback on
    /// first touch; otherwise inside `seconds`).
    pub rollback_seconds: Option<f64>,
}

/// How a table that was not closed cleanly is repaired at open.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RepairMode {
    /// Check every record (as after a power loss).
    pub verify: bool,
    /// Repair in the background when a killed process of this boot left the table.
    pub background: bool,
    /// Test hook: buckets per step of the background pass, and a pause after each.
    pub throttle: Option<(u64, std::time::Duration)>,
}
