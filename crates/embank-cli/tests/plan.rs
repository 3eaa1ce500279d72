//! `embank plan` end to end: a generated workload and a trace file, JSON and PNG out,
//! curves that only rise, bad input refused with a reason.

use std::process::Command;

fn embank(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_embank")).args(args).output().unwrap()
}

#[test]
fn plans_a_workload_and_a_trace() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let png = dir.path().join("plan.png");
    let run = embank(&[
        "plan",
        "--workload",
        "hps-a",
        "--keys",
        "50000",
        "--stream-batches",
        "40",
        "--batch",
        "250",
        "--dim",
        "16",
        "--cache-bytes",
        "100K,1M",
        "--budget-dram",
        "4M",
        "--budget-gpu",
        "1M",
        "--limits",
        "--dir",
        dir.path().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--png",
        png.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let t = &p["tables"][0];
    let curve = t["row_cache_curve"].as_array().unwrap();
    let rates: Vec<f64> = curve.iter().map(|c| c["hit_rate"].as_f64().unwrap()).collect();
    assert!(rates.windows(2).all(|w| w[1] >= w[0]), "{rates:?}");
    let at = t["at_cache_bytes"].as_array().unwrap();
    assert!(at[0]["hit_rate"].as_f64().unwrap() < at[1]["hit_rate"].as_f64().unwrap());
    assert!(t["at_budget_dram"]["hit_rate"].as_f64().unwrap() > 0.0);
    // --limits: keys/s from the machine's copy bandwidth and device read rate.
    let l = &p["limits"];
    assert!(l["copy_gb_per_second"].as_f64().unwrap() > 0.0 && l["miss_keys_per_second"].as_f64().unwrap() > 0.0);
    let k: Vec<f64> = at.iter().map(|c| c["keys_per_second"].as_f64().unwrap()).collect();
    assert!(k[1] > k[0], "more hits, more keys/s: {k:?}");
    assert!(["pin", "cache", "bypass"].contains(&t["placement"].as_str().unwrap()));
    assert!(std::fs::metadata(&png).unwrap().len() > 1000);

    // A trace file: two keys alternating (every access after the first two hits a
    // cache of two rows), then the same for a second table.
    let keys: Vec<u64> = (0..1000).map(|i| i % 2).collect();
    let trace = dir.path().join("two.npy");
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    let mut header = "{'descr': '<u8', 'fortran_order': False, 'shape': (1000,), }".to_owned();
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(' ');
    }
    header.push('\n');
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    for k in &keys {
        bytes.extend(k.to_le_bytes());
    }
    std::fs::write(&trace, bytes).unwrap();
    let run =
        embank(&["plan", "--trace", &format!("two={}", trace.display()), "--dim", "8", "--out", out.to_str().unwrap()]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let t = &p["tables"][0];
    assert_eq!(t["name"], "two");
    assert_eq!(t["distinct_keys"].as_f64().unwrap(), 2.0);
    let full = t["row_cache_curve"].as_array().unwrap().last().unwrap()["hit_rate"].as_f64().unwrap();
    assert!((full - 998.0 / 1000.0).abs() < 1e-9, "{full}");
    assert_eq!(t["placement"], "pin");

    // Criteo-format lines: feature 1 takes ids a, b, a, (missing), a; feature 2 is 7 always.
    let tsv = dir.path().join("day.tsv");
    let line = |c1: &str| format!("1\t{}\t{c1}\t7{}\n", "\t".repeat(12), "\tff".repeat(24));
    let text: String = ["a", "b", "a", "", "a"].iter().map(|c| line(c)).collect();
    std::fs::write(&tsv, text).unwrap();
    let run = embank(&[
        "plan",
        "--criteo",
        tsv.to_str().unwrap(),
        "--features",
        "1,2",
        "--dim",
        "8",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(p["tables"][0]["name"], "c1");
    assert_eq!(p["tables"][0]["distinct_keys"].as_f64().unwrap(), 3.0, "a, b and the missing id");
    assert_eq!(p["tables"][1]["distinct_keys"].as_f64().unwrap(), 1.0);
    let run = embank(&["plan", "--criteo", tsv.to_str().unwrap(), "--features", "27"]);
    assert!(String::from_utf8_lossy(&run.stderr).contains("1 to 26"));

    let run = embank(&["plan"]);
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("--trace"));
    let run = embank(&["plan", "--workload", "ycsb-a"]);
    assert!(String::from_utf8_lossy(&run.stderr).contains("read-only"));
}
