//! `embank demo`: the newcomer's first run.
//!
//! Builds a store of a few million rows, runs a Zipf 0.99 workload of batched
//! pulls against it and, in the same run, against the classic in-DRAM
//! parameter server (a `RwLock<HashMap<u64, Vec<f32>>>`), then closes the store
//! and times reopening it against rebuilding the hash map from an export.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use embank_core::{human_bytes, Initializer, KeyStream, Store, StoreOptions, Table, TableOptions};
use parking_lot::RwLock;

use embank_bench::progress;
use embank_bench::workload::{percentile, row_for};

#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Keep the store in this directory (must not exist yet); default: a temporary directory, removed at the end.
    #[arg(long)]
    pub path: Option<PathBuf>,
    /// Rows in the table.
    #[arg(long, default_value_t = 3_000_000)]
    pub rows: u64,
    /// Elements per row (f32).
    #[arg(long, default_value_t = 64)]
    pub dim: u32,
    /// Keys per pull request.
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
    /// Zipf exponent of the key popularity (0 = uniform).
    #[arg(long, default_value_t = 0.99)]
    pub zipf: f64,
    /// Threads issuing pulls (default: the number of cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seconds each engine is measured.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Seed of the key streams.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Skip the in-DRAM hash-map comparison.
    #[arg(long)]
    pub no_baseline: bool,
}

/// Result of one measured engine.
pub struct Measured {
    pub keys_per_second: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// Runs `pull(batch)` from `threads` threads for `seconds` over pre-generated key batches.
pub fn measure<F>(
    threads: usize,
    seconds: f64,
    batches: &[Arc<Vec<u64>>],
    batch: usize,
    dim: usize,
    pull: F,
) -> Measured
where
    F: Fn(&[u64], &mut [f32]) + Sync,
{
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let pull = &pull;
    let (mut lat, mut keys) = (Vec::new(), 0u64);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let stream = Arc::clone(&batches[t % batches.len()]);
                s.spawn(move || {
                    let mut out = vec![0f32; batch * dim];
                    let mut lat = Vec::with_capacity(1 << 16);
                    let mut i = 0;
                    let n = stream.len() / batch;
                    while Instant::now() < deadline {
                        let keys = &stream[(i % n) * batch..(i % n + 1) * batch];
                        let start = Instant::now();
                        pull(keys, &mut out);
                        lat.push(start.elapsed().as_nanos() as u64);
                        std::hint::black_box(&out);
                        i += 1;
                    }
                    lat
                })
            })
            .collect();
        for h in handles {
            let l = h.join().expect("worker");
            keys += (l.len() * batch) as u64;
            lat.extend(l);
        }
    });
    let elapsed = t0.elapsed().as_secs_f64();
    lat.sort_unstable();
    Measured {
        keys_per_second: keys as f64 / elapsed,
        p50_us: percentile(&lat, 50.0) as f64 / 1e3,
        p99_us: percentile(&lat, 99.0) as f64 / 1e3,
    }
}

/// Loads rows `0..rows` (`row_for` values) in one bulk load with a progress bar, as the
/// bench loads; returns the seconds taken.
pub(crate) fn load(table: &Table, rows: u64, dim: usize) -> Result<f64, String> {
    let t0 = Instant::now();
    let mut loader = table.loader(rows).map_err(|e| e.to_string())?;
    embank_bench::load_rows(rows, dim, &mut |keys, data| loader.push(keys, data).map_err(|e| e.to_string()))?;
    loader.finish().map_err(|e| e.to_string())?;
    Ok(t0.elapsed().as_secs_f64())
}

fn mrate(x: f64) -> String {
    format!("{:.2} M", x / 1e6)
}

pub fn run(args: DemoArgs) -> Result<(), String> {
    if args.rows == 0 || args.batch == 0 {
        return Err("--rows and --batch must be at least 1".into());
    }
    let threads =
        args.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)).max(1);
    let dim = args.dim as usize;
    let tmp;
    let path = match &args.path {
        Some(p) => {
            if p.exists() {
                return Err(format!(
                    "{} exists; give a new directory, or leave --path out for a temporary one",
                    p.display()
                ));
            }
            p.clone()
        }
        None => {
            tmp = tempfile::Builder::new().prefix("embank-demo-").tempdir().map_err(|e| e.to_string())?;
            tmp.path().join("store")
        }
    };
    println!(
        "embank demo: {} rows x dim {} (f32) at {}; Zipf {} pulls of {} keys from {} threads, {}s per engine",
        args.rows,
        dim,
        path.display(),
        args.zipf,
        args.batch,
        threads,
        args.seconds
    );

    // Build.
    let store = Store::open(&path, StoreOptions::default()).map_err(|e| e.to_string())?;
    let mut o = TableOptions::new(args.dim);
    o.capacity = args.rows;
    o.init = Initializer::Normal { mean: 0.0, std: 0.01 };
    let table = store.create_table("demo", o).map_err(|e| e.to_string())?;
    let load_s = load(&table, args.rows, dim)?;
    let t0 = Instant::now();
    store.flush().map_err(|e| e.to_string())?;
    let flush_s = t0.elapsed().as_secs_f64();
    let stats = table.stats().map_err(|e| e.to_string())?;
    println!(
        "load:    {} rows in {load_s:.2}s ({} rows/s), flush {flush_s:.2}s; index {} + rows {}, load factor {:.2}",
        args.rows,
        mrate(args.rows as f64 / load_s),
        human_bytes(stats.index_bytes),
        human_bytes(stats.rows_file_bytes),
        stats.load_factor
    );

    // Key streams, generated before anything is timed.
    let per_thread_batches = 2000usize;
    let batches: Vec<Arc<Vec<u64>>> = (0..threads)
        .map(|t| {
            KeyStream::new(args.rows, args.zipf, args.seed + t as u64)
                .map(|mut s| Arc::new(s.batches(per_thread_batches, args.batch)))
        })
        .collect::<Result<_, _>>()?;

    let embank = measure(threads, args.seconds, &batches, args.batch, dim, |keys, out| {
        table.pull(keys, out).expect("pull");
    });

    let baseline = if args.no_baseline {
        None
    } else {
        let bar = progress(args.rows, "hash map");
        let t0 = Instant::now();
        let mut map: HashMap<u64, Vec<f32>> = HashMap::with_capacity(args.rows as usize);
        for key in 0..args.rows {
            let mut row = vec![0f32; dim];
            row_for(key, &mut row);
            map.insert(key, row);
            if key % 65_536 == 0 {
                bar.set_position(key);
            }
        }
        bar.finish_and_clear();
        let build_s = t0.elapsed().as_secs_f64();
        let map = RwLock::new(map);
        let m = measure(threads, args.seconds, &batches, args.batch, dim, |keys, out| {
            let map = map.read();
            for (i, k) in keys.iter().enumerate() {
                out[i * dim..(i + 1) * dim].copy_from_slice(map.get(k).expect("loaded key"));
            }
        });
        drop(map);
        Some((m, build_s))
    };

    println!();
    println!("{:<34} {:>12} {:>12} {:>12}", "engine", "keys/s", "p50 batch", "p99 batch");
    println!(
        "{:<34} {:>12} {:>9.1} us {:>9.1} us",
        "embank (mmap medium)",
        mrate(embank.keys_per_second),
        embank.p50_us,
        embank.p99_us
    );
    if let Some((b, _)) = &baseline {
        println!(
            "{:<34} {:>12} {:>9.1} us {:>9.1} us",
            "RwLock<HashMap> in DRAM",
            mrate(b.keys_per_second),
            b.p50_us,
            b.p99_us
        );
        println!("{:<34} {:>11.2}x", "embank / hash map", embank.keys_per_second / b.keys_per_second);
    }

    // Reopen against rebuild.
    drop(table);
    store.close().map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let store = Store::open(&path, StoreOptions::default()).map_err(|e| e.to_string())?;
    let table = store.table("demo").map_err(|e| e.to_string())?;
    let reopen_s = t0.elapsed().as_secs_f64();
    let mut out = vec![0f32; args.batch * dim];
    let t1 = Instant::now();
    table.pull(&batches[0][..args.batch], &mut out).map_err(|e| e.to_string())?;
    let first_batch_us = t1.elapsed().as_secs_f64() * 1e6;
    println!();
    println!(
        "reopen:  store reopened in {:.2} ms; first {}-key pull after it took {first_batch_us:.0} us",
        reopen_s * 1e3,
        args.batch
    );
    if !args.no_baseline {
        let t0 = Instant::now();
        let mut map: HashMap<u64, Vec<f32>> = HashMap::with_capacity(args.rows as usize);
        table
            .export(65_536, |keys, rows| {
                for (i, &k) in keys.iter().enumerate() {
                    map.insert(k, rows[i * dim..(i + 1) * dim].to_vec());
                }
                Ok(())
            })
            .map_err(|e| e.to_string())?;
        let rebuild_s = t0.elapsed().as_secs_f64();
        println!(
            "         a hash-map server reloading the same rows from an export: {rebuild_s:.2}s ({:.0}x the reopen)",
            rebuild_s / reopen_s
        );
        drop(map);
    }
    drop(table);
    store.close().map_err(|e| e.to_string())?;
    if args.path.is_some() {
        println!("store kept at {}", path.display());
    }
    Ok(())
}
