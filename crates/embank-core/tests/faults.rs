//! Fault injection in the block medium's I/O layer: failed and short reads and
//! writes. Each failing operation must return an `Io` error, leave the store
//! consistent (every row either its old or its new value, never torn), and
//! lose nothing that was flushed. Runs with both I/O engines.

use std::collections::HashMap;
use std::sync::Arc;

use embank_core::FaultPlan;
use embank_core::{ErrorKind, IoChoice, MediumKind, Store, StoreOptions, Table, TableOptions};

const DIM: usize = 16;

fn row(key: u64, v: f32) -> Vec<f32> {
    (0..DIM).map(|j| v + key as f32 * 0.001 + j as f32).collect()
}

fn rows(keys: &[u64], v: f32) -> Vec<f32> {
    keys.iter().flat_map(|&k| row(k, v)).collect()
}

fn options(io: IoChoice, plan: &Arc<FaultPlan>) -> StoreOptions {
    StoreOptions {
        io_engine: io,
        io_depth: 8,
        // Room for every row, and dirty rows stay under the write-back thresholds, so
        // only the test's own calls do I/O while a fault is armed.
        cache_bytes: 1 << 20,
        fault: Some(Arc::clone(plan)),
        ..StoreOptions::default()
    }
}

/// Every key of the model has its row; `maybe` keys have one of the listed values or none.
fn assert_state(table: &Table, model: &HashMap<u64, Vec<f32>>, maybe: &[(u64, Vec<f32>)], ctx: &str) {
    let keys: Vec<u64> = model.keys().copied().collect();
    let mut out = vec![0.0; keys.len() * DIM];
    let mut found = vec![false; keys.len()];
    table.lookup(&keys, &mut out, &mut found).unwrap_or_else(|e| panic!("{ctx}: lookup failed: {e}"));
    for (i, k) in keys.iter().enumerate() {
        assert!(found[i], "{ctx}: key {k} lost");
        assert_eq!(&out[i * DIM..(i + 1) * DIM], &model[k][..], "{ctx}: key {k}");
    }
    for (k, want) in maybe {
        let mut out = vec![0.0; DIM];
        let mut found = [false];
        table.lookup(&[*k], &mut out, &mut found).unwrap();
        assert!(!found[0] || out == *want, "{ctx}: key {k} holds neither nothing nor its pushed row: {out:?}");
    }
}

fn run(io: IoChoice) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let plan = FaultPlan::new();
    let mut model = HashMap::new();
    {
        let store = Store::open(&path, options(io, &plan)).unwrap();
        let mut o = TableOptions::new(DIM as u32);
        o.medium = MediumKind::Block;
        o.capacity = 64; // growth happens during the faulty pushes too
        let t = store.create_table("t", o).unwrap();
        let base: Vec<u64> = (0..300).collect();
        t.push(&base, &rows(&base, 1.0)).unwrap();
        for &k in &base {
            model.insert(k, row(k, 1.0));
        }
        store.flush().unwrap();

        // 1. A write fails in the middle of a push of new rows (write-through).
        plan.fail_writes_after(0);
        let fresh: Vec<u64> = (1000..1200).collect();
        let e = t.push(&fresh, &rows(&fresh, 2.0)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{e}");
        let maybe: Vec<(u64, Vec<f32>)> = fresh.iter().map(|&k| (k, row(k, 2.0))).collect();
        assert_state(&t, &model, &maybe, "after a failed write-through");

        // 2. A short write while writing back dirty rows: flush fails, rows stay dirty
        //    (still readable with their new values), a later flush succeeds.
        let upd: Vec<u64> = (0..300).step_by(3).collect();
        t.push(&upd, &rows(&upd, 3.0)).unwrap();
        for &k in &upd {
            model.insert(k, row(k, 3.0));
        }
        plan.short.store(true, std::sync::atomic::Ordering::SeqCst);
        plan.fail_writes_after(0);
        let e = store.flush().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{e}");
        assert!(e.to_string().contains("short write"), "{e}");
        plan.short.store(false, std::sync::atomic::Ordering::SeqCst);
        assert_state(&t, &model, &[], "after a failed write-back");
        plan.clear();
        store.flush().unwrap();
        assert_state(&t, &model, &[], "after the flush that worked");
    }
    {
        // Reopen: the row cache starts empty, so reads go to the medium.
        let store = Store::open(&path, options(io, &plan)).unwrap();
        let t = store.table("t").unwrap();
        let maybe: Vec<(u64, Vec<f32>)> = (1000..1200).map(|k| (k, row(k, 2.0))).collect();

        // 3. A read fails: the lookup fails, nothing changes.
        plan.fail_reads_after(0);
        let keys: Vec<u64> = (0..300).collect();
        let mut out = vec![0.0; keys.len() * DIM];
        let mut found = vec![false; keys.len()];
        let e = t.lookup(&keys, &mut out, &mut found).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{e}");
        // 4. A short read of a pull: fails too, and creates nothing.
        plan.short.store(true, std::sync::atomic::Ordering::SeqCst);
        plan.fail_reads_after(0);
        let len = t.len().unwrap();
        let e = t.pull(&keys, &mut out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{e}");
        assert_eq!(t.len().unwrap(), len, "a failed pull creates no rows");
        plan.short.store(false, std::sync::atomic::Ordering::SeqCst);
        plan.clear();
        assert_state(&t, &model, &maybe, "after failed reads");
        assert!(plan.injected.load(std::sync::atomic::Ordering::SeqCst) >= 4);
        // Drop without closing cleanly is not possible here (close flushes); the crash
        // test covers kills. Close, then reopen without faults.
    }
    let store = Store::open(&path, StoreOptions { io_engine: io, ..StoreOptions::default() }).unwrap();
    let t = store.table("t").unwrap();
    let maybe: Vec<(u64, Vec<f32>)> = (1000..1200).map(|k| (k, row(k, 2.0))).collect();
    assert_state(&t, &model, &maybe, "after reopening");
    t.export(64, |_, _| Ok(())).unwrap();
}

#[test]
fn io_faults_with_pread() {
    run(IoChoice::Pread);
}

#[test]
fn io_faults_with_auto_engine() {
    run(IoChoice::Auto);
}
