//! The collection-level training path (`embank_core::Collection`) for
//! `embank.torch.EmbeddingBagCollection`: one call per step each way, the GIL released.

use std::sync::Arc;
use std::time::Duration;

use embank_core as core;
use embank_core::{Bags, CollectionTable};
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::{detached, slice, to_py_err, Table};

/// One table's keys and their gradients.
type KeysAndGrads<'py> = (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray2<f32>>);

/// Features pooled from tables, trained with one native call per step each way.
#[pyclass(module = "embank._native", frozen)]
pub(crate) struct Collection {
    inner: Arc<core::Collection>,
}

/// What a forward learned of its step (for the backward).
#[pyclass(module = "embank._native", frozen)]
pub(crate) struct Step {
    inner: core::Step,
}

/// One step's per-row gradients of every table, waiting to be pushed.
#[pyclass(module = "embank._native", frozen)]
pub(crate) struct Grads {
    inner: core::Grads,
}

/// Keys of one feature as u64 (ids arrive as int64 tensors' arrays: negative ids refused).
fn keys_of(a: &PyReadonlyArray1<'_, i64>, f: usize) -> PyResult<Vec<u64>> {
    let ids = slice(a, "ids")?;
    if let Some(i) = ids.iter().position(|&k| k < 0) {
        return Err(to_py_err(core::Error::invalid(format!(
            "feature {f}: id {i} is negative ({}); embank keys are >= 0",
            ids[i]
        ))));
    }
    Ok(ids.iter().map(|&k| k as u64).collect())
}

/// Bag starts (as `torch.nn.EmbeddingBag` takes them) to `starts + [len(ids)]`.
fn offsets_of(a: &PyReadonlyArray1<'_, i64>, ids: usize, f: usize) -> PyResult<Vec<usize>> {
    let o = slice(a, "offsets")?;
    if let Some(i) = o.iter().position(|&x| x < 0 || x as usize > ids) {
        return Err(to_py_err(core::Error::invalid(format!(
            "feature {f}: offset {i} ({}) is outside the {ids} ids",
            o[i]
        ))));
    }
    let mut v: Vec<usize> = o.iter().map(|&x| x as usize).collect();
    v.push(ids);
    Ok(v)
}

/// The step's input, owned (checked in Python's thread, used with the GIL released).
struct Input {
    ids: Vec<Vec<u64>>,
    offsets: Vec<Vec<usize>>,
    weights: Vec<Option<Vec<f32>>>,
}

impl Input {
    fn read(
        values: Vec<PyReadonlyArray1<'_, i64>>,
        offsets: Vec<PyReadonlyArray1<'_, i64>>,
        weights: Vec<Option<PyReadonlyArray1<'_, f32>>>,
    ) -> PyResult<Input> {
        if values.len() != offsets.len() || values.len() != weights.len() {
            return Err(PyValueError::new_err("values, offsets and weights need one entry per feature"));
        }
        let mut input = Input { ids: Vec::new(), offsets: Vec::new(), weights: Vec::new() };
        for (f, ((v, o), w)) in values.iter().zip(&offsets).zip(&weights).enumerate() {
            let ids = keys_of(v, f)?;
            input.offsets.push(offsets_of(o, ids.len(), f)?);
            input.ids.push(ids);
            input.weights.push(match w {
                Some(w) => Some(slice(w, "weights")?.to_vec()),
                None => None,
            });
        }
        Ok(input)
    }

    fn bags(&self) -> Vec<Bags<'_>> {
        (0..self.ids.len())
            .map(|f| Bags { ids: &self.ids[f], offsets: &self.offsets[f], weights: self.weights[f].as_deref() })
            .collect()
    }
}

#[pymethods]
impl Collection {
    /// `tables`: the collection's tables; `features[f]`: the index of feature f's table;
    /// `workers[t]`: the staleness worker id table t's pulls hold keys for, or None.
    #[new]
    #[pyo3(signature = (tables, features, workers, mode="sum", threads=1, hold_timeout=60.0))]
    fn new(
        tables: Vec<PyRef<'_, Table>>,
        features: Vec<usize>,
        workers: Vec<Option<u64>>,
        mode: &str,
        threads: usize,
        hold_timeout: f64,
    ) -> PyResult<Self> {
        if workers.len() != tables.len() {
            return Err(PyValueError::new_err("workers needs one entry per table"));
        }
        if !(hold_timeout.is_finite() && hold_timeout >= 0.0) {
            return Err(to_py_err(core::Error::config(format!("timeout must be >= 0 seconds, got {hold_timeout}"))));
        }
        let mode = core::Pooling::parse(mode).map_err(to_py_err)?;
        let tables = tables
            .iter()
            .zip(workers)
            .map(|(t, worker)| CollectionTable { table: Arc::clone(&t.inner), worker })
            .collect();
        let c = core::Collection::new(tables, features, mode, threads)
            .map_err(to_py_err)?
            .with_hold_timeout(Duration::from_secs_f64(hold_timeout));
        Ok(Collection { inner: Arc::new(c) })
    }

    /// Pulls and pools every feature: the flat output (feature blocks of `bags x dim`)
    /// and the step for `backward`.
    fn forward<'py>(
        &self,
        py: Python<'py>,
        values: Vec<PyReadonlyArray1<'py, i64>>,
        offsets: Vec<PyReadonlyArray1<'py, i64>>,
        weights: Vec<Option<PyReadonlyArray1<'py, f32>>>,
    ) -> PyResult<(Bound<'py, PyArray1<f32>>, Step)> {
        let input = Input::read(values, offsets, weights)?;
        let bags = input.offsets.first().map_or(0, |o| o.len() - 1);
        let out = PyArray1::<f32>::zeros(py, [self.inner.out_len(bags)], false);
        let step = {
            let mut rw = out.readwrite();
            let rows = rw.as_slice_mut().expect("new array is contiguous");
            detached(py, || self.inner.forward(&input.bags(), rows))?
        };
        Ok((out, Step { inner: step }))
    }

    /// Reduces the output's gradient (flat, as `forward`'s output) to per-row gradients.
    fn backward(&self, py: Python<'_>, step: Bound<'_, Step>, grad: PyReadonlyArray1<'_, f32>) -> PyResult<Grads> {
        let grad = slice(&grad, "grad")?;
        let step = &step.get().inner;
        let g = detached(py, || self.inner.backward(step, grad))?;
        Ok(Grads { inner: g })
    }

    /// Applies every table's optimizer to `grads` (as part of training step `step`, when
    /// given); returns how many rows were updated.
    #[pyo3(signature = (grads, step=None))]
    fn push(&self, py: Python<'_>, grads: Bound<'_, Grads>, step: Option<u64>) -> PyResult<usize> {
        let grads = &grads.get().inner;
        detached(py, || self.inner.push(grads, step))
    }

    /// Queues a background read of a coming step's rows into the tables' row caches.
    fn lookahead(
        &self,
        py: Python<'_>,
        values: Vec<PyReadonlyArray1<'_, i64>>,
        offsets: Vec<PyReadonlyArray1<'_, i64>>,
    ) -> PyResult<()> {
        let weights = values.iter().map(|_| None).collect();
        let input = Input::read(values, offsets, weights)?;
        detached(py, || self.inner.lookahead(&input.bags()))
    }

    /// Output width (sum of the features' dims).
    fn dims(&self) -> Vec<usize> {
        (0..self.inner.features()).map(|f| self.inner.dim(f)).collect()
    }
}

#[pymethods]
impl Step {
    #[getter]
    fn bags(&self) -> usize {
        self.inner.bags()
    }

    /// Distinct rows pulled, all tables.
    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows()
    }
}

#[pymethods]
impl Grads {
    /// Keys with a gradient, all tables.
    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows()
    }

    /// Table `t`'s `(keys, grads)` as arrays (for pushes made elsewhere, e.g. averaged
    /// across ranks first).
    fn table<'py>(&self, py: Python<'py>, t: usize) -> PyResult<KeysAndGrads<'py>> {
        let (Some(keys), Some(grads)) = (self.inner.keys.get(t), self.inner.grads.get(t)) else {
            return Err(PyValueError::new_err(format!("no table {t}")));
        };
        let n = keys.len();
        let dim = grads.len().checked_div(n).unwrap_or(0);
        let g = PyArray1::from_slice(py, grads).reshape([n, dim])?;
        Ok((PyArray1::from_slice(py, keys), g))
    }

    #[getter]
    fn tables(&self) -> usize {
        self.inner.keys.len()
    }
}
