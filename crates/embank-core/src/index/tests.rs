use super::bucket::match_fp;
use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

fn new_index(dir: &tempfile::TempDir, buckets: u64) -> Index {
    Index::create(&dir.path().join("i"), buckets, 99).unwrap()
}

#[test]
fn fp_matching() {
    let words = [0x0000_0300_0503_0001u64, 0x0000_0000_0000_0300];
    assert_eq!(match_fp(words, 3), (1 << 2) | (1 << 5) | (1 << 9));
    assert_eq!(match_fp(words, 1), 1);
    let empty = empty_slots(words);
    assert_eq!(empty & 0b1, 0);
    assert_ne!(empty & 0b10, 0);
}

#[test]
fn fills_a_tiny_index_completely() {
    let dir = tempfile::tempdir().unwrap();
    let index = new_index(&dir, 4);
    let slots = index.slot_count();
    for key in 0..slots {
        let h = index.hash(key);
        assert!(index.insert_new(key, h, key + 1), "key {key} of {slots}");
    }
    assert!(!index.insert_new(slots, index.hash(slots), 7), "a full index took one more key");
    for key in 0..slots {
        assert_eq!(index.get(key, index.hash(key)), Some(key + 1));
    }
    assert_eq!(index.len(), slots);
    // Remove everything; every overflow counter must return to zero.
    for key in 0..slots {
        assert_eq!(index.remove(key, index.hash(key)), Some(key + 1));
    }
    for b in 0..index.bucket_count() {
        assert_eq!(index.bucket(b).overflow.load(Ordering::Relaxed), 0, "bucket {b}");
    }
    assert!(index.is_empty());
}

#[derive(Debug, Clone)]
enum Op {
    Put(u64, u64),
    Remove(u64),
    Recover,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..300u64, 1..u64::MAX).prop_map(|(k, p)| Op::Put(k, p)),
        3 => (0..300u64).prop_map(Op::Remove),
        1 => Just(Op::Recover),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    /// The index behaves as a HashMap, including after a recovery pass.
    #[test]
    fn behaves_like_a_hashmap(ops in proptest::collection::vec(op(), 1..400)) {
        let dir = tempfile::tempdir().unwrap();
        let index = new_index(&dir, 32);
        let mut model: HashMap<u64, u64> = HashMap::new();
        for (i, op) in ops.iter().enumerate() {
            match *op {
                Op::Put(k, p) => {
                    let h = index.hash(k);
                    if index.replace(k, h, p).is_none() {
                        prop_assert!(index.insert_new(k, h, p), "step {}: insert failed", i);
                    }
                    model.insert(k, p);
                }
                Op::Remove(k) => {
                    prop_assert_eq!(index.remove(k, index.hash(k)), model.remove(&k), "step {}", i);
                }
                Op::Recover => {
                    let report = index.recover(|_, _, _| true);
                    prop_assert_eq!(report.keys, model.len() as u64);
                    prop_assert_eq!(report.slots_dropped, 0);
                }
            }
            prop_assert_eq!(index.len(), model.len() as u64, "step {}", i);
        }
        for k in 0..300u64 {
            prop_assert_eq!(index.get(k, index.hash(k)), model.get(&k).copied(), "key {}", k);
        }
        let mut seen = HashMap::new();
        index.for_each(0, index.bucket_count(), |k, p| { seen.insert(k, p); });
        prop_assert_eq!(seen, model);
    }
}

#[test]
fn reopen_keeps_keys_and_recover_unlocks_interrupted_buckets() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("i");
    {
        let index = Index::create(&path, 16, 3).unwrap();
        for key in 0..100 {
            assert!(index.insert_new(key, index.hash(key), 1000 + key));
        }
        // Simulate a writer killed inside bucket 5.
        index.bucket(5).version.fetch_add(1, Ordering::Relaxed);
    }
    let index = Index::open(&path).unwrap();
    assert_eq!(index.seed(), 3);
    let report = index.recover(|key, ptr, _| ptr == 1000 + key && key != 7);
    assert_eq!(report.buckets_interrupted, 1);
    assert_eq!(report.slots_dropped, 1);
    assert_eq!(report.keys, 99);
    for key in 0..100 {
        let want = if key == 7 { None } else { Some(1000 + key) };
        assert_eq!(index.get(key, index.hash(key)), want, "key {key}");
    }
}

#[test]
fn open_rejects_truncated_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("i");
    drop(Index::create(&path, 16, 3).unwrap());
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(INDEX_HEADER_BYTES as u64 + 100).unwrap();
    let err = Index::open(&path).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::Recover, "{err}");
}
