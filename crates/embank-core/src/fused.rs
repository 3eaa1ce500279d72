//! The collection-level training path: one call pulls and pools every feature of a
//! training step, one call reduces the pooled gradients to per-row gradients, one
//! call applies every table's optimizer.
//!
//! A [`Collection`] is a list of features, each pooled from one table (a table may
//! serve several features). [`Collection::forward`] takes every feature's bags
//! (`ids`, `offsets`, optional per-id weights), deduplicates the ids per table (the
//! features of one table together), pulls each table's distinct rows once and pools
//! them into one output buffer: feature `f`'s block of `bags x dim` values, the
//! features one after the other. It returns a [`Step`] — the distinct keys of every
//! table and where every id's row sits among them — which
//! [`Collection::backward`] uses to reduce the gradient of that output to one
//! gradient per distinct row ([`Grads`]); [`Collection::push`] hands those to the
//! tables' optimizers (`push_grad`, or `push_grad_held` for a staleness worker).
//!
//! Tables are independent, so each call spreads them over up to `threads` threads
//! (the caller's included): an embedded table's pull and push are CPU work, a remote
//! table's are round trips that then overlap.
//!
//! The results are those of pooling per feature with `torch.nn.EmbeddingBag` over
//! rows pulled per table and pushing each table's summed gradients, up to the order
//! floats are summed in.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::api::TableApi;
use crate::error::{Error, Result};
use crate::pooled::Pooling;

/// One feature's bags in a step: bag `b` is `ids[offsets[b]..offsets[b + 1]]`.
#[derive(Clone, Copy, Debug)]
pub struct Bags<'a> {
    pub ids: &'a [u64],
    /// One entry more than there are bags: starts at 0, ends at `ids.len()`.
    pub offsets: &'a [usize],
    /// One weight per id (mode sum only).
    pub weights: Option<&'a [f32]>,
}

/// One table of a collection, with the staleness worker its pulls hold keys for.
pub struct CollectionTable {
    pub table: Arc<dyn TableApi>,
    /// `Some(worker)`: pulls are `pull_held` and pushes `push_grad_held` of this worker.
    pub worker: Option<u64>,
}

/// What [`Collection::forward`] learned of a step, for its backward.
#[derive(Debug)]
pub struct Step {
    bags: usize,
    /// Distinct keys of each table, in the order their rows were pulled.
    keys: Vec<Vec<u64>>,
    /// Per feature: the position of each id's key in its table's `keys`.
    inverse: Vec<Vec<u32>>,
    offsets: Vec<Vec<usize>>,
    weights: Vec<Option<Vec<f32>>>,
}

impl Step {
    /// Bags per feature.
    pub fn bags(&self) -> usize {
        self.bags
    }

    /// Distinct keys pulled, all tables.
    pub fn rows(&self) -> usize {
        self.keys.iter().map(Vec::len).sum()
    }
}

/// Per-row gradients of one step, per table: distinct keys and their summed gradients.
#[derive(Debug, Default)]
pub struct Grads {
    pub keys: Vec<Vec<u64>>,
    pub grads: Vec<Vec<f32>>,
}

impl Grads {
    /// Keys with a gradient, all tables.
    pub fn rows(&self) -> usize {
        self.keys.iter().map(Vec::len).sum()
    }
}

/// Features pooled from tables; see the module docs.
pub struct Collection {
    tables: Vec<CollectionTable>,
    /// The table of each feature.
    features: Vec<usize>,
    /// The features of each table.
    by_table: Vec<Vec<usize>>,
    mode: Pooling,
    threads: usize,
    hold_timeout: Duration,
}

impl std::fmt::Debug for Collection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.tables.iter().map(|t| t.table.name()).collect();
        f.debug_struct("Collection").field("tables", &names).field("features", &self.features).finish()
    }
}

type IdMap = crate::hash::IdMap<u32>;

/// Runs `f(i)` for `i` in `0..n` on up to `threads` threads (this one included),
/// returning the results in order; the first error (lowest `i`) wins.
fn par_map<R: Send>(n: usize, threads: usize, f: impl Fn(usize) -> Result<R> + Sync) -> Result<Vec<R>> {
    let threads = threads.clamp(1, n.max(1));
    if threads == 1 {
        return (0..n).map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<R>>>> = Mutex::new((0..n).map(|_| None).collect());
    let work = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        let r = f(i);
        results.lock()[i] = Some(r);
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(work);
        }
        work();
    });
    results.into_inner().into_iter().map(|r| r.expect("every index ran")).collect()
}

impl Collection {
    /// `features[f]`: the index in `tables` of feature `f`'s table. `threads`: how many
    /// threads a call may use (1: the caller's only).
    pub fn new(tables: Vec<CollectionTable>, features: Vec<usize>, mode: Pooling, threads: usize) -> Result<Self> {
        if features.is_empty() {
            return Err(Error::invalid("a collection needs at least one feature"));
        }
        let mut by_table = vec![Vec::new(); tables.len()];
        for (f, &t) in features.iter().enumerate() {
            match by_table.get_mut(t) {
                Some(v) => v.push(f),
                None => {
                    return Err(Error::invalid(format!(
                        "feature {f} names table {t}, but the collection has {} tables",
                        tables.len()
                    )))
                }
            }
        }
        if let Some(t) = by_table.iter().position(Vec::is_empty) {
            return Err(Error::invalid(format!("table {:?} serves no feature", tables[t].table.name())));
        }
        Ok(Collection {
            tables,
            features,
            by_table,
            mode,
            threads: threads.max(1),
            hold_timeout: Duration::from_secs(60),
        })
    }

    /// How long a staleness worker's pull waits for a held key (default 60 s).
    pub fn with_hold_timeout(mut self, timeout: Duration) -> Self {
        self.hold_timeout = timeout;
        self
    }

    pub fn features(&self) -> usize {
        self.features.len()
    }

    /// The width of feature `f`'s pooled rows.
    pub fn dim(&self, f: usize) -> usize {
        self.tables[self.features[f]].table.dim()
    }

    /// Output elements for `bags` bags per feature.
    pub fn out_len(&self, bags: usize) -> usize {
        (0..self.features.len()).map(|f| bags * self.dim(f)).sum()
    }

    /// Checks a step's input; returns the bag count (equal for every feature).
    fn check(&self, input: &[Bags<'_>]) -> Result<usize> {
        if input.len() != self.features.len() {
            return Err(Error::invalid(format!(
                "the collection has {} features, the step gave {}",
                self.features.len(),
                input.len()
            )));
        }
        let bags = input[0].offsets.len().saturating_sub(1);
        for (f, b) in input.iter().enumerate() {
            crate::table::check_bags(b.ids, b.offsets, b.weights, self.mode)
                .map_err(|e| Error::invalid(format!("feature {f}: {e}")))?;
            if b.offsets.len() - 1 != bags {
                return Err(Error::invalid(format!(
                    "feature {f} has {} bags, feature 0 has {bags}: every feature needs one bag per example",
                    b.offsets.len() - 1
                )));
            }
        }
        Ok(bags)
    }

    /// Distinct keys of table `t`'s features in `input`, and each id's position among them.
    fn dedup(&self, t: usize, input: &[Bags<'_>]) -> (Vec<u64>, Vec<Vec<u32>>) {
        let n: usize = self.by_table[t].iter().map(|&f| input[f].ids.len()).sum();
        let mut map = IdMap::with_capacity_and_hasher(n, Default::default());
        let mut keys = Vec::with_capacity(n);
        let inverse = self.by_table[t]
            .iter()
            .map(|&f| {
                input[f]
                    .ids
                    .iter()
                    .map(|&k| {
                        *map.entry(k).or_insert_with(|| {
                            keys.push(k);
                            (keys.len() - 1) as u32
                        })
                    })
                    .collect()
            })
            .collect();
        (keys, inverse)
    }

    /// Pulls and pools every feature of a step into `out` (feature blocks of `bags x
    /// dim`, in feature order). The rows pulled are created as a pull creates them.
    pub fn forward(&self, input: &[Bags<'_>], out: &mut [f32]) -> Result<Step> {
        let bags = self.check(input)?;
        if out.len() != self.out_len(bags) {
            return Err(Error::invalid(format!(
                "{bags} bags per feature need {} output elements, got {}",
                self.out_len(bags),
                out.len()
            )));
        }
        // Each feature's output block, handed to its table's task.
        let mut blocks: Vec<Mutex<&mut [f32]>> = Vec::with_capacity(self.features.len());
        let mut rest = out;
        for f in 0..self.features.len() {
            let (block, tail) = rest.split_at_mut(bags * self.dim(f));
            blocks.push(Mutex::new(block));
            rest = tail;
        }
        let per_table = par_map(self.tables.len(), self.threads, |t| {
            let ct = &self.tables[t];
            let dim = ct.table.dim();
            let (keys, inverse) = self.dedup(t, input);
            let mut rows = vec![0f32; keys.len() * dim];
            match ct.worker {
                Some(w) => ct.table.pull_held(w, &keys, &mut rows, self.hold_timeout),
                None => ct.table.pull(&keys, &mut rows),
            }
            .map_err(|e| e.context(format!("pull of table {:?}", ct.table.name())))?;
            for (&f, inv) in self.by_table[t].iter().zip(&inverse) {
                let mut block = blocks[f].lock();
                pool_feature(self.mode, &input[f], inv, &rows, dim, &mut block);
            }
            Ok((keys, inverse))
        })?;
        let mut keys = Vec::with_capacity(self.tables.len());
        let mut inverse: Vec<Vec<u32>> = vec![Vec::new(); self.features.len()];
        for (t, (k, inv)) in per_table.into_iter().enumerate() {
            keys.push(k);
            for (&f, i) in self.by_table[t].iter().zip(inv) {
                inverse[f] = i;
            }
        }
        Ok(Step {
            bags,
            keys,
            inverse,
            offsets: input.iter().map(|b| b.offsets.to_vec()).collect(),
            weights: input.iter().map(|b| b.weights.map(<[f32]>::to_vec)).collect(),
        })
    }

    /// Reduces the gradient of a step's output (`grad`, laid out as `forward`'s `out`)
    /// to one summed gradient per distinct row of each table.
    pub fn backward(&self, step: &Step, grad: &[f32]) -> Result<Grads> {
        let bags = step.bags;
        if grad.len() != self.out_len(bags) {
            return Err(Error::invalid(format!(
                "the step's output has {} elements, its gradient {}",
                self.out_len(bags),
                grad.len()
            )));
        }
        if let Some(i) = crate::optim::first_non_finite(grad) {
            return Err(Error::invalid(format!(
                "the gradient holds a non-finite value ({}) at element {i}; nothing was pushed",
                grad[i]
            )));
        }
        let mut starts = Vec::with_capacity(self.features.len());
        let mut at = 0;
        for f in 0..self.features.len() {
            starts.push(at);
            at += bags * self.dim(f);
        }
        let per_table = par_map(self.tables.len(), self.threads, |t| {
            let dim = self.tables[t].table.dim();
            let mut g = vec![0f32; step.keys[t].len() * dim];
            for &f in &self.by_table[t] {
                let block = &grad[starts[f]..starts[f] + bags * dim];
                let (offsets, inv, weights) = (&step.offsets[f], &step.inverse[f], step.weights[f].as_deref());
                for b in 0..bags {
                    let (lo, hi) = (offsets[b], offsets[b + 1]);
                    if lo == hi {
                        continue;
                    }
                    let gb = &block[b * dim..(b + 1) * dim];
                    let scale = if self.mode == Pooling::Mean { 1.0 / (hi - lo) as f32 } else { 1.0 };
                    for j in lo..hi {
                        let s = scale * weights.map_or(1.0, |w| w[j]);
                        let r = inv[j] as usize * dim;
                        for (x, y) in g[r..r + dim].iter_mut().zip(gb) {
                            *x += s * y;
                        }
                    }
                }
            }
            Ok(g)
        })?;
        Ok(Grads { keys: step.keys.clone(), grads: per_table })
    }

    /// Applies every table's optimizer to `grads` (one `push_grad` per table, tables
    /// in parallel), as part of training step `step` when given ([`TableApi::push_grad_at`]:
    /// a table with no rows in the step still reaches it at its next push); returns how
    /// many rows were updated. A failing table is named; the other tables' updates stand.
    pub fn push(&self, grads: &Grads, step: Option<u64>) -> Result<usize> {
        if grads.keys.len() != self.tables.len() || grads.grads.len() != self.tables.len() {
            return Err(Error::invalid(format!(
                "gradients of {} tables for a collection of {}",
                grads.keys.len(),
                self.tables.len()
            )));
        }
        let done = par_map(self.tables.len(), self.threads, |t| {
            let ct = &self.tables[t];
            let (keys, g) = (&grads.keys[t], &grads.grads[t]);
            if keys.is_empty() {
                return Ok(0);
            }
            match (ct.worker, step) {
                (Some(w), None) => ct.table.push_grad_held(w, keys, g),
                (Some(w), Some(s)) => ct.table.push_grad_held_at(w, keys, g, s),
                // The backward's keys are each table's distinct rows.
                (None, None) => ct.table.push_grad_distinct(keys, g),
                (None, Some(s)) => ct.table.push_grad_at(keys, g, s, true),
            }
            .map_err(|e| e.context(format!("push_grad of table {:?}", ct.table.name())))?;
            Ok(keys.len())
        })?;
        Ok(done.into_iter().sum())
    }

    /// Asks every table to read a coming step's rows into its row cache in the
    /// background (`TableApi::lookahead`); returns at once.
    pub fn lookahead(&self, input: &[Bags<'_>]) -> Result<()> {
        self.check(input)?;
        for t in 0..self.tables.len() {
            let (keys, _) = self.dedup(t, input);
            self.tables[t].table.lookahead(&keys)?;
        }
        Ok(())
    }

    /// The tables, in order.
    pub fn tables(&self) -> impl Iterator<Item = &Arc<dyn TableApi>> {
        self.tables.iter().map(|t| &t.table)
    }
}

/// Pools one feature's bags from its table's distinct `rows` into `out` (`bags x dim`)
/// with the store's one pooling routine (`pooled::pool`).
fn pool_feature(mode: Pooling, bags: &Bags<'_>, inverse: &[u32], rows: &[f32], dim: usize, out: &mut [f32]) {
    let mut members: Vec<&[f32]> = Vec::new();
    for (b, o) in out.chunks_exact_mut(dim).enumerate().take(bags.offsets.len() - 1) {
        let (lo, hi) = (bags.offsets[b], bags.offsets[b + 1]);
        members.clear();
        members.extend(inverse[lo..hi].iter().map(|&r| &rows[r as usize * dim..][..dim]));
        crate::pooled::pool(mode, &members, bags.weights.map(|w| &w[lo..hi]), o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Store, StoreOptions, TableOptions};

    /// A store with tables `a` (dim 3) and `b` (dim 2), SGD lr 1, rows initialized to 0.
    fn store(dir: &std::path::Path) -> (Store, Vec<Arc<dyn TableApi>>) {
        let store = Store::open(dir, StoreOptions::default()).unwrap();
        let mut tables: Vec<Arc<dyn TableApi>> = Vec::new();
        for (name, dim) in [("a", 3), ("b", 2)] {
            let mut o = TableOptions::new(dim);
            o.optimizer = crate::Optimizer::Sgd { lr: 1.0 };
            store.create_table(name, o).unwrap();
            tables.push(Arc::new(store.table(name).unwrap()));
        }
        (store, tables)
    }

    fn seed(t: &dyn TableApi, keys: &[u64]) {
        let d = t.dim();
        let rows: Vec<f32> = keys.iter().flat_map(|&k| (0..d).map(move |j| k as f32 + j as f32 / 10.0)).collect();
        t.push(keys, &rows).unwrap();
    }

    #[test]
    fn forward_pools_and_backward_pushes_summed_gradients() {
        let dir = tempfile::tempdir().unwrap();
        let (_store, tables) = store(dir.path());
        // Features 0 and 2 share table a; feature 1 is table b. Two bags each.
        let cts: Vec<CollectionTable> =
            tables.iter().map(|t| CollectionTable { table: Arc::clone(t), worker: None }).collect();
        for threads in [1, 3] {
            seed(&*tables[0], &[1, 2, 3]);
            seed(&*tables[1], &[7, 8]);
            let c = Collection::new(cts_clone(&cts), vec![0, 1, 0], Pooling::Sum, threads).unwrap();
            let ids0 = [1u64, 2, 2];
            let off0 = [0usize, 2, 3];
            let ids1 = [7u64, 8];
            let off1 = [0usize, 0, 2];
            let w1 = [2.0f32, 0.5];
            let ids2 = [3u64];
            let off2 = [0usize, 1, 1];
            let input = [
                Bags { ids: &ids0, offsets: &off0, weights: None },
                Bags { ids: &ids1, offsets: &off1, weights: Some(&w1) },
                Bags { ids: &ids2, offsets: &off2, weights: None },
            ];
            let mut out = vec![f32::NAN; c.out_len(2)];
            let step = c.forward(&input, &mut out).unwrap();
            let expect = [
                // feature 0: [1]+[2], [2]
                3.0, 3.2, 3.4, 2.0, 2.1, 2.2, //
                // feature 1: empty bag, 2*[7] + 0.5*[8]
                0.0, 0.0, 18.0, 18.25, //
                // feature 2: [3], empty
                3.0, 3.1, 3.2, 0.0, 0.0, 0.0,
            ];
            for (x, y) in out.iter().zip(expect) {
                assert!((x - y).abs() < 1e-5, "{out:?}");
            }
            assert_eq!(step.rows(), 5);
            let grad = vec![1.0f32; out.len()];
            let g = c.backward(&step, &grad).unwrap();
            // Table a: key 1 once, key 2 twice, key 3 once; table b: 2 and 0.5.
            let mut got: Vec<(u64, f32)> =
                g.keys[0].iter().zip(g.grads[0].chunks(3)).map(|(&k, r)| (k, r[0])).collect();
            got.sort_by_key(|x| x.0);
            assert_eq!(got, vec![(1, 1.0), (2, 2.0), (3, 1.0)]);
            let mut got: Vec<(u64, f32)> =
                g.keys[1].iter().zip(g.grads[1].chunks(2)).map(|(&k, r)| (k, r[1])).collect();
            got.sort_by_key(|x| x.0);
            assert_eq!(got, vec![(7, 2.0), (8, 0.5)]);
            assert_eq!(c.push(&g, None).unwrap(), 5);
            let mut row = vec![0f32; 3];
            tables[0].pull(&[2], &mut row).unwrap();
            assert!((row[0]).abs() < 1e-6, "{row:?}"); // 2.0 - lr 1 x gradient 2
        }
    }

    fn cts_clone(cts: &[CollectionTable]) -> Vec<CollectionTable> {
        cts.iter().map(|t| CollectionTable { table: Arc::clone(&t.table), worker: t.worker }).collect()
    }

    #[test]
    fn mean_pooling_scales_the_gradient() {
        let dir = tempfile::tempdir().unwrap();
        let (_store, tables) = store(dir.path());
        seed(&*tables[1], &[4, 5]);
        let c = Collection::new(
            vec![CollectionTable { table: Arc::clone(&tables[1]), worker: None }],
            vec![0],
            Pooling::Mean,
            2,
        )
        .unwrap();
        let (ids, off) = ([4u64, 5, 5, 4], [0usize, 4]);
        let input = [Bags { ids: &ids, offsets: &off, weights: None }];
        let mut out = vec![0f32; 2];
        let step = c.forward(&input, &mut out).unwrap();
        assert!((out[0] - 4.5).abs() < 1e-6);
        let g = c.backward(&step, &[1.0, 1.0]).unwrap();
        assert_eq!(g.grads[0], vec![0.5, 0.5, 0.5, 0.5]);
    }

    #[test]
    fn bad_input_is_refused_and_nothing_is_pushed() {
        let dir = tempfile::tempdir().unwrap();
        let (_store, tables) = store(dir.path());
        seed(&*tables[0], &[1]);
        let one = |t: &Arc<dyn TableApi>| CollectionTable { table: Arc::clone(t), worker: None };
        assert!(Collection::new(vec![one(&tables[0]), one(&tables[1])], vec![0], Pooling::Sum, 1)
            .unwrap_err()
            .to_string()
            .contains("serves no feature"));
        let c = Collection::new(vec![one(&tables[0]), one(&tables[1])], vec![0, 1], Pooling::Sum, 1).unwrap();
        let (ids, off, off3) = ([1u64], [0usize, 1], [0usize, 0, 1]);
        let input =
            [Bags { ids: &ids, offsets: &off, weights: None }, Bags { ids: &ids, offsets: &off3, weights: None }];
        let e = c.forward(&input, &mut [0.0; 8]).unwrap_err();
        assert!(e.to_string().contains("feature 1 has 2 bags"), "{e}");
        let input =
            [Bags { ids: &ids, offsets: &off, weights: None }, Bags { ids: &ids, offsets: &off, weights: None }];
        let mut out = vec![0f32; 5];
        let step = c.forward(&input, &mut out).unwrap();
        let e = c.backward(&step, &[1.0, f32::NAN, 0.0, 0.0, 0.0]).unwrap_err();
        assert!(e.to_string().contains("non-finite"), "{e}");
        let mut row = vec![0f32; 3];
        tables[0].pull(&[1], &mut row).unwrap();
        assert_eq!(row, vec![1.0, 1.1, 1.2]);
    }
}
