//! The rollback after a SIGKILL, applied on first touch (`index/undo.rs`): the reopened
//! table serves at once, each key the undo journal names goes back to the checkpoint
//! when first read or written, the background repair applies the rest.
//!
//! One scenario per medium, children of this test binary (`--ignored --exact
//! rollback_child`) doing the writes that get killed:
//! 1. a store with 3,000 keys, checkpoint 1;
//! 2. a child replaces, deletes and creates keys with no checkpoint, and is killed;
//! 3. reopened with the background slowed down: every key reads as at checkpoint 1
//!    while the rollback is pending (two readers beside a writer); writes during it
//!    read back; closed cleanly, the
//!    table equals the model, and again after a reopen;
//! 4. a child changes keys and is killed: back at checkpoint 1, the writes of step 3
//!    undone too; checkpoints 2..4 (the first finishes the rollback) drop checkpoint 1
//!    and free the records it held, while writes reuse them: every row stays whole (a
//!    record wrongly held would be freed under a live key);
//! 5. killed again, the rollback to 4 done and closed cleanly; reopened cleanly,
//!    checkpoints 5..7 drop 4 and reuse its records (the journal must say what the
//!    rollback undid);
//! 6. a child changes keys and is killed; another reopens, writes while its rollback
//!    is pending, and is killed too; reopened, the table equals checkpoint 7.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use embank_core::{MediumKind, Placement, Store, StoreOptions, Table, TableOptions};

mod common;
use common::{open_store, Rng};

const DIM: usize = 4;
const KEYS: u64 = 3000;

fn row(key: u64, generation: u64) -> Vec<f32> {
    (0..DIM).map(|i| (key * 10 + i as u64) as f32 + generation as f32 * 0.25).collect()
}

type Rows = BTreeMap<u64, Vec<f32>>;

fn contents(t: &Table) -> Rows {
    let mut out = BTreeMap::new();
    t.export(1024, |keys, rows| {
        for (i, &k) in keys.iter().enumerate() {
            out.insert(k, rows[i * DIM..(i + 1) * DIM].to_vec());
        }
        Ok(())
    })
    .unwrap();
    out
}

fn write(t: &Table, model: &mut Rows, keys: impl Iterator<Item = u64>, generation: u64) {
    let keys: Vec<u64> = keys.collect();
    let rows: Vec<f32> = keys.iter().flat_map(|&k| row(k, generation)).collect();
    t.push(&keys, &rows).unwrap();
    for &k in &keys {
        model.insert(k, row(k, generation));
    }
}

fn delete(t: &Table, model: &mut Rows, keys: impl Iterator<Item = u64>) {
    let keys: Vec<u64> = keys.collect();
    t.delete(&keys).unwrap();
    for k in &keys {
        model.remove(k);
    }
}

/// Reads `keys` in shuffled batches and compares each with the model.
fn check_reads(t: &Table, model: &Rows, keys: impl Iterator<Item = u64>, rng: &mut Rng, ctx: &str) -> usize {
    let mut keys: Vec<u64> = keys.collect();
    for i in (1..keys.len()).rev() {
        keys.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let mut batches_pending = 0;
    for batch in keys.chunks(256) {
        let pending = t.recover_stats().is_some_and(|r| r.rollback_seconds.is_none());
        let mut out = vec![0f32; batch.len() * DIM];
        let mut found = vec![false; batch.len()];
        t.lookup(batch, &mut out, &mut found).unwrap();
        for (i, &k) in batch.iter().enumerate() {
            let got = found[i].then(|| out[i * DIM..(i + 1) * DIM].to_vec());
            assert_eq!(got.as_ref(), model.get(&k), "{ctx}: key {k} (rollback pending: {pending})");
        }
        batches_pending += pending as usize;
    }
    batches_pending
}

fn options(medium: MediumKind) -> TableOptions {
    let mut o = TableOptions::new(DIM as u32);
    // Room for the rollback on first touch to start after step 6's writes (~6,400 keys
    // and 1,800 entries that may bring a key back: at most 0.9 of the slots,
    // `checkpoint::begin_lazy_rollback`).
    o.capacity = 3 * KEYS;
    o.medium = medium;
    if medium == MediumKind::Block {
        o.placement = Placement::Cache;
    }
    o
}

fn slow_repair() -> StoreOptions {
    // One bucket of the rollback (and of the pass) every 2 ms: a rollback of ~2,000
    // buckets stays pending for seconds.
    StoreOptions { repair_throttle: Some((1, Duration::from_millis(2))), ..Default::default() }
}

/// The children: `dirty` writes with no checkpoint; `during` reopens (a rollback
/// pending, slowed down) and writes while it runs. Each prints READY and waits to die.
#[test]
#[ignore]
fn rollback_child() {
    let Ok(dir) = std::env::var("EMBANK_RB_DIR") else { return };
    let mode = std::env::var("EMBANK_RB_MODE").unwrap();
    let during = mode == "during";
    let store = open_store(Path::new(&dir), if during { slow_repair() } else { StoreOptions::default() });
    let t = store.table("t").unwrap();
    let mut scratch = BTreeMap::new();
    if during {
        let r = t.recover_stats().unwrap();
        assert!(r.rollback_on_touch && r.rollback_seconds.is_none(), "{r:?}");
        println!("PENDING");
        write(&t, &mut scratch, 0..200, 9);
        delete(&t, &mut scratch, 200..300);
        write(&t, &mut scratch, 7000..7100, 9);
    } else {
        write(&t, &mut scratch, (0..KEYS).step_by(2), 3);
        delete(&t, &mut scratch, (1..KEYS).step_by(5));
        write(&t, &mut scratch, KEYS..KEYS + 1000, 3);
    }
    println!("READY");
    std::thread::sleep(Duration::from_secs(600));
}

fn start(dir: &Path, mode: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "rollback_child", "--nocapture", "--test-threads", "1"])
        .env("EMBANK_RB_DIR", dir)
        .env("EMBANK_RB_MODE", mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Runs a child until it says READY, then SIGKILLs it; returns what it printed.
fn run_and_kill(dir: &Path, mode: &str) -> Vec<String> {
    let mut child = start(dir, mode);
    let mut lines = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines().map_while(Result::ok) {
        // (libtest may print "test rollback_child ... " first on the same line.)
        let ready = line.ends_with("READY");
        lines.push(line);
        if ready {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(lines.last().is_some_and(|l| l.ends_with("READY")), "child {mode} printed {lines:?}");
    lines
}

fn scenario(medium: MediumKind) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let mut rng = Rng(0x5eed ^ medium as u64);
    let ctx = medium.name();
    let open = |options: StoreOptions| {
        let store = open_store(&dir, options);
        let t = store.table("t").unwrap();
        (store, t)
    };
    // 1. Checkpoint 1.
    let mut at_1 = BTreeMap::new();
    {
        let store = open_store(&dir, StoreOptions::default());
        let t = store.create_table("t", options(medium)).unwrap();
        write(&t, &mut at_1, 0..KEYS, 0);
        store.checkpoint(1).unwrap();
        store.close().unwrap();
    }
    // 2. Changes after it, killed.
    run_and_kill(&dir, "dirty");
    // 3. Reads while the rollback is pending, and writes; closed with no checkpoint.
    let mut model = at_1.clone();
    {
        let (store, t) = open(slow_repair());
        let r = t.recover_stats().unwrap();
        assert!(r.background && r.rollback_on_touch && r.rollback_seconds.is_none(), "{ctx}: {r:?}");
        let pending = check_reads(&t, &model, 0..1000, &mut rng, &format!("{ctx}, after the kill"));
        assert!(pending > 0, "{ctx}: no read ran while the rollback was pending");
        // Two readers of the other keys, first touches, while this thread writes.
        let unwritten = 1000..KEYS + 1000;
        let (written, pending) = {
            let (t, at_1, ctx) = (&t, &model, &ctx);
            std::thread::scope(|s| {
                let readers: Vec<_> = (0..2u64)
                    .map(|reader| {
                        let keys = unwritten.clone();
                        s.spawn(move || {
                            let mut rng = Rng(reader + 11);
                            check_reads(t, at_1, keys, &mut rng, &format!("{ctx}, reader {reader} beside writes"))
                        })
                    })
                    .collect();
                let mut written = at_1.clone();
                write(t, &mut written, 0..100, 5);
                delete(t, &mut written, 100..150);
                write(t, &mut written, 5000..5100, 5);
                (written, readers.into_iter().map(|r| r.join().unwrap()).sum::<usize>())
            })
        };
        assert!(pending > 0, "{ctx}: no concurrent read ran while the rollback was pending");
        model = written;
        check_reads(&t, &model, (0..150).chain(5000..5100), &mut rng, &format!("{ctx}, written during the rollback"));
        t.wait_repaired();
        assert!(t.recover_stats().unwrap().rollback_seconds.is_some(), "{ctx}: rollback not done after the repair");
        assert_rows(&t, &model, &format!("{ctx}: the table after the rollback and the writes"));
        assert_eq!(t.len().unwrap(), model.len() as u64, "{ctx}: row count");
        store.close().unwrap();
    }
    {
        let (store, t) = open(StoreOptions::default());
        assert!(t.recover_stats().is_none(), "{ctx}: closed cleanly");
        assert_rows(&t, &model, &format!("{ctx}: the table reopened"));
        store.close().unwrap();
    }
    // 4. Killed again: back at checkpoint 1, the writes made during the first rollback
    // undone too (they followed the journal's entries that rollback had undone).
    run_and_kill(&dir, "dirty");
    let mut model = at_1;
    {
        let (store, t) = open(StoreOptions::default());
        assert!(t.recover_stats().unwrap().rollback_on_touch, "{ctx}");
        check_reads(&t, &model, (0..KEYS + 1000).chain(5000..5100), &mut rng, &format!("{ctx}, killed again"));
        // Checkpoints while the rollback may still run (the first finishes it): they drop
        // checkpoint 1 and free the records it held, while writes reuse them.
        write(&t, &mut model, 0..100, 6);
        checkpoints_reusing_records(&store, &t, &mut model, 2);
        assert!(t.recover_stats().unwrap().rollback_seconds.is_some(), "{ctx}: checkpoint before the rollback ended");
        assert_rows(&t, &model, &format!("{ctx}: after checkpoint 1 was dropped and its records reused"));
        store.close().unwrap();
    }
    // 5. Killed again; the rollback (to checkpoint 4) finished and closed cleanly; after
    // a clean reopen, checkpoints drop checkpoint 4 and reuse the records it held.
    run_and_kill(&dir, "dirty");
    {
        let (store, t) = open(StoreOptions::default());
        assert!(t.recover_stats().unwrap().rollback_on_touch, "{ctx}");
        t.wait_repaired();
        store.close().unwrap();
    }
    {
        let (store, t) = open(StoreOptions::default());
        assert_rows(&t, &model, &format!("{ctx}: back at checkpoint 4, reopened cleanly"));
        checkpoints_reusing_records(&store, &t, &mut model, 5);
        assert_rows(&t, &model, &format!("{ctx}: after checkpoint 4 was dropped and its records reused"));
        store.close().unwrap();
    }
    // 6. Killed twice: once writing, once writing while its rollback was pending.
    run_and_kill(&dir, "dirty");
    let printed = run_and_kill(&dir, "during");
    assert!(printed.iter().any(|l| l.ends_with("PENDING")), "{ctx}: {printed:?}");
    {
        let (store, t) = open(StoreOptions::default());
        assert!(t.recover_stats().unwrap().rollback_on_touch, "{ctx}");
        check_reads(&t, &model, (0..KEYS + 1000).chain(7000..7100), &mut rng, &format!("{ctx}, after two kills"));
        t.wait_repaired();
        assert_rows(&t, &model, &format!("{ctx}: the table after two kills"));
        assert_eq!(t.len().unwrap(), model.len() as u64, "{ctx}: row count after two kills");
        store.close().unwrap();
    }
}

/// Checkpoints `first`, `first + 1` and `first + 2` (the store keeps 2: the second
/// drops the one before `first`, the third `first`), each after rewriting keys and
/// followed by writes of new keys (which reuse the records a drop freed); the model is
/// the table at the last one.
fn checkpoints_reusing_records(store: &Store, t: &Table, model: &mut Rows, first: u64) {
    for batch in first..first + 3 {
        write(t, model, (300..900).step_by(3), 20 + batch);
        store.checkpoint(batch).unwrap();
        if batch < first + 2 {
            write(t, model, batch * 1000 + 10_000..batch * 1000 + 10_500, 20 + batch);
        }
    }
}

/// The table equals the model, or the first key that differs.
fn assert_rows(t: &Table, model: &Rows, what: &str) {
    let got = contents(t);
    if &got == model {
        return;
    }
    let keys: std::collections::BTreeSet<u64> = got.keys().chain(model.keys()).copied().collect();
    let diff: Vec<u64> = keys.into_iter().filter(|k| got.get(k) != model.get(k)).collect();
    panic!(
        "{what}: {} of {} keys differ; key {}: table {:?}, model {:?}",
        diff.len(),
        model.len(),
        diff[0],
        got.get(&diff[0]),
        model.get(&diff[0])
    );
}

#[test]
fn rollback_on_first_touch_mmap() {
    scenario(MediumKind::Mmap);
}

#[test]
fn rollback_on_first_touch_block() {
    scenario(MediumKind::Block);
}
