//! `embank bench`: the serving and training workloads against real baselines, side by side
//! in one run, next to the physical limits of the machine measured in the same run.
//!
//! A crate of its own so that what links the engine without the command line (the Python
//! extension) links neither the benchmark's plotting nor its baseline engines. The `embank`
//! command (embank-cli) parses `embank bench`'s arguments as [`BenchArgs`] and calls [`run`];
//! its other measuring commands share [`workload`], [`progress`] and [`plot`].

pub mod bags;
#[cfg(feature = "baselines")]
pub mod baselines;
mod dtypes;
pub mod engines;
pub mod limits;
mod measure;
pub mod pattern;
pub mod plot;
mod report;
pub mod workload;

pub use measure::load_rows;
use measure::{cpu_figures, load, measure};
use report::print_table;

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use embank_core::{human_bytes, parse_bytes, KeyStream};
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::workload::percentile;
use engines::Engine;

/// A progress bar on stderr in the command's one style: `what [=====>   ] 1,000/4,000 (rate, eta left)`.
pub fn progress(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {human_pos}/{human_len} ({per_sec}, {eta} left)")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// 100 % pull.
    YcsbC,
    /// 95 % pull, 5 % push (per batch).
    YcsbB,
    /// 50 % pull, 50 % push.
    YcsbA,
    /// 100 % pull with a power law of exponent 1.2 (hot set much smaller than the keys).
    HpsA,
    /// Each batch pulls rows, then pushes updated rows for the same keys.
    Train,
    /// Inference bags pooled in the store (`lookup_pooled`), some repeating whole:
    /// without and with the pooled-embedding cache (embank only).
    Bags,
}

impl Workload {
    /// The name used on the command line (`ycsb-c`, ...).
    pub fn name(self) -> String {
        self.to_possible_value().map_or_else(|| format!("{self:?}"), |v| v.get_name().to_owned())
    }

    fn push_fraction(self) -> f64 {
        match self {
            Workload::YcsbC | Workload::HpsA | Workload::Train | Workload::Bags => 0.0,
            Workload::YcsbB => 0.05,
            Workload::YcsbA => 0.5,
        }
    }

    fn default_zipf(self) -> f64 {
        if self == Workload::HpsA {
            1.2
        } else {
            0.99
        }
    }
}

/// Every engine this build knows, in report order.
pub const ENGINES: [&str; 9] = [
    "embank-tcp",
    "embank-mmap",
    "embank-mmap-hot",
    "embank-block",
    "embank-block-pread",
    "hashmap",
    "rocksdb",
    "lmdb",
    "redis",
];

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Access pattern: ycsb-c (all pulls), ycsb-b (95/5 pull/push), ycsb-a (50/50), hps-a (Zipf 1.2 pulls), train (pull then push).
    #[arg(long, value_enum, default_value = "ycsb-c")]
    pub workload: Workload,
    /// Keys loaded into every engine (key space 0..N).
    #[arg(long, default_value_t = 1_000_000)]
    pub keys: u64,
    /// Elements (f32) per row.
    #[arg(long, default_value_t = 128)]
    pub dim: u32,
    /// Element type of embank's tables: f32, f16 or int8 (the API stays f32; the
    /// baselines store f32 rows either way).
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: embank_core::DType,
    /// Compare element types in one run (e.g. `f32,int8`): one table per type on the one
    /// embedded engine of `--engines`, loaded side by side (memory for all of them), read
    /// by the same workload in alternating slices of `--duration` seconds, `--rounds`
    /// times; prints each round's keys/s and ratio to the first type, then min/median/max.
    /// Slices seconds apart see the same host, where separate runs minutes apart may not.
    /// The limits are not measured in this mode.
    #[arg(long, value_delimiter = ',', value_parser = parse_dtype, conflicts_with = "dtype")]
    pub dtypes: Vec<embank_core::DType>,
    /// With `--dtypes`: rounds of alternating slices.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// `embank-mmap-hot`: the hottest keys of the workload's popularity order placed in
    /// their home index buckets after the load (`Table::place_hot`).
    #[arg(long, default_value_t = 10_000)]
    pub hot_keys: u64,
    /// Capacity the embedded embank tables are created with (default: --keys). More
    /// than --keys leaves the index emptier (more keys in their home bucket, more bytes a
    /// key); fewer changes nothing, as the load sizes the index for --keys (0.76 full).
    #[arg(long)]
    pub capacity: Option<u64>,
    /// `bags`: ids per bag (a request holds `--batch / --bag-size` bags).
    #[arg(long, default_value_t = 20)]
    pub bag_size: usize,
    /// `bags`: fraction of bags drawn whole from the pool of repeating bags.
    #[arg(long, default_value_t = 0.05)]
    pub bag_repeat: f64,
    /// `bags`: distinct bags in that pool (drawn with Zipf 1.0 popularity).
    #[arg(long, default_value_t = 10_000)]
    pub bag_pool: usize,
    /// `bags`: budget of the pooled-embedding cache in the measured run with it.
    #[arg(long, default_value = "64M", value_parser = parse_bytes)]
    pub pooled_cache_bytes: u64,
    /// Keys per request.
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
    /// Zipf exponent of key popularity (0 = uniform); default 0.99, or 1.2 for hps-a.
    #[arg(long)]
    pub zipf: Option<f64>,
    /// Client threads (default: the number of cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seconds each engine is measured.
    #[arg(long, default_value_t = 10.0, conflicts_with = "ops")]
    pub duration: f64,
    /// Batches pre-generated per client thread; a thread replays them in a loop. Raise it
    /// so a run never repeats its keys (larger-than-memory runs: the distinct keys must
    /// not fit the cache just because the stream repeats). 8 bytes per key in DRAM.
    #[arg(long, default_value_t = 1000)]
    pub stream_batches: usize,
    /// Seconds of the same workload run before the measured phase and not counted,
    /// so caches reach their steady state (0: measure from a cold cache).
    #[arg(long, default_value_t = 0.0)]
    pub warmup: f64,
    /// Measure a fixed number of batches per engine instead of a duration.
    #[arg(long)]
    pub ops: Option<u64>,
    /// Comma-separated engines: embank-mmap, embank-block (block medium + io_uring + row
    /// cache), embank-block-pread (the same with the pread pool), hashmap, rocksdb, lmdb, redis.
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_ENGINES)]
    pub engines: Vec<String>,
    /// Seed of the key streams and operation mix.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Write results as JSON here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Directory for the engines' files (default: a temporary directory, removed after).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// A few seconds in all: 20 000 keys, dim 16, 0.3 s per engine. Keeps the bench from rotting.
    #[arg(long)]
    pub smoke: bool,
    /// DRAM budget of the caching engines: embank-block's row cache and RocksDB's block
    /// cache (RocksDB then reads with O_DIRECT so the page cache adds nothing). Default:
    /// the size of the rows. Accepts K, M, G suffixes (powers of 1024).
    #[arg(long, value_parser = parse_bytes)]
    pub cache_bytes: Option<u64>,
    /// embank's `mmap_random_access` store option (MADV_RANDOM on mmap files); `false`
    /// measures the read-optimised setting of a read-only, resident table.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub mmap_random_access: bool,
    /// embank's `huge_pages` store option: the index and mmap rows on transparent huge
    /// pages (MADV_HUGEPAGE instead of MADV_RANDOM), for read-mostly stores.
    #[arg(long)]
    pub huge_pages: bool,
    /// embank engines read rows as stored (`Table::lookup_stored`: f16 halves, int8 bytes
    /// with scale and bias, not decoded to f32; `embank-tcp` over the wire the same way),
    /// as a consumer that decodes them itself would (a GPU kernel); pushes still write f32. Compare with
    /// `gather_stored_keys_per_second`, the index-free gather of rows of that size.
    #[arg(long)]
    pub stored_rows: bool,
    /// Also time each batch on the reader thread's CPU clock (`CLOCK_THREAD_CPUTIME_ID`,
    /// two more clock reads a batch): the report gives that time's p50/p99 beside the
    /// wall clock's, so a tail the read path does not spend on the core (preemption,
    /// interrupts, a VM's steal) shows as wall time above CPU time.
    #[arg(long)]
    pub cpu_time: bool,
    /// Skip measuring the physical limits: the copy bandwidth, the index-free gather (it
    /// allocates a flat array of all rows: skip it in a memory-limited run), the device's
    /// I/O rates and the checkpoint pattern.
    #[arg(long)]
    pub skip_limits: bool,
    /// Running `embank serve` shards (`tcp://host:port[,host:port...]`): adds the
    /// `embank-tcp` engine, the workload through the client against them (a table
    /// `bench-<pid>` is created there, mmap medium, and dropped afterwards).
    #[arg(long)]
    pub target: Option<String>,
    /// Thread 0 takes a batch-aware checkpoint after every N of its batches (embank
    /// engines; its time counts in that batch). 0: never. With `--workload train` the
    /// limits then include the workload's memory pattern without a store, with and
    /// without keeping the old rows: the most any store can keep of its speed here.
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: usize,
    /// Token of the `--target` servers (default: $EMBANK_TOKEN).
    #[arg(long, env = "EMBANK_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// An element type by name (`f32`, `f16`, `int8`), as a flag gives it.
pub fn parse_dtype(s: &str) -> Result<embank_core::DType, String> {
    embank_core::DType::parse(s).map_err(|e| e.to_string())
}

#[derive(Debug, Serialize)]
pub struct EngineResult {
    pub engine: String,
    /// Why the engine was not measured, when it was not.
    pub skipped: Option<String>,
    pub load_seconds: f64,
    pub keys_per_second: f64,
    pub latency_us_p50: f64,
    pub latency_us_p99: f64,
    pub latency_us_p999: f64,
    pub batches: u64,
    pub resident_bytes: u64,
    /// `resident_bytes` per key of the data set.
    pub resident_bytes_per_row: f64,
    pub ratio_to_hashmap: Option<f64>,
    /// Hit rate of the DRAM row cache in the measured phase (embank-block engines).
    pub hit_rate: Option<f64>,
    pub fraction_of_gather: f64,
    pub fraction_of_copy_bound: f64,
    /// Block-medium engines: device requests per second in the measured phase as a
    /// fraction of what the device sustains at the record size, measured in the same run
    /// (`device` in the report): its random read rate when the engine only read, its
    /// mixed read/write rate when it wrote too (write-backs).
    pub fraction_of_device_io: Option<f64>,
    /// Block-medium engines: device reads and writes per second in the measured phase.
    pub device_reads_per_second: Option<f64>,
    pub device_writes_per_second: Option<f64>,
    /// embank engines: of the measured stream's lookups (a sample), the fraction that
    /// find their key in its home index bucket (one bucket read).
    pub home_bucket_fraction: Option<f64>,
    /// `embank-mmap-hot`: seconds the hot placement took after the load.
    pub placement_seconds: Option<f64>,
    /// Latency CDF: (microseconds, fraction of batches at or below).
    pub latency_cdf: Vec<(f64, f64)>,
    /// `--cpu-time`: p50 and p99 of a batch's time on its thread's CPU clock (µs), and the
    /// fraction of batches whose wall time exceeds their CPU time by more than their
    /// p50 CPU time (they waited off the core).
    pub cpu_us_p50: Option<f64>,
    pub cpu_us_p99: Option<f64>,
    pub off_core_fraction: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub workload: Workload,
    pub keys: u64,
    pub dim: u32,
    /// Element type of embank's tables.
    pub dtype: embank_core::DType,
    /// embank engines read rows as stored (`--stored-rows`).
    pub stored_rows: bool,
    pub batch: usize,
    pub zipf: f64,
    pub threads: usize,
    pub seed: u64,
    pub machine: String,
    /// DRAM budget of the caching engines, bytes.
    pub cache_bytes: u64,
    /// Seconds run before each measured phase, not counted.
    pub warmup_seconds: f64,
    /// Batches each thread replays in a loop.
    pub stream_batches: usize,
    pub copy_gb_per_second: f64,
    pub copy_bound_keys_per_second: f64,
    pub gather_keys_per_second: f64,
    /// p50 and p99 of one batch of the index-free gather (µs): the tail the access
    /// pattern has on this machine (0 when limits were skipped).
    pub gather_batch_us_p50: f64,
    pub gather_batch_us_p99: f64,
    /// With `--dtype f16|int8`: the index-free gather of rows of the type's stored size
    /// (`limits::gather_stored`), keys/s.
    pub gather_stored_keys_per_second: Option<f64>,
    /// With `--dtype f16|int8`: the gather through a table of record pointers (one random
    /// line a key), decoded, for f32 rows and for the type's rows (`limits::gather_indexed`),
    /// keys/s: `[f32, dtype]`.
    pub gather_indexed_keys_per_second: Option<[f64; 2]>,
    /// Payload bandwidth of one loopback TCP stream, GB/s (measured when a networked
    /// engine runs: `embank-tcp`, `redis`).
    pub loopback_gb_per_second: Option<f64>,
    /// The device's random read and mixed read/write rates at the block medium's record
    /// size (measured when a block-medium engine runs).
    pub device: Option<embank_core::DeviceLimits>,
    /// `train` with `--checkpoint-every`: the workload's memory pattern without a store,
    /// without checkpoints and with the old rows kept two ways (`bench::pattern`).
    pub checkpoint_pattern: Option<pattern::CheckpointPattern>,
    pub engines: Vec<EngineResult>,
}

fn skipped(engine: &str, why: String) -> EngineResult {
    EngineResult {
        engine: engine.to_owned(),
        skipped: Some(why),
        load_seconds: 0.0,
        keys_per_second: 0.0,
        latency_us_p50: 0.0,
        latency_us_p99: 0.0,
        latency_us_p999: 0.0,
        batches: 0,
        resident_bytes: 0,
        resident_bytes_per_row: 0.0,
        ratio_to_hashmap: None,
        hit_rate: None,
        fraction_of_gather: 0.0,
        fraction_of_copy_bound: 0.0,
        fraction_of_device_io: None,
        device_reads_per_second: None,
        device_writes_per_second: None,
        home_bucket_fraction: None,
        placement_seconds: None,
        latency_cdf: Vec::new(),
        cpu_us_p50: None,
        cpu_us_p99: None,
        off_core_fraction: None,
    }
}

/// CPU time the calling thread has run, in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Resident set of this process in bytes.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .map_or(0, |pages| pages * 4096)
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| s.lines().next().and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
        .map_or(String::new(), |kb| format!(", {} RAM", human_bytes(kb * 1024)));
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    format!("{cores} cores, {cpu}{mem}")
}

/// Key batches per thread, generated before anything is timed.
struct Streams {
    batches: Vec<Vec<u64>>,
    pushes: Vec<Vec<bool>>,
}

fn streams(args: &BenchArgs, threads: usize, zipf: f64) -> Result<Streams, String> {
    let mut batches = Vec::new();
    let mut pushes = Vec::new();
    for t in 0..threads {
        let seed = args.seed.wrapping_add(t as u64 * 7919);
        let mut s = KeyStream::new(args.keys, zipf, seed)?;
        batches.push(s.batches(args.stream_batches, args.batch));
        let mut rng = StdRng::seed_from_u64(seed ^ 0xABCD);
        pushes.push((0..args.stream_batches).map(|_| rng.random::<f64>() < args.workload.push_fraction()).collect());
    }
    Ok(Streams { batches, pushes })
}

fn open_engine(name: &str, dir: &std::path::Path, args: &BenchArgs, threads: usize) -> Result<Box<dyn Engine>, String> {
    let dim = args.dim as usize;
    // What the caching engines may keep in DRAM: the budget, or the whole data set (rows only).
    let dram_bytes = args.cache_bytes.unwrap_or(args.keys * dim as u64 * 4);
    let _ = threads;
    match name {
        "embank-tcp" => match &args.target {
            Some(target) => {
                let mut e = engines::Remote::open(target, args.token.clone(), args.keys, args.dim, args.dtype)?;
                e.set_stored_rows(args.stored_rows);
                Ok(Box::new(e))
            }
            None => Err("embank-tcp runs against servers: give --target tcp://host:port[,host:port]".into()),
        },
        "embank-mmap" | "embank-mmap-hot" | "embank-block" | "embank-block-pread" => {
            let name = ENGINES.iter().find(|e| **e == name).expect("known engine");
            let mut e = engines::Embank::open(
                name,
                dir,
                args.capacity.unwrap_or(args.keys),
                args.dim,
                args.dtype,
                dram_bytes,
                (args.mmap_random_access, args.huge_pages),
            )?;
            e.set_stored_rows(args.stored_rows);
            if name == &"embank-mmap-hot" {
                let zipf = args.zipf.unwrap_or(args.workload.default_zipf());
                let ranks = KeyStream::new(args.keys, zipf, args.seed)?;
                e.set_hot((0..args.hot_keys.min(args.keys)).map(|r| ranks.key_of_rank(r)).collect());
            }
            Ok(Box::new(e))
        }
        "hashmap" => Ok(Box::new(engines::ShardedHashMap::new(args.keys, dim))),
        #[cfg(feature = "baselines")]
        "lmdb" => Ok(Box::new(baselines::Lmdb::open(dir, args.keys, dim)?)),
        #[cfg(feature = "baselines")]
        "rocksdb" => Ok(Box::new(baselines::Rocks::open(dir, dram_bytes, dim, args.cache_bytes.is_some())?)),
        #[cfg(feature = "baselines")]
        "redis" => Ok(Box::new(baselines::Redis::start(dir, threads, dim)?)),
        #[cfg(not(feature = "baselines"))]
        "rocksdb" | "lmdb" | "redis" => Err(format!(
            "{name} is a baseline: this embank was built without them (cargo build --release -p embank-cli --features baselines)"
        )),
        other => Err(format!("unknown engine {other:?}; known: {}", ENGINES.join(", "))),
    }
}

/// The engines a bench runs unless told: the baselines are left out of a build without
/// them (said once), and named ones are reported skipped.
const DEFAULT_ENGINES: &str = "embank-mmap,hashmap,rocksdb,lmdb,redis";

pub fn run(mut args: BenchArgs) -> Result<(), String> {
    if !cfg!(feature = "baselines") && args.engines.join(",") == DEFAULT_ENGINES {
        args.engines.retain(|e| !matches!(e.as_str(), "rocksdb" | "lmdb" | "redis"));
        println!(
            "baselines rocksdb, lmdb, redis: not in this build (`make bench` builds embank with them and runs this bench)"
        );
    }
    if args.smoke {
        args.keys = 20_000;
        args.dim = 16;
        args.duration = 0.3;
        args.ops = None;
    }
    if args.keys == 0 || args.batch == 0 || args.dim == 0 || args.stream_batches == 0 {
        return Err("--keys, --batch, --dim and --stream-batches must be at least 1".into());
    }
    if args.target.is_some() && !args.engines.iter().any(|e| e == "embank-tcp") {
        args.engines.insert(0, "embank-tcp".into());
    }
    for e in &args.engines {
        if !ENGINES.contains(&e.as_str()) {
            return Err(format!("unknown engine {e:?}; known: {}", ENGINES.join(", ")));
        }
    }
    let threads =
        args.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)).max(1);
    let zipf = args.zipf.unwrap_or(args.workload.default_zipf());
    let dim = args.dim as usize;
    let tmp;
    let dir = match &args.dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
            d.clone()
        }
        None => {
            tmp = tempfile::Builder::new().prefix("embank-bench-").tempdir().map_err(|e| e.to_string())?;
            tmp.path().to_owned()
        }
    };
    let machine = machine();
    if args.workload == Workload::Bags {
        if !(0.0..=1.0).contains(&args.bag_repeat) || args.bag_size == 0 || args.pooled_cache_bytes == 0 {
            return Err("--bag-repeat must be in [0, 1], --bag-size and --pooled-cache-bytes at least 1".into());
        }
        return bags::run(&args, &dir, threads, zipf, machine);
    }
    println!(
        "embank bench {}: {} keys x dim {} {}{}, batch {}, Zipf {}, {} threads, {} per engine{}; {}",
        args.workload.name(),
        args.keys,
        dim,
        if args.dtypes.is_empty() {
            args.dtype.to_string()
        } else {
            args.dtypes.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(" | ")
        },
        if args.stored_rows { " (embank reads rows as stored)" } else { "" },
        args.batch,
        zipf,
        threads,
        args.ops.map_or(format!("{}s", args.duration), |o| format!("{o} batches")),
        if args.warmup > 0.0 { format!(" after {}s of warm-up", args.warmup) } else { String::new() },
        machine
    );
    let streams = streams(&args, threads, zipf)?;
    if !args.dtypes.is_empty() {
        return dtypes::run(&args, &dir, threads, zipf, &streams, machine);
    }

    // Physical limits first, while memory is empty.
    let row_bytes = (dim * 4) as f64;
    let (copy, copy_bound, gather, gather_p50, gather_p99) = if args.skip_limits {
        println!("limits: skipped (--skip-limits)");
        (f64::NAN, f64::NAN, f64::NAN, 0.0, 0.0)
    } else {
        let copy = embank_core::copy_bandwidth();
        let copy_bound = copy * 1e9 / (2.0 * row_bytes);
        let (gather, g50, g99) = limits::gather(args.keys, dim, &streams.batches, args.batch, args.duration.min(3.0));
        println!(
            "limits: memory copy {copy:.1} GB/s (read + write) bounds pulls at {:.1} M keys/s; index-free prefetched gather {:.1} M keys/s \
             (a batch: p50 {g50:.1} us, p99 {g99:.1} us, {:.2}x)",
            copy_bound / 1e6,
            gather / 1e6,
            g99 / g50.max(1e-9)
        );
        (copy, copy_bound, gather, g50, g99)
    };
    // A compact type's own limit: the same gather over rows of its stored size.
    let gather_stored = if args.skip_limits || args.dtype == embank_core::DType::F32 {
        None
    } else {
        let bytes = args.dtype.row_bytes(dim);
        let g = limits::gather_stored(args.keys, bytes, &streams.batches, args.batch, args.duration.min(3.0));
        println!(
            "limits: index-free gather of the stored {} rows ({bytes} B each, not decoded) {:.1} M keys/s: {:.2}x the f32 rows' gather",
            args.dtype,
            g / 1e6,
            g / gather
        );
        Some(g)
    };
    // Through a one-line index, decoded: f32 and the compact type, the ratio a compact
    // type can reach against f32 through any index that reads a line a key.
    let gather_indexed = if args.skip_limits || args.dtype == embank_core::DType::F32 {
        None
    } else {
        let secs = args.duration.min(3.0);
        let c = limits::gather_indexed(args.keys, dim, args.dtype, &streams.batches, args.batch, secs);
        let f = limits::gather_indexed(args.keys, dim, embank_core::DType::F32, &streams.batches, args.batch, secs);
        println!(
            "limits: gather through a one-line pointer table, decoded: f32 {:.1} M keys/s, {} {:.1} M keys/s ({:.2}x)",
            f / 1e6,
            args.dtype,
            c / 1e6,
            c / f
        );
        Some([f, c])
    };
    // The device's random I/O rate at the block medium's record size, where a block
    // engine will run: what its misses can at best be served at.
    let device = if args.skip_limits || !args.engines.iter().any(|e| e.starts_with("embank-block")) {
        None
    } else {
        let stride = embank_core::block_stride(args.dtype.row_bytes(dim), 512);
        let bytes = (args.keys * stride as u64).clamp(64 << 20, 1 << 30);
        let d = embank_core::device_limits(&dir, stride, bytes, embank_core::IO_DEPTH_DEFAULT, args.duration.min(3.0))?;
        println!(
            "limits: device random reads {:.0} k/s, mixed read/write {:.0} k ops/s ({} B each, depth {}, {} scratch file)",
            d.random_reads_per_second / 1e3,
            d.mixed_ops_per_second / 1e3,
            d.record_bytes,
            d.depth,
            human_bytes(d.file_bytes)
        );
        Some(d)
    };

    // What one loopback TCP stream carries: the transport's limit for networked engines.
    let loopback = if args.skip_limits || !args.engines.iter().any(|e| e == "embank-tcp" || e == "redis") {
        None
    } else {
        let gbs = limits::loopback_tcp(args.duration.min(3.0)).map_err(|e| format!("loopback TCP stream: {e}"))?;
        let wire_row = if args.stored_rows { args.dtype.row_bytes(dim) } else { dim * 4 };
        println!(
            "limits: one loopback TCP stream carries {gbs:.2} GB/s: {:.2} M rows/s of {wire_row} B ({} on the wire)",
            gbs * 1e9 / wire_row as f64 / 1e6,
            if args.stored_rows { format!("{} as stored", args.dtype) } else { "f32".to_string() }
        );
        Some(gbs)
    };

    // What keeping a checkpoint's old rows costs on this access pattern, whoever keeps them.
    let checkpoint_pattern = if args.skip_limits || args.workload != Workload::Train || args.checkpoint_every == 0 {
        None
    } else {
        checkpoint_floor(&args, threads, &streams)
    };

    let mut results = Vec::new();
    for name in &args.engines {
        let rss0 = rss_bytes();
        let engine = match open_engine(name, &dir, &args, threads) {
            Ok(e) => e,
            Err(why) => {
                println!("{name:<18} skipped: {why}");
                results.push(skipped(name, why));
                continue;
            }
        };
        let outcome = load(engine.as_ref(), args.keys, dim).and_then(|load_s| {
            let sample = &streams.batches[0][..streams.batches[0].len().min(200_000)];
            let home = engine.home_fraction(sample);
            if args.warmup > 0.0 {
                let warm = BenchArgs { duration: args.warmup, ops: None, ..args.clone() };
                measure(engine.as_ref(), &warm, threads, &streams)?;
            }
            engine.start_measure();
            let (secs, (mut lat, cpu)) = measure(engine.as_ref(), &args, threads, &streams)?;
            let cpu = cpu_figures(&lat, &cpu);
            lat.sort_unstable();
            // Resident after the measured phase, so caches filled by it count.
            let resident = rss_bytes().saturating_sub(rss0) + engine.external_resident_bytes().unwrap_or(0);
            let io = engine.io_ops().map(|(r, w)| (r as f64 / secs, w as f64 / secs));
            Ok((load_s, resident, secs, lat, cpu, engine.hit_rate(), io, home, engine.placement_seconds()))
        });
        drop(engine);
        // Free the disk before the next engine loads.
        let _ = std::fs::remove_dir_all(dir.join(name.as_str()));
        let (load_s, resident, secs, lat, cpu, hit_rate, io, home, placement) = match outcome {
            Ok(x) => x,
            Err(why) => {
                println!("{name:<18} failed: {why}");
                results.push(skipped(name, format!("failed: {why}")));
                continue;
            }
        };
        let kps = (lat.len() * args.batch) as f64 / secs;
        let cdf = (1..=100).map(|p| (percentile(&lat, p as f64) as f64 / 1e3, p as f64 / 100.0)).collect();
        results.push(EngineResult {
            engine: name.clone(),
            skipped: None,
            load_seconds: load_s,
            keys_per_second: kps,
            latency_us_p50: percentile(&lat, 50.0) as f64 / 1e3,
            latency_us_p99: percentile(&lat, 99.0) as f64 / 1e3,
            latency_us_p999: percentile(&lat, 99.9) as f64 / 1e3,
            batches: lat.len() as u64,
            resident_bytes: resident,
            resident_bytes_per_row: resident as f64 / args.keys.max(1) as f64,
            ratio_to_hashmap: None,
            hit_rate,
            fraction_of_gather: kps / gather,
            fraction_of_copy_bound: kps / copy_bound,
            fraction_of_device_io: match (&device, io) {
                (Some(d), Some((r, w))) if w > 0.0 => Some((r + w) / d.mixed_ops_per_second),
                (Some(d), Some((r, _))) => Some(r / d.random_reads_per_second),
                _ => None,
            },
            device_reads_per_second: io.map(|(r, _)| r),
            device_writes_per_second: io.map(|(_, w)| w),
            home_bucket_fraction: home,
            placement_seconds: placement,
            latency_cdf: cdf,
            cpu_us_p50: cpu.map(|c| c.0),
            cpu_us_p99: cpu.map(|c| c.1),
            off_core_fraction: cpu.map(|c| c.2),
        });
        if let Some((c50, c99, off)) = cpu {
            println!(
                "{name:<18} per batch: wall p50 {:.1} us, p99 {:.1} us ({:.2}x); on the thread's CPU clock p50 {c50:.1} us, \
                 p99 {c99:.1} us ({:.2}x); {:.2} % of batches waited off the core longer than the CPU p50",
                percentile(&lat, 50.0) as f64 / 1e3,
                percentile(&lat, 99.0) as f64 / 1e3,
                percentile(&lat, 99.0) as f64 / percentile(&lat, 50.0).max(1) as f64,
                c99 / c50.max(1e-9),
                100.0 * off
            );
        }
        match io {
            Some((r, w)) => println!(
                "{name:<18} done: {:.2} M keys/s; device {:.1} k reads/s, {:.1} k writes/s",
                kps / 1e6,
                r / 1e3,
                w / 1e3
            ),
            None => println!("{name:<18} done: {:.2} M keys/s", kps / 1e6),
        }
    }
    if let Some(base) = results.iter().find(|r| r.engine == "hashmap" && r.skipped.is_none()).map(|r| r.keys_per_second)
    {
        for r in results.iter_mut().filter(|r| r.skipped.is_none()) {
            r.ratio_to_hashmap = Some(r.keys_per_second / base);
        }
    }
    let report = Report {
        workload: args.workload,
        keys: args.keys,
        dim: args.dim,
        dtype: args.dtype,
        stored_rows: args.stored_rows,
        batch: args.batch,
        zipf,
        threads,
        seed: args.seed,
        machine,
        cache_bytes: args.cache_bytes.unwrap_or(args.keys * dim as u64 * 4),
        warmup_seconds: args.warmup,
        stream_batches: args.stream_batches,
        copy_gb_per_second: copy,
        copy_bound_keys_per_second: copy_bound,
        gather_keys_per_second: gather,
        gather_batch_us_p50: gather_p50,
        gather_batch_us_p99: gather_p99,
        gather_stored_keys_per_second: gather_stored,
        gather_indexed_keys_per_second: gather_indexed,
        loopback_gb_per_second: loopback,
        device,
        checkpoint_pattern,
        engines: results,
    };
    print_table(&report);
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_string_pretty(&report).expect("serializes"))
            .map_err(|e| format!("{}: {e}", out.display()))?;
        println!("results written to {}", out.display());
        let png = out.with_extension("png");
        match plot::draw(&report, &png) {
            Ok(()) => println!("plot written to {}", png.display()),
            Err(why) => println!("plot skipped: {why}"),
        }
    }
    Ok(())
}

/// Measures [`pattern::checkpoint_pattern`] for the bench's streams at the record stride
/// of embank's tables (`--dtype`), when it fits in half of the memory available.
fn checkpoint_floor(args: &BenchArgs, threads: usize, streams: &Streams) -> Option<pattern::CheckpointPattern> {
    let dim = args.dim as usize;
    let stride = embank_core::record_stride(args.dtype.row_bytes(dim), args.dtype) as usize;
    let need = pattern::bytes_needed(args.keys, stride, args.checkpoint_every, args.batch, threads);
    let available = mem_available_bytes().unwrap_or(u64::MAX);
    if need > available / 2 {
        println!(
            "limits: checkpoint pattern skipped: it needs {} and {} of memory is available",
            human_bytes(need),
            human_bytes(available)
        );
        return None;
    }
    let Some(p) = pattern::checkpoint_pattern(
        args.keys,
        stride,
        &streams.batches,
        args.batch,
        args.checkpoint_every,
        1.0,
        args.duration.min(3.0),
    ) else {
        println!("limits: checkpoint pattern skipped: too many records for it, or a thread ran out of spare records");
        return None;
    };
    println!(
        "limits: the train pattern without a store ({} B records, a checkpoint every {} batches): {:.2} M keys/s without \
         checkpoints; old records held {:.2} M ({:.2}x), old rows copied to an undo log {:.2} M ({:.2}x); {:.0} % of writes first changes",
        p.record_bytes,
        p.every,
        p.none_keys_per_second / 1e6,
        p.held_keys_per_second / 1e6,
        p.held_keys_per_second / p.none_keys_per_second,
        p.copied_keys_per_second / 1e6,
        p.copied_keys_per_second / p.none_keys_per_second,
        p.first_change_fraction * 100.0
    );
    Some(p)
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn mem_available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
}
