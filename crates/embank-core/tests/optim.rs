//! `push_grad` (and `push_grad_distinct`, for batches of distinct keys) against an
//! independent reference: f64 formulas applied to a
//! `HashMap` of rows and optimizer state, with duplicate keys in batches,
//! pulls, plain pushes (which restart a row's state), a learning-rate change,
//! flush and close/reopen (state persists with the row), on every medium.

#![allow(clippy::needless_range_loop)] // the formulas read best with indices

use std::collections::HashMap;

use embank_core::{Initializer, IoChoice, MediumKind, Optimizer, Placement, Store, StoreOptions, Table, TableOptions};
use proptest::prelude::*;

const DIM: usize = 4;
const KEYS: u64 = 40;

/// Row and state in f64: (w, s or m, v, step).
#[derive(Clone, Debug)]
struct Ref {
    w: Vec<f64>,
    a: Vec<f64>,
    b: Vec<f64>,
    t: f64,
}

fn init_row(key: u64) -> Vec<f64> {
    let mut r = vec![0.0f32; DIM];
    Initializer::Uniform { low: -0.1, high: 0.1 }.fill(5, key, &mut r);
    r.into_iter().map(f64::from).collect()
}

fn fresh(opt: &Optimizer, w: Vec<f64>) -> Ref {
    let (a0, b0) = match opt {
        Optimizer::Adagrad { initial_accumulator_value, .. }
        | Optimizer::RowWiseAdagrad { initial_accumulator_value, .. } => (*initial_accumulator_value as f64, 0.0),
        // FTRL: z (a) from 0, n (b) from the initial accumulator.
        Optimizer::Ftrl { initial_accumulator_value, .. } => (0.0, *initial_accumulator_value as f64),
        _ => (0.0, 0.0),
    };
    Ref { w, a: vec![a0; DIM], b: vec![b0; DIM], t: 0.0 }
}

fn step(opt: &Optimizer, r: &mut Ref, g: &[f64]) {
    match *opt {
        Optimizer::Sgd { lr } => (0..DIM).for_each(|i| r.w[i] -= lr as f64 * g[i]),
        Optimizer::Adagrad { lr, eps, .. } => {
            for i in 0..DIM {
                r.a[i] += g[i] * g[i];
                r.w[i] -= lr as f64 * g[i] / (r.a[i].sqrt() + eps as f64);
            }
        }
        Optimizer::RowWiseAdagrad { lr, eps, .. } => {
            // One accumulator a row (a[0]): the mean of the squared gradient.
            r.a[0] += g.iter().map(|x| x * x).sum::<f64>() / DIM as f64;
            let multiplier = lr as f64 / (r.a[0].sqrt() + eps as f64);
            (0..DIM).for_each(|i| r.w[i] -= multiplier * g[i]);
        }
        Optimizer::Ftrl { lr, beta, l1, l2, .. } => {
            let (lr, beta, l1, l2) = (lr as f64, beta as f64, l1 as f64, l2 as f64);
            for i in 0..DIM {
                let n = r.b[i] + g[i] * g[i];
                let sigma = (n.sqrt() - r.b[i].sqrt()) / lr;
                r.a[i] += g[i] - sigma * r.w[i];
                r.b[i] = n;
                let z = r.a[i];
                r.w[i] = if z.abs() <= l1 { 0.0 } else { -(z - z.signum() * l1) / ((beta + n.sqrt()) / lr + l2) };
            }
        }
        Optimizer::AdamW { lr, beta1, beta2, eps, weight_decay } => {
            (0..DIM).for_each(|i| r.w[i] *= 1.0 - lr as f64 * weight_decay as f64);
            step(&Optimizer::Adam { lr, beta1, beta2, eps }, r, g);
        }
        Optimizer::Adam { lr, beta1, beta2, eps } => {
            let (b1, b2) = (beta1 as f64, beta2 as f64);
            r.t += 1.0;
            for i in 0..DIM {
                r.a[i] = b1 * r.a[i] + (1.0 - b1) * g[i];
                r.b[i] = b2 * r.b[i] + (1.0 - b2) * g[i] * g[i];
                let mhat = r.a[i] / (1.0 - b1.powf(r.t));
                let vhat = r.b[i] / (1.0 - b2.powf(r.t));
                r.w[i] -= lr as f64 * mhat / (vhat.sqrt() + eps as f64);
            }
        }
        Optimizer::None => unreachable!(),
        // Their bias correction is the table's step: tests/table_step.rs.
        Optimizer::FbgemmAdam { .. }
        | Optimizer::PartialRowWiseAdam { .. }
        | Optimizer::Lamb { .. }
        | Optimizer::PartialRowWiseLamb { .. } => unreachable!("a table-step kind"),
    }
}

#[derive(Debug, Clone)]
enum Op {
    Grad(Vec<u64>, Vec<f32>),
    Pull(Vec<u64>),
    Push(u64, f32),
    SetLr(f32),
    Flush,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    let keys = proptest::collection::vec(0..KEYS, 1..12);
    prop_oneof![
        6 => keys.clone().prop_flat_map(|k| {
            let n = k.len() * DIM;
            (Just(k), proptest::collection::vec(-1.0f32..1.0, n))
        }).prop_map(|(k, g)| Op::Grad(k, g)),
        2 => keys.prop_map(Op::Pull),
        1 => (0..KEYS, -1.0f32..1.0).prop_map(|(k, v)| Op::Push(k, v)),
        1 => (0.001f32..0.2).prop_map(Op::SetLr),
        1 => Just(Op::Flush),
        1 => Just(Op::Reopen),
    ]
}

fn close_enough(got: &[f32], want: &[f64]) -> bool {
    got.iter().zip(want).all(|(&g, &w)| (g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0))
}

fn check(opt: Optimizer, medium: MediumKind, ops: &[Op]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let so = StoreOptions { cache_bytes: 4096, io_engine: IoChoice::Auto, ..StoreOptions::default() };
    let mut store = Store::open(&path, so.clone()).unwrap();
    let mut o = TableOptions::new(DIM as u32);
    o.init = Initializer::Uniform { low: -0.1, high: 0.1 };
    o.seed = 5;
    o.optimizer = opt;
    o.medium = medium;
    o.placement = if medium == MediumKind::Block { Placement::Cache } else { Placement::Auto };
    o.capacity = 8;
    store.create_table("e", o).unwrap();
    let mut opt = opt;
    let mut model: HashMap<u64, Ref> = HashMap::new();
    let table = |s: &Store| -> Table { s.table("e").unwrap() };
    for (n, op) in ops.iter().enumerate() {
        match op {
            Op::Grad(keys, grads) => {
                // Distinct keys take the fused collection's entry every other op.
                let distinct = keys.iter().collect::<std::collections::HashSet<_>>().len() == keys.len();
                if distinct && n % 2 == 1 {
                    table(&store).push_grad_distinct(keys, grads).unwrap();
                } else {
                    table(&store).push_grad(keys, grads).unwrap();
                }
                let mut summed: Vec<(u64, Vec<f64>)> = Vec::new();
                for (i, k) in keys.iter().enumerate() {
                    let g: Vec<f64> = grads[i * DIM..(i + 1) * DIM].iter().map(|&x| x as f64).collect();
                    match summed.iter_mut().find(|(key, _)| key == k) {
                        Some((_, s)) => s.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
                        None => summed.push((*k, g)),
                    }
                }
                for (k, g) in summed {
                    let r = model.entry(k).or_insert_with(|| fresh(&opt, init_row(k)));
                    step(&opt, r, &g);
                }
            }
            Op::Pull(keys) => {
                let mut out = vec![0.0; keys.len() * DIM];
                table(&store).pull(keys, &mut out).unwrap();
                for (i, k) in keys.iter().enumerate() {
                    let r = model.entry(*k).or_insert_with(|| fresh(&opt, init_row(*k)));
                    prop_assert!(
                        close_enough(&out[i * DIM..(i + 1) * DIM], &r.w),
                        "op {} key {}: {:?} vs {:?}",
                        n,
                        k,
                        &out[i * DIM..(i + 1) * DIM],
                        r.w
                    );
                }
            }
            Op::Push(k, v) => {
                table(&store).push(&[*k], &[*v; DIM]).unwrap();
                model.insert(*k, fresh(&opt, vec![*v as f64; DIM]));
            }
            Op::SetLr(lr) => {
                table(&store).set_lr(*lr).unwrap();
                opt = opt.with_lr(*lr).unwrap();
            }
            Op::Flush => store.flush().unwrap(),
            Op::Reopen => {
                store.close().unwrap();
                store = Store::open(&path, so.clone()).unwrap();
                prop_assert_eq!(table(&store).optimizer(), opt, "optimizer and learning rate persist");
            }
        }
    }
    let keys: Vec<u64> = model.keys().copied().collect();
    let mut out = vec![0.0; keys.len() * DIM];
    table(&store).pull(&keys, &mut out).unwrap();
    for (i, k) in keys.iter().enumerate() {
        prop_assert!(close_enough(&out[i * DIM..(i + 1) * DIM], &model[k].w), "end: key {}", k);
    }
    Ok(())
}

const ADAGRAD: Optimizer = Optimizer::Adagrad { lr: 0.05, eps: 1e-8, initial_accumulator_value: 0.1 };
const ADAM: Optimizer = Optimizer::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 };
const ROWWISE: Optimizer = Optimizer::RowWiseAdagrad { lr: 0.05, eps: 1e-8, initial_accumulator_value: 0.1 };
const ADAMW: Optimizer = Optimizer::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
const FTRL: Optimizer = Optimizer::Ftrl { lr: 0.1, beta: 1.0, l1: 0.01, l2: 0.01, initial_accumulator_value: 0.1 };

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn sgd_mmap(ops in proptest::collection::vec(op(), 1..60)) {
        check(Optimizer::Sgd { lr: 0.1 }, MediumKind::Mmap, &ops)?;
    }

    #[test]
    fn adagrad_mmap(ops in proptest::collection::vec(op(), 1..60)) {
        check(ADAGRAD, MediumKind::Mmap, &ops)?;
    }

    #[test]
    fn adam_mmap(ops in proptest::collection::vec(op(), 1..60)) {
        check(ADAM, MediumKind::Mmap, &ops)?;
    }

    #[test]
    fn rowwise_adagrad_mmap(ops in proptest::collection::vec(op(), 1..60)) {
        check(ROWWISE, MediumKind::Mmap, &ops)?;
    }

    #[test]
    fn adamw_mmap(ops in proptest::collection::vec(op(), 1..60)) {
        check(ADAMW, MediumKind::Mmap, &ops)?;
    }

    #[test]
    fn ftrl_mmap(ops in proptest::collection::vec(op(), 1..60)) {
        check(FTRL, MediumKind::Mmap, &ops)?;
    }

    #[test]
    fn rowwise_adagrad_block_cache(ops in proptest::collection::vec(op(), 1..60)) {
        check(ROWWISE, MediumKind::Block, &ops)?;
    }

    #[test]
    fn ftrl_block_cache(ops in proptest::collection::vec(op(), 1..60)) {
        check(FTRL, MediumKind::Block, &ops)?;
    }

    #[test]
    fn adagrad_block_cache(ops in proptest::collection::vec(op(), 1..60)) {
        check(ADAGRAD, MediumKind::Block, &ops)?;
    }

    #[test]
    fn adam_block_cache(ops in proptest::collection::vec(op(), 1..60)) {
        check(ADAM, MediumKind::Block, &ops)?;
    }
}

#[test]
fn push_grad_errors() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let plain = store.create_table("plain", TableOptions::new(2)).unwrap();
    let e = plain.push_grad(&[1], &[0.1, 0.1]).unwrap_err();
    assert_eq!(e.kind(), embank_core::ErrorKind::Config, "{e}");
    let mut o = TableOptions::new(2);
    o.optimizer = Optimizer::Sgd { lr: 0.1 };
    let t = store.create_table("t", o).unwrap();
    let e = t.push_grad(&[1, 2], &[0.1, f32::NAN, 0.0, 0.0]).unwrap_err();
    assert_eq!(e.kind(), embank_core::ErrorKind::InvalidInput);
    assert_eq!(t.len().unwrap(), 0, "a refused push_grad writes nothing");
    let e = t.push_grad(&[1], &[0.1]).unwrap_err();
    assert!(e.to_string().contains("dim 2"), "{e}");
    let mut o = TableOptions::new(2);
    o.optimizer = Optimizer::Adam { lr: 0.1, beta1: 1.5, beta2: 0.9, eps: 1e-8 };
    assert_eq!(store.create_table("bad", o).unwrap_err().kind(), embank_core::ErrorKind::Config);
    assert!(t.set_lr(-1.0).is_err());
}
