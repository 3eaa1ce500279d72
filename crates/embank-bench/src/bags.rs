//! `embank bench --workload bags`: an inference trace of pooled bags, some of
//! which repeat whole (`--bag-repeat` of them drawn from a pool of `--bag-pool`
//! bags, popular ones more often), answered by `Table::lookup_pooled` on the same
//! embedded table without and with the pooled-embedding cache: bags/s, ids/s,
//! latency per request and the cache's hit rate, side by side. The table is on
//! the mmap medium, or with `--engines embank-block` on the block medium under a
//! row cache of `--cache-bytes`.

use std::path::Path;
use std::time::{Duration, Instant};

use embank_core::{KeyStream, MediumKind, Pooling, Store, StoreOptions, TableOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde::Serialize;

use super::{load_rows, BenchArgs};
use crate::workload::percentile;

#[derive(Debug, Serialize)]
pub struct BagsResult {
    pub pooled_cache_bytes: u64,
    pub bags_per_second: f64,
    pub ids_per_second: f64,
    pub latency_us_p50: f64,
    pub latency_us_p99: f64,
    pub hit_rate: Option<f64>,
    pub cache_bytes_used: u64,
    pub cache_entries: u64,
}

#[derive(Debug, Serialize)]
pub struct BagsReport {
    pub medium: &'static str,
    pub keys: u64,
    pub dim: u32,
    pub dtype: embank_core::DType,
    pub ids_per_request: usize,
    pub bag_size: usize,
    pub bag_repeat: f64,
    pub bag_pool: usize,
    pub zipf: f64,
    pub threads: usize,
    pub machine: String,
    pub without: BagsResult,
    pub with: BagsResult,
    /// `with.bags_per_second / without.bags_per_second`.
    pub speedup: f64,
}

/// One thread's requests: ids, bag offsets (one more than bags) and which bags are
/// fresh (not from the pool) per request. Requests are replayed in a loop; each
/// replay shifts the fresh bags' ids, so only pool bags repeat.
struct Trace {
    requests: Vec<(Vec<u64>, Vec<usize>, Vec<bool>)>,
}

fn traces(args: &BenchArgs, threads: usize, zipf: f64) -> Result<Vec<Trace>, String> {
    let size = args.bag_size.max(1);
    let bags_per_request = (args.batch / size).max(1);
    // The pool of bags that repeat, the same for every thread.
    let mut pool_keys = KeyStream::new(args.keys, zipf, args.seed ^ 0x706f_6f6c)?;
    let pool: Vec<Vec<u64>> = (0..args.bag_pool.max(1)).map(|_| pool_keys.batches(1, size)).collect();
    let popular = Zipf::new(pool.len() as f64, 1.0).map_err(|e| e.to_string())?;
    (0..threads)
        .map(|t| {
            let seed = args.seed.wrapping_add(t as u64 * 7919);
            let mut keys = KeyStream::new(args.keys, zipf, seed)?;
            let mut rng = StdRng::seed_from_u64(seed ^ 0xBA65);
            let requests = (0..args.stream_batches)
                .map(|_| {
                    let mut ids = Vec::with_capacity(bags_per_request * size);
                    let mut offsets = vec![0];
                    let mut fresh = Vec::with_capacity(bags_per_request);
                    for _ in 0..bags_per_request {
                        if rng.random::<f64>() < args.bag_repeat {
                            let i = (popular.sample(&mut rng) as usize).clamp(1, pool.len()) - 1;
                            ids.extend_from_slice(&pool[i]);
                            fresh.push(false);
                        } else {
                            ids.extend(keys.batches(1, size));
                            fresh.push(true);
                        }
                        offsets.push(ids.len());
                    }
                    (ids, offsets, fresh)
                })
                .collect();
            Ok(Trace { requests })
        })
        .collect()
}

fn measure(args: &BenchArgs, dir: &Path, pooled_bytes: u64, traces: &[Trace]) -> Result<BagsResult, String> {
    let dim = args.dim as usize;
    // `--engines embank-block`: the block medium under a row cache of `--cache-bytes`.
    let block = args.engines.iter().any(|e| e == "embank-block");
    let mut options = StoreOptions { pooled_cache_bytes: pooled_bytes, ..StoreOptions::default() };
    if let Some(c) = args.cache_bytes {
        options.cache_bytes = c;
    }
    let path = dir.join(format!("bags-{pooled_bytes}"));
    let _ = std::fs::remove_dir_all(&path);
    let store = Store::open(&path, options).map_err(|e| e.to_string())?;
    let mut o = TableOptions::new(args.dim);
    o.capacity = args.keys;
    o.medium = if block { MediumKind::Block } else { MediumKind::Mmap };
    o.dtype = args.dtype;
    let table = store.create_table("bags", o).map_err(|e| e.to_string())?;
    let mut loader = table.loader(args.keys).map_err(|e| e.to_string())?;
    load_rows(args.keys, dim, &mut |keys, rows| loader.push(keys, rows).map_err(|e| e.to_string()))?;
    loader.finish().map_err(|e| e.to_string())?;
    let keys = args.keys;
    // `first`: the replay number the run starts at (the warm-up's replays are not reused).
    let run = |seconds: f64, first: usize| -> Result<(f64, Vec<u64>, u64), String> {
        let deadline = Instant::now() + Duration::from_secs_f64(seconds);
        let t0 = Instant::now();
        let results: Vec<Result<(Vec<u64>, u64), String>> = std::thread::scope(|s| {
            let handles: Vec<_> = traces
                .iter()
                .map(|trace| {
                    let table = &table;
                    s.spawn(move || {
                        let mut lat = Vec::new();
                        let mut bags = 0u64;
                        let mut out = Vec::new();
                        let mut shifted = Vec::new();
                        let mut i = 0;
                        while Instant::now() < deadline {
                            let n = trace.requests.len();
                            let (ids, offsets, fresh) = &trace.requests[i % n];
                            // Replay `i / n` of the trace: fresh bags get other ids.
                            let shift = (first + i / n) as u64 * 0x9E37_79B9;
                            shifted.clear();
                            shifted.extend_from_slice(ids);
                            for (b, &f) in fresh.iter().enumerate() {
                                if f {
                                    for k in &mut shifted[offsets[b]..offsets[b + 1]] {
                                        *k = (*k + shift) % keys;
                                    }
                                }
                            }
                            out.resize((offsets.len() - 1) * dim, 0.0);
                            let start = Instant::now();
                            table
                                .lookup_pooled(&shifted, offsets, None, Pooling::Sum, &mut out)
                                .map_err(|e| e.to_string())?;
                            lat.push(start.elapsed().as_nanos() as u64);
                            std::hint::black_box(&out);
                            bags += (offsets.len() - 1) as u64;
                            i += 1;
                        }
                        Ok((lat, bags))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("bench thread")).collect()
        });
        let secs = t0.elapsed().as_secs_f64();
        let mut lat = Vec::new();
        let mut bags = 0;
        for r in results {
            let (l, b) = r?;
            lat.extend(l);
            bags += b;
        }
        lat.sort_unstable();
        Ok((secs, lat, bags))
    };
    if args.warmup > 0.0 {
        run(args.warmup, 1 << 20)?;
    }
    let before = store.stats().map_err(|e| e.to_string())?.pooled;
    let (secs, lat, bags) = run(args.duration, 0)?;
    let after = store.stats().map_err(|e| e.to_string())?.pooled;
    let hit_rate = match (before, &after) {
        (Some(b), Some(a)) => {
            let (h, m) = (a.hits - b.hits, a.misses - b.misses);
            (h + m > 0).then(|| h as f64 / (h + m) as f64)
        }
        _ => None,
    };
    let ids_per_bag = args.bag_size.max(1) as f64;
    Ok(BagsResult {
        pooled_cache_bytes: pooled_bytes,
        bags_per_second: bags as f64 / secs,
        ids_per_second: bags as f64 * ids_per_bag / secs,
        latency_us_p50: percentile(&lat, 50.0) as f64 / 1e3,
        latency_us_p99: percentile(&lat, 99.0) as f64 / 1e3,
        hit_rate,
        cache_bytes_used: after.as_ref().map_or(0, |a| a.bytes),
        cache_entries: after.as_ref().map_or(0, |a| a.entries),
    })
}

pub fn run(args: &BenchArgs, dir: &Path, threads: usize, zipf: f64, machine: String) -> Result<(), String> {
    let traces = traces(args, threads, zipf)?;
    let size = args.bag_size.max(1);
    println!(
        "embank bench bags ({}): {} keys x dim {} {}, requests of {} bags of {size} ids, {:.0} % of bags repeat from a pool of {} (Zipf 1.0), ids Zipf {zipf}, {threads} threads, {}s each",
        if args.engines.iter().any(|e| e == "embank-block") { "block medium" } else { "mmap medium" },
        args.keys,
        args.dim,
        args.dtype,
        (args.batch / size).max(1),
        args.bag_repeat * 100.0,
        args.bag_pool,
        args.duration
    );
    let without = measure(args, dir, 0, &traces)?;
    let with = measure(args, dir, args.pooled_cache_bytes, &traces)?;
    let speedup = with.bags_per_second / without.bags_per_second.max(1e-9);
    println!(
        "\n{:<22} {:>12} {:>12} {:>9} {:>9} {:>8} {:>10}",
        "pooled cache", "bags/s", "ids/s", "p50 us", "p99 us", "hits", "bytes"
    );
    for r in [&without, &with] {
        println!(
            "{:<22} {:>11.2}M {:>11.2}M {:>9.1} {:>9.1} {:>8} {:>10}",
            if r.pooled_cache_bytes == 0 { "off".to_owned() } else { embank_core::human_bytes(r.pooled_cache_bytes) },
            r.bags_per_second / 1e6,
            r.ids_per_second / 1e6,
            r.latency_us_p50,
            r.latency_us_p99,
            r.hit_rate.map_or("-".into(), |h| format!("{:.1}%", h * 100.0)),
            embank_core::human_bytes(r.cache_bytes_used)
        );
    }
    println!("speed-up with the pooled cache: {speedup:.2}x");
    let report = BagsReport {
        medium: if args.engines.iter().any(|e| e == "embank-block") { "block" } else { "mmap" },
        keys: args.keys,
        dim: args.dim,
        dtype: args.dtype,
        ids_per_request: (args.batch / size).max(1) * size,
        bag_size: size,
        bag_repeat: args.bag_repeat,
        bag_pool: args.bag_pool,
        zipf,
        threads,
        machine,
        without,
        with,
        speedup,
    };
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_string_pretty(&report).expect("serializes"))
            .map_err(|e| format!("{}: {e}", out.display()))?;
        println!("wrote {}", out.display());
    }
    Ok(())
}
