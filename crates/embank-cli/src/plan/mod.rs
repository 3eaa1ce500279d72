//! `embank plan`: sizes every tier from the real key stream before memory is
//! bought. Per table: the hit-rate curve of the DRAM row cache and of a GPU
//! cache over sizes (Mattson stack distances, SHARDS-sampled for long traces:
//! `embank_core::plan`), the bytes of each tier from the store's own layouts, a
//! recommended placement, and answers for a DRAM or GPU budget or a target hit
//! rate. Text, JSON (`--out`) and a PNG of the curves (`--png`).

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use embank_core::plan::{row_cache_shards, tier_bytes, Access, SampledStream, StackDistances, TableShape, TierBytes};
use embank_core::{DType, MediumKind, Optimizer};
use std::sync::Arc;

use serde::Serialize;

use crate::bench::{parse_bytes, parse_dtype};
use crate::npy::NpyReader;
use crate::tools::human_bytes;
use crate::workload::KeyStream;

mod draw;
mod request;

use draw::draw;
pub use request::{plan_request, Bytes, PlanRequest};

#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    /// A key trace per table: `NAME=keys.npy` or `keys.npy` (the table named after the
    /// file); 1-D uint64/int64, in access order. Repeat for several tables.
    #[arg(long = "trace")]
    pub traces: Vec<String>,
    /// Or Criteo-format TSV files (label, 13 integer and 26 categorical features): each
    /// categorical feature of --features is a table `c<N>` whose keys are its hex ids
    /// (a missing value is id 2^32), as `embank.datasets.read_criteo` reads them.
    #[arg(long = "criteo")]
    pub criteo: Vec<PathBuf>,
    /// Categorical features to plan (1 to 26) with --criteo. Default: all 26.
    #[arg(long, value_delimiter = ',')]
    pub features: Vec<usize>,
    /// Categorical ids modulo this (as the DLRM example's --hash-size).
    #[arg(long)]
    pub hash_size: Option<u64>,
    /// With --criteo: model training steps for the store-wide row cache, as the DLRM
    /// example makes them: per batch of --batch lines, each table's distinct ids are
    /// pulled, then pushed back (`push_grad` re-reads the rows it updates; the store
    /// counts both reads).
    #[arg(long)]
    pub training: bool,
    /// With --criteo: the next batch's ids are read ahead of each step
    /// (`embank.torch.lookahead`): rows that exist enter the cache before their pull.
    #[arg(long)]
    pub lookahead: bool,
    /// Or a workload of `embank bench` (`ycsb-c`, `hps-a`) generated as it does:
    /// --keys, --zipf, --batch, --threads, --stream-batches, --seed; the bench's threads'
    /// batches interleaved and replayed, the first replay left out (its warm-up).
    /// (--batch is also the lines of a batch of --criteo input: the DLRM example's
    /// --batch-size.)
    #[arg(long)]
    pub workload: Option<String>,
    #[arg(long, default_value_t = 1_000_000)]
    pub keys: u64,
    #[arg(long)]
    pub zipf: Option<f64>,
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    #[arg(long, default_value_t = 1000)]
    pub stream_batches: usize,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Row elements of the tables.
    #[arg(long, default_value_t = 128)]
    pub dim: usize,
    /// Element type: f32, f16 or int8.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,
    /// Server-side optimizer (its state is stored with each row): none, sgd, adagrad, adam.
    #[arg(long, default_value = "none")]
    pub optimizer: String,
    /// Medium of the tables: mmap or block.
    #[arg(long, default_value = "block")]
    pub medium: String,
    /// Row-cache sizes to predict the hit rate at (bytes, e.g. 10M,100M).
    #[arg(long, value_delimiter = ',', value_parser = parse_bytes)]
    pub cache_bytes: Vec<u64>,
    /// DRAM for the store (index and row cache): what hit rate does it buy?
    #[arg(long, value_parser = parse_bytes)]
    pub budget_dram: Option<u64>,
    /// GPU memory for a GPU cache: what hit rate does it buy?
    #[arg(long, value_parser = parse_bytes)]
    pub budget_gpu: Option<u64>,
    /// Hit rate to size the row cache for.
    #[arg(long, default_value_t = 0.9)]
    pub target_hit_rate: f64,
    /// Fraction of keys tracked (SHARDS sampling); default: all for traces up to
    /// --tracked-max accesses, fewer beyond.
    #[arg(long)]
    pub sample_rate: Option<f64>,
    /// Sampled accesses tracked at most (memory: about 30 bytes each).
    #[arg(long, default_value_t = 4_000_000, alias = "max-tracked")]
    pub tracked_max: usize,
    /// Measure this machine's limits (memory copy bandwidth; with the block medium, the
    /// device's random read rate at the record size, on a scratch file in --dir) and
    /// turn each predicted hit rate into the keys/s to expect: hits at the copy bound,
    /// misses at the device's read rate.
    #[arg(long)]
    pub limits: bool,
    /// Scratch directory for --limits' device measurement (default: the system's temp).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Write the plan as JSON here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Draw the hit-rate curves here (PNG).
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// Key traces given in memory (the API's, see [`plan_request`]): name, keys in
    /// access order.
    #[arg(skip)]
    pub trace_keys: Vec<(String, Arc<Vec<u64>>)>,
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

/// Streams the accesses of one table into `f`.
fn each_access(args: &PlanArgs, source: &Source, f: &mut dyn FnMut(u64, bool)) -> Result<(), String> {
    match source {
        Source::File(path) => {
            let mut r = NpyReader::open(path)?;
            if r.shape.len() != 1 || (r.descr != "<u8" && r.descr != "<i8") {
                return Err(format!("{}: a trace is a 1-D uint64/int64 array", path.display()));
            }
            let n = r.shape[0];
            let mut buf = Vec::new();
            let mut done = 0;
            while done < n {
                let m = (n - done).min(1 << 20);
                r.read_keys(m, &mut buf)?;
                for &k in &buf {
                    f(k, true);
                }
                done += m;
            }
        }
        Source::Keys(keys) => keys.iter().for_each(|&k| f(k, true)),
        Source::Criteo(n) => each_criteo_line(args, &[*n], &mut |ids| f(ids[0], true))?,
        Source::Workload(zipf) => {
            let streams: Vec<Vec<u64>> = (0..args.threads.max(1))
                .map(|t| {
                    let seed = args.seed.wrapping_add(t as u64 * 7919);
                    Ok(KeyStream::new(args.keys, *zipf, seed)?.batches(args.stream_batches, args.batch))
                })
                .collect::<Result<_, String>>()?;
            // Three replays of the interleaved batches; the first is the warm-up.
            for replay in 0..3 {
                for b in 0..args.stream_batches {
                    for s in &streams {
                        for &k in &s[b * args.batch..(b + 1) * args.batch] {
                            f(k, replay > 0);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

enum Source {
    File(PathBuf),
    Keys(Arc<Vec<u64>>),
    Workload(f64),
    /// Categorical feature `n` (1-based) of Criteo files.
    Criteo(usize),
}

/// The id a Criteo categorical value stands for (`embank.datasets` reads it the same way).
fn criteo_id(field: &str, hash_size: Option<u64>) -> Result<u64, String> {
    let id = if field.is_empty() {
        1u64 << 32
    } else {
        u64::from_str_radix(field, 16).map_err(|_| format!("categorical value {field:?} is not hex"))?
    };
    Ok(hash_size.map_or(id, |h| id % h))
}

/// Calls `f` with the ids of categorical `features` (1-based) of every line of the
/// Criteo files, in file order; an error names the file and line.
fn each_criteo_line(args: &PlanArgs, features: &[usize], f: &mut dyn FnMut(&[u64])) -> Result<(), String> {
    use std::io::BufRead;
    let mut ids = vec![0u64; features.len()];
    for path in &args.criteo {
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        for (i, line) in std::io::BufReader::with_capacity(1 << 20, file).lines().enumerate() {
            let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
            let fields: Vec<&str> = line.split('\t').collect();
            if fields.len() < 40 {
                return Err(format!("{} line {}: fewer than 40 tab-separated fields", path.display(), i + 1));
            }
            for (id, &n) in ids.iter_mut().zip(features) {
                *id = criteo_id(fields[13 + n], args.hash_size)
                    .map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))?;
            }
            f(&ids);
        }
    }
    Ok(())
}

/// Accesses of a source (the Criteo files' line count, counted once for all features,
/// is kept in `criteo_lines`).
fn accesses_of(args: &PlanArgs, source: &Source, criteo_lines: &mut Option<u64>) -> Result<u64, String> {
    Ok(match source {
        Source::File(p) => NpyReader::open(p)?.shape.first().copied().unwrap_or(0) as u64,
        Source::Keys(keys) => keys.len() as u64,
        Source::Workload(_) => 3 * (args.threads.max(1) * args.stream_batches * args.batch) as u64,
        Source::Criteo(_) => match criteo_lines {
            Some(n) => *n,
            None => {
                // Lines of the files: one access per line per feature.
                let mut n = 0u64;
                each_criteo_line(args, &[], &mut |_| n += 1)?;
                *criteo_lines = Some(n);
                n
            }
        },
    })
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

pub fn plan(args: &PlanArgs) -> Result<Plan, String> {
    let t0 = Instant::now();
    let optimizer = match args.optimizer.as_str() {
        "none" => Optimizer::None,
        "sgd" => Optimizer::Sgd { lr: 0.01 },
        "adagrad" => Optimizer::Adagrad { lr: 0.01, eps: 1e-10, initial_accumulator_value: 0.0 },
        "adam" => Optimizer::Adam { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8 },
        "rowwise_adagrad" => Optimizer::RowWiseAdagrad { lr: 0.01, eps: 1e-8, initial_accumulator_value: 0.0 },
        "adamw" => Optimizer::AdamW { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
        "ftrl" => Optimizer::Ftrl { lr: 0.05, beta: 1.0, l1: 0.0, l2: 0.0, initial_accumulator_value: 0.1 },
        other => {
            return Err(format!(
                "unknown optimizer {other:?}: none, sgd, adagrad, rowwise_adagrad, adam, adamw or ftrl"
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
        let bar = crate::tools::progress(accesses, name);
        let mut n = 0u64;
        each_access(args, source, &mut |k, counting| {
            sd.set_counting(counting);
            sd.access(k);
            sample.access(k, counting, capacity);
            n += 1;
            if n.is_multiple_of(1 << 20) {
                bar.set_position(n);
            }
        })?;
        bar.finish_and_clear();
        let shape = TableShape { name: name.clone(), dim: args.dim, dtype: args.dtype, optimizer, medium };
        let distinct = sd.distinct();
        let bytes = tier_bytes(&shape, distinct.round() as u64);
        if args.limits && measured.is_none() {
            let copy = crate::bench::limits::copy_bandwidth();
            let device = if medium == MediumKind::Block {
                let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
                let file = (distinct as u64 * bytes.record_bytes).clamp(64 << 20, 1 << 30);
                let d = crate::bench::limits::device(
                    &dir,
                    bytes.record_bytes as u32,
                    file,
                    embank_core::store::IO_DEPTH_DEFAULT,
                    3.0,
                )?;
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
        Some(store_plan(args, &features, lines, entry, distinct, index, limits.as_ref())?)
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

/// The store-wide row cache over Criteo input: one more pass over the files, in batches
/// of `--batch` lines, every table's distinct ids of a batch (tables keep apart: the
/// table's number goes in the key's top bits) read as the training steps read them.
fn store_plan(
    args: &PlanArgs,
    features: &[usize],
    lines: u64,
    entry: u64,
    distinct: f64,
    index: u64,
    limits: Option<&Limits>,
) -> Result<StorePlan, String> {
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
    let bar = crate::tools::progress(lines, "store");
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
            bar.set_position(n);
        }
    })?;
    if in_batch > 0 {
        end_batch(&mut batch, &mut sample);
    }
    if let Some(cur) = current.take() {
        step(&mut sample, &cur, None);
    }
    bar.finish_and_clear();
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
fn limits_of((copy, device): (f64, Option<f64>), args: &PlanArgs) -> Limits {
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

pub fn run(args: PlanArgs) -> Result<(), String> {
    let p = plan(&args)?;
    for t in &p.tables {
        println!(
            "table {}: {} accesses, {:.0} distinct keys (sampled at {:.4}, {} tracked), dim {} {} on {}",
            t.name,
            t.accesses,
            t.distinct_keys,
            t.sample_rate,
            human_bytes(t.tracked_bytes),
            t.shape.dim,
            t.shape.dtype,
            t.shape.medium.name()
        );
        println!(
            "  bytes: index {}, rows on the medium {} ({} B records), row-cache entry {} B, GPU-cache entry {} B",
            human_bytes(t.bytes.index),
            human_bytes(t.bytes.medium),
            t.bytes.record_bytes,
            t.bytes.cache_entry_bytes,
            t.bytes.gpu_entry_bytes
        );
        println!("  {:>12} {:>14} {:>9} {:>9}", "cache", "rows", "row cache", "GPU");
        for (r, g) in t.row_cache_curve.iter().zip(&t.gpu_curve) {
            println!(
                "  {:>12} {:>14.0} {:>8.1}% {:>8.1}%",
                human_bytes(r.cache_bytes),
                r.rows,
                r.hit_rate * 100.0,
                g.hit_rate * 100.0
            );
        }
        print_answers(&t.at_cache_bytes, t.cache_bytes_for_target, t.at_budget_dram.as_ref(), p.target_hit_rate);
        if let Some(c) = &t.at_budget_gpu {
            println!("  with --budget-gpu: {:.0} rows on the GPU, {:.1} % hits", c.rows, c.hit_rate * 100.0);
        }
        println!("  placement: {} ({})", t.placement, t.why);
    }
    if let Some(s) = &p.store {
        println!(
            "store-wide row cache (all tables share it; batches of {} lines{}{}): {} counted reads, sampled at {:.4}",
            s.batch,
            if s.training { ", pulled and pushed" } else { "" },
            if s.lookahead { ", read ahead" } else { "" },
            s.accesses,
            s.sample_rate
        );
        println!("  {:>12} {:>14} {:>9}", "cache", "rows", "row cache");
        for r in &s.row_cache_curve {
            println!("  {:>12} {:>14.0} {:>8.1}%", human_bytes(r.cache_bytes), r.rows, r.hit_rate * 100.0);
        }
        println!(
            "  {:.0} distinct rows a step: reading ahead needs more than {} of row cache (two steps' rows), or \
             the rows read ahead evict the ones in use",
            s.rows_per_step,
            human_bytes(s.lookahead_floor_bytes)
        );
        print_answers(&s.at_cache_bytes, s.cache_bytes_for_target, s.at_budget_dram.as_ref(), p.target_hit_rate);
    }
    if let Some(l) = &p.limits {
        println!(
            "limits: copy {:.1} GB/s (hits at {:.1} M keys/s), misses at {:.0} k keys/s",
            l.copy_gb_per_second,
            l.hit_keys_per_second / 1e6,
            l.miss_keys_per_second / 1e3
        );
    }
    println!(
        "store: index {}, medium {}; planned in {:.2}s",
        human_bytes(p.total_index_bytes),
        human_bytes(p.total_medium_bytes),
        p.seconds
    );
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_string_pretty(&p).expect("serializes"))
            .map_err(|e| format!("{}: {e}", out.display()))?;
        println!("wrote {}", out.display());
    }
    if let Some(png) = &args.png {
        draw(&p, png)?;
        println!("wrote {}", png.display());
    }
    Ok(())
}

/// What one row cache (a table's, or the store-wide one) gives at --cache-bytes, what
/// the target hit rate takes, and what --budget-dram buys.
fn print_answers(at: &[CurvePoint], for_target: Option<u64>, at_budget: Option<&CurvePoint>, target: f64) {
    for c in at {
        println!(
            "  --cache-bytes {}: {:.1} % predicted row-cache hits{}",
            human_bytes(c.cache_bytes),
            c.hit_rate * 100.0,
            c.keys_per_second.map_or(String::new(), |k| format!(", about {:.2} M keys/s", k / 1e6))
        );
    }
    match for_target {
        Some(b) => println!("  a {:.0} % hit rate takes {} of row cache", target * 100.0, human_bytes(b)),
        None => println!("  the stream never reaches a {:.0} % hit rate", target * 100.0),
    }
    if let Some(c) = at_budget {
        println!(
            "  with --budget-dram: {} of row cache beside the index, {:.1} % hits",
            human_bytes(c.cache_bytes),
            c.hit_rate * 100.0
        );
    }
}
