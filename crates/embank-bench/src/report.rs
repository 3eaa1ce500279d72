//! The bench's table on the terminal: each engine's throughput, latencies, memory and
//! share of the limits measured in the same run.

use super::Report;
use embank_core::human_bytes;

/// A share of a limit as a percentage, or `-` when the limit was not measured (skipped
/// limits leave NaN or infinity behind).
fn share(f: f64) -> String {
    if f.is_finite() {
        format!("{:.0}%", f * 100.0)
    } else {
        "-".into()
    }
}

pub(super) fn print_table(r: &Report) {
    println!();
    println!(
        "{:<18} {:>8} {:>10} {:>9} {:>9} {:>9} {:>10} {:>9} {:>6} {:>8} {:>8} {:>8}",
        "engine",
        "load s",
        "keys/s",
        "p50 us",
        "p99 us",
        "p999 us",
        "resident",
        "vs hash",
        "hits",
        "of gath",
        "of copy",
        "of I/O"
    );
    for e in &r.engines {
        if let Some(why) = &e.skipped {
            println!("{:<18} skipped: {why}", e.engine);
            continue;
        }
        println!(
            "{:<18} {:>8.2} {:>9.2}M {:>9.1} {:>9.1} {:>9.1} {:>10} {:>9} {:>6} {:>8} {:>8} {:>8}",
            e.engine,
            e.load_seconds,
            e.keys_per_second / 1e6,
            e.latency_us_p50,
            e.latency_us_p99,
            e.latency_us_p999,
            human_bytes(e.resident_bytes),
            e.ratio_to_hashmap.map_or("-".into(), |x| format!("{x:.2}x")),
            e.hit_rate.map_or("-".into(), |x| format!("{:.1}%", x * 100.0)),
            share(e.fraction_of_gather),
            share(e.fraction_of_copy_bound),
            e.fraction_of_device_io.map_or("-".into(), |f| format!("{:.0}%", f * 100.0))
        );
    }
    let home: Vec<String> = r
        .engines
        .iter()
        .filter_map(|e| e.home_bucket_fraction.map(|f| format!("{} {:.2} %", e.engine, f * 100.0)))
        .collect();
    if !home.is_empty() {
        println!("lookups answered from their home index bucket: {}", home.join(", "));
    }
    if let Some(gbs) = r.loopback_gb_per_second {
        // Networked engines' reply payload against one loopback TCP stream: rows travel
        // as f32 whatever they are stored as, except embank's with `--stored-rows`.
        let row = |engine: &str| -> f64 {
            if engine == "embank-tcp" && r.stored_rows {
                r.dtype.row_bytes(r.dim as usize) as f64
            } else {
                r.dim as f64 * 4.0
            }
        };
        let net: Vec<String> = r
            .engines
            .iter()
            .filter(|e| e.skipped.is_none() && (e.engine == "embank-tcp" || e.engine == "redis"))
            .map(|e| format!("{} {}", e.engine, share(e.keys_per_second * row(&e.engine) / (gbs * 1e9))))
            .collect();
        if !net.is_empty() {
            println!("reply payload of a loopback TCP stream's {gbs:.2} GB/s: {}", net.join(", "));
        }
    }
    if let Some(p) = &r.checkpoint_pattern {
        println!(
            "checkpoint floor: keeping the old rows runs this pattern at {:.2}x of its speed without checkpoints \
             (held {:.2}x, copied {:.2}x): the most a store checkpointing every {} batches can keep of its own",
            p.best_ratio(),
            p.held_keys_per_second / p.none_keys_per_second,
            p.copied_keys_per_second / p.none_keys_per_second,
            p.every
        );
        for e in r.engines.iter().filter(|e| e.skipped.is_none() && e.engine.starts_with("embank")) {
            println!(
                "{:<18} with checkpoints: {:.2} of the pattern holding old records, {:.2} of it without checkpoints",
                e.engine,
                e.keys_per_second / p.held_keys_per_second,
                e.keys_per_second / p.none_keys_per_second
            );
        }
    }
}

#[cfg(test)]
mod share_tests {
    #[test]
    fn a_limit_not_measured_prints_a_dash() {
        assert_eq!(super::share(f64::NAN), "-");
        assert_eq!(super::share(f64::INFINITY), "-");
        assert_eq!(super::share(0.404), "40%");
    }
}
