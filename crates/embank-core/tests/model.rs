//! Model-based test: random sequences of pull / lookup / push / delete / flush /
//! close-reopen against a `HashMap` reference. proptest prints the failing
//! sequence (shrunk) and its seed; set PROPTEST_CASES for longer runs.

use std::collections::HashMap;

use embank_core::{ErrorKind, Initializer, MissingDefault, Store, StoreOptions, TableOptions};
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
    ]
}

fn row_of(key: u64, v: f32) -> [f32; DIM] {
    [v, key as f32, v + 0.5]
}

fn options() -> TableOptions {
    let mut o = TableOptions::new(DIM as u32);
    o.init = Initializer::Uniform { low: -1.0, high: 1.0 };
    o.seed = 11;
    o.capacity = 8; // grows several times during a run
    o.missing = MissingDefault::Value { value: -7.0 };
    o
}

fn init_row(key: u64) -> Vec<f32> {
    let mut r = vec![0.0; DIM];
    Initializer::Uniform { low: -1.0, high: 1.0 }.fill(11, key, &mut r);
    r
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn store_matches_hashmap(ops in proptest::collection::vec(op(), 1..120)) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let mut store = Store::open(&path, StoreOptions::default()).unwrap();
        store.create_table("t", options()).unwrap();
        let mut model: HashMap<u64, Vec<f32>> = HashMap::new();
        for (step, op) in ops.iter().enumerate() {
            let table = store.table("t").unwrap();
            match op {
                Op::Pull(keys) => {
                    let mut out = vec![0.0; keys.len() * DIM];
                    table.pull(keys, &mut out).unwrap();
                    for (i, k) in keys.iter().enumerate() {
                        let want = model.entry(*k).or_insert_with(|| init_row(*k));
                        prop_assert_eq!(&out[i * DIM..(i + 1) * DIM], &want[..], "step {} pull key {}", step, k);
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
                        prop_assert_eq!(&out[i * DIM..(i + 1) * DIM], &want[..], "step {} lookup key {}", step, k);
                    }
                }
                Op::Push(keys, v) => {
                    let rows: Vec<f32> = keys.iter().enumerate().flat_map(|(i, k)| row_of(*k, v + i as f32)).collect();
                    table.push(keys, &rows).unwrap();
                    for (i, k) in keys.iter().enumerate() {
                        model.insert(*k, row_of(*k, v + i as f32).to_vec());
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
                    store = Store::open(&path, StoreOptions::default()).unwrap();
                }
            }
            prop_assert_eq!(store.table("t").unwrap().len().unwrap(), model.len() as u64, "step {} len", step);
        }
        // Export sees exactly the model.
        let mut exported = HashMap::new();
        store.table("t").unwrap().export(7, |keys, rows| {
            for (i, k) in keys.iter().enumerate() {
                assert!(exported.insert(*k, rows[i * DIM..(i + 1) * DIM].to_vec()).is_none(), "key {k} exported twice");
            }
            Ok(())
        }).unwrap();
        prop_assert_eq!(exported, model);
    }
}
