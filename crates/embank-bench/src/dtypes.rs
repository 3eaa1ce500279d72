//! `embank bench --dtypes f32,int8[,f16]`: one table per element type, loaded side by
//! side in one process, read by the same workload in alternating slices of
//! `--duration` seconds, `--rounds` times (each round starts with the next type). Each
//! type's keys/s per round, their min/median/max, and each round's ratio to the first
//! type: a ratio between two slices seconds apart, so a host whose speed drifts between
//! runs minutes apart (a VM's neighbours, how many huge pages each load got) moves both
//! sides of it alike.

use std::path::Path;

use serde::Serialize;

use super::{load, measure, open_engine, BenchArgs, Streams};
use crate::workload::percentile;

#[derive(Debug, Serialize)]
pub struct DtypeSlices {
    pub dtype: embank_core::DType,
    pub load_seconds: f64,
    /// Keys/s of each round's slice.
    pub keys_per_second: Vec<f64>,
    pub latency_us_p50: Vec<f64>,
    pub latency_us_p99: Vec<f64>,
    /// This type's keys/s over the first type's, round by round (1 for the first).
    pub ratio_to_first: Vec<f64>,
}

#[derive(Debug, Serialize)]
pub struct DtypesReport {
    pub engine: String,
    pub workload: String,
    pub keys: u64,
    pub dim: u32,
    pub batch: usize,
    pub zipf: f64,
    pub threads: usize,
    pub stored_rows: bool,
    pub huge_pages: bool,
    pub slice_seconds: f64,
    pub rounds: usize,
    pub machine: String,
    pub dtypes: Vec<DtypeSlices>,
}

/// `(min, median, max)` of `v` (not empty).
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
    (s[0], median, s[n - 1])
}

pub(super) fn run(
    args: &BenchArgs,
    dir: &Path,
    threads: usize,
    zipf: f64,
    streams: &Streams,
    machine: String,
) -> Result<(), String> {
    let [name] = args.engines.as_slice() else {
        return Err(format!(
            "--dtypes compares embank's element types on one embedded engine: give --engines embank-mmap \
             (or embank-block), not {}",
            args.engines.join(",")
        ));
    };
    if !name.starts_with("embank-") || name == "embank-tcp" {
        return Err(format!("--dtypes needs an embedded embank engine (embank-mmap, embank-block...), not {name}"));
    }
    if args.rounds == 0 || args.ops.is_some() {
        return Err("--dtypes measures --rounds (at least 1) slices of --duration seconds; --ops does not apply".into());
    }
    let mut seen = Vec::new();
    for d in &args.dtypes {
        if seen.contains(d) {
            return Err(format!("--dtypes names {d} twice"));
        }
        seen.push(*d);
    }
    let dim = args.dim as usize;
    println!(
        "dtypes: {} on {name}{}, loaded side by side; {} rounds of a {}s slice each, alternating (limits not measured)",
        args.dtypes.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "),
        if args.stored_rows { ", rows read as stored" } else { "" },
        args.rounds,
        args.duration
    );
    let mut engines = Vec::new();
    let mut out = Vec::new();
    for &dtype in &args.dtypes {
        let per = BenchArgs { dtype, ..args.clone() };
        let sub = dir.join(dtype.to_string());
        std::fs::create_dir_all(&sub).map_err(|e| format!("{}: {e}", sub.display()))?;
        let engine = open_engine(name, &sub, &per, threads)?;
        let load_seconds = load(engine.as_ref(), args.keys, dim).map_err(|e| format!("{name} {dtype}: load: {e}"))?;
        println!("{name} {dtype}: loaded in {load_seconds:.2}s");
        engines.push((per, engine));
        out.push(DtypeSlices {
            dtype,
            load_seconds,
            keys_per_second: Vec::new(),
            latency_us_p50: Vec::new(),
            latency_us_p99: Vec::new(),
            ratio_to_first: Vec::new(),
        });
    }
    if args.warmup > 0.0 {
        for (per, engine) in &engines {
            let warm = BenchArgs { duration: args.warmup, ..per.clone() };
            measure(engine.as_ref(), &warm, threads, streams)?;
        }
    }
    let n = engines.len();
    for round in 0..args.rounds {
        for j in 0..n {
            let i = (round + j) % n;
            let (per, engine) = &engines[i];
            engine.start_measure();
            let (secs, (mut lat, _)) = measure(engine.as_ref(), per, threads, streams)?;
            lat.sort_unstable();
            let o = &mut out[i];
            o.keys_per_second.push((lat.len() * args.batch) as f64 / secs);
            o.latency_us_p50.push(percentile(&lat, 50.0) as f64 / 1e3);
            o.latency_us_p99.push(percentile(&lat, 99.0) as f64 / 1e3);
        }
        let first = out[0].keys_per_second[round];
        for o in out.iter_mut() {
            o.ratio_to_first.push(o.keys_per_second[round] / first);
        }
        let line: Vec<String> = out
            .iter()
            .enumerate()
            .map(|(i, o)| {
                let kps = o.keys_per_second[round] / 1e6;
                if i == 0 {
                    format!("{} {kps:.2} M keys/s", o.dtype)
                } else {
                    format!("{} {kps:.2} M ({:.2}x)", o.dtype, o.ratio_to_first[round])
                }
            })
            .collect();
        println!("round {}: {}", round + 1, line.join(", "));
    }
    for (i, o) in out.iter().enumerate() {
        let (lo, med, hi) = spread(&o.keys_per_second);
        let (p50, p99) = (spread(&o.latency_us_p50).1, spread(&o.latency_us_p99).1);
        let vs = if i == 0 {
            String::new()
        } else {
            let (rlo, rmed, rhi) = spread(&o.ratio_to_first);
            format!("; vs {} in the same round: median {rmed:.2}x (min {rlo:.2}x, max {rhi:.2}x)", out[0].dtype)
        };
        println!(
            "{:<5} keys/s median {:.2} M (min {:.2}, max {:.2}); batch p50 {p50:.1} us, p99 {p99:.1} us (medians){vs}",
            o.dtype.to_string(),
            med / 1e6,
            lo / 1e6,
            hi / 1e6
        );
    }
    drop(engines);
    if let Some(path) = &args.out {
        let report = DtypesReport {
            engine: name.clone(),
            workload: args.workload.name(),
            keys: args.keys,
            dim: args.dim,
            batch: args.batch,
            zipf,
            threads,
            stored_rows: args.stored_rows,
            huge_pages: args.huge_pages,
            slice_seconds: args.duration,
            rounds: args.rounds,
            machine,
            dtypes: out,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report).expect("serializes"))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        println!("results written to {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::spread;

    #[test]
    fn spread_gives_min_median_max() {
        assert_eq!(spread(&[3.0, 1.0, 2.0]), (1.0, 2.0, 3.0));
        assert_eq!(spread(&[4.0, 1.0, 2.0, 3.0]), (1.0, 2.5, 4.0));
        assert_eq!(spread(&[5.0]), (5.0, 5.0, 5.0));
    }
}
