//! The server process SIGKILLed under load, again and again.
//!
//! A client thread writes generations of rows through `embank serve`: every
//! generation rewrites the steady keys, inserts its own keys and deletes those
//! of three generations back, and every third generation ends with a flush. The
//! server is SIGKILLed at a random moment and started again on the same store
//! (which it repairs in the background while it serves); a new client then checks
//! every flushed generation: steady rows whole and not older than the last flush,
//! each generation's keys present or deleted as the flushed generations say, and —
//! once the repair is done — a row count that leaves no room for a deleted key
//! come back.
//!
//! `EMBANK_SERVER_KILLS` sets the kills (default 20; `make test-long` runs 1,000);
//! `EMBANK_SERVER_SEED` replays a run (the seed is printed).

use std::path::Path;
use std::process::Child;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use embank_core::TableOptions;
use embank_net::{Client, ClientOptions, RemoteTable};
use rand::{Rng, SeedableRng};

const DIM: usize = 8;
const STEADY: u64 = 600;
const NEW_BASE: u64 = 1 << 32;
const NEW_PER: u64 = 20;
/// Generation g deletes the keys generation g - LAG inserted.
const LAG: u64 = 3;
const FLUSH_EVERY: u64 = 3;

fn row(g: u64, key: u64) -> [f32; DIM] {
    let k = (key % (1 << 20)) as f32;
    [g as f32, k, g as f32, k, g as f32, k, g as f32, k]
}

fn new_keys(g: u64) -> Vec<u64> {
    (NEW_BASE + g * NEW_PER..NEW_BASE + (g + 1) * NEW_PER).collect()
}

fn start(config: &Path) -> (Child, String) {
    let s = common::serve(config, &[], common::Stderr::Hidden);
    (s.child, s.addr)
}

fn connect(addr: &str) -> Client {
    Client::connect(&[addr.to_string()], ClientOptions::default()).unwrap()
}

/// Writes generations from `g` on until a request fails (the server was killed).
fn write(t: &RemoteTable, mut g: u64, started: &AtomicU64, flushed: &AtomicU64, client: &Client) {
    let steady: Vec<u64> = (0..STEADY).collect();
    loop {
        started.store(g, Ordering::SeqCst);
        let rows: Vec<f32> = steady.iter().flat_map(|&k| row(g, k)).collect();
        if t.push(&steady, &rows).is_err() {
            return;
        }
        let fresh = new_keys(g);
        let rows: Vec<f32> = fresh.iter().flat_map(|&k| row(g, k)).collect();
        if t.push(&fresh, &rows).is_err() {
            return;
        }
        if g > LAG && t.delete(&new_keys(g - LAG)).is_err() {
            return;
        }
        if g.is_multiple_of(FLUSH_EVERY) {
            if client.flush().is_err() {
                return;
            }
            flushed.store(g, Ordering::SeqCst);
        }
        g += 1;
    }
}

/// Waits until the server's background repair (if any) is done: the row count is exact.
fn wait_repaired(t: &RemoteTable) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = t.stats().unwrap();
        let pending = stats["shards"].as_array().map_or_else(
            || stats["recovered"]["pending"].as_bool() == Some(true),
            |shards| shards.iter().any(|s| s["recovered"]["pending"].as_bool() == Some(true)),
        );
        if !pending {
            return;
        }
        assert!(Instant::now() < deadline, "background repair still pending after 30 s: {stats}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn sigkilled_server_loses_no_flushed_row() {
    let kills: u64 = std::env::var("EMBANK_SERVER_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let seed: u64 =
        std::env::var("EMBANK_SERVER_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| rand::rng().random());
    eprintln!("server crash test: {kills} kills, EMBANK_SERVER_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("serve.toml");
    let store = dir.path().join("store");
    std::fs::write(&config, format!("store = {:?}\nlisten = \"127.0.0.1:0\"\n", store.display().to_string())).unwrap();
    // `ran`: the latest generation that may have reached the store; the next writer
    // starts there again (so the deletes of a generation cut short happen too).
    let (mut ran, mut last_flushed, mut recoveries, mut during_repair) = (1u64, 0u64, 0u64, 0u64);
    let t0 = Instant::now();
    for kill in 0..kills {
        let (mut child, addr) = start(&config);
        let client = connect(&addr);
        let table = match client.table("t") {
            Ok(t) => t,
            Err(_) => {
                let mut o = TableOptions::new(DIM as u32);
                o.capacity = 64; // grows while being killed
                client.create_table("t", o).unwrap()
            }
        };
        let ctx = format!("kill {kill}, seed {seed}");
        // Check what the last kill left, while the server may still be repairing.
        if kill > 0 {
            let recovered = &table.stats().unwrap()["recovered"];
            if recovered.is_object() {
                recoveries += 1;
                if recovered["pending"].as_bool() == Some(true) {
                    during_repair += 1;
                }
            }
            let keys: Vec<u64> = (0..STEADY).collect();
            let mut out = vec![0.0; keys.len() * DIM];
            let mut found = vec![false; keys.len()];
            table.lookup(&keys, &mut out, &mut found).unwrap();
            let mut counted = 0u64;
            for (i, &k) in keys.iter().enumerate() {
                if !found[i] {
                    assert_eq!(last_flushed, 0, "{ctx}: steady key {k} missing after flushed gen {last_flushed}");
                    continue;
                }
                counted += 1;
                let r = &out[i * DIM..(i + 1) * DIM];
                let g = r[0] as u64;
                assert_eq!(r, &row(g, k), "{ctx}: torn row for key {k}");
                assert!(g >= last_flushed && g <= ran, "{ctx}: key {k} at gen {g}, flushed {last_flushed}, ran {ran}");
            }
            for h in last_flushed.saturating_sub(LAG).max(1)..=ran {
                let keys = new_keys(h);
                let mut out = vec![0.0; keys.len() * DIM];
                let mut found = vec![false; keys.len()];
                table.lookup(&keys, &mut out, &mut found).unwrap();
                for (i, &k) in keys.iter().enumerate() {
                    if h + LAG <= last_flushed {
                        assert!(!found[i], "{ctx}: key {k} of gen {h} deleted by a flushed gen is back");
                    } else if h <= last_flushed && h + LAG > ran {
                        assert!(found[i], "{ctx}: key {k} of flushed gen {h} missing");
                    }
                    if found[i] {
                        assert_eq!(&out[i * DIM..(i + 1) * DIM], &row(h, k), "{ctx}: key {k} torn or wrong");
                        counted += 1;
                    }
                }
            }
            wait_repaired(&table);
            assert_eq!(
                table.len().unwrap(),
                counted,
                "{ctx}: rows outside the checked window (a deleted key is back?)"
            );
        }
        // Write until killed; re-run the generation the kill cut short (its deletes too).
        let (started, flushed) = (Arc::new(AtomicU64::new(ran)), Arc::new(AtomicU64::new(0)));
        let writer = {
            let (t, c, s, f) = (table.clone(), client.clone(), Arc::clone(&started), Arc::clone(&flushed));
            let from = ran;
            std::thread::spawn(move || write(&t, from, &s, &f, &c))
        };
        std::thread::sleep(Duration::from_millis(rng.random_range(5..150)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        writer.join().unwrap();
        let f = flushed.load(Ordering::SeqCst);
        if f > 0 {
            last_flushed = f;
        }
        ran = started.load(Ordering::SeqCst);
        client.close();
    }
    assert!(last_flushed > 0, "no flush completed in {kills} runs: the kill window is too short");
    eprintln!(
        "server crash test: {kills} kills in {:.1}s, {recoveries} recoveries ({during_repair} checked during the background repair), last flushed gen {last_flushed}",
        t0.elapsed().as_secs_f64()
    );
}
