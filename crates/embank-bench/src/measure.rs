//! The measured parts of a bench run: loading every key's row, and the timed phase
//! (every thread replaying its batches), with per-batch wall-clock and CPU time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::engines::Engine;
use super::{thread_cpu_ns, BenchArgs, Streams, Workload};
use crate::progress;
use crate::workload::{percentile, row_for};

pub(super) fn load(engine: &dyn Engine, keys: u64, dim: usize) -> Result<f64, String> {
    let t0 = Instant::now();
    engine.begin_load(keys)?;
    load_rows(keys, dim, &mut |ks, rows| engine.load(ks, rows))?;
    engine.finish_load()?;
    Ok(t0.elapsed().as_secs_f64())
}

/// Where a load writes a chunk of keys and their rows.
pub type RowSink<'a> = &'a mut dyn FnMut(&[u64], &[f32]) -> Result<(), String>;

/// Writes every key's `row_for` row through `push` (a bulk load's, or a table's), in
/// chunks, with a progress bar.
pub fn load_rows(keys: u64, dim: usize, push: RowSink<'_>) -> Result<(), String> {
    let bar = progress(keys, "load");
    let chunk = 10_000u64;
    let mut ks = Vec::with_capacity(chunk as usize);
    let mut rows = vec![0f32; chunk as usize * dim];
    let mut k = 0;
    while k < keys {
        let m = chunk.min(keys - k);
        ks.clear();
        ks.extend(k..k + m);
        for (i, &key) in ks.iter().enumerate() {
            row_for(key, &mut rows[i * dim..(i + 1) * dim]);
        }
        push(&ks, &rows[..m as usize * dim])?;
        k += m;
        bar.set_position(k);
    }
    bar.finish_and_clear();
    Ok(())
}

/// Per batch: wall-clock nanoseconds and, with `--cpu-time`, the thread's CPU nanoseconds
/// (else empty), in the same order.
pub(super) type Latencies = (Vec<u64>, Vec<u64>);

/// The measured phase: every thread replays its batches until the deadline or its share of `ops`.
pub(super) fn measure(
    engine: &dyn Engine,
    args: &BenchArgs,
    threads: usize,
    streams: &Streams,
) -> Result<(f64, Latencies), String> {
    let dim = args.dim as usize;
    let batch = args.batch;
    let deadline = Instant::now() + Duration::from_secs_f64(args.duration);
    let ops_left = AtomicU64::new(args.ops.unwrap_or(u64::MAX));
    let train = args.workload == Workload::Train;
    let bar = progress(args.ops.unwrap_or((args.duration * 10.0) as u64), "measure");
    let t0 = Instant::now();
    let results: Vec<Result<Latencies, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (keys, pushes, ops_left, bar) = (&streams.batches[t], &streams.pushes[t], &ops_left, &bar);
                s.spawn(move || -> Result<Latencies, String> {
                    let mut out = vec![0f32; batch * dim];
                    let mut rows = vec![0f32; batch * dim];
                    for (i, x) in rows.iter_mut().enumerate() {
                        *x = (i % 97) as f32 * 0.01;
                    }
                    let mut lat = Vec::with_capacity(1 << 16);
                    let mut cpu = Vec::with_capacity(if args.cpu_time { 1 << 16 } else { 0 });
                    let mut i = 0usize;
                    loop {
                        if args.ops.is_some() {
                            if ops_left.fetch_sub(1, Ordering::Relaxed) == 0
                                || ops_left.load(Ordering::Relaxed) > u64::MAX / 2
                            {
                                break;
                            }
                        } else if Instant::now() >= deadline {
                            break;
                        }
                        let b = i % args.stream_batches;
                        let ks = &keys[b * batch..(b + 1) * batch];
                        let cpu0 = if args.cpu_time { thread_cpu_ns() } else { 0 };
                        let start = Instant::now();
                        if train {
                            engine.pull(t, ks, &mut out)?;
                            for x in out.iter_mut() {
                                *x -= 0.001;
                            }
                            engine.push(t, ks, &out)?;
                        } else if pushes[b] {
                            engine.push(t, ks, &rows)?;
                        } else {
                            engine.pull(t, ks, &mut out)?;
                        }
                        if t == 0 && args.checkpoint_every > 0 && (i + 1).is_multiple_of(args.checkpoint_every) {
                            engine.checkpoint()?;
                        }
                        lat.push(start.elapsed().as_nanos() as u64);
                        if args.cpu_time {
                            cpu.push(thread_cpu_ns().saturating_sub(cpu0));
                        }
                        std::hint::black_box(&out);
                        i += 1;
                        if t == 0 && i.is_multiple_of(64) {
                            bar.set_position(match args.ops {
                                Some(ops) => ops.saturating_sub(ops_left.load(Ordering::Relaxed)),
                                None => (t0.elapsed().as_secs_f64() * 10.0) as u64,
                            });
                        }
                    }
                    Ok((lat, cpu))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a bench thread panicked".into()))).collect()
    });
    let elapsed = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let (mut lat, mut cpu) = (Vec::new(), Vec::new());
    for r in results {
        let (l, c) = r?;
        lat.extend(l);
        cpu.extend(c);
    }
    Ok((elapsed, (lat, cpu)))
}

/// `--cpu-time`'s figures of a measured phase: CPU p50, CPU p99 (µs), and the fraction
/// of batches whose wall time exceeds their CPU time by more than the CPU p50.
pub(super) fn cpu_figures(lat: &[u64], cpu: &[u64]) -> Option<(f64, f64, f64)> {
    if cpu.is_empty() || cpu.len() != lat.len() {
        return None;
    }
    let mut sorted = cpu.to_vec();
    sorted.sort_unstable();
    let p50 = percentile(&sorted, 50.0);
    let off = lat.iter().zip(cpu).filter(|(w, c)| w.saturating_sub(**c) > p50).count();
    Some((p50 as f64 / 1e3, percentile(&sorted, 99.0) as f64 / 1e3, off as f64 / lat.len() as f64))
}
