//! `embank bench --smoke` runs every engine (a few seconds) so the bench never rots.
//! Built with `--features baselines`, every engine must be measured; without it the
//! baselines must be reported as skipped with the reason.

use std::process::Command;

#[test]
fn smoke_runs_or_explains_every_engine() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results.json");
    let all = "embank-mmap,embank-block,embank-block-pread,hashmap,rocksdb,lmdb,redis";
    for workload in ["ycsb-c", "ycsb-a", "hps-a", "train"] {
        let run = Command::new(env!("CARGO_BIN_EXE_embank"))
            // A row cache of a quarter of the rows, so the block engines miss and read.
            .args(["bench", "--smoke", "--engines", all, "--cache-bytes", "300K", "--workload", workload, "--out"])
            .arg(&out)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(run.status.success(), "{workload}: {stdout}\n{}", String::from_utf8_lossy(&run.stderr));
        let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        let engines = report["engines"].as_array().unwrap();
        assert_eq!(engines.len(), 7, "{workload}: every engine is reported");
        assert!(report["gather_keys_per_second"].as_f64().unwrap() > 0.0);
        let (g50, g99) =
            (report["gather_batch_us_p50"].as_f64().unwrap(), report["gather_batch_us_p99"].as_f64().unwrap());
        assert!(g50 > 0.0 && g99 >= g50, "{workload}: the gather's batch latency {g50} / {g99}");
        // The device's I/O limits at the block record size, measured with the block engines.
        let device = &report["device"];
        assert!(device["random_reads_per_second"].as_f64().unwrap() > 0.0, "{workload}: {device}");
        assert!(device["mixed_ops_per_second"].as_f64().unwrap() > 0.0, "{workload}: {device}");
        for e in engines {
            let name = e["engine"].as_str().unwrap();
            let baseline = matches!(name, "rocksdb" | "lmdb" | "redis");
            if baseline && !cfg!(feature = "baselines") {
                let why = e["skipped"].as_str().unwrap_or_else(|| panic!("{name} neither measured nor skipped"));
                assert!(why.contains("--features baselines"), "{name}: {why}");
            } else {
                assert!(e["skipped"].is_null(), "{workload}: {name} was not measured: {}", e["skipped"]);
                assert!(e["keys_per_second"].as_f64().unwrap() > 0.0, "{workload}: {name}");
                assert!(e["latency_us_p99"].as_f64().unwrap() >= e["latency_us_p50"].as_f64().unwrap());
                assert!(e["ratio_to_hashmap"].as_f64().is_some(), "{name}");
                if name.starts_with("embank-block") {
                    assert!(e["fraction_of_device_io"].as_f64().is_some(), "{workload}: {name}");
                    assert!(e["device_reads_per_second"].as_f64().unwrap() > 0.0, "{workload}: {name}");
                    let hit = e["hit_rate"].as_f64().unwrap_or_else(|| panic!("{workload}: {name} has no hit rate"));
                    assert!(
                        (0.0..1.0).contains(&hit),
                        "{workload}: {name} hit rate {hit}: the cache is too small to hit always"
                    );
                }
            }
        }
        assert!(stdout.contains("vs hash"), "{stdout}");
    }
}

/// Without `--engines`, a build without the baselines runs only its own engines and says
/// once how to get the others.
#[test]
fn the_default_engines_are_the_builds() {
    let run = Command::new(env!("CARGO_BIN_EXE_embank")).args(["bench", "--smoke", "--skip-limits"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    if cfg!(feature = "baselines") {
        assert!(stdout.contains("rocksdb") && !stdout.contains("not in this build"), "{stdout}");
    } else {
        assert_eq!(stdout.matches("not in this build").count(), 1, "{stdout}");
        assert!(!stdout.contains("skipped:"), "{stdout}");
    }
}

/// `--workload bags` measures the pooled-embedding cache against none, and
/// `--dtype` runs the embank engines on compact rows.
#[test]
fn smoke_bags_and_compact_dtypes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bags.json");
    let run = Command::new(env!("CARGO_BIN_EXE_embank"))
        .args(["bench", "--smoke", "--workload", "bags", "--bag-repeat", "0.5", "--warmup", "0.2", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert!(r["without"]["bags_per_second"].as_f64().unwrap() > 0.0);
    assert!(r["without"]["hit_rate"].is_null());
    let hit = r["with"]["hit_rate"].as_f64().unwrap();
    assert!(hit > 0.2 && hit <= 0.5 + 0.05, "about half the bags repeat: {hit}");
    assert!(r["speedup"].as_f64().unwrap() > 0.0);
    // int8 reads its rows as stored (`lookup_stored`), on both media.
    for dtype in ["f16", "int8"] {
        let out = dir.path().join(format!("{dtype}.json"));
        let stored: &[&str] = if dtype == "int8" { &["--stored-rows"] } else { &[] };
        let run = Command::new(env!("CARGO_BIN_EXE_embank"))
            .args([
                "bench",
                "--smoke",
                "--engines",
                "embank-mmap,embank-block",
                "--cache-bytes",
                "300K",
                "--dtype",
                dtype,
            ])
            .args(stored)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        assert!(run.status.success(), "{dtype}: {}", String::from_utf8_lossy(&run.stderr));
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        assert_eq!(r["dtype"], dtype);
        assert_eq!(r["stored_rows"], dtype == "int8");
        // The compact type's own limit, measured beside the f32 rows' gather.
        assert!(r["gather_stored_keys_per_second"].as_f64().unwrap() > 0.0, "{dtype}: {r}");
        // And the one-line-index bound, for f32 rows and for the type's, in the same run.
        let indexed = r["gather_indexed_keys_per_second"].as_array().unwrap();
        assert!(indexed.len() == 2 && indexed.iter().all(|v| v.as_f64().unwrap() > 0.0), "{dtype}: {r}");
        for e in r["engines"].as_array().unwrap() {
            assert!(e["keys_per_second"].as_f64().unwrap() > 0.0, "{dtype}: {e}");
            assert!(e["resident_bytes_per_row"].as_f64().is_some(), "{dtype}: {e}");
        }
    }
}

/// `--dtypes` loads one table per type side by side and alternates their slices: every
/// round has a slice of each type and its ratio to the first; a bad engine list is refused.
#[test]
fn dtypes_alternate_slices_of_one_table_per_type() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("dtypes.json");
    let run = Command::new(env!("CARGO_BIN_EXE_embank"))
        .args(["bench", "--smoke", "--engines", "embank-mmap", "--dtypes", "f32,int8", "--stored-rows"])
        .args(["--rounds", "3", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("round 3:") && stdout.contains("vs f32 in the same round"), "{stdout}");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(r["rounds"], 3);
    assert_eq!(r["stored_rows"], true);
    let types = r["dtypes"].as_array().unwrap();
    assert_eq!(types.iter().map(|t| t["dtype"].as_str().unwrap()).collect::<Vec<_>>(), ["f32", "int8"]);
    for t in types {
        let kps = t["keys_per_second"].as_array().unwrap();
        assert!(kps.len() == 3 && kps.iter().all(|v| v.as_f64().unwrap() > 0.0), "{t}");
        let firsts = types[0]["keys_per_second"].as_array().unwrap();
        for ((v, first), ratio) in kps.iter().zip(firsts).zip(t["ratio_to_first"].as_array().unwrap()) {
            let want = v.as_f64().unwrap() / first.as_f64().unwrap();
            assert!((ratio.as_f64().unwrap() - want).abs() < 1e-9, "{t}");
        }
    }
    for bad in [["--engines", "embank-mmap,hashmap"], ["--engines", "hashmap"]] {
        let run = Command::new(env!("CARGO_BIN_EXE_embank"))
            .args(["bench", "--smoke", "--dtypes", "f32,int8"])
            .args(bad)
            .output()
            .unwrap();
        assert!(!run.status.success());
        assert!(String::from_utf8_lossy(&run.stderr).contains("--dtypes"), "{bad:?}");
    }
}

#[test]
fn cpu_time_puts_the_thread_s_cpu_clock_beside_the_wall_clock() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results.json");
    for cpu_time in [true, false] {
        let mut args = vec!["bench", "--smoke", "--engines", "embank-mmap", "--skip-limits", "--out"];
        let path = out.to_str().unwrap();
        args.push(path);
        if cpu_time {
            args.push("--cpu-time");
        }
        let run = Command::new(env!("CARGO_BIN_EXE_embank")).args(&args).output().unwrap();
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
        let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        let e = &report["engines"][0];
        if cpu_time {
            let (c50, c99) = (e["cpu_us_p50"].as_f64().unwrap(), e["cpu_us_p99"].as_f64().unwrap());
            assert!(c50 > 0.0 && c99 >= c50, "{e}");
            // A batch's CPU time never exceeds its wall time by more than the clocks' grain.
            assert!(c50 <= e["latency_us_p50"].as_f64().unwrap() * 1.5 + 5.0, "{e}");
            let off = e["off_core_fraction"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&off), "{e}");
            assert!(stdout.contains("on the thread's CPU clock"), "{stdout}");
        } else {
            assert!(e["cpu_us_p50"].is_null() && e["off_core_fraction"].is_null(), "{e}");
        }
    }
}

/// `embank bench-stream` at a small size through a local Redis (the Kafka jars are not
/// needed), in a directory given by `--dir`: every number it reports is there and sane,
/// the read batches' times included.
#[test]
fn bench_stream_smoke_reports_reads_during_ingest_with_their_batch_times() {
    let work = tempfile::tempdir().unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_embank"))
        .args(["bench-stream", "--transport", "redis", "--rows", "20000", "--checkpoint-rows", "2000"])
        .args(["--seconds", "0.5", "--checkpoints", "2", "--train-batches", "20", "--repeats", "1"])
        .args(["--checkpoint-every", "10", "--ingest-share", "0.1", "--json", "--dir"])
        .arg(work.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    let json = stdout.lines().last().unwrap();
    let report: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"));
    for key in ["ingest_rows_per_second", "reads_idle_keys_per_second", "reads_during_ingest_keys_per_second"] {
        assert!(report[key].as_f64().unwrap() > 0.0, "{key}: {report}");
    }
    assert!(report["read_windows"].as_u64().unwrap() >= 1, "{report}");
    for window in ["idle", "during_ingest"] {
        let p50 = report[format!("reads_{window}_batch_p50_us")].as_f64().unwrap();
        let p99 = report[format!("reads_{window}_batch_p99_us")].as_f64().unwrap();
        let over = report[format!("reads_{window}_time_in_batches_over_1ms")].as_f64().unwrap();
        assert!(p50 > 0.0 && p99 >= p50 && (0.0..=1.0).contains(&over), "{window}: {p50} {p99} {over}");
    }
    assert!(stdout.contains("a read batch of 500"), "{stdout}");
    // Nothing is left under --dir; and a --dir that does not exist fails the run, with
    // the reason.
    assert_eq!(std::fs::read_dir(work.path()).unwrap().count(), 0, "the run's directory is left");
    let missing = work.path().join("missing");
    let run = Command::new(env!("CARGO_BIN_EXE_embank"))
        .args(["bench-stream", "--transport", "redis", "--rows", "2000", "--checkpoint-rows", "200", "--dir"])
        .arg(&missing)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success() && stderr.contains("cannot make the run's directory"), "{stderr}");
}
