//! The training step of a table whose optimizer bias-corrects with it (FBGEMM's Adam,
//! LAMB and their partial row-wise forms): one t for every row updated in a step however
//! many calls the step makes, carried by `push_grad_at`; durable across close and reopen;
//! a restore to a checkpoint continues exactly as an uninterrupted run.

use embank_core::{Initializer, Optimizer, Store, StoreOptions, Table, TableOptions};

const DIM: usize = 4;

fn options(opt: Optimizer) -> TableOptions {
    let mut o = TableOptions::new(DIM as u32);
    o.init = Initializer::Uniform { low: -0.5, high: 0.5 };
    o.seed = 3;
    o.optimizer = opt;
    o
}

const ADAM: Optimizer = Optimizer::FbgemmAdam { lr: 0.05, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
const KINDS: [Optimizer; 4] = [
    ADAM,
    Optimizer::PartialRowWiseAdam { lr: 0.05, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 },
    Optimizer::Lamb { lr: 0.05, beta1: 0.8, beta2: 0.999, eps: 1e-6, weight_decay: 0.1 },
    Optimizer::PartialRowWiseLamb { lr: 0.05, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
];

/// Step `s`'s batch: 3 of 8 keys (so rows skip steps), gradients from `s`.
fn batch(s: u64) -> (Vec<u64>, Vec<f32>) {
    let keys: Vec<u64> = (0..3).map(|i| (s * 5 + i * 3) % 8).collect();
    let grads = (0..keys.len() * DIM).map(|i| ((s as usize * 7 + i * 13) % 17) as f32 / 17.0 - 0.5).collect();
    (keys, grads)
}

fn rows(t: &Table) -> Vec<u32> {
    let keys: Vec<u64> = (0..8).collect();
    let mut out = vec![0f32; keys.len() * (DIM + t.state_len())];
    let mut found = vec![false; keys.len()];
    t.lookup_with_state(&keys, &mut out, &mut found).unwrap();
    out.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn one_step_of_several_calls_uses_one_t() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let a = store.create_table("a", options(ADAM)).unwrap();
    let b = store.create_table("b", options(ADAM)).unwrap();
    // Table a: step 4's gradients in two calls (two ranks); table b: in one.
    let g = [0.3f32, -0.2, 0.1, 0.4];
    a.push_grad_at(&[1], &g, 4, false).unwrap();
    a.push_grad_at(&[2], &g, 4, true).unwrap();
    b.push_grad_at(&[1, 2], &[g, g].concat(), 4, false).unwrap();
    assert_eq!((a.optimizer_step(), b.optimizer_step()), (4, 4));
    assert_eq!(rows(&a), rows(&b), "two calls of one step are one step");
    // A late call of an earlier step leaves the table's step where it is.
    a.push_grad_at(&[3], &g, 2, false).unwrap();
    assert_eq!(a.optimizer_step(), 4);
    // Without a step, a call is a step of its own.
    a.push_grad(&[3], &g).unwrap();
    assert_eq!(a.optimizer_step(), 5);
    // An empty push of step 9 (no rows of this table in it) still moves the step.
    a.push_grad_at(&[], &[], 9, true).unwrap();
    assert_eq!(a.optimizer_step(), 9);
    let e = a.push_grad_at(&[1], &g, 0, false).unwrap_err();
    assert_eq!(e.kind(), embank_core::ErrorKind::InvalidInput, "{e}");
    // Per-row optimizers keep no table step.
    let mut o = options(Optimizer::Adam { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8 });
    o.seed = 4;
    let per_row = store.create_table("per_row", o).unwrap();
    per_row.push_grad_at(&[1], &g, 7, false).unwrap();
    assert_eq!(per_row.optimizer_step(), 0);
}

#[test]
fn restore_continues_as_an_uninterrupted_run_and_close_keeps_the_step() {
    for opt in KINDS {
        let dir = tempfile::tempdir().unwrap();
        let (path_a, path_b) = (dir.path().join("a"), dir.path().join("b"));
        // A: 25 steps without interruption.
        let a = Store::open(&path_a, StoreOptions::default()).unwrap();
        let ta = a.create_table("e", options(opt)).unwrap();
        for s in 1..=25 {
            let (k, g) = batch(s);
            ta.push_grad_at(&k, &g, s, false).unwrap();
        }
        // B: 10 steps, a checkpoint, 7 more (to be lost), a restore to the checkpoint, a
        // close and reopen (the step in the catalog), then steps 11 to 25 without a step
        // given: each call continues from the table's step.
        let b = Store::open(&path_b, StoreOptions::default()).unwrap();
        let tb = b.create_table("e", options(opt)).unwrap();
        for s in 1..=10 {
            let (k, g) = batch(s);
            tb.push_grad_at(&k, &g, s, false).unwrap();
        }
        b.checkpoint(10).unwrap();
        for s in 11..=17 {
            let (k, g) = batch(s + 100);
            tb.push_grad_at(&k, &g, s, false).unwrap();
        }
        assert_eq!(tb.optimizer_step(), 17);
        b.restore(10).unwrap();
        let tb = b.table("e").unwrap();
        assert_eq!(tb.optimizer_step(), 10, "{}: the checkpoint's step", opt.name());
        drop(tb);
        b.close().unwrap();
        let b = Store::open(&path_b, StoreOptions::default()).unwrap();
        let tb = b.table("e").unwrap();
        assert_eq!(tb.optimizer_step(), 10, "{}: the step after close and reopen", opt.name());
        for s in 11..=25 {
            let (k, g) = batch(s);
            tb.push_grad(&k, &g).unwrap();
        }
        assert_eq!(tb.optimizer_step(), 25);
        assert_eq!(rows(&ta), rows(&tb), "{}: restored run differs from the uninterrupted one", opt.name());
        assert_eq!(tb.meta().optimizer_step, 25);
        // A second checkpoint records the step it was taken at.
        b.checkpoint(30).unwrap();
        tb.push_grad(&batch(1).0, &batch(1).1).unwrap();
        assert_eq!(tb.optimizer_step(), 26);
        b.restore(30).unwrap();
        assert_eq!(b.table("e").unwrap().optimizer_step(), 25);
    }
}
