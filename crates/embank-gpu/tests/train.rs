//! The training kernels (kernels/train.cuh) on the CPU emulator against a model: a cache
//! driven by find, place and update, its evicted dirty rows and a final flush written to a
//! map standing for the table, must leave the map equal bit for bit to a reference that
//! applies every update to the map directly (embank-core's optimizers); each call's slots
//! must be the model's (empty slots first, then the least recently used one the call
//! does not use, ties to the lowest index). `cargo test -p embank-gpu --features emulator`.
#![cfg(feature = "emulator")]

use std::collections::HashMap;
use std::sync::Arc;

use embank_core::Optimizer;
use embank_gpu::device::Emulator;
use embank_gpu::train::train_bucket;
use embank_gpu::{Device, Rule, RuleKind, TrainKernels, TrainLayout};
use rand::{Rng, SeedableRng};

const EMPTY: i64 = -1;

struct Cache {
    keys: Vec<i64>,
    used: Vec<i64>,
    records: Vec<f32>,
    dirty: Vec<u8>,
    nb: usize,
    s: usize,
    w: usize,
    dim: usize,
}

impl Cache {
    fn new(nb: usize, s: usize, dim: usize, w: usize) -> Cache {
        Cache {
            keys: vec![EMPTY; nb * s],
            used: vec![0; nb * s],
            records: vec![0.0; nb * s * w],
            dirty: vec![0; nb * s],
            nb,
            s,
            w,
            dim,
        }
    }
    fn layout(&mut self) -> TrainLayout {
        TrainLayout {
            keys: self.keys.as_mut_ptr() as u64,
            used: self.used.as_mut_ptr() as u64,
            records: self.records.as_mut_ptr() as u64,
            dirty: self.dirty.as_mut_ptr() as u64,
            n_buckets: self.nb,
            slots: self.s,
            width: self.w,
            dim: self.dim,
        }
    }
}

fn rule_of(kind: RuleKind) -> (Rule, Optimizer) {
    let (lr, eps, b1, b2, wd, l1, l2, beta) = (0.05f32, 1e-3f32, 0.9f32, 0.999f32, 0.01f32, 0.001f32, 0.01f32, 1.0f32);
    let opt = match kind {
        RuleKind::Sgd => Optimizer::Sgd { lr },
        RuleKind::Adagrad => Optimizer::Adagrad { lr, eps, initial_accumulator_value: 0.0 },
        RuleKind::RowWiseAdagrad => Optimizer::RowWiseAdagrad { lr, eps, initial_accumulator_value: 0.0 },
        RuleKind::Adam => Optimizer::Adam { lr, beta1: b1, beta2: b2, eps },
        RuleKind::AdamW => Optimizer::AdamW { lr, beta1: b1, beta2: b2, eps, weight_decay: wd },
        RuleKind::Ftrl => Optimizer::Ftrl { lr, beta, l1, l2, initial_accumulator_value: 0.0 },
    };
    (Rule { kind, lr, eps, beta1: b1, beta2: b2, weight_decay: wd, l1, l2, beta }, opt)
}

/// The record a table would give a key it never saw: its row, state zero; Adam's step
/// count starts at 2950, past steps where `f32::powf` and a rounded `f64` power differ
/// (0.999^2958: the kernels and the host must compute the bias correction alike).
fn fresh(key: u64, dim: usize, w: usize) -> Vec<f32> {
    let mut r = vec![0.0f32; w];
    for (j, v) in r[..dim].iter_mut().enumerate() {
        *v = ((key * 31 + j as u64) as f32 * 0.13).sin();
    }
    if w == 3 * dim + 1 {
        r[3 * dim] = 2950.0;
    }
    r
}

/// The model's slot for each miss of one call (`hit`: slots the call found).
fn model_place(c: &Cache, misses: &[u64], clock: i64) -> Vec<Option<usize>> {
    let mut keys = c.keys.clone();
    let mut used = c.used.clone();
    misses
        .iter()
        .map(|&k| {
            let b = train_bucket(k, c.nb as u64) as usize;
            let best = (0..c.s)
                .map(|i| b * c.s + i)
                .filter(|&f| used[f] != clock || keys[f] == EMPTY)
                .min_by_key(|&f| (if keys[f] == EMPTY { 0 } else { used[f] + 1 }, f))?;
            keys[best] = k as i64;
            used[best] = clock;
            Some(best)
        })
        .collect()
}

fn run(kind: RuleKind, seed: u64) {
    let dim = 5usize; // not a multiple of 4, under a warp
    let (rule, opt) = rule_of(kind);
    let w = dim + kind.state_len(dim);
    let (nb, s) = (4usize, 4usize);
    let dev: Arc<dyn Device> = Arc::new(Emulator);
    let mut c = Cache::new(nb, s, dim, w);
    // The caller's thread has another context current (PyTorch's on another GPU): every
    // call makes the cache's current for itself and leaves the caller's as it was.
    embank_gpu::device::set_current_context(0x77);
    let k = TrainKernels::new(dev, c.layout()).unwrap();
    assert_eq!(embank_gpu::device::current_context(), 0x77);
    let mut table: HashMap<u64, Vec<f32>> = HashMap::new(); // what the cache writes back
    let mut reference: HashMap<u64, Vec<f32>> = HashMap::new(); // every update applied here
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut evicted, mut unplaced) = (0u64, 0usize);
    for call in 1..=40i64 {
        // Distinct ids, skewed: a few hot, a tail; more than a bucket holds at times.
        let n = rng.random_range(1..=16usize);
        let mut ids: Vec<u64> = Vec::new();
        while ids.len() < n {
            let id = if rng.random_bool(0.5) { rng.random_range(0..6u64) } else { rng.random_range(0..60u64) };
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        let before = (c.keys.clone(), c.used.clone());
        let mut slot = vec![-7i64; n];
        let mut out = vec![f32::NAN; n * dim];
        let missed =
            k.find(ids.as_ptr() as u64, n, slot.as_mut_ptr() as u64, out.as_mut_ptr() as u64, call as u64, 0).unwrap();
        assert_eq!(embank_gpu::device::current_context(), 0x77, "after find");
        // Hits: the cached rows and slots, touched; misses: listed in the call's order.
        let mut want_miss = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            match before.0.iter().position(|&x| x == id as i64) {
                Some(f) => {
                    assert_eq!(slot[i], f as i64, "call {call}: slot of {id}");
                    assert_eq!(c.used[f], call);
                    assert_eq!(&out[i * dim..(i + 1) * dim], &c.records[f * w..f * w + dim]);
                }
                None => {
                    assert_eq!(slot[i], -1);
                    want_miss.push((id, i as u32));
                }
            }
        }
        assert_eq!(missed.keys, want_miss.iter().map(|x| x.0).collect::<Vec<_>>(), "call {call}: misses");
        assert_eq!(missed.at, want_miss.iter().map(|x| x.1).collect::<Vec<_>>());
        // The misses' records: written back ones first, else fresh (as the table gives).
        let mut recs = Vec::new();
        for &key in &missed.keys {
            recs.extend(table.get(&key).cloned().unwrap_or_else(|| fresh(key, dim, w)));
        }
        let want = model_place(&c, &missed.keys, call);
        let placed = k
            .place(&missed.keys, &missed.at, &recs, slot.as_mut_ptr() as u64, out.as_mut_ptr() as u64, call as u64, 0)
            .unwrap();
        for (q, (&key, &i)) in missed.keys.iter().zip(&missed.at).enumerate() {
            let i = i as usize;
            assert_eq!(&out[i * dim..(i + 1) * dim], &recs[q * w..q * w + dim], "call {call}: row of miss {key}");
            match want[q] {
                Some(f) => {
                    assert_eq!(slot[i], f as i64, "call {call}: slot of miss {key}");
                    assert_eq!(c.keys[f], key as i64);
                    assert_eq!(c.dirty[f], 0);
                    assert_eq!(&c.records[f * w..(f + 1) * w], &recs[q * w..(q + 1) * w]);
                }
                None => assert_eq!(slot[i], -1, "call {call}: miss {key} has no slot"),
            }
        }
        let want_unplaced: Vec<u32> = (0..want.len() as u32).filter(|&q| want[q as usize].is_none()).collect();
        assert_eq!(placed.unplaced, want_unplaced);
        unplaced += placed.unplaced.len();
        evicted += placed.evicted;
        for (q, &key) in placed.dirty_keys.iter().enumerate() {
            table.insert(key, placed.dirty_records[q * w..(q + 1) * w].to_vec());
        }
        // One update of every id (a miss with no slot goes straight to the table).
        let grads: Vec<f32> = (0..n * dim).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        k.update(slot.as_ptr() as u64, grads.as_ptr() as u64, n, &rule, true, 0).unwrap();
        assert_eq!(embank_gpu::device::current_context(), 0x77, "after place and update");
        for (i, &id) in ids.iter().enumerate() {
            let g = &grads[i * dim..(i + 1) * dim];
            let r = reference.entry(id).or_insert_with(|| fresh(id, dim, w));
            opt.apply(r, g, call as u64);
            if slot[i] < 0 {
                let q = missed.keys.iter().position(|&x| x == id).unwrap();
                let mut rec = recs[q * w..(q + 1) * w].to_vec();
                opt.apply(&mut rec, g, call as u64);
                table.insert(id, rec);
            } else {
                assert_eq!(c.dirty[slot[i] as usize], 1);
            }
        }
    }
    assert!(evicted > 20 && unplaced > 0, "the sequence evicts ({evicted}) and overflows ({unplaced})");
    // The flush: every dirty row to the table.
    for f in 0..nb * s {
        if c.dirty[f] == 1 {
            table.insert(c.keys[f] as u64, c.records[f * w..(f + 1) * w].to_vec());
        }
    }
    for (key, want) in &reference {
        let got = &table[key];
        let same = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{kind:?}: key {key}: {got:?} against the reference {want:?}");
    }
}

#[test]
fn each_optimizer_through_the_kernels_equals_the_store_bit_for_bit() {
    for kind in
        [RuleKind::Sgd, RuleKind::Adagrad, RuleKind::RowWiseAdagrad, RuleKind::Adam, RuleKind::AdamW, RuleKind::Ftrl]
    {
        run(kind, 7);
    }
}

#[test]
fn an_update_refuses_records_of_another_width() {
    let dev: Arc<dyn Device> = Arc::new(Emulator);
    let mut c = Cache::new(2, 4, 3, 3);
    let k = TrainKernels::new(dev, c.layout()).unwrap();
    let (rule, _) = rule_of(RuleKind::Adam);
    let slots = [0i64];
    let grads = [0.0f32; 3];
    let e = k.update(slots.as_ptr() as u64, grads.as_ptr() as u64, 1, &rule, true, 0).unwrap_err();
    assert!(e.to_string().contains("state values"), "{e}");
    let e = k.place(&[1], &[0], &[0.0; 2], 0, 0, 1, 0).unwrap_err();
    assert!(e.to_string().contains("records of width 3"), "{e}");
}
