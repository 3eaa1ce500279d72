//! The pooled-embedding cache: random bags (repeating on purpose) and random writes
//! — push, push_grad, delete, pulls that create rows, restore — on every medium;
//! every `lookup_pooled` must equal the bags pooled afresh from `lookup` (a changed
//! member row is never served stale), and repeated bags must hit. Plus writers
//! racing readers: once the writers stop, no bag is stale.

use embank_core::testing::pool;
use embank_core::{MediumKind, Optimizer, Pooling, Store, StoreOptions, Table, TableOptions};
use proptest::prelude::*;

const DIM: usize = 4;
const KEYS: u64 = 40;

#[derive(Debug, Clone)]
enum Op {
    Bags(Vec<(Vec<u64>, bool)>, bool),
    Push(Vec<u64>, f32),
    Grad(Vec<u64>),
    Delete(Vec<u64>),
    Pull(Vec<u64>),
    Checkpoint,
    Restore,
}

fn bag() -> impl Strategy<Value = (Vec<u64>, bool)> {
    // Few distinct bags: the cache gets hits.
    (0..12u64, any::<bool>()).prop_map(|(seed, weighted)| {
        let n = (seed % 5) as usize;
        ((0..n).map(|i| (seed * 7 + i as u64 * 3) % KEYS).collect(), weighted && seed % 2 == 0)
    })
}

fn keys() -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(0..KEYS, 1..6)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (proptest::collection::vec(bag(), 1..8), any::<bool>()).prop_map(|(b, mean)| Op::Bags(b, mean)),
        2 => (keys(), -5.0f32..5.0).prop_map(|(k, v)| Op::Push(k, v)),
        1 => keys().prop_map(Op::Grad),
        1 => keys().prop_map(Op::Delete),
        1 => keys().prop_map(Op::Pull),
        1 => Just(Op::Checkpoint),
        1 => Just(Op::Restore),
    ]
}

/// The bags pooled afresh from `lookup`, one bag at a time.
fn fresh(t: &Table, bags: &[(Vec<u64>, bool)], mode: Pooling) -> Vec<f32> {
    let mut out = vec![0f32; bags.len() * DIM];
    for (b, (ids, weighted)) in bags.iter().enumerate() {
        let mut rows = vec![0f32; ids.len() * DIM];
        let mut found = vec![false; ids.len()];
        t.lookup(ids, &mut rows, &mut found).unwrap();
        let members: Vec<&[f32]> = rows.chunks_exact(DIM).collect();
        let w: Vec<f32> = (0..ids.len()).map(|i| 0.5 + i as f32).collect();
        let w = (*weighted && mode == Pooling::Sum).then_some(&w[..]);
        pool(mode, &members, w, &mut out[b * DIM..(b + 1) * DIM]);
    }
    out
}

fn pooled(t: &Table, bags: &[(Vec<u64>, bool)], mode: Pooling) -> Vec<f32> {
    let mut ids = Vec::new();
    let mut offsets = vec![0];
    let mut weights = Vec::new();
    let any_weighted = mode == Pooling::Sum && bags.iter().any(|b| b.1);
    for (b, weighted) in bags {
        ids.extend_from_slice(b);
        offsets.push(ids.len());
        // Unweighted bags in a weighted batch get weight 1: the same sums as no weights
        // only when pooled afresh with weights 1 — so weight every bag of such a batch.
        weights.extend((0..b.len()).map(|i| if *weighted { 0.5 + i as f32 } else { 1.0 }));
    }
    let mut out = vec![0f32; bags.len() * DIM];
    t.lookup_pooled(&ids, &offsets, any_weighted.then_some(&weights[..]), mode, &mut out).unwrap();
    out
}

fn check(medium: MediumKind, ops: &[Op]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let options = StoreOptions { pooled_cache_bytes: 1 << 20, cache_bytes: 4096, ..Default::default() };
    let store = Store::open(dir.path().join("s"), options).unwrap();
    let mut o = TableOptions::new(DIM as u32);
    o.medium = medium;
    o.optimizer = Optimizer::Sgd { lr: 0.5 };
    // Rows a pull creates differ from the missing default lookups answer.
    o.init = embank_core::Initializer::Uniform { low: -1.0, high: 1.0 };
    store.create_table("t", o).unwrap();
    let mut batch = 0;
    for (step, op) in ops.iter().enumerate() {
        let t = store.table("t").unwrap();
        match op {
            Op::Bags(bags, mean) => {
                let mode = if *mean { Pooling::Mean } else { Pooling::Sum };
                // Weighted batches: give unweighted bags weight 1 in the reference too.
                let reference: Vec<(Vec<u64>, bool)> = bags.clone();
                let got = pooled(&t, bags, mode);
                let any_weighted = mode == Pooling::Sum && bags.iter().any(|b| b.1);
                let want = if any_weighted {
                    let mut out = vec![0f32; bags.len() * DIM];
                    for (b, (ids, weighted)) in reference.iter().enumerate() {
                        let mut rows = vec![0f32; ids.len() * DIM];
                        let mut found = vec![false; ids.len()];
                        t.lookup(ids, &mut rows, &mut found).unwrap();
                        let members: Vec<&[f32]> = rows.chunks_exact(DIM).collect();
                        let w: Vec<f32> =
                            (0..ids.len()).map(|i| if *weighted { 0.5 + i as f32 } else { 1.0 }).collect();
                        pool(mode, &members, Some(&w), &mut out[b * DIM..(b + 1) * DIM]);
                    }
                    out
                } else {
                    fresh(&t, &reference, mode)
                };
                prop_assert_eq!(got, want, "step {}: {:?}", step, op);
            }
            Op::Push(keys, v) => {
                let rows: Vec<f32> = keys.iter().flat_map(|&k| [*v, k as f32, -*v, 1.0]).collect();
                t.push(keys, &rows).unwrap();
            }
            Op::Grad(keys) => t.push_grad(keys, &vec![0.25; keys.len() * DIM]).unwrap(),
            Op::Delete(keys) => {
                t.delete(keys).unwrap();
            }
            Op::Pull(keys) => {
                let mut out = vec![0f32; keys.len() * DIM];
                t.pull(keys, &mut out).unwrap();
            }
            Op::Checkpoint => {
                batch += 1;
                store.checkpoint(batch).unwrap();
            }
            Op::Restore => {
                if batch > 0 {
                    store.restore(batch).unwrap();
                }
            }
        }
    }
    let stats = store.stats().unwrap().pooled.unwrap();
    prop_assert!(stats.bytes <= stats.budget_bytes);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn pooled_bags_are_never_stale_mmap(ops in proptest::collection::vec(op(), 1..80)) {
        check(MediumKind::Mmap, &ops)?;
    }

    #[test]
    fn pooled_bags_are_never_stale_block(ops in proptest::collection::vec(op(), 1..80)) {
        check(MediumKind::Block, &ops)?;
    }
}

#[test]
fn repeated_bags_hit_and_writers_racing_readers_leave_nothing_stale() {
    let dir = tempfile::tempdir().unwrap();
    let options = StoreOptions { pooled_cache_bytes: 4 << 20, ..Default::default() };
    let store = Store::open(dir.path().join("s"), options).unwrap();
    let t = store.create_table("t", TableOptions::new(DIM as u32)).unwrap();
    let keys: Vec<u64> = (0..200).collect();
    t.push(&keys, &vec![1.0; 200 * DIM]).unwrap();
    let bags: Vec<(Vec<u64>, bool)> = (0..50u64).map(|b| ((b..b + 5).collect(), false)).collect();
    // First sight remembers, second caches, third hits.
    pooled(&t, &bags, Pooling::Sum);
    pooled(&t, &bags, Pooling::Sum);
    pooled(&t, &bags, Pooling::Sum);
    let s = store.stats().unwrap().pooled.unwrap();
    assert_eq!((s.hits, s.misses, s.entries, s.first_seen), (50, 100, 50, 50), "{s:?}");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let pushes = std::sync::atomic::AtomicU64::new(0);
    let (stop, pushes) = (&stop, &pushes);
    std::thread::scope(|scope| {
        for w in 0..2u64 {
            let t = t.clone();
            scope.spawn(move || {
                let mut v = 2.0 + w as f32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let k: Vec<u64> = (0..200).filter(|k| k % 3 == w).collect();
                    t.push(&k, &vec![v; k.len() * DIM]).unwrap();
                    pushes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    v += 1.0;
                }
            });
        }
        // At least 300 rounds of reads, and on until the writers really raced them (on a
        // loaded machine the readers could otherwise finish before a writer ran).
        let mut round = 0;
        while round < 300 || pushes.load(std::sync::atomic::Ordering::Relaxed) < 20 {
            pooled(&t, &bags, Pooling::Sum);
            round += 1;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    assert_eq!(pooled(&t, &bags, Pooling::Sum), fresh(&t, &bags, Pooling::Sum), "a bag outlived a write");
    let s = store.stats().unwrap().pooled.unwrap();
    assert!(s.invalidated > 0 && s.hits > 50, "{s:?}");
}
