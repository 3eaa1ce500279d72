//! The planner's run: the options of a plan, the plan, and the simulation that makes
//! it (each table's stream through the stack distances and the row cache's CLOCK in
//! miniature, then the tiers' bytes and the answers for budgets and a target).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::trace::{accesses_of, each_access, each_criteo_line, Source};
use super::{row_cache_shards, tier_bytes, Access, SampledStream, StackDistances, TableShape, TierBytes};
use crate::format::DType;
use crate::limits::{copy_bandwidth, device_limits};
use crate::medium::MediumKind;
use crate::optim::Optimizer;
use crate::store::IO_DEPTH_DEFAULT;
use crate::units::human_bytes;

/// What to plan, and from which key streams: `embank plan`'s options by their long
/// names (the command's `--help` says more of each), as [`plan_request`](super::plan_request)
/// reads them from JSON.
#[derive(Debug, Clone)]
pub struct PlanOptions {
    /// Key traces, one a table: `NAME=keys.npy` or `keys.npy` (1-D uint64/int64, in
    /// access order). Default: none.
    pub traces: Vec<String>,
    /// Key traces in memory: a table's name and its keys in access order. Default: none.
    pub trace_keys: Vec<(String, Arc<Vec<u64>>)>,
    /// Criteo-format TSV files: each categorical feature of `features` a table. Default: none.
    pub criteo: Vec<PathBuf>,
    /// Categorical features (1 to 26) planned with `criteo`. Default: empty, all 26.
    pub features: Vec<usize>,
    /// Categorical ids modulo this. Default: none.
    pub hash_size: Option<u64>,
    /// With `criteo`: model training steps (each batch's ids pulled, then pushed). Default: false.
    pub training: bool,
    /// With `criteo`: the next batch's ids read ahead of each step. Default: false.
    pub lookahead: bool,
    /// Or a generated workload, `ycsb-c` or `hps-a`. Default: none.
    pub workload: Option<String>,
    /// The workload's key space. Default: 1,000,000.
    pub keys: u64,
    /// The workload's Zipf exponent. Default: none, the workload's own (0.99, 1.2).
    pub zipf: Option<f64>,
    /// Keys of a workload's batch; lines of a batch of Criteo input. Default: 500.
    pub batch: usize,
    /// The workload's threads, whose batches are interleaved. Default: 2.
    pub threads: usize,
    /// Batches of each workload thread. Default: 1000.
    pub stream_batches: usize,
    /// The workload's seed. Default: 42.
    pub seed: u64,
    /// Row elements of the tables. Default: 128.
    pub dim: usize,
    /// Element type of the tables. Default: f32.
    pub dtype: DType,
    /// Optimizer by name (its state is stored with each row). Default: `none`.
    pub optimizer: String,
    /// Medium of the tables: `mmap` or `block`. Default: `block`.
    pub medium: String,
    /// Row-cache sizes to predict the hit rate at. Default: none.
    pub cache_bytes: Vec<u64>,
    /// DRAM for the store (index and row cache). Default: none.
    pub budget_dram: Option<u64>,
    /// GPU memory for a GPU cache. Default: none.
    pub budget_gpu: Option<u64>,
    /// Hit rate to size the row cache for. Default: 0.9.
    pub target_hit_rate: f64,
    /// Fraction of keys tracked. Default: none, all up to `tracked_max` accesses, fewer beyond.
    pub sample_rate: Option<f64>,
    /// Sampled accesses tracked at most (about 30 bytes each). Default: 4,000,000.
    pub tracked_max: usize,
    /// Measure this machine's limits and turn hit rates into keys/s. Default: false.
    pub limits: bool,
    /// Scratch directory of the device measurement of `limits`. Default: none, the
    /// system's temporary directory.
    pub dir: Option<PathBuf>,
}

impl Default for PlanOptions {
    fn default() -> PlanOptions {
        PlanOptions {
            traces: Vec::new(),
            trace_keys: Vec::new(),
            criteo: Vec::new(),
            features: Vec::new(),
            hash_size: None,
            training: false,
            lookahead: false,
            workload: None,
            keys: 1_000_000,
            zipf: None,
            batch: 500,
            threads: 2,
            stream_batches: 1000,
            seed: 42,
            dim: 128,
            dtype: DType::F32,
            optimizer: "none".to_owned(),
            medium: "block".to_owned(),
            cache_bytes: Vec::new(),
            budget_dram: None,
            budget_gpu: None,
            target_hit_rate: 0.9,
            sample_rate: None,
            tracked_max: 4_000_000,
            limits: false,
            dir: None,
        }
    }
}

/// Hears how far the planner has got through each pass over a key stream (the command
/// draws a bar of each). `()` hears nothing.
pub trait PlanProgress {
    /// A pass over `total` accesses (or lines) of `what` begins.
    fn begin(&mut self, what: &str, total: u64);
    /// `done` of the pass's `total` are through.
    fn advance(&mut self, done: u64);
    /// The pass is over.
    fn end(&mut self);
}

impl PlanProgress for () {
    fn begin(&mut self, _: &str, _: u64) {}
    fn advance(&mut self, _: u64) {}
    fn end(&mut self) {}
}

#[derive(Debug, Serialize)]
pub struct CurvePoint {
    pub cache_bytes: u64,
    pub rows: f64,
    pub hit_rate: f64,
    /// With --limits: keys/s to expect at this hit rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keys_per_second: Option<f64>,
}

/// What --limits measured.
#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    pub copy_gb_per_second: f64,
    /// Keys/s a hit can be served at: copy bandwidth over the row's bytes read and written.
    pub hit_keys_per_second: f64,
    /// Keys/s a miss can be served at: the device's random reads/s at the record size
    /// (block medium), or the copy bound (mmap: the rows are in memory).
    pub miss_keys_per_second: f64,
}

impl Limits {
    /// Keys/s at hit rate `h`: the time of a key is the mix of a hit's and a miss's.
    pub fn keys_per_second(&self, h: f64) -> f64 {
        1.0 / (h / self.hit_keys_per_second + (1.0 - h) / self.miss_keys_per_second)
    }
}

#[derive(Debug, Serialize)]
pub struct TablePlan {
    pub name: String,
    pub shape: TableShape,
    pub accesses: u64,
    pub distinct_keys: f64,
    pub sample_rate: f64,
    pub tracked_bytes: u64,
    pub bytes: TierBytes,
    /// Row cache: predicted hit rate over sizes (log-spaced up to the whole table),
    /// from miniature simulations of its CLOCK policy on the sampled stream.
    pub row_cache_curve: Vec<CurvePoint>,
    /// An LRU cache of the same sizes (the stack-distance curve), for reference.
    pub lru_curve: Vec<CurvePoint>,
    /// GPU cache: predicted hit rate over sizes.
    pub gpu_curve: Vec<CurvePoint>,
    /// At the sizes asked for with --cache-bytes.
    pub at_cache_bytes: Vec<CurvePoint>,
    /// Row-cache bytes for --target-hit-rate (None: the stream never gets there).
    pub cache_bytes_for_target: Option<u64>,
    pub placement: String,
    pub why: String,
    pub at_budget_dram: Option<CurvePoint>,
    pub at_budget_gpu: Option<CurvePoint>,
    /// A table with an optimizer trained through a GPU training cache of --budget-gpu
    /// (rows with their state: fewer rows than an inference cache of the same bytes).
    pub at_budget_gpu_train: Option<CurvePoint>,
}

/// The store's one row cache shared by every table (Criteo input: the tables' ids
/// interleaved as batches make them).
#[derive(Debug, Serialize)]
pub struct StorePlan {
    /// Steps modelled: pulls and pushes (--training), reads ahead (--lookahead).
    pub training: bool,
    pub lookahead: bool,
    pub batch: usize,
    /// Reads the store counts (hits and misses) over all tables.
    pub accesses: u64,
    /// Distinct rows of a step over all tables (mean): with --lookahead the cache must
    /// hold two steps' rows (the one training and the one read ahead) or they thrash.
    pub rows_per_step: f64,
    /// Row-cache bytes of two steps' rows.
    pub lookahead_floor_bytes: u64,
    pub sample_rate: f64,
    pub row_cache_curve: Vec<CurvePoint>,
    pub at_cache_bytes: Vec<CurvePoint>,
    pub cache_bytes_for_target: Option<u64>,
    pub at_budget_dram: Option<CurvePoint>,
}

#[derive(Debug, Serialize)]
pub struct Plan {
    pub target_hit_rate: f64,
    /// With --limits: the machine's limits the keys/s come from.
    pub limits: Option<Limits>,
    pub budget_dram: Option<u64>,
    pub budget_gpu: Option<u64>,
    pub tables: Vec<TablePlan>,
    /// The shared row cache over all tables (Criteo input).
    pub store: Option<StorePlan>,
    /// Bytes of the whole store: index, medium.
    pub total_index_bytes: u64,
    pub total_medium_bytes: u64,
    pub seconds: f64,
}

fn log_sizes(rows_max: f64, entry: u64) -> Vec<(u64, f64)> {
    let mut out = Vec::new();
    let top = (rows_max.max(1.0) * entry as f64).max(entry as f64);
    let mut bytes = (entry as f64 * 16.0).min(top);
    while bytes < top * 1.0001 {
        out.push((bytes as u64, bytes / entry as f64));
        bytes *= 1.6;
    }
    out.push((top as u64, top / entry as f64));
    out
}

/// The plan of the key streams `args` names: per table, the hit-rate curves of the row
/// cache and a GPU cache, the bytes of each tier, a placement and what the budgets buy;
/// with Criteo input, the store-wide row cache too. `progress` hears each pass over a
/// stream.
pub fn plan(args: &PlanOptions, progress: &mut dyn PlanProgress) -> Result<Plan, String> {
    let t0 = Instant::now();
    let optimizer = match args.optimizer.as_str() {
        "none" => Optimizer::None,
        "sgd" => Optimizer::Sgd { lr: 0.01 },
        "adagrad" => Optimizer::Adagrad { lr: 0.01, eps: 1e-10, initial_accumulator_value: 0.0 },
        "adam" => Optimizer::Adam { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8 },
        "rowwise_adagrad" => Optimizer::RowWiseAdagrad { lr: 0.01, eps: 1e-8, initial_accumulator_value: 0.0 },
        "adamw" => Optimizer::AdamW { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
        "ftrl" => Optimizer::Ftrl { lr: 0.05, beta: 1.0, l1: 0.0, l2: 0.0, initial_accumulator_value: 0.1 },
        "fbgemm_adam" => Optimizer::FbgemmAdam { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
        "partial_rowwise_adam" => {
            Optimizer::PartialRowWiseAdam { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
        }
        "lamb" => Optimizer::Lamb { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
        "partial_rowwise_lamb" => {
            Optimizer::PartialRowWiseLamb { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
        }
        other => {
            return Err(format!(
                "unknown optimizer {other:?}: none, sgd, adagrad, rowwise_adagrad, adam, adamw, ftrl, fbgemm_adam, \
                 partial_rowwise_adam, lamb or partial_rowwise_lamb"
            ))
        }
    };
    let medium = MediumKind::parse(&args.medium).map_err(|e| e.to_string())?;
    if !(0.0..=1.0).contains(&args.target_hit_rate) {
        return Err("--target-hit-rate must be in [0, 1]".into());
    }
    let mut sources: Vec<(String, Source)> = Vec::new();
    for t in &args.traces {
        let (name, path) = match t.split_once('=') {
            Some((n, p)) => (n.to_owned(), PathBuf::from(p)),
            None => {
                let p = PathBuf::from(t);
                let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "table".into());
                (stem.trim_end_matches(".keys").to_owned(), p)
            }
        };
        sources.push((name, Source::File(path)));
    }
    for (name, keys) in &args.trace_keys {
        sources.push((name.clone(), Source::Keys(Arc::clone(keys))));
    }
    if let Some(w) = &args.workload {
        let zipf = match w.as_str() {
            "ycsb-c" => args.zipf.unwrap_or(0.99),
            "hps-a" => args.zipf.unwrap_or(1.2),
            other => return Err(format!("--workload {other:?}: ycsb-c or hps-a (read-only workloads)")),
        };
        sources.push((w.clone(), Source::Workload(zipf)));
    }
    if !args.criteo.is_empty() {
        let features: Vec<usize> = if args.features.is_empty() { (1..=26).collect() } else { args.features.clone() };
        for n in features {
            if !(1..=26).contains(&n) {
                return Err(format!("--features: Criteo has categorical features 1 to 26, not {n}"));
            }
            sources.push((format!("c{n}"), Source::Criteo(n)));
        }
    }
    if (args.training || args.lookahead) && args.criteo.is_empty() {
        return Err("--training and --lookahead model steps over batches of --criteo input".into());
    }
    if args.batch == 0 {
        return Err("--batch must be at least 1".into());
    }
    if sources.is_empty() {
        return Err("give --trace NAME=keys.npy (one per table), --criteo FILE or --workload ycsb-c|hps-a".into());
    }
    let mut tables = Vec::new();
    let mut measured: Option<(f64, Option<f64>)> = None; // (copy GB/s, device reads/s)
    let mut criteo_lines: Option<u64> = None;
    for (name, source) in &sources {
        let accesses = accesses_of(args, source, &mut criteo_lines)?;
        let rate = args.sample_rate.unwrap_or_else(|| (args.tracked_max as f64 / accesses.max(1) as f64).min(1.0));
        let capacity = ((accesses as f64 * rate * 1.2) as usize + 1024).min(args.tracked_max.max(1024) * 2);
        let mut sd = StackDistances::new(rate, capacity);
        let mut sample = SampledStream::new(rate);
        progress.begin(name, accesses);
        let mut n = 0u64;
        each_access(args, source, &mut |k, counting| {
            sd.set_counting(counting);
            sd.access(k);
            sample.access(k, counting, capacity);
            n += 1;
            if n.is_multiple_of(1 << 20) {
                progress.advance(n);
            }
        })?;
        progress.end();
        let shape = TableShape { name: name.clone(), dim: args.dim, dtype: args.dtype, optimizer, medium };
        let distinct = sd.distinct();
        let bytes = tier_bytes(&shape, distinct.round() as u64);
        if args.limits && measured.is_none() {
            let copy = copy_bandwidth();
            let device = if medium == MediumKind::Block {
                let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
                let file = (distinct as u64 * bytes.record_bytes).clamp(64 << 20, 1 << 30);
                let d = device_limits(&dir, bytes.record_bytes as u32, file, IO_DEPTH_DEFAULT, 3.0)?;
                Some(d.random_reads_per_second)
            } else {
                None
            };
            measured = Some((copy, device));
        }
        let limits = measured.map(|m| limits_of(m, args));
        let kps = |h: f64| limits.as_ref().map(|l| l.keys_per_second(h));
        let entry = bytes.cache_entry_bytes;
        let clock = |b: u64| -> CurvePoint {
            let rows = b as f64 / entry as f64;
            let hit_rate = sample.clock_hit_rate(rows, row_cache_shards(b));
            CurvePoint { cache_bytes: b, rows, hit_rate, keys_per_second: kps(hit_rate) }
        };
        let lru = |b: u64, entry: u64| -> CurvePoint {
            let rows = b as f64 / entry as f64;
            CurvePoint { cache_bytes: b, rows, hit_rate: sd.hit_rate(rows), keys_per_second: None }
        };
        let row_cache_curve: Vec<CurvePoint> = log_sizes(distinct, entry).into_iter().map(|(b, _)| clock(b)).collect();
        let lru_curve = log_sizes(distinct, entry).into_iter().map(|(b, _)| lru(b, entry)).collect();
        let gpu_curve = log_sizes(distinct, bytes.gpu_entry_bytes)
            .into_iter()
            .map(|(b, _)| lru(b, bytes.gpu_entry_bytes))
            .collect();
        let at_cache_bytes = args.cache_bytes.iter().map(|&b| clock(b)).collect();
        let cache_bytes_for_target = bytes_for(&clock, distinct * entry as f64, args.target_hit_rate);
        // DRAM for the row cache: the budget less the index (which must be resident).
        let at_budget_dram = args.budget_dram.map(|b| clock(b.saturating_sub(bytes.index)));
        let at_budget_gpu = args.budget_gpu.map(|b| lru(b, bytes.gpu_entry_bytes));
        let trains = !matches!(shape.optimizer, crate::Optimizer::None);
        let at_budget_gpu_train = args.budget_gpu.filter(|_| trains).map(|b| lru(b, bytes.train_cache_entry_bytes));
        let whole = distinct * bytes.cache_entry_bytes as f64;
        let dram = args.budget_dram.map(|b| b.saturating_sub(bytes.index) as f64);
        let (placement, why) = recommend(&sd, whole, dram, cache_bytes_for_target, args.target_hit_rate, &bytes);
        tables.push(TablePlan {
            name: name.clone(),
            shape,
            accesses: sd.accesses(),
            distinct_keys: distinct,
            sample_rate: sd.rate(),
            tracked_bytes: sd.bytes(),
            bytes,
            row_cache_curve,
            lru_curve,
            gpu_curve,
            at_cache_bytes,
            cache_bytes_for_target,
            placement,
            why,
            at_budget_dram,
            at_budget_gpu,
            at_budget_gpu_train,
        });
    }
    let store = if args.criteo.is_empty() {
        None
    } else {
        let features: Vec<usize> =
            sources.iter().filter_map(|(_, s)| if let Source::Criteo(n) = s { Some(*n) } else { None }).collect();
        let lines = criteo_lines.unwrap_or(0);
        let entry = tables.iter().map(|t| t.bytes.cache_entry_bytes).max().unwrap_or(1);
        let distinct: f64 = tables
            .iter()
            .zip(&sources)
            .filter(|(_, (_, s))| matches!(s, Source::Criteo(_)))
            .map(|(t, _)| t.distinct_keys)
            .sum();
        let index: u64 = tables.iter().map(|t| t.bytes.index).sum();
        let limits = measured.map(|m| limits_of(m, args));
        let input = StoreInput { features, lines, entry, distinct, index };
        Some(store_plan(args, &input, limits.as_ref(), progress)?)
    };
    Ok(Plan {
        target_hit_rate: args.target_hit_rate,
        store,
        limits: measured.map(|m| limits_of(m, args)),
        budget_dram: args.budget_dram,
        budget_gpu: args.budget_gpu,
        total_index_bytes: tables.iter().map(|t| t.bytes.index).sum(),
        total_medium_bytes: tables.iter().map(|t| t.bytes.medium).sum(),
        tables,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// What the store-wide plan takes from the tables' plans.
struct StoreInput {
    /// The Criteo features planned (1-based), a table each.
    features: Vec<usize>,
    /// Lines of the Criteo files.
    lines: u64,
    /// The largest row-cache entry of the tables.
    entry: u64,
    /// Distinct keys of all the tables.
    distinct: f64,
    /// Index bytes of all the tables.
    index: u64,
}

/// The store-wide row cache over Criteo input: one more pass over the files, in batches
/// of `--batch` lines, every table's distinct ids of a batch (tables keep apart: the
/// table's number goes in the key's top bits) read as the training steps read them.
fn store_plan(
    args: &PlanOptions,
    input: &StoreInput,
    limits: Option<&Limits>,
    progress: &mut dyn PlanProgress,
) -> Result<StorePlan, String> {
    let StoreInput { ref features, lines, entry, distinct, index } = *input;
    let per_id = 1 + args.training as u64 + args.lookahead as u64;
    let events = lines * features.len() as u64 * per_id;
    let rate = args.sample_rate.unwrap_or_else(|| (args.tracked_max as f64 / events.max(1) as f64).min(1.0));
    let max = args.tracked_max.max(1024) * 2;
    let mut sample = SampledStream::new(rate);
    // A step: the maintenance thread reads the next batch's rows ahead while the step
    // pulls, table by table (it got the hints just before the step began).
    let step = |sample: &mut SampledStream, batch: &[Vec<u64>], ahead: Option<&[Vec<u64>]>| {
        for (j, ids) in batch.iter().enumerate() {
            for &k in ahead.map_or(&[][..], |a| &a[j][..]) {
                sample.access_as(k, Access::Ahead, max);
            }
            for &k in ids {
                sample.access_as(k, Access::Counted, max);
            }
        }
        if args.training {
            for ids in batch {
                for &k in ids {
                    sample.access_as(k, Access::Push, max);
                }
            }
        }
        sample.access_as(0, Access::StepEnd, max);
    };
    let mut batch: Vec<Vec<u64>> = vec![Vec::new(); features.len()];
    let mut current: Option<Vec<Vec<u64>>> = None;
    let (mut steps, mut step_rows) = (0u64, 0u64);
    let mut in_batch = 0usize;
    progress.begin("store", lines);
    let mut n = 0u64;
    let mut end_batch = |batch: &mut Vec<Vec<u64>>, sample: &mut SampledStream| {
        let mut next: Vec<Vec<u64>> = std::mem::replace(batch, vec![Vec::new(); features.len()]);
        for ids in next.iter_mut() {
            ids.sort_unstable();
            ids.dedup();
            if args.lookahead && current.is_none() {
                // The first batch is read ahead before any step.
                for &k in ids.iter() {
                    sample.access_as(k, Access::Ahead, max);
                }
            }
        }
        steps += 1;
        step_rows += next.iter().map(|ids| ids.len() as u64).sum::<u64>();
        if let Some(cur) = current.take() {
            step(sample, &cur, args.lookahead.then_some(&next[..]));
        }
        current = Some(next);
    };
    each_criteo_line(args, features, &mut |ids| {
        for (j, &id) in ids.iter().enumerate() {
            batch[j].push(((j as u64 + 1) << 48) ^ id);
        }
        in_batch += 1;
        if in_batch == args.batch {
            end_batch(&mut batch, &mut sample);
            in_batch = 0;
        }
        n += 1;
        if n.is_multiple_of(1 << 16) {
            progress.advance(n);
        }
    })?;
    if in_batch > 0 {
        end_batch(&mut batch, &mut sample);
    }
    if let Some(cur) = current.take() {
        step(&mut sample, &cur, None);
    }
    progress.end();
    let rows_per_step = step_rows as f64 / steps.max(1) as f64;
    let kps = |h: f64| limits.map(|l| l.keys_per_second(h));
    let clock = |b: u64| -> CurvePoint {
        let rows = b as f64 / entry as f64;
        let hit_rate = sample.clock_hit_rate(rows, row_cache_shards(b));
        CurvePoint { cache_bytes: b, rows, hit_rate, keys_per_second: kps(hit_rate) }
    };
    Ok(StorePlan {
        training: args.training,
        lookahead: args.lookahead,
        batch: args.batch,
        accesses: sample.counted_all,
        rows_per_step,
        lookahead_floor_bytes: (2.0 * rows_per_step * entry as f64).ceil() as u64,
        sample_rate: sample.rate,
        row_cache_curve: log_sizes(distinct, entry).into_iter().map(|(b, _)| clock(b)).collect(),
        at_cache_bytes: args.cache_bytes.iter().map(|&b| clock(b)).collect(),
        cache_bytes_for_target: bytes_for(&clock, distinct * entry as f64, args.target_hit_rate),
        at_budget_dram: args.budget_dram.map(|b| clock(b.saturating_sub(index))),
    })
}

/// The limits in keys/s: a hit copies the row out (read and write: twice its f32 bytes);
/// a miss is one device read on the block medium, a copy on mmap.
fn limits_of((copy, device): (f64, Option<f64>), args: &PlanOptions) -> Limits {
    let hit = copy * 1e9 / (2.0 * (args.dim * 4) as f64);
    Limits { copy_gb_per_second: copy, hit_keys_per_second: hit, miss_keys_per_second: device.unwrap_or(hit) }
}

/// The least cache bytes (within 1 %) whose simulated hit rate reaches `target`.
fn bytes_for(sim: &dyn Fn(u64) -> CurvePoint, whole: f64, target: f64) -> Option<u64> {
    let mut hi = whole.max(1.0);
    if sim(hi as u64).hit_rate < target {
        return None;
    }
    let mut lo = 1.0f64;
    while hi / lo > 1.01 {
        let mid = (lo * hi).sqrt();
        if sim(mid as u64).hit_rate >= target {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi.ceil() as u64)
}

/// Pin a table that fits in a small share of the DRAM, cache a skewed one, bypass one
/// whose stream has little locality.
fn recommend(
    sd: &StackDistances,
    whole: f64,
    dram: Option<f64>,
    for_target: Option<u64>,
    target: f64,
    bytes: &TierBytes,
) -> (String, String) {
    let share = dram.unwrap_or(256.0 * 1024.0 * 1024.0);
    if whole <= share * 0.25 {
        return (
            "pin".into(),
            format!("the whole table ({}) fits in a quarter of the row-cache budget", human_bytes(whole as u64)),
        );
    }
    let tenth = sd.hit_rate(whole / bytes.cache_entry_bytes as f64 * 0.1);
    if tenth < 0.2 {
        return (
            "bypass".into(),
            format!("a cache of 10 % of the rows hits only {:.0} %: little locality to cache", tenth * 100.0),
        );
    }
    match for_target {
        Some(b) => (
            "cache".into(),
            format!(
                "{} of row cache ({:.1} % of the rows) reaches a {:.0} % hit rate",
                human_bytes(b),
                b as f64 / whole * 100.0,
                target * 100.0
            ),
        ),
        None => ("cache".into(), format!("skewed (10 % of the rows hit {:.0} %)", tenth * 100.0)),
    }
}
