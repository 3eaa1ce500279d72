//! Model-based test: random sequences of pull / lookup / push / delete / flush /
//! close-reopen against a `HashMap` reference, for every medium, placement and
//! I/O engine, with hot placement (index rebuilds) among the operations (the
//! block medium under a row cache of a few rows, so eviction,
//! dirty write-back and writer back-pressure happen all the time), each for
//! every element type: the `f32` run compares exactly against the reference,
//! `f16` and `int8` against the reference passed through the same rounding
//! (`RecordLayout::round_trip`; `int8` within 1e-3 of a quantization step,
//! since re-quantizing a de-quantized row may move it by an `f32` ulp). proptest
//! prints the failing sequence (shrunk) and its seed; set PROPTEST_CASES for
//! longer runs.

use std::collections::HashMap;

use embank_core::RecordLayout;
use embank_core::{
    DType, ErrorKind, Initializer, IoChoice, MediumKind, MissingDefault, Placement, Store, StoreOptions, TableOptions,
};
use proptest::prelude::*;

const DIM: usize = 3;
const KEYS: u64 = 120;

#[derive(Debug, Clone)]
enum Op {
    Pull(Vec<u64>),
    Lookup(Vec<u64>),
    Push(Vec<u64>, f32),
    Delete(Vec<u64>),
    Flush,
    Reopen,
    Lookahead(Vec<u64>),
    /// Hot placement of these keys (an index rebuild with them first).
    PlaceHot(Vec<u64>),
}

fn keys() -> impl Strategy<Value = Vec<u64>> {
    // Small key space and batches with duplicates on purpose.
    proptest::collection::vec(0..KEYS, 0..24)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => keys().prop_map(Op::Pull),
        3 => keys().prop_map(Op::Lookup),
        5 => (keys(), -100.0f32..100.0).prop_map(|(k, v)| Op::Push(k, v)),
        2 => keys().prop_map(Op::Delete),
        1 => Just(Op::Flush),
        1 => Just(Op::Reopen),
        1 => keys().prop_map(Op::Lookahead),
        1 => keys().prop_map(Op::PlaceHot),
    ]
}

/// A medium / placement / engine / cache combination under test.
#[derive(Clone, Copy, Debug)]
struct Config {
    medium: MediumKind,
    placement: Placement,
    io: IoChoice,
    cache_bytes: u64,
    dtype: DType,
}

const MMAP: Config = Config {
    medium: MediumKind::Mmap,
    placement: Placement::Auto,
    io: IoChoice::Auto,
    cache_bytes: 0,
    dtype: DType::F32,
};
/// About 19 rows of dim 3 fit: most of the 120 keys are evicted and reread.
const TINY_CACHE: u64 = 2048;

fn store_options(cfg: Config) -> StoreOptions {
    StoreOptions { cache_bytes: cfg.cache_bytes, io_engine: cfg.io, io_depth: 8, ..StoreOptions::default() }
}

fn row_of(key: u64, v: f32) -> [f32; DIM] {
    [v, key as f32, v + 0.5]
}

fn options(cfg: Config) -> TableOptions {
    let mut o = TableOptions::new(DIM as u32);
    o.medium = cfg.medium;
    o.placement = cfg.placement;
    o.dtype = cfg.dtype;
    o.init = Initializer::Uniform { low: -1.0, high: 1.0 };
    o.seed = 11;
    o.capacity = 8; // grows several times during a run
    o.missing = MissingDefault::Value { value: -7.0 };
    o
}

fn init_row(key: u64, dtype: DType) -> Vec<f32> {
    let mut r = vec![0.0; DIM];
    Initializer::Uniform { low: -1.0, high: 1.0 }.fill(11, key, &mut r);
    stored(r, dtype)
}

/// A row as the table holds it: through the element type's rounding.
fn stored(mut row: Vec<f32>, dtype: DType) -> Vec<f32> {
    RecordLayout::new(DIM, 0, dtype).round_trip(&mut row);
    row
}

/// Exact for `f32` and `f16`; `int8` within 1e-3 of the row's quantization step.
fn same(got: &[f32], want: &[f32], dtype: DType) -> bool {
    if dtype != DType::Int8 {
        return got == want;
    }
    let lo = want.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = want.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let tol = (hi - lo) / 255.0 * 1e-3 + 4.0 * f32::EPSILON * hi.abs().max(lo.abs());
    got.iter().zip(want).all(|(a, b)| (a - b).abs() <= tol)
}

fn check(ops: &[Op], cfg: Config) -> Result<(), TestCaseError> {
    for dtype in DType::ALL {
        check_one(ops, Config { dtype, ..cfg })?;
    }
    Ok(())
}

fn check_one(ops: &[Op], cfg: Config) -> Result<(), TestCaseError> {
    let d = cfg.dtype;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let mut store = Store::open(&path, store_options(cfg)).unwrap();
    store.create_table("t", options(cfg)).unwrap();
    let mut model: HashMap<u64, Vec<f32>> = HashMap::new();
    for (step, op) in ops.iter().enumerate() {
        let table = store.table("t").unwrap();
        match op {
            Op::Pull(keys) => {
                let mut out = vec![0.0; keys.len() * DIM];
                table.pull(keys, &mut out).unwrap();
                for (i, k) in keys.iter().enumerate() {
                    let want = model.entry(*k).or_insert_with(|| init_row(*k, d));
                    let got = &out[i * DIM..(i + 1) * DIM];
                    prop_assert!(same(got, want, d), "{} step {} pull key {}: {:?} != {:?}", d, step, k, got, want);
                }
            }
            Op::Lookup(keys) => {
                let mut out = vec![0.0; keys.len() * DIM];
                let mut found = vec![false; keys.len()];
                table.lookup(keys, &mut out, &mut found).unwrap();
                for (i, k) in keys.iter().enumerate() {
                    let want = model.get(k).cloned();
                    prop_assert_eq!(found[i], want.is_some(), "step {} lookup key {}", step, k);
                    let want = want.unwrap_or_else(|| vec![-7.0; DIM]);
                    let got = &out[i * DIM..(i + 1) * DIM];
                    prop_assert!(same(got, &want, d), "{} step {} lookup key {}: {:?} != {:?}", d, step, k, got, want);
                }
            }
            Op::Push(keys, v) => {
                let rows: Vec<f32> = keys.iter().enumerate().flat_map(|(i, k)| row_of(*k, v + i as f32)).collect();
                table.push(keys, &rows).unwrap();
                for (i, k) in keys.iter().enumerate() {
                    model.insert(*k, stored(row_of(*k, v + i as f32).to_vec(), d));
                }
            }
            Op::Delete(keys) => {
                let n = table.delete(keys).unwrap();
                let mut want = 0;
                for k in keys {
                    if model.remove(k).is_some() {
                        want += 1;
                    }
                }
                prop_assert_eq!(n, want, "step {} delete", step);
            }
            Op::Flush => store.flush().unwrap(),
            Op::Reopen => {
                drop(table);
                store.close().unwrap();
                prop_assert_eq!(store.table("t").err().map(|e| e.kind()), Some(ErrorKind::Closed));
                store = Store::open(&path, store_options(cfg)).unwrap();
            }
            Op::Lookahead(keys) => {
                // A hint only: nothing may change that a later read can see.
                table.lookahead(keys).unwrap();
            }
            Op::PlaceHot(keys) => {
                // Moves keys between index buckets: nothing a read can see changes, and
                // every placed key the table holds is then in its home bucket.
                let r = table.place_hot(keys).unwrap();
                let mut held: Vec<u64> = keys.iter().copied().filter(|k| model.contains_key(k)).collect();
                held.sort_unstable();
                held.dedup();
                prop_assert_eq!(r.held, keys.iter().filter(|k| model.contains_key(k)).count() as u64);
                prop_assert!(r.home_after == 1.0 || held.len() > 14, "step {}: {:?}", step, r);
            }
        }
        prop_assert_eq!(store.table("t").unwrap().len().unwrap(), model.len() as u64, "step {} len", step);
    }
    // Export sees exactly the model.
    let mut exported = HashMap::new();
    store
        .table("t")
        .unwrap()
        .export(7, |keys, rows| {
            for (i, k) in keys.iter().enumerate() {
                assert!(exported.insert(*k, rows[i * DIM..(i + 1) * DIM].to_vec()).is_none(), "key {k} exported twice");
            }
            Ok(())
        })
        .unwrap();
    prop_assert_eq!(exported.len(), model.len());
    // So do its keys alone.
    let mut keys = Vec::new();
    store
        .table("t")
        .unwrap()
        .export_keys(7, |k| {
            keys.extend_from_slice(k);
            Ok(())
        })
        .unwrap();
    keys.sort_unstable();
    let mut want_keys: Vec<u64> = model.keys().copied().collect();
    want_keys.sort_unstable();
    prop_assert_eq!(keys, want_keys, "{} export_keys", d);
    for (k, want) in &model {
        let got = &exported[k];
        prop_assert!(same(got, want, d), "{} export key {}: {:?} != {:?}", d, k, got, want);
    }
    let stats = store.table("t").unwrap().stats().unwrap();
    prop_assert_eq!(stats.medium, cfg.medium.name());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mmap_matches_hashmap(ops in proptest::collection::vec(op(), 1..120)) {
        check(&ops, MMAP)?;
    }

    #[test]
    fn mmap_with_cache_matches_hashmap(ops in proptest::collection::vec(op(), 1..120)) {
        check(&ops, Config { placement: Placement::Cache, cache_bytes: TINY_CACHE, ..MMAP })?;
    }

    #[test]
    fn block_uring_cache_matches_hashmap(ops in proptest::collection::vec(op(), 1..120)) {
        check(&ops, Config { medium: MediumKind::Block, io: IoChoice::Auto, cache_bytes: TINY_CACHE, ..MMAP })?;
    }

    #[test]
    fn block_pread_cache_matches_hashmap(ops in proptest::collection::vec(op(), 1..120)) {
        check(&ops, Config { medium: MediumKind::Block, io: IoChoice::Pread, cache_bytes: TINY_CACHE, ..MMAP })?;
    }

    #[test]
    fn block_bypass_matches_hashmap(ops in proptest::collection::vec(op(), 1..120)) {
        check(&ops, Config { medium: MediumKind::Block, placement: Placement::Bypass, cache_bytes: TINY_CACHE, ..MMAP })?;
    }

    #[test]
    fn block_pin_matches_hashmap(ops in proptest::collection::vec(op(), 1..120)) {
        check(&ops, Config { medium: MediumKind::Block, placement: Placement::Pin, cache_bytes: TINY_CACHE, ..MMAP })?;
    }
}
