//! Bulk loads (`Table::loader`, `Table::load`): a loaded table equals one written by
//! `push`, row for row, across growths and a reopen; bad input is refused with nothing
//! lost; and a SIGKILL at any moment of a load reopens the table before the load or
//! after it, whole.
//!
//! `EMBANK_LOAD_KILLS` sets the number of kills (default 20); `EMBANK_LOAD_SEED`
//! replays a run (the seed is printed). The child is this test binary, started with
//! `--ignored --exact load_child`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use embank_core::{ErrorKind, MediumKind, Optimizer, Placement, Store, StoreOptions, Table, TableOptions};

mod common;
use common::Rng;

const DIM: usize = 4;

fn row(tag: u64, key: u64) -> [f32; DIM] {
    [tag as f32, (key % 4096) as f32, (key >> 12) as f32, 1.0]
}

fn rows_of(keys: &[u64], tag: u64) -> Vec<f32> {
    keys.iter().flat_map(|&k| row(tag, k)).collect()
}

/// Every key of `keys` in both tables: the same presence and the same row, and the same
/// row count.
fn assert_equal(a: &Table, b: &Table, keys: &[u64], ctx: &str) {
    assert_eq!(a.len().unwrap(), b.len().unwrap(), "{ctx}: row counts differ");
    for chunk in keys.chunks(1000) {
        let mut ra = vec![0f32; chunk.len() * DIM];
        let mut rb = ra.clone();
        let (mut fa, mut fb) = (vec![false; chunk.len()], vec![false; chunk.len()]);
        a.lookup(chunk, &mut ra, &mut fa).unwrap();
        b.lookup(chunk, &mut rb, &mut fb).unwrap();
        for (i, &k) in chunk.iter().enumerate() {
            assert_eq!(fa[i], fb[i], "{ctx}: key {k} present in one table only");
            assert_eq!(&ra[i * DIM..(i + 1) * DIM], &rb[i * DIM..(i + 1) * DIM], "{ctx}: key {k}");
        }
    }
}

fn small_table(store: &Store, name: &str, medium: MediumKind) -> Table {
    let mut o = TableOptions::new(DIM as u32);
    o.capacity = 64; // the loads below grow it several times
    o.medium = medium;
    o.placement = Placement::Bypass; // no row cache: a table with one loads through push
    store.create_table(name, o).unwrap()
}

/// The same writes by `push` and by a bulk load (in batches: keys the table held,
/// keys new to it, a key loaded twice): the same table, before and after a reopen.
#[test]
fn a_bulk_load_equals_push_across_growth_and_reopen() {
    for medium in [MediumKind::Mmap, MediumKind::Block] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let before: Vec<u64> = (0..300u64).map(|k| k * 7).collect();
        let loaded: Vec<u64> = (0..20_000u64).map(|k| k * 3 + 1000).collect();
        // Keys of `before` loaded again, and the first loaded keys again (last wins).
        let again: Vec<u64> = before[..100].iter().copied().chain(loaded[..500].iter().copied()).collect();
        let mut all: Vec<u64> = before.iter().chain(&loaded).chain(&again).copied().collect();
        all.extend([1, 2, 5, u64::MAX]); // never written
        {
            let store = Store::open(&path, StoreOptions::default()).unwrap();
            let (pushed, bulk) = (small_table(&store, "pushed", medium), small_table(&store, "bulk", medium));
            for t in [&pushed, &bulk] {
                t.push(&before, &rows_of(&before, 1)).unwrap();
            }
            let buckets_before = bulk.stats().unwrap().buckets;
            let mut loader = bulk.loader(1000).unwrap(); // a small hint: the DRAM index grows
            for (chunk, tag) in loaded.chunks(3000).map(|c| (c, 2)).chain([(&again[..], 3)]) {
                pushed.push(chunk, &rows_of(chunk, tag)).unwrap();
                loader.push(chunk, &rows_of(chunk, tag)).unwrap();
            }
            assert_eq!(bulk.len().unwrap(), before.len() as u64, "a load shows nothing before its finish");
            let report = loader.finish().unwrap();
            assert!(report.bulk, "{report:?}");
            assert_eq!(report.rows, (loaded.len() + again.len()) as u64);
            assert_eq!(report.keys, (loaded.len() + 100) as u64, "{report:?}");
            assert!(bulk.stats().unwrap().buckets > buckets_before, "the load grew the index");
            assert_equal(&pushed, &bulk, &all, &format!("{} after the load", medium.name()));
            // The table works on as usual: a push after the load.
            for t in [&pushed, &bulk] {
                t.push(&loaded[..10], &rows_of(&loaded[..10], 4)).unwrap();
            }
            // A second load on the loaded table.
            let more: Vec<u64> = (0..2000u64).map(|k| k * 11 + 1).collect();
            pushed.push(&more, &rows_of(&more, 5)).unwrap();
            bulk.load(&more, &rows_of(&more, 5)).unwrap();
            all.extend(&more);
            assert_equal(&pushed, &bulk, &all, &format!("{} after the second load", medium.name()));
            store.close().unwrap();
        }
        let store = Store::open(&path, StoreOptions::default()).unwrap();
        let (pushed, bulk) = (store.table("pushed").unwrap(), store.table("bulk").unwrap());
        assert_equal(&pushed, &bulk, &all, &format!("{} after a reopen", medium.name()));
    }
}

/// Two tables "a" and "b" alike, with Adagrad state.
fn adagrad_pair(store: &Store) -> (Table, Table) {
    let mut o = TableOptions::new(DIM as u32);
    o.optimizer = Optimizer::Adagrad { lr: 0.1, eps: 1e-10, initial_accumulator_value: 0.5 };
    (store.create_table("a", o.clone()).unwrap(), store.create_table("b", o).unwrap())
}

/// A table with an optimizer: loaded rows start their state afresh, as pushed ones do.
#[test]
fn loaded_rows_start_their_optimizer_state_afresh() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let (a, b) = adagrad_pair(&store);
    let keys: Vec<u64> = (0..500).collect();
    a.push(&keys, &rows_of(&keys, 1)).unwrap();
    b.load(&keys, &rows_of(&keys, 1)).unwrap();
    let grads = vec![0.25f32; keys.len() * DIM];
    a.push_grad(&keys, &grads).unwrap();
    b.push_grad(&keys, &grads).unwrap();
    assert_equal(&a, &b, &keys, "after a gradient step");
}

/// Records given with their state (what a reshard copies) load as `push_with_state`
/// writes them: the same rows and state, the same next gradient step; a state the
/// optimizer cannot reach is refused with the loader still usable.
#[test]
fn records_with_state_load_as_push_with_state_writes_them() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let (a, b) = adagrad_pair(&store);
    let w = 2 * DIM; // row and accumulator
    let keys: Vec<u64> = (0..3000).collect();
    let records: Vec<f32> = keys
        .iter()
        .flat_map(|&k| row(1, k).into_iter().chain((0..DIM).map(move |i| (k % 7) as f32 + i as f32 * 0.5)))
        .collect();
    a.push_with_state(&keys, &records).unwrap();
    let mut load = b.loader(keys.len() as u64).unwrap();
    let mut bad = records[..w].to_vec();
    bad[DIM] = -1.0;
    let err = load.push_with_state(&keys[..1], &bad).unwrap_err();
    assert!(err.to_string().contains("refused"), "{err}");
    for (k, r) in keys.chunks(700).zip(records.chunks(700 * w)) {
        load.push_with_state(k, r).unwrap();
    }
    assert!(load.finish().unwrap().bulk);
    let (mut ra, mut rb) = (vec![0f32; keys.len() * w], vec![0f32; keys.len() * w]);
    let (mut fa, mut fb) = (vec![false; keys.len()], vec![false; keys.len()]);
    a.lookup_with_state(&keys, &mut ra, &mut fa).unwrap();
    b.lookup_with_state(&keys, &mut rb, &mut fb).unwrap();
    assert_eq!((fa, ra), (fb, rb), "rows and state as pushed");
    let grads = vec![0.25f32; keys.len() * DIM];
    a.push_grad(&keys, &grads).unwrap();
    b.push_grad(&keys, &grads).unwrap();
    assert_equal(&a, &b, &keys, "after a gradient step");
}

/// Bad input is refused before anything is written, the loader still usable; a table
/// written during its load, or a full table without growth, refuses the load with the
/// table as it was.
#[test]
fn bad_input_is_refused_with_nothing_lost() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let t = small_table(&store, "t", MediumKind::Mmap);
    let kept: Vec<u64> = (0..100).collect();
    t.push(&kept, &rows_of(&kept, 1)).unwrap();
    let reference = small_table(&store, "reference", MediumKind::Mmap);
    reference.push(&kept, &rows_of(&kept, 1)).unwrap();
    let fresh: Vec<u64> = (1000..3000).collect();
    let mut all: Vec<u64> = kept.iter().chain(&fresh).copied().collect();

    // Rows of the wrong length, and a non-finite value: refused, the loader goes on.
    let mut loader = t.loader(0).unwrap();
    let e = loader.push(&fresh, &rows_of(&fresh, 2)[1..]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    let mut nan = rows_of(&fresh, 2);
    nan[17] = f32::NAN;
    assert_eq!(loader.push(&fresh, &nan).unwrap_err().kind(), ErrorKind::InvalidInput);
    assert!(t.loader(0).is_err(), "a second load of the same table is refused");
    loader.push(&fresh, &rows_of(&fresh, 2)).unwrap();
    loader.finish().unwrap();
    reference.push(&fresh, &rows_of(&fresh, 2)).unwrap();
    assert_equal(&reference, &t, &all, "after the refused batches");
    assert_eq!(t.load(&fresh, &rows_of(&fresh, 2)[4..]).unwrap_err().kind(), ErrorKind::InvalidInput);

    // A write during the load: the finish refuses and the table keeps that write only.
    let other: Vec<u64> = (5000..6000).collect();
    all.extend(&other);
    let mut loader = t.loader(other.len() as u64).unwrap();
    loader.push(&other, &rows_of(&other, 3)).unwrap();
    t.push(&kept[..1], &rows_of(&kept[..1], 4)).unwrap();
    reference.push(&kept[..1], &rows_of(&kept[..1], 4)).unwrap();
    let e = loader.finish().unwrap_err();
    assert!(e.to_string().contains("written during its bulk load"), "{e}");
    assert_equal(&reference, &t, &all, "after a refused finish");
    // Its records went back: loading the same rows again takes no more of the file.
    let used = t.stats().unwrap().records_used;
    t.load(&other, &rows_of(&other, 3)).unwrap();
    reference.push(&other, &rows_of(&other, 3)).unwrap();
    assert_equal(&reference, &t, &all, "after the load done again");
    assert_eq!(t.stats().unwrap().records_used, used, "the refused load's records were reused");

    // A write during the load that grows the table (its next index generation): the
    // finish refuses, and the grown index, the table's now, survives the loader and a
    // reopen (the loader builds under a name of its own and removes only that).
    let buckets = t.stats().unwrap().buckets;
    let mut loader = t.loader(10).unwrap();
    loader.push(&[8_888_888], &row(6, 8_888_888)).unwrap();
    let growing: Vec<u64> = (20_000..20_000 + buckets * 14).collect();
    t.push(&growing, &rows_of(&growing, 7)).unwrap();
    reference.push(&growing, &rows_of(&growing, 7)).unwrap();
    assert!(t.stats().unwrap().buckets > buckets, "the pushes grew the table during the load");
    assert!(loader.finish().is_err());
    all.extend(&growing);
    all.push(8_888_888);
    assert_equal(&reference, &t, &all, "after a load refused by a growth");

    // A dropped loader leaves nothing.
    let mut loader = t.loader(10).unwrap();
    loader.push(&[9_999_999], &row(5, 9_999_999)).unwrap();
    drop(loader);
    all.push(9_999_999);
    assert_equal(&reference, &t, &all, "after a dropped loader");

    // Growth off: the load that does not fit is refused, the table as it was.
    let mut o = TableOptions::new(DIM as u32);
    o.capacity = 64;
    o.growth = false;
    let full = store.create_table("full", o).unwrap();
    full.push(&kept[..10], &rows_of(&kept[..10], 1)).unwrap();
    let e = full.load(&fresh, &rows_of(&fresh, 2)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TableFull, "{e}");
    assert_eq!(full.len().unwrap(), 10);
    full.push(&kept[10..20], &rows_of(&kept[10..20], 1)).unwrap();
    assert_eq!(full.len().unwrap(), 20, "the table takes writes after a refused load");
    drop((t, reference, full));
    store.close().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let (t, reference) = (store.table("t").unwrap(), store.table("reference").unwrap());
    assert_equal(&reference, &t, &all, "after a reopen");
}

// The crash test. Round r loads keys [r*N, (r+1)*N) with rows tagged r, the keys
// [0, OVERWRITE) again with rows tagged r (keys the table has: the last load wins), and
// its first DUPLICATES keys twice (a first row tagged r + 1000, then the right one), in
// batches of BATCH. After round r the table holds keys [0, (r+1)*N): [0, OVERWRITE)
// tagged r, the rest tagged by the round that loaded them.
const N: u64 = 6000;
const OVERWRITE: u64 = 300;
const DUPLICATES: u64 = 200;
const BATCH: usize = 1000;

fn round_keys(r: u64) -> Vec<(u64, u64)> {
    let mut keys: Vec<(u64, u64)> = (r * N..r * N + DUPLICATES).map(|k| (k, r + 1000)).collect();
    keys.extend((r * N..(r + 1) * N).map(|k| (k, r)));
    if r > 0 {
        keys.extend((0..OVERWRITE).map(|k| (k, r)));
    }
    keys
}

fn tag_after(round: u64, key: u64) -> u64 {
    if key < OVERWRITE {
        round
    } else {
        key / N
    }
}

/// The child: loads rounds from EMBANK_LOAD_ROUND on until killed.
#[test]
#[ignore]
fn load_child() {
    let Ok(path) = std::env::var("EMBANK_LOAD_DIR") else { return };
    let mut r: u64 = std::env::var("EMBANK_LOAD_ROUND").unwrap().parse().unwrap();
    let store = Store::open(&path, StoreOptions::default()).unwrap();
    let table = match store.table("t") {
        Ok(t) => t,
        Err(_) => {
            let mut o = TableOptions::new(DIM as u32);
            o.capacity = 64;
            store.create_table("t", o).unwrap()
        }
    };
    loop {
        println!("START {r}");
        let keys = round_keys(r);
        let mut loader = table.loader(N / 2).unwrap();
        for chunk in keys.chunks(BATCH) {
            let ks: Vec<u64> = chunk.iter().map(|&(k, _)| k).collect();
            let rows: Vec<f32> = chunk.iter().flat_map(|&(k, tag)| row(tag, k)).collect();
            loader.push(&ks, &rows).unwrap();
        }
        loader.finish().unwrap();
        println!("DONE {r}");
        r += 1;
    }
}

/// A child bulk-loads rounds and is SIGKILLed at random moments; every reopen must hold
/// exactly the rounds before the one cut short or that one too, whole: every key of the
/// rounds done with its right row, none of the cut round's keys otherwise, and the row
/// count to match.
#[test]
fn sigkill_during_a_bulk_load_reopens_before_or_after_it_whole() {
    let kills: u64 = std::env::var("EMBANK_LOAD_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let seed: u64 = std::env::var("EMBANK_LOAD_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    eprintln!("bulk load crash test: {kills} kills, EMBANK_LOAD_SEED={seed}");
    let mut rng = Rng(seed);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let exe = std::env::current_exe().unwrap();
    // Rounds the table holds (0: none yet).
    let mut rounds = 0u64;
    let (mut cut_before, mut cut_after, mut records_max) = (0u64, 0u64, 0u64);
    for kill in 0..kills {
        let mut child = Command::new(&exe)
            .args(["--ignored", "--exact", "load_child", "--nocapture", "--test-threads", "1"])
            .env("EMBANK_LOAD_DIR", &path)
            .env("EMBANK_LOAD_ROUND", rounds.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut done, mut started) = (None, None);
            // The test harness writes "test load_child ... " without a newline before the
            // child's first line: a word is looked for anywhere in a line, not at its start
            // (a START glued to it was missed, and a round the child finished unsaid then
            // looked like one too many).
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let after = |word: &str| line.find(word).map(|i| line[i + word.len()..].trim().parse::<u64>().unwrap());
                if let Some(r) = after("DONE ") {
                    done = Some(r);
                } else if let Some(r) = after("START ") {
                    started = Some(r);
                }
            }
            (done, started)
        });
        std::thread::sleep(Duration::from_millis(20 + rng.next() % 400));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let (done, started) = reader.join().unwrap();
        let ctx = format!("kill {kill}, seed {seed}, rounds held before {rounds}, done {done:?}, started {started:?}");
        let store = Store::open(&path, StoreOptions::default()).unwrap_or_else(|e| panic!("{ctx}: reopen: {e}"));
        let Ok(table) = store.table("t") else {
            assert!(started.is_none(), "{ctx}: table missing after a round started");
            continue;
        };
        store.wait_repaired().unwrap();
        let len = table.len().unwrap();
        assert!(len.is_multiple_of(N), "{ctx}: {len} rows: a round loaded in part");
        let now = len / N;
        // Whatever the child finished (it said DONE) is there; the round it was in may be.
        let least = done.map_or(rounds, |d| d + 1);
        let most = started.map_or(rounds, |s| s + 1);
        assert!(least <= now && now <= most, "{ctx}: the table holds {now} rounds, expected {least}..={most}");
        if started.is_some_and(|s| s + 1 > least) {
            if now == least {
                cut_before += 1;
            } else {
                cut_after += 1;
            }
        }
        if now > 0 {
            let keys: Vec<u64> = (0..now * N + N).collect(); // one round past: absent
            for chunk in keys.chunks(4096) {
                let mut out = vec![0f32; chunk.len() * DIM];
                let mut found = vec![false; chunk.len()];
                table.lookup(chunk, &mut out, &mut found).unwrap();
                for (i, &k) in chunk.iter().enumerate() {
                    let want = k < now * N;
                    assert_eq!(found[i], want, "{ctx}: key {k} present {} with {now} rounds", found[i]);
                    if want {
                        let tag = tag_after(now - 1, k);
                        assert_eq!(&out[i * DIM..(i + 1) * DIM], &row(tag, k), "{ctx}: key {k}");
                    }
                }
            }
        }
        records_max = records_max.max(table.stats().unwrap().records_used);
        rounds = now;
        drop(table);
        store.close().unwrap();
    }
    eprintln!(
        "bulk load crash test: {kills} kills, {rounds} rounds held at the end; kills inside a load: \
         {cut_before} reopened before it, {cut_after} after it; at most {records_max} records handed out"
    );
    assert!(rounds > 0, "no round finished in {kills} runs: the kill window is too short");
    // Records of loads cut short are found free and reused: the rows file stays within
    // a few rounds of what the table holds.
    let bound = 3 * rounds * N + 4 * (N + OVERWRITE + DUPLICATES);
    assert!(
        records_max <= bound,
        "{records_max} records handed out for {} rows: records of cut loads not reused",
        rounds * N
    );
}

/// A load's batch that fills its gathered keys (2 M) puts them in the next index while
/// another thread asks the table for its write lock (a second loader, refused): neither
/// waits forever (the batch once read the table's state twice, and parking_lot's fair
/// lock queues a second read behind a waiting writer: this test then hung). Threads of
/// their own, not scoped: a deadlock fails the test rather than hanging it.
#[test]
fn a_load_putting_its_keys_in_the_index_does_not_block_a_waiting_writer() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let t = small_table(&store, "t", MediumKind::Mmap);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    // The load's loader exists before the other thread asks for one.
    let mut loader = t.loader(1 << 21).unwrap();
    std::thread::spawn(move || {
        for chunk in (0..(1u64 << 21) + 1000).collect::<Vec<u64>>().chunks(100_000) {
            loader.push(chunk, &rows_of(chunk, 1)).unwrap();
        }
        loader.finish().unwrap();
        done_tx.send(()).unwrap();
    });
    let writer = {
        let (t, stop) = (t.clone(), stop.clone());
        // Writers queue on the state's write lock again and again meanwhile.
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let err = t.loader(1).err().map(|e| e.to_string()).unwrap_or_default();
                assert!(err.is_empty() || err.contains("running already"), "{err}");
            }
        })
    };
    if done_rx.recv_timeout(Duration::from_secs(120)).is_err() {
        // Closing the store would wait on the same lock: leak it and fail.
        std::mem::forget((t, store));
        panic!("the load and a writer waited on each other");
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert_eq!(t.len().unwrap(), (1 << 21) + 1000);
}
