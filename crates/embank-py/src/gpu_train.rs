//! `embank._native.TrainKernels`: the training kernels of crate embank-gpu for
//! `embank.gpu.TrainCache(kernels="native")`, over the Python cache's own tensors (their
//! addresses); ids, slots, rows and gradients cross as addresses too, the caller's stream
//! as its handle. Every call releases the GIL.

use embank_gpu::{Rule, RuleKind, TrainKernels as Engine, TrainLayout};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;

use crate::detached;
use crate::gpu::device;

type Found<'py> = (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<u32>>);
type PlacedOut<'py> = (u64, Bound<'py, PyArray1<u64>>, Bound<'py, numpy::PyArray2<f32>>, Bound<'py, PyArray1<u32>>);

#[pyclass(module = "embank._native", frozen)]
pub(crate) struct TrainKernels {
    inner: Engine,
    width: usize,
}

#[pymethods]
impl TrainKernels {
    /// Over the cache's tensors at `keys` (int64), `used` (int64), `records` (float32,
    /// `width` a slot) and `dirty` (bool): `n_buckets` buckets of `slots`, rows of `dim`.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        device_ordinal: i32,
        keys: u64,
        used: u64,
        records: u64,
        dirty: u64,
        n_buckets: usize,
        slots: usize,
        width: usize,
        dim: usize,
    ) -> PyResult<TrainKernels> {
        let layout = TrainLayout { keys, used, records, dirty, n_buckets, slots, width, dim };
        let inner = detached(py, move || Engine::new(device(device_ordinal)?, layout))?;
        Ok(TrainKernels { inner, width })
    }

    /// The slots of the `n` distinct ids at `ids` into `slot` (int64, -1: not cached),
    /// their rows into `out` (n x dim float32; 0: none), the slots found touched with
    /// `clock` (0: none). Returns the misses: (keys uint64, their indexes uint32).
    #[allow(clippy::too_many_arguments)]
    fn find<'py>(
        &self,
        py: Python<'py>,
        ids: u64,
        n: usize,
        slot: u64,
        out: u64,
        clock: u64,
        stream: u64,
    ) -> PyResult<Found<'py>> {
        let m = detached(py, || self.inner.find(ids, n, slot, out, clock, stream))?;
        Ok((PyArray1::from_vec(py, m.keys), PyArray1::from_vec(py, m.at)))
    }

    /// Places the misses `keys` (indexes `at`) with their `records` (m x width float32),
    /// writing their slots into `slot` and their rows into `out` (0: none), with the
    /// call's `clock`. Returns (rows evicted, the dirty ones' keys, their records, the
    /// positions among the misses of those left without a slot).
    #[allow(clippy::too_many_arguments)]
    fn place<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'py, u64>,
        at: PyReadonlyArray1<'py, u32>,
        records: PyReadonlyArray2<'py, f32>,
        slot: u64,
        out: u64,
        clock: u64,
        stream: u64,
    ) -> PyResult<PlacedOut<'py>> {
        let (k, a, r) = (keys.as_slice()?, at.as_slice()?, records.as_slice()?);
        let p = detached(py, || self.inner.place(k, a, r, slot, out, clock, stream))?;
        let n = p.dirty_keys.len();
        let recs = PyArray1::from_vec(py, p.dirty_records).reshape([n, self.width])?;
        Ok((p.evicted, PyArray1::from_vec(py, p.dirty_keys), recs, PyArray1::from_vec(py, p.unplaced)))
    }

    /// The optimizer `kind` (with its hyper-parameters) applied in place to the `n` rows
    /// at `slots` (int64; < 0 skipped) with `grads` (n x dim float32); `mark_dirty`
    /// flags them. Launched on `stream`; no wait.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (slots, grads, n, kind, lr, eps=0.0, beta1=0.0, beta2=0.0, weight_decay=0.0, l1=0.0, l2=0.0, beta=0.0, mark_dirty=true, stream=0))]
    fn update(
        &self,
        py: Python<'_>,
        slots: u64,
        grads: u64,
        n: usize,
        kind: &str,
        lr: f32,
        eps: f32,
        beta1: f32,
        beta2: f32,
        weight_decay: f32,
        l1: f32,
        l2: f32,
        beta: f32,
        mark_dirty: bool,
        stream: u64,
    ) -> PyResult<()> {
        let kind = RuleKind::from_name(kind).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!("the native kernels do not apply optimizer {kind:?}"))
        })?;
        let rule = Rule { kind, lr, eps, beta1, beta2, weight_decay, l1, l2, beta };
        detached(py, || self.inner.update(slots, grads, n, &rule, mark_dirty, stream))
    }
}
