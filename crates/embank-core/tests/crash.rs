//! Crash test with real processes: a child writes, flushes and keeps writing,
//! and is SIGKILLed at a random moment; the parent reopens the store and checks
//! that every flushed row is present and no row is torn.
//!
//! `EMBANK_CRASH_KILLS` sets the number of kills (default 50; `make test-long`
//! runs 1,000 per medium). `EMBANK_CRASH_SEED` replays a run; the seed is printed.
//!
//! The cost per kill is bounded, so a run is linear in its kills: every generation
//! deletes what generations a few steps back added, so the live set stays bounded,
//! and each check looks at the generations still in the window and then compares
//! the table's row count with the keys found there: a row outside the window (a
//! deleted key come back, a stray key) makes the counts differ.
//!
//! Reopens repair in the background (a killed process of this boot): half of them
//! slow the background pass down, so the checks, and writes (steady rows written
//! back unchanged, scratch keys inserted and deleted), run while buckets are still
//! being repaired and the free list rebuilt; the row count is checked once the
//! repair is done.
//!
//! The child also places hot keys every few generations (an index rebuild with
//! them first), so kills land inside those rebuilds too.
//!
//! Compact element types run the same test (fewer kills): `f16` and `int8` rows
//! are checked against the expected row passed through the same rounding.
//!
//! The child is this same test binary, started with `--ignored --exact crash_child`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use embank_core::RecordLayout;
use embank_core::{DType, MediumKind, Store, StoreOptions, TableOptions};

mod common;
use common::Rng;

const DIM: usize = 8;
/// Keys rewritten in every generation.
const STEADY: u64 = 1500;
/// Each generation g adds keys NEW_BASE + g*NEW_PER .. + NEW_PER, deletes the first
/// half of generation g-3's and the second half of generation g-WINDOW's.
const NEW_BASE: u64 = 1 << 32;
const NEW_PER: u64 = 40;
const WINDOW: u64 = 12;
const FLUSH_EVERY: u64 = 3;
/// Keys the parent inserts and deletes again while the repair runs.
const SCRATCH_BASE: u64 = 1 << 40;

fn row(g: u64, key: u64) -> [f32; DIM] {
    // Even elements carry the generation, odd ones the key (mod 2^11, exact in
    // f16 too): a torn or misplaced row shows up as a mismatch.
    let k = (key % (1 << 11)) as f32;
    [g as f32, k, g as f32, k, g as f32, k, g as f32, k]
}

/// The row of generation `g` as a table of `dtype` stores it.
fn stored(g: u64, key: u64, dtype: DType) -> Vec<f32> {
    let mut r = row(g, key).to_vec();
    RecordLayout::new(DIM, 0, dtype).round_trip(&mut r);
    r
}

/// The generation a stored row carries.
fn gen_of(r: &[f32]) -> u64 {
    r[0].round() as u64
}

/// True when `got` is the row of generation `g` for `key` as `dtype` stores it (int8
/// within 1e-3 of a quantization step: a row written back from the row cache is
/// re-quantized).
fn is_row(got: &[f32], g: u64, key: u64, dtype: DType) -> bool {
    let want = stored(g, key, dtype);
    if dtype != DType::Int8 {
        return got == &want[..];
    }
    let tol = (g as f32 - (key % (1 << 11)) as f32).abs() / 255.0 * 1e-3 + 1e-3;
    got.iter().zip(&want).all(|(a, b)| (a - b).abs() <= tol)
}

fn new_keys(g: u64) -> std::ops::Range<u64> {
    NEW_BASE + g * NEW_PER..NEW_BASE + (g + 1) * NEW_PER
}

/// The first half of generation g's keys (deleted by generation g + 3).
fn early_keys(g: u64) -> std::ops::Range<u64> {
    let r = new_keys(g);
    r.start..r.start + NEW_PER / 2
}

/// The second half of generation g's keys (deleted by generation g + WINDOW).
fn late_keys(g: u64) -> std::ops::Range<u64> {
    let r = new_keys(g);
    r.start + NEW_PER / 2..r.end
}

/// The generation that deletes key `k` of generation `g`.
fn deleter(g: u64, k: u64) -> u64 {
    if early_keys(g).contains(&k) {
        g + 3
    } else {
        g + WINDOW
    }
}

/// The child: writes generations from EMBANK_CRASH_GEN on until killed.
#[test]
#[ignore]
fn crash_child() {
    let Ok(path) = std::env::var("EMBANK_CRASH_DIR") else { return };
    let mut g: u64 = std::env::var("EMBANK_CRASH_GEN").unwrap().parse().unwrap();
    let store = Store::open(&path, StoreOptions::default()).unwrap();
    let table = match store.table("t") {
        Ok(t) => t,
        Err(_) => {
            let mut o = TableOptions::new(DIM as u32);
            o.capacity = 64; // grows while being killed
            o.medium = MediumKind::parse(&std::env::var("EMBANK_CRASH_MEDIUM").unwrap()).unwrap();
            o.dtype = DType::parse(&std::env::var("EMBANK_CRASH_DTYPE").unwrap()).unwrap();
            store.create_table("t", o).unwrap()
        }
    };
    let steady: Vec<u64> = (0..STEADY).collect();
    loop {
        println!("START {g}");
        for chunk in steady.chunks(250) {
            let rows: Vec<f32> = chunk.iter().flat_map(|&k| row(g, k)).collect();
            table.push(chunk, &rows).unwrap();
        }
        let fresh: Vec<u64> = new_keys(g).collect();
        let rows: Vec<f32> = fresh.iter().flat_map(|&k| row(g, k)).collect();
        table.push(&fresh, &rows).unwrap();
        if g >= 3 {
            let gone: Vec<u64> = early_keys(g - 3).collect();
            table.delete(&gone).unwrap();
        }
        if g >= WINDOW {
            let gone: Vec<u64> = late_keys(g - WINDOW).collect();
            table.delete(&gone).unwrap();
        }
        if g % 4 == 2 {
            // Hot placement rebuilds the index: kills land inside rebuilds too.
            table.place_hot(&steady[..300]).unwrap();
        }
        if g.is_multiple_of(FLUSH_EVERY) {
            table.flush().unwrap();
            println!("FLUSHED {g}");
        }
        g += 1;
    }
}

#[test]
fn sigkill_loses_no_flushed_row_and_tears_none() {
    crash_run(MediumKind::Mmap, DType::F32);
}

/// The same on the block medium: rows in the DRAM row cache, written back in
/// batches with O_DIRECT through io_uring, some written back and some not when
/// the kill lands.
#[test]
fn sigkill_block_medium_loses_no_flushed_row_and_tears_none() {
    crash_run(MediumKind::Block, DType::F32);
}

/// f16 and int8 rows on both media (a quarter of the kills: generations stay
/// below 2048, exact in f16).
#[test]
fn sigkill_compact_rows_lose_no_flushed_row_and_tear_none() {
    for dtype in [DType::F16, DType::Int8] {
        for medium in [MediumKind::Mmap, MediumKind::Block] {
            crash_run(medium, dtype);
        }
    }
}

fn crash_run(medium: MediumKind, dtype: DType) {
    let mut kills: u64 = std::env::var("EMBANK_CRASH_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
    if dtype != DType::F32 {
        // Generations stay below 2048 (about 30 a kill), exact in f16.
        kills = (kills / 4).clamp(12, 50);
    }
    let seed: u64 = std::env::var("EMBANK_CRASH_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    eprintln!("crash test ({}, {dtype}): {kills} kills, EMBANK_CRASH_SEED={seed}", medium.name());
    let mut rng = Rng(seed);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let exe = std::env::current_exe().unwrap();
    let mut next_gen = 1u64;
    let mut last_flushed = 0u64;
    let mut recoveries = 0u64;
    let mut during_repair = 0u64;
    let t0 = Instant::now();
    for kill in 0..kills {
        let mut child = Command::new(&exe)
            .args(["--ignored", "--exact", "crash_child", "--nocapture", "--test-threads", "1"])
            .env("EMBANK_CRASH_DIR", &path)
            .env("EMBANK_CRASH_GEN", next_gen.to_string())
            .env("EMBANK_CRASH_MEDIUM", medium.name())
            .env("EMBANK_CRASH_DTYPE", dtype.name())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut flushed, mut started) = (None, None);
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(g) = line.strip_prefix("FLUSHED ") {
                    flushed = Some(g.parse::<u64>().unwrap());
                } else if let Some(g) = line.strip_prefix("START ") {
                    started = Some(g.parse::<u64>().unwrap());
                }
            }
            (flushed, started)
        });
        // Kill somewhere between store open and a few generations in.
        std::thread::sleep(Duration::from_millis(5 + rng.next() % 120));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let (flushed, started) = reader.join().unwrap();
        if let Some(f) = flushed {
            last_flushed = f;
        }
        let ctx = format!("kill {kill}, seed {seed}, last flushed gen {last_flushed}");

        let mut options = StoreOptions::default();
        if rng.next().is_multiple_of(2) {
            options.repair_throttle = Some((2, Duration::from_millis(1)));
        }
        let store = Store::open(&path, options).unwrap_or_else(|e| panic!("{ctx}: reopen failed: {e}"));
        let Ok(table) = store.table("t") else {
            assert!(started.is_none(), "{ctx}: table missing after a generation started");
            continue;
        };
        // (Not `stats()`: it walks the whole index, which would repair every bucket.)
        if let Some(r) = &table.recover_stats() {
            recoveries += 1;
            assert!(r.background, "{ctx}: a process killed in this boot is repaired in the background");
            if r.pending {
                during_repair += 1;
            }
        }
        // Steady keys: present (once anything was flushed), whole, not older than the last flush.
        let keys: Vec<u64> = (0..STEADY).collect();
        let mut out = vec![0.0; keys.len() * DIM];
        let mut found = vec![false; keys.len()];
        table.lookup(&keys, &mut out, &mut found).unwrap();
        let mut max_gen = 0u64;
        for (i, &k) in keys.iter().enumerate() {
            if !found[i] {
                assert_eq!(last_flushed, 0, "{ctx}: key {k} missing");
                continue;
            }
            let r = &out[i * DIM..(i + 1) * DIM];
            let g = gen_of(r);
            assert!(is_row(r, g, k, dtype), "{ctx}: torn row for key {k}: {r:?}");
            assert!(g >= last_flushed, "{ctx}: key {k} at gen {g}, older than the flushed gen");
            max_gen = max_gen.max(g);
        }
        // Keys of the generations still in the window: present if a flushed generation
        // added them and none that ran deleted them, absent if a flushed generation deleted
        // them, either way in between; every row found whole.
        let ran = started.unwrap_or(next_gen).max(next_gen);
        let mut counted = found.iter().filter(|&&f| f).count() as u64;
        for g in last_flushed.saturating_sub(WINDOW + 1).max(1)..=ran {
            let keys: Vec<u64> = new_keys(g).collect();
            let mut out = vec![0.0; keys.len() * DIM];
            let mut found = vec![false; keys.len()];
            table.lookup(&keys, &mut out, &mut found).unwrap();
            for (i, &k) in keys.iter().enumerate() {
                let d = deleter(g, k);
                if d <= last_flushed {
                    assert!(!found[i], "{ctx}: key {k} of gen {g} was deleted by flushed gen {d} but is back");
                } else if g <= last_flushed && d > ran {
                    assert!(found[i], "{ctx}: key {k} of flushed gen {g} missing");
                }
                if found[i] {
                    let r = &out[i * DIM..(i + 1) * DIM];
                    assert!(is_row(r, g, k, dtype), "{ctx}: key {k} torn or wrong: {r:?}");
                    counted += 1;
                }
            }
        }
        // Writes while the repair may still run: steady rows written back as they are
        // (each replaces a record the free-list rebuild must not free twice), scratch keys
        // inserted and deleted again (the key count must come out exact).
        let keys: Vec<u64> = (0..STEADY).collect();
        let mut out = vec![0.0; keys.len() * DIM];
        let mut found = vec![false; keys.len()];
        table.lookup(&keys, &mut out, &mut found).unwrap();
        let present: Vec<u64> = keys.iter().zip(&found).filter(|(_, &f)| f).map(|(&k, _)| k).collect();
        let rows: Vec<f32> = keys
            .iter()
            .zip(&found)
            .filter(|(_, &f)| f)
            .flat_map(|(&k, _)| out[k as usize * DIM..][..DIM].to_vec())
            .collect();
        table.push(&present, &rows).unwrap_or_else(|e| panic!("{ctx}: write during repair failed: {e}"));
        let scratch: Vec<u64> = (SCRATCH_BASE..SCRATCH_BASE + 100).collect();
        table.push(&scratch, &vec![1.0; scratch.len() * DIM]).unwrap();
        table.delete(&scratch).unwrap();
        table.wait_repaired();
        let stats = table.stats().unwrap();
        assert_eq!(stats.medium, medium.name(), "{ctx}");
        let repaired = stats.recovered;
        assert!(repaired.is_none_or(|r| !r.pending), "{ctx}: repair still pending after wait_repaired");
        // Nothing outside the window: every older key was deleted by a flushed generation.
        assert_eq!(table.len().unwrap(), counted, "{ctx}: rows outside the checked window (a deleted key is back?)");
        // Every stored row passes its checksum.
        table.export(4096, |_, _| Ok(())).unwrap_or_else(|e| panic!("{ctx}: export failed: {e}"));
        // Re-run the generation the child was killed in, so its deletes happen too.
        assert!(max_gen <= started.unwrap_or(next_gen), "{ctx}: saw gen {max_gen}, beyond any started");
        next_gen = started.unwrap_or(next_gen);
        drop(table);
        store.close().unwrap();
    }
    assert!(last_flushed > 0, "no flush completed in {kills} runs: the kill window is too short");
    assert!(recoveries > 0, "no run needed recovery");
    assert!(kills < 20 || during_repair > 0, "no check ran while a background repair was pending");
    eprintln!(
        "crash test ({}, {dtype}): {kills} kills in {:.1}s, {recoveries} recoveries ({during_repair} checked during the background repair), last flushed gen {last_flushed}",
        medium.name(),
        t0.elapsed().as_secs_f64()
    );
}
