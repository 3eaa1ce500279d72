//! Hot placement: on demand, a hot set of displaced keys ends in its home buckets
//! with every row unchanged while lookups run; automatically, the maintenance
//! thread finds the hot set from the reads' sample and places it.

use std::time::{Duration, Instant};

use embank_core::{HotOptions, Store, StoreOptions, TableOptions};

const DIM: usize = 4;
/// Keys of the table: 0.84 of its slots.
const KEYS: u64 = 11_000;

fn row(k: u64) -> [f32; DIM] {
    [k as f32, 1.0, -(k as f32), 0.5]
}

/// A table filled to a load of about 0.85, and keys that are not in their home bucket.
fn full_table(store: &Store) -> (embank_core::Table, Vec<u64>) {
    let mut o = TableOptions::new(DIM as u32);
    o.capacity = 10_000; // 774 buckets, 13,158 slots
    let t = store.create_table("t", o).unwrap();
    let keys: Vec<u64> = (0..KEYS).collect();
    let rows: Vec<f32> = keys.iter().flat_map(|&k| row(k)).collect();
    t.push(&keys, &rows).unwrap();
    assert_eq!(t.stats().unwrap().grow_count, 0);
    let displaced: Vec<u64> = keys.iter().copied().filter(|&k| t.home_fraction(&[k]).unwrap().0 == 0.0).collect();
    assert!(displaced.len() > 300, "only {} keys displaced", displaced.len());
    (t, displaced)
}

fn check_all(t: &embank_core::Table) {
    let keys: Vec<u64> = (0..KEYS).collect();
    let mut out = vec![0f32; keys.len() * DIM];
    let mut found = vec![false; keys.len()];
    t.lookup(&keys, &mut out, &mut found).unwrap();
    assert!(found.iter().all(|&f| f));
    for (i, &k) in keys.iter().enumerate() {
        assert_eq!(&out[i * DIM..(i + 1) * DIM], &row(k));
    }
    assert_eq!(t.len().unwrap(), KEYS);
}

#[test]
fn placing_displaced_hot_keys_brings_them_home_while_lookups_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let (t, displaced) = full_table(&store);
    let hot = &displaced[..200];
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut out = vec![0f32; hot.len() * DIM];
                let mut found = vec![false; hot.len()];
                t.lookup(hot, &mut out, &mut found).unwrap();
                assert!(found.iter().all(|&f| f), "a placed key went missing during the rebuild");
                n += 1;
            }
            n
        });
        let r = t.place_hot(hot).unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
        assert_eq!((r.held, r.home_before, r.home_after), (200, 0.0, 1.0), "{r:?}");
    });
    assert_eq!(t.home_fraction(hot).unwrap(), (1.0, 200));
    check_all(&t);
    assert_eq!(t.stats().unwrap().hot_placements, 1);
    // It survives a reopen (the catalog names the rebuilt index).
    drop(t);
    store.close().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let t = store.table("t").unwrap();
    assert_eq!(t.home_fraction(hot).unwrap(), (1.0, 200));
    check_all(&t);
}

#[test]
fn automatic_placement_finds_the_hot_set_from_the_reads() {
    let dir = tempfile::tempdir().unwrap();
    let hot_opts = HotOptions { keys: 100, every_seconds: 0.2, sample_every: 1, min_home_fraction: 0.99 };
    let options = StoreOptions { hot_placement: Some(hot_opts), ..Default::default() };
    let store = Store::open(dir.path().join("s"), options).unwrap();
    let (t, displaced) = full_table(&store);
    let hot: Vec<u64> = displaced[..100].to_vec();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut cold = 0u64;
    while t.stats().unwrap().hot_placements == 0 {
        assert!(Instant::now() < deadline, "no automatic placement in 20 s");
        let mut batch = hot.clone();
        batch.extend((0..50).map(|i| (cold + i * 97) % KEYS));
        cold += 1;
        let mut out = vec![0f32; batch.len() * DIM];
        let mut found = vec![false; batch.len()];
        t.lookup(&batch, &mut out, &mut found).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(t.home_fraction(&hot).unwrap(), (1.0, 100));
    check_all(&t);
}
