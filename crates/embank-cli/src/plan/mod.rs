//! `embank plan`: sizes every tier from the real key stream before memory is
//! bought. Per table: the hit-rate curve of the DRAM row cache and of a GPU
//! cache over sizes (Mattson stack distances, SHARDS-sampled for long traces), the
//! bytes of each tier from the store's own layouts, a recommended placement, and
//! answers for a DRAM or GPU budget or a target hit rate. Text, JSON (`--out`) and a
//! PNG of the curves (`--png`). The planner itself is the core's
//! ([`embank_core::plan`], which the Python package's `embank.plan` calls too): this
//! file parses the flags, draws progress bars and prints the plan.

use std::path::PathBuf;

use clap::Args;
use embank_core::{human_bytes, parse_bytes, plan, CurvePoint, DType, PlanOptions, PlanProgress};
use indicatif::ProgressBar;

use embank_bench::parse_dtype;

mod draw;

use draw::draw;

/// `embank plan`'s flags: [`PlanOptions`] (whose defaults they show) and what to do with
/// the plan.
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
    #[arg(long, default_value_t = PlanOptions::default().keys)]
    pub keys: u64,
    #[arg(long)]
    pub zipf: Option<f64>,
    #[arg(long, default_value_t = PlanOptions::default().batch)]
    pub batch: usize,
    #[arg(long, default_value_t = PlanOptions::default().threads)]
    pub threads: usize,
    #[arg(long, default_value_t = PlanOptions::default().stream_batches)]
    pub stream_batches: usize,
    #[arg(long, default_value_t = PlanOptions::default().seed)]
    pub seed: u64,
    /// Row elements of the tables.
    #[arg(long, default_value_t = PlanOptions::default().dim)]
    pub dim: usize,
    /// Element type: f32, f16 or int8.
    #[arg(long, default_value_t = PlanOptions::default().dtype, value_parser = parse_dtype)]
    pub dtype: DType,
    /// Server-side optimizer (its state is stored with each row): none, sgd, adagrad, adam.
    #[arg(long, default_value_t = PlanOptions::default().optimizer)]
    pub optimizer: String,
    /// Medium of the tables: mmap or block.
    #[arg(long, default_value_t = PlanOptions::default().medium)]
    pub medium: String,
    /// Row-cache sizes to predict the hit rate at (bytes, e.g. 10M,100M).
    #[arg(long, value_delimiter = ',', value_parser = parse_bytes)]
    pub cache_bytes: Vec<u64>,
    /// DRAM for the store (index and row cache): what hit rate does it buy?
    #[arg(long, value_parser = parse_bytes)]
    pub budget_dram: Option<u64>,
    /// GPU memory for a GPU cache: what hit rate does it buy? (With --optimizer: also for a
    /// training cache, `embank.gpu.TrainCache`, whose rows carry their optimizer state.)
    #[arg(long, value_parser = parse_bytes)]
    pub budget_gpu: Option<u64>,
    /// Hit rate to size the row cache for.
    #[arg(long, default_value_t = PlanOptions::default().target_hit_rate)]
    pub target_hit_rate: f64,
    /// Fraction of keys tracked (SHARDS sampling); default: all for traces up to
    /// --tracked-max accesses, fewer beyond.
    #[arg(long)]
    pub sample_rate: Option<f64>,
    /// Sampled accesses tracked at most (memory: about 30 bytes each).
    #[arg(long, default_value_t = PlanOptions::default().tracked_max, alias = "max-tracked")]
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
}

impl PlanArgs {
    /// The planner's options these flags give.
    pub fn options(&self) -> PlanOptions {
        PlanOptions {
            traces: self.traces.clone(),
            trace_keys: Vec::new(),
            criteo: self.criteo.clone(),
            features: self.features.clone(),
            hash_size: self.hash_size,
            training: self.training,
            lookahead: self.lookahead,
            workload: self.workload.clone(),
            keys: self.keys,
            zipf: self.zipf,
            batch: self.batch,
            threads: self.threads,
            stream_batches: self.stream_batches,
            seed: self.seed,
            dim: self.dim,
            dtype: self.dtype,
            optimizer: self.optimizer.clone(),
            medium: self.medium.clone(),
            cache_bytes: self.cache_bytes.clone(),
            budget_dram: self.budget_dram,
            budget_gpu: self.budget_gpu,
            target_hit_rate: self.target_hit_rate,
            sample_rate: self.sample_rate,
            tracked_max: self.tracked_max,
            limits: self.limits,
            dir: self.dir.clone(),
        }
    }
}

/// A progress bar of each pass over a stream, on stderr.
#[derive(Default)]
struct Bars(Option<ProgressBar>);

impl PlanProgress for Bars {
    fn begin(&mut self, what: &str, total: u64) {
        self.0 = Some(embank_bench::progress(total, what));
    }

    fn advance(&mut self, done: u64) {
        if let Some(bar) = &self.0 {
            bar.set_position(done);
        }
    }

    fn end(&mut self) {
        if let Some(bar) = self.0.take() {
            bar.finish_and_clear();
        }
    }
}

pub fn run(args: PlanArgs) -> Result<(), String> {
    let p = plan(&args.options(), &mut Bars::default())?;
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
        if let (Some(c), Some(b)) = (&t.at_budget_gpu_train, p.budget_gpu) {
            println!(
                "  training on the GPU in --budget-gpu: {:.0} rows with their optimizer state ({} B each), {:.1} % hits: \
                 embank.gpu.TrainCache(table, bytes_max={b})",
                c.rows,
                t.bytes.train_cache_entry_bytes,
                c.hit_rate * 100.0
            );
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
