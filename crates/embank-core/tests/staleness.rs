//! Bounded staleness with concurrent workers: a row pulled under bound k is never
//! more than k updates behind (each update adds exactly 1 to the row, so at most k + 1
//! pulls can see the same value); BSP is strictly pull, push, pull, push per key; ASP
//! never waits; release and leases free a dead worker's holds.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use embank_core::{ErrorKind, Optimizer, Store, StoreOptions, Table, TableOptions};
use rand::{Rng, SeedableRng};

const WORKERS: u64 = 4;
const STEPS: usize = 60;
const KEYS: u64 = 6;

fn table(dir: &std::path::Path, bound: Option<u32>, lease: f64) -> (Store, Table) {
    let store = Store::open(dir.join("s"), StoreOptions::default()).unwrap();
    let mut o = TableOptions::new(1);
    // SGD with lr 1 and gradient -1: each update adds exactly 1 to the row.
    o.optimizer = Optimizer::Sgd { lr: 1.0 };
    o.staleness_bound = bound;
    o.lease_seconds = lease;
    let t = store.create_table("t", o).unwrap();
    (store, t)
}

/// Runs WORKERS threads of pull_held / push_grad_held over random distinct keys and
/// returns every (key, value pulled).
fn train(t: &Table, seed: u64) -> Vec<(u64, f32)> {
    let t = Arc::new(t.clone());
    let handles: Vec<_> = (0..WORKERS)
        .map(|w| {
            let t = Arc::clone(&t);
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed + w);
                let mut seen = Vec::new();
                for _ in 0..STEPS {
                    let mut keys: Vec<u64> = (0..KEYS).collect();
                    for i in (1..keys.len()).rev() {
                        keys.swap(i, rng.random_range(0..=i));
                    }
                    keys.truncate(rng.random_range(1..=3));
                    let mut out = vec![0f32; keys.len()];
                    t.pull_held(w, &keys, &mut out, Duration::from_secs(30)).unwrap();
                    seen.extend(keys.iter().copied().zip(out.iter().copied()));
                    if rng.random_bool(0.5) {
                        std::thread::yield_now();
                    }
                    t.push_grad_held(w, &keys, &vec![-1.0; keys.len()]).unwrap();
                }
                seen
            })
        })
        .collect();
    handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
}

fn check_bound(seen: &[(u64, f32)], bound: u32) {
    let mut count: HashMap<(u64, i64), u32> = HashMap::new();
    for &(k, v) in seen {
        assert_eq!(v.fract(), 0.0);
        *count.entry((k, v as i64)).or_insert(0) += 1;
    }
    for ((k, v), n) in count {
        assert!(n <= bound + 1, "key {k}: {n} pulls saw value {v}, bound {bound} allows {}", bound + 1);
    }
}

#[test]
fn bsp_and_ssp_bound_how_far_behind_a_pull_is() {
    for bound in [0u32, 1, 3] {
        let dir = tempfile::tempdir().unwrap();
        let (_s, t) = table(dir.path(), Some(bound), 60.0);
        let seen = train(&t, 100 + bound as u64);
        check_bound(&seen, bound);
        // Every update landed: each key's row counts the pulls of it.
        let keys: Vec<u64> = (0..KEYS).collect();
        let mut rows = vec![0f32; KEYS as usize];
        t.pull(&keys, &mut rows).unwrap();
        for k in 0..KEYS {
            let pulls = seen.iter().filter(|(key, _)| *key == k).count();
            assert_eq!(rows[k as usize], pulls as f32, "key {k}");
        }
        if bound == 0 {
            // BSP: per key, the values pulled are exactly 0, 1, 2, ...: pull, push, pull, push.
            for k in 0..KEYS {
                let mut vals: Vec<i64> = seen.iter().filter(|(key, _)| *key == k).map(|&(_, v)| v as i64).collect();
                vals.sort();
                assert_eq!(vals, (0..vals.len() as i64).collect::<Vec<_>>(), "key {k}");
            }
        }
        assert_eq!(t.stats().unwrap().holds_outstanding, 0);
    }
}

#[test]
fn asp_never_waits_and_bounded_tables_do() {
    let dir = tempfile::tempdir().unwrap();
    let (_s, asp) = table(dir.path(), None, 60.0);
    let mut out = [0f32; 1];
    for _ in 0..100 {
        // No push in between, a zero timeout: nothing may wait.
        asp.pull_held(1, &[3], &mut out, Duration::ZERO).unwrap();
    }
    assert_eq!(asp.staleness_bound(), None);
    assert_eq!(asp.stats().unwrap().holds_outstanding, 0);

    let dir = tempfile::tempdir().unwrap();
    let (_s, ssp) = table(dir.path(), Some(1), 60.0);
    ssp.pull_held(1, &[3], &mut out, Duration::ZERO).unwrap();
    ssp.pull_held(2, &[3], &mut out, Duration::ZERO).unwrap();
    let e = ssp.pull_held(3, &[3], &mut out, Duration::from_millis(20)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(e.to_string().contains("key 3") && e.to_string().contains("bound 1"), "{e}");
    let st = ssp.stats().unwrap();
    assert_eq!((st.holds_outstanding, st.holding_workers), (2, 2));
}

#[test]
fn release_and_lease_free_a_dead_workers_holds() {
    let dir = tempfile::tempdir().unwrap();
    let (_s, t) = table(dir.path(), Some(0), 0.3);
    let mut out = [0f32; 2];
    t.pull_held(1, &[1, 2], &mut out, Duration::ZERO).unwrap();
    let t2 = t.clone();
    let waiter = std::thread::spawn(move || {
        let mut out = [0f32; 1];
        t2.pull_held(2, &[2], &mut out, Duration::from_secs(20))
    });
    std::thread::sleep(Duration::from_millis(30));
    assert!(!waiter.is_finished(), "BSP: worker 2 waits for worker 1's push");
    assert_eq!(t.release(1), 2);
    waiter.join().unwrap().unwrap();
    // Worker 2 now holds key 2 and goes silent: its lease (0.3 s) ends and worker 3 gets it.
    t.pull_held(3, &[2], &mut out[..1], Duration::from_secs(20)).unwrap();
    let st = t.stats().unwrap();
    assert_eq!((st.holds_outstanding, st.holding_workers), (1, 1));
    // A push by a worker without holds still applies the update.
    t.push_grad_held(9, &[1], &[-1.0]).unwrap();
    t.pull(&[1], &mut out[..1]).unwrap();
    assert_eq!(out[0], 1.0);
}

#[test]
fn staleness_options_persist() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (s, _t) = table(dir.path(), Some(2), 5.0);
        s.close().unwrap();
    }
    let s = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let t = s.table("t").unwrap();
    assert_eq!(t.staleness_bound(), Some(2));
    assert_eq!(t.meta().lease_seconds, 5.0);
    let mut bad = TableOptions::new(2);
    bad.lease_seconds = 0.0;
    assert_eq!(s.create_table("u", bad).unwrap_err().kind(), ErrorKind::Config);
}
