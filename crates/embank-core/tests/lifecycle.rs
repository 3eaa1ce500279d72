//! Admission and eviction against a model of the policy: a `BTreeMap` of rows, the
//! candidate counts and the last touch of every row, driven by the same random
//! pulls, lookups, pushes, gradient pushes (`push_grad`, and `push_grad_distinct` for
//! batches of distinct keys), deletes, TTL sweeps and reopens, on the
//! mmap medium and on the block medium under the row cache. After every operation
//! the table (export, counters) must equal the model exactly.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use embank_core::{
    ErrorKind, EvictPolicy, Initializer, LifecycleOptions, MediumKind, Optimizer, Store, StoreOptions, Table,
    TableOptions,
};

mod common;
use common::Rng;

const DIM: usize = 2;
const KEYS: u64 = 48;
const INIT: f32 = 0.5;
const LR: f32 = 0.5;

#[derive(Default)]
struct Model {
    o: LifecycleOptions,
    rows: BTreeMap<u64, [f32; DIM]>,
    cand: HashMap<u64, u32>,
    /// key -> (tick, step, touches)
    act: HashMap<u64, (u64, u64, u64)>,
    tick: u64,
    step: u64,
    evicted_ttl: u64,
    evicted_capacity: u64,
    grads_dropped: u64,
}

impl Model {
    fn new(o: LifecycleOptions) -> Model {
        Model { o, tick: 1, ..Default::default() }
    }

    /// What a reopen does: every row touched once at tick 0, step 0; counts and counters
    /// start over.
    fn reopen(&mut self) {
        self.cand.clear();
        self.act = self.rows.keys().map(|&k| (k, (0, 0, 1))).collect();
        self.tick = 1;
        self.step = 0;
        (self.evicted_ttl, self.evicted_capacity, self.grads_dropped) = (0, 0, 0);
    }

    fn evicts(&self) -> bool {
        self.o.ttl_steps.is_some() || self.o.rows_max.is_some()
    }

    fn touch(&mut self, keys: impl IntoIterator<Item = u64>) {
        if !self.evicts() {
            return;
        }
        let t = self.tick;
        self.tick += 1;
        for k in keys {
            let e = self.act.entry(k).or_insert((t, self.step, 0));
            e.0 = t;
            e.1 = self.step;
            e.2 += 1;
        }
    }

    fn remove(&mut self, keys: &[u64]) -> u64 {
        let mut n = 0;
        for k in keys {
            n += self.rows.remove(k).is_some() as u64;
            self.act.remove(k);
        }
        n
    }

    fn make_room(&mut self, new: &[u64], batch: &[u64]) {
        let Some(max) = self.o.rows_max else { return };
        let distinct: HashSet<u64> = new.iter().copied().collect();
        let len = self.rows.len() as u64;
        if len + distinct.len() as u64 <= max {
            return;
        }
        let n = (len + distinct.len() as u64 - max + max / 32) as usize;
        let spare: HashSet<u64> = batch.iter().copied().collect();
        let mut ranked: Vec<(u64, u64, u64)> = self
            .act
            .iter()
            .filter(|(k, _)| !spare.contains(k))
            .map(|(&k, &(tick, _, count))| match self.o.evict {
                EvictPolicy::Lru => (tick, 0, k),
                EvictPolicy::Lfu => (count, tick, k),
            })
            .collect();
        ranked.sort_unstable();
        let victims: Vec<u64> = ranked.into_iter().take(n).map(|r| r.2).collect();
        self.evicted_capacity += self.remove(&victims);
    }

    fn pull(&mut self, keys: &[u64]) -> Vec<f32> {
        let mut missing = Vec::new();
        for &k in keys {
            if !self.rows.contains_key(&k) && !missing.contains(&k) {
                missing.push(k);
            }
        }
        let admitted: Vec<u64> = if self.o.admit_after > 1 {
            let mut a = Vec::new();
            for &k in &missing {
                let c = self.cand.entry(k).or_insert(0);
                *c += 1;
                if *c >= self.o.admit_after {
                    self.cand.remove(&k);
                    a.push(k);
                }
            }
            a
        } else {
            missing
        };
        if !admitted.is_empty() {
            self.make_room(&admitted, keys);
            for &k in &admitted {
                self.rows.insert(k, [INIT; DIM]);
            }
        }
        let present: Vec<u64> = keys.iter().copied().filter(|k| self.rows.contains_key(k)).collect();
        self.touch(present);
        keys.iter().flat_map(|k| self.rows.get(k).copied().unwrap_or([INIT; DIM])).collect()
    }

    fn lookup(&mut self, keys: &[u64]) -> Vec<bool> {
        let found: Vec<bool> = keys.iter().map(|k| self.rows.contains_key(k)).collect();
        let present: Vec<u64> = keys.iter().copied().filter(|k| self.rows.contains_key(k)).collect();
        self.touch(present);
        found
    }

    fn push(&mut self, keys: &[u64], rows: &[f32]) {
        for k in keys {
            self.cand.remove(k);
        }
        let new: Vec<u64> = keys.iter().copied().filter(|k| !self.rows.contains_key(k)).collect();
        if !new.is_empty() {
            self.make_room(&new, keys);
        }
        for (i, &k) in keys.iter().enumerate() {
            self.rows.insert(k, rows[i * DIM..(i + 1) * DIM].try_into().unwrap());
        }
        self.touch(keys.iter().copied());
    }

    fn push_grad(&mut self, keys: &[u64], grads: &[f32]) {
        let mut uniq: Vec<u64> = Vec::new();
        let mut sums: Vec<[f32; DIM]> = Vec::new();
        for (i, &k) in keys.iter().enumerate() {
            let j = uniq.iter().position(|&u| u == k).unwrap_or_else(|| {
                uniq.push(k);
                sums.push([0.0; DIM]);
                uniq.len() - 1
            });
            for d in 0..DIM {
                sums[j][d] += grads[i * DIM + d];
            }
        }
        if self.o.admit_after > 1 {
            let keep: Vec<bool> = uniq.iter().map(|k| self.rows.contains_key(k)).collect();
            self.grads_dropped += keep.iter().filter(|&&f| !f).count() as u64;
            let mut j = 0;
            uniq.retain(|_| (keep[j], j += 1).0);
            let mut j = 0;
            sums.retain(|_| (keep[j], j += 1).0);
        } else {
            let new: Vec<u64> = uniq.iter().copied().filter(|k| !self.rows.contains_key(k)).collect();
            if !new.is_empty() {
                self.make_room(&new, &uniq);
            }
        }
        for (k, g) in uniq.iter().zip(&sums) {
            let r = self.rows.entry(*k).or_insert([INIT; DIM]);
            for d in 0..DIM {
                r[d] -= LR * g[d];
            }
        }
        self.step += 1;
        self.touch(uniq.iter().copied());
    }

    fn evict_expired(&mut self) -> u64 {
        let Some(ttl) = self.o.ttl_steps else { return 0 };
        let old: Vec<u64> = self.act.iter().filter(|(_, t)| self.step - t.1 >= ttl).map(|(&k, _)| k).collect();
        let n = self.remove(&old);
        self.evicted_ttl += n;
        n
    }
}

fn options(o: &LifecycleOptions, medium: MediumKind) -> TableOptions {
    let mut t = TableOptions::new(DIM as u32);
    t.init = Initializer::Constant { value: INIT };
    t.optimizer = Optimizer::Sgd { lr: LR };
    t.capacity = 16; // the index grows during the run
    t.medium = medium;
    t.lifecycle = o.clone();
    t
}

/// A new store holding table "t" with lifecycle options `o` (the directory lives as long as the guard).
fn fresh(o: LifecycleOptions, medium: MediumKind) -> (tempfile::TempDir, Store, Table) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let t = store.create_table("t", options(&o, medium)).unwrap();
    (dir, store, t)
}

fn export(t: &Table) -> BTreeMap<u64, [f32; DIM]> {
    let mut out = BTreeMap::new();
    t.export(7, |keys, rows| {
        for (i, &k) in keys.iter().enumerate() {
            out.insert(k, rows[i * DIM..(i + 1) * DIM].try_into().unwrap());
        }
        Ok(())
    })
    .unwrap();
    out
}

fn batch(rng: &mut Rng, n: usize) -> Vec<u64> {
    // Skewed: low keys far more often, so LRU and LFU pick different victims.
    (0..n)
        .map(|_| {
            let a = rng.next() % KEYS;
            let b = rng.next() % KEYS;
            a.min(b)
        })
        .collect()
}

fn run(o: LifecycleOptions, medium: MediumKind, seed: u64, ops: usize) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let mut store = Store::open(&path, StoreOptions::default()).unwrap();
    let mut t = store.create_table("t", options(&o, medium)).unwrap();
    let mut m = Model::new(o.clone());
    let mut rng = Rng(seed);
    let ctx = |i: usize, what: &str| format!("{o:?} on {medium:?}, seed {seed}, op {i} ({what})");
    for i in 0..ops {
        let n = 1 + (rng.next() % 9) as usize;
        let keys = batch(&mut rng, n);
        let what = match rng.next() % 100 {
            0..=34 => {
                let mut out = vec![0f32; n * DIM];
                t.pull(&keys, &mut out).unwrap();
                assert_eq!(out, m.pull(&keys), "{}", ctx(i, "pull"));
                "pull"
            }
            35..=44 => {
                let mut out = vec![0f32; n * DIM];
                let mut found = vec![false; n];
                t.lookup(&keys, &mut out, &mut found).unwrap();
                assert_eq!(found, m.lookup(&keys), "{}", ctx(i, "lookup"));
                "lookup"
            }
            45..=54 => {
                let rows: Vec<f32> = (0..n * DIM).map(|_| (rng.next() % 16) as f32 - 8.0).collect();
                t.push(&keys, &rows).unwrap();
                m.push(&keys, &rows);
                "push"
            }
            55..=89 => {
                let grads: Vec<f32> = (0..n * DIM).map(|_| (rng.next() % 5) as f32 - 2.0).collect();
                // Distinct keys take the fused collection's entry half the time.
                if keys.iter().collect::<HashSet<_>>().len() == n && rng.next().is_multiple_of(2) {
                    t.push_grad_distinct(&keys, &grads).unwrap();
                } else {
                    t.push_grad(&keys, &grads).unwrap();
                }
                m.push_grad(&keys, &grads);
                // The TTL sweep right away (the maintenance thread would find the same rows).
                t.evict_expired().unwrap();
                m.evict_expired();
                "push_grad"
            }
            90..=94 => {
                let n_del = t.delete(&keys[..1]).unwrap();
                assert_eq!(n_del, m.remove(&keys[..1]), "{}", ctx(i, "delete"));
                "delete"
            }
            95..=97 => {
                t.evict_expired().unwrap();
                m.evict_expired();
                "evict_expired"
            }
            _ => {
                drop(t);
                store.close().unwrap();
                store = Store::open(&path, StoreOptions::default()).unwrap();
                t = store.table("t").unwrap();
                m.reopen();
                "reopen"
            }
        };
        assert_eq!(export(&t), m.rows, "{}", ctx(i, what));
        let s = t.stats().unwrap().lifecycle.unwrap();
        assert_eq!(
            (s.evicted_ttl, s.evicted_capacity, s.step, s.grads_dropped),
            (m.evicted_ttl, m.evicted_capacity, m.step, m.grads_dropped),
            "{}",
            ctx(i, what)
        );
        if let Some(max) = o.rows_max {
            assert!(t.len().unwrap() <= max, "{}", ctx(i, what));
        }
    }
}

fn configs() -> Vec<LifecycleOptions> {
    let lo = LifecycleOptions::default;
    vec![
        LifecycleOptions { admit_after: 3, ..lo() },
        LifecycleOptions { rows_max: Some(20), ..lo() },
        LifecycleOptions { rows_max: Some(20), evict: EvictPolicy::Lfu, ..lo() },
        LifecycleOptions { ttl_steps: Some(4), ..lo() },
        LifecycleOptions { admit_after: 2, rows_max: Some(16), ttl_steps: Some(6), ..lo() },
        LifecycleOptions { admit_after: 2, rows_max: Some(24), evict: EvictPolicy::Lfu, ..lo() },
    ]
}

#[test]
fn policies_match_the_model_on_mmap() {
    for (c, o) in configs().into_iter().enumerate() {
        for seed in 1..=4 {
            run(o.clone(), MediumKind::Mmap, seed * 7919 + c as u64, 400);
        }
    }
}

#[test]
fn policies_match_the_model_on_block_under_the_cache() {
    for (c, o) in configs().into_iter().enumerate() {
        for seed in 1..=2 {
            run(o.clone(), MediumKind::Block, seed * 104_729 + c as u64, 300);
        }
    }
}

#[test]
fn evicted_rows_are_gone_from_the_cache_and_the_medium() {
    let (_dir, store, t) = fresh(LifecycleOptions { rows_max: Some(100), ..Default::default() }, MediumKind::Block);
    let keys: Vec<u64> = (0..100).collect();
    let rows: Vec<f32> = keys.iter().flat_map(|&k| [k as f32; DIM]).collect();
    t.push(&keys, &rows).unwrap();
    let mut out = vec![0f32; 100 * DIM];
    t.pull(&keys, &mut out).unwrap(); // all cached now
                                      // 10 new rows: 10 + 100/32 = 13 victims, the least recently touched: keys 0..13 of
                                      // the push (touched by the pull too, all at one tick: smaller keys first).
    t.push(&(1000..1010).collect::<Vec<_>>(), &[1.0; 10 * DIM]).unwrap();
    assert_eq!(t.len().unwrap(), 97);
    let mut found = vec![false; 13];
    t.lookup(&(0..13).collect::<Vec<_>>(), &mut [0f32; 13 * DIM], &mut found).unwrap();
    assert!(found.iter().all(|f| !f), "evicted rows still visible: {found:?}");
    store.flush().unwrap();
    let s = t.stats().unwrap();
    assert_eq!(s.lifecycle.unwrap().evicted_capacity, 13);
    // Pulled again they come back as new rows (the initializer's), not the old values.
    let mut out = vec![0f32; DIM];
    t.pull(&[5], &mut out).unwrap();
    assert_eq!(out, [INIT; DIM]);
}

#[test]
fn a_batch_larger_than_max_rows_is_refused_with_nothing_created() {
    let (_dir, _store, t) = fresh(LifecycleOptions { rows_max: Some(4), ..Default::default() }, MediumKind::Mmap);
    t.pull(&[1, 2], &mut [0f32; 2 * DIM]).unwrap();
    let e = t.pull(&[10, 11, 12, 13, 14], &mut [0f32; 5 * DIM]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(e.to_string().contains("rows_max"), "{e}");
    assert_eq!(export(&t).keys().copied().collect::<Vec<_>>(), [1, 2]);
}

#[test]
fn ttl_in_seconds_is_swept_by_the_maintenance_thread() {
    let (_dir, _store, t) = fresh(LifecycleOptions { ttl_seconds: Some(0.5), ..Default::default() }, MediumKind::Mmap);
    t.pull(&[1, 2, 3], &mut [0f32; 3 * DIM]).unwrap();
    // Key 1 stays in use; 2 and 3 are left alone. Within ~1 s sweep + 0.5 s TTL they go.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        t.pull(&[1], &mut [0f32; DIM]).unwrap();
        let keys: Vec<u64> = export(&t).into_keys().collect();
        if keys == [1] {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "rows 2, 3 not evicted after 10 s: {keys:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(t.stats().unwrap().lifecycle.unwrap().evicted_ttl, 2);
}

#[test]
fn bad_lifecycle_options_name_the_option() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let o = LifecycleOptions { ttl_steps: Some(0), ..Default::default() };
    let e = store.create_table("t", options(&o, MediumKind::Mmap)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.to_string().contains("ttl_steps"), "{e}");
    assert!(store.tables().unwrap().is_empty());
}

/// `push_with_state` on a table with a lifecycle is a push (what `embank reshard` writes):
/// the records are stored at once whatever `admit_after` says, room is made under
/// `rows_max` first (the least recently touched row goes), and the keys count as touched.
#[test]
fn push_with_state_on_a_lifecycle_table_is_a_push() {
    let o = LifecycleOptions { admit_after: 3, rows_max: Some(4), ..Default::default() };
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let mut opts = options(&o, MediumKind::Mmap);
    opts.optimizer = Optimizer::Adagrad { lr: LR, eps: 1e-8, initial_accumulator_value: 0.0 };
    let t = store.create_table("t", opts).unwrap();
    let w = DIM + t.state_len();
    let records: Vec<f32> = (0..3 * w).map(|i| i as f32).collect();
    t.push_with_state(&[1, 2, 3], &records).unwrap();
    let (mut out, mut found) = (vec![0f32; 3 * w], vec![false; 3]);
    t.lookup_with_state(&[1, 2, 3], &mut out, &mut found).unwrap();
    assert_eq!((out, found), (records.clone(), vec![true; 3]));
    t.pull(&[1], &mut [0f32; DIM]).unwrap(); // 2 is now the least recently touched
    t.push_with_state(&[7, 8], &records[..2 * w]).unwrap();
    assert_eq!(export(&t).keys().copied().collect::<Vec<_>>(), [1, 3, 7, 8]);
    assert_eq!(t.stats().unwrap().lifecycle.unwrap().evicted_capacity, 1);
}
