//! `embank._native.GpuTable`: the GPU cache's native path (crate embank-gpu) for
//! `embank.gpu.GpuCache(kernels="native")`. Tensors cross as addresses (`data_ptr()`)
//! and the caller's stream as its handle; every call releases the GIL.

use std::sync::Arc;

use embank_core::{Error, ErrorKind};
use embank_gpu::{Device, GpuTable as Engine, Insert, Options, Policy, RowType};
use pyo3::prelude::*;

use crate::{detached, Store, Table};

fn invalid(msg: String) -> Error {
    Error::new(ErrorKind::InvalidInput, msg)
}

/// The device a cache runs on: a CUDA ordinal, or -1 for the CPU emulator (only in a
/// build with the `gpu-emulator` feature, for tests).
pub(crate) fn device(ordinal: i32) -> Result<Arc<dyn Device>, Error> {
    if ordinal >= 0 {
        return Ok(Arc::new(embank_gpu::device::Cuda::new(ordinal)?));
    }
    #[cfg(feature = "gpu-emulator")]
    {
        Ok(Arc::new(embank_gpu::device::Emulator))
    }
    #[cfg(not(feature = "gpu-emulator"))]
    Err(Error::new(ErrorKind::Unsupported, "this build of embank has no CPU emulator of the GPU kernels"))
}

fn parse_insert(insert: &str) -> Result<Insert, Error> {
    match insert {
        "sync" => Ok(Insert::Sync),
        "async" => Ok(Insert::Async),
        "auto" => Ok(Insert::Auto),
        o => Err(invalid(format!("insert must be sync, async or auto, got {o}"))),
    }
}

/// True when this build carries the CPU emulator of the GPU cache's kernels.
#[pyfunction]
pub(crate) fn gpu_emulator() -> bool {
    cfg!(feature = "gpu-emulator")
}

#[pyclass(module = "embank._native", frozen)]
pub(crate) struct GpuTable {
    inner: Engine,
}

#[pymethods]
impl GpuTable {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (table, device_ordinal, n_buckets, slots, row_type, policy, insert, hit_rate_threshold, window, default_row, stored_rows, store=None))]
    fn new(
        py: Python<'_>,
        table: &Table,
        device_ordinal: i32,
        n_buckets: usize,
        slots: usize,
        row_type: &str,
        policy: &str,
        insert: &str,
        hit_rate_threshold: f64,
        window: usize,
        default_row: Vec<f32>,
        stored_rows: bool,
        store: Option<&Store>,
    ) -> PyResult<GpuTable> {
        let table_api = table.inner.clone();
        let embedded = store.and_then(|s| s.embedded.clone());
        let (row_type, policy, insert) = (row_type.to_owned(), policy.to_owned(), insert.to_owned());
        detached(py, move || {
            let row_type = match row_type.as_str() {
                "float32" => RowType::F32,
                "float16" => RowType::F16,
                "bfloat16" => RowType::Bf16,
                o => return Err(invalid(format!("row type must be float32, float16 or bfloat16, got {o}"))),
            };
            let policy = match policy.as_str() {
                "lru" => Policy::Lru,
                "lfu" => Policy::Lfu,
                "custom" => Policy::Custom,
                o => return Err(invalid(format!("policy must be lru, lfu or custom, got {o}"))),
            };
            let insert = parse_insert(&insert)?;
            let name = table_api.name().to_owned();
            let opts = Options {
                n_buckets,
                slots,
                row_type,
                policy,
                insert,
                hit_rate_threshold,
                window,
                default_row,
                stored_rows,
                async_miss_cap: embank_gpu::ASYNC_MISS_CAP,
                report_warps_max: embank_gpu::REPORT_WARPS_MAX,
                refresh_chunk: embank_gpu::REFRESH_CHUNK,
            };
            let inner = Engine::new(device(device_ordinal)?, table_api, opts)?;
            if let Some(store) = embedded {
                store.add_change_listener(inner.listener(&name))?;
            }
            Ok(GpuTable { inner })
        })
    }

    /// Rows of `n` ids (u64 at device address `ids`) into `out` (n x dim float32) on
    /// `stream`; `given`: the ids' scores (policy custom) or 0. The hits, or None when
    /// the lookup did not wait for them (async inserts).
    fn lookup(&self, py: Python<'_>, ids: u64, n: usize, out: u64, stream: u64, given: u64) -> PyResult<Option<usize>> {
        detached(py, || self.inner.lookup(ids, n, out, stream, given))
    }

    /// `bags` bags of the `n` ids at `ids`, pooled into `out` (bags x dim float32):
    /// `offsets` (int64, where each bag starts) and `weights` (float32 per id, or 0) are
    /// device addresses; `mean` pools by the mean. As `lookup` otherwise.
    #[allow(clippy::too_many_arguments)]
    fn lookup_pooled(
        &self,
        py: Python<'_>,
        ids: u64,
        n: usize,
        offsets: u64,
        bags: usize,
        weights: u64,
        mean: bool,
        out: u64,
        stream: u64,
        given: u64,
    ) -> PyResult<Option<usize>> {
        let b = embank_gpu::Bags { offsets, bags, weights, mean };
        detached(py, || self.inner.lookup_pooled(ids, n, b, out, stream, given))
    }

    /// When misses are inserted from the next lookup on: "sync", "async" or "auto".
    fn set_insert(&self, insert: &str) -> PyResult<()> {
        self.inner.set_insert(parse_insert(insert).map_err(crate::to_py_err)?);
        Ok(())
    }

    /// Drops `keys` now; the rows dropped.
    fn invalidate(&self, py: Python<'_>, keys: Vec<u64>) -> PyResult<u64> {
        detached(py, || self.inner.invalidate(&keys))
    }

    /// Keys written elsewhere, dropped before the next lookup.
    fn notice(&self, keys: Vec<u64>) {
        self.inner.notice(&keys)
    }

    /// (rows, changed, bytes, seconds, setup_seconds, read_seconds, wait_seconds, threads).
    #[allow(clippy::type_complexity)]
    fn refresh(&self, py: Python<'_>) -> PyResult<(u64, u64, u64, f64, f64, f64, f64, u64)> {
        let r = detached(py, || self.inner.refresh())?;
        Ok((r.rows, r.changed, r.bytes, r.seconds, r.setup_seconds, r.read_seconds, r.wait_seconds, r.threads))
    }

    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        detached(py, || self.inner.wait())
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        detached(py, || self.inner.close())
    }

    /// Statistics as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let s = detached(py, || self.inner.stats())?;
        let d = pyo3::types::PyDict::new(py);
        let h = &s.host;
        for (k, v) in [
            ("lookups", h.lookups),
            ("hits", h.hits),
            ("misses", h.misses),
            ("default_answers", h.default_answers),
            ("async_dropped", h.async_dropped),
            ("async_errors", h.async_errors),
            ("refreshes", h.refreshes),
            ("refresh_rows", h.refresh_rows),
            ("refresh_changed", h.refresh_changed),
            ("refresh_bytes", h.refresh_bytes),
            ("notices", h.notices),
            ("scratch_allocations", h.scratch_allocations),
            ("host_syncs", h.host_syncs),
            ("invalidated", s.invalidated),
            ("sync_inserts", s.sync_inserts),
            ("async_inserts", s.async_inserts),
            ("insert_refused", s.insert_refused),
            ("evictions", s.evictions),
            ("rows_cached", s.rows_cached),
            ("rows_max", s.rows_max),
            ("bytes", s.bytes),
        ] {
            d.set_item(k, v)?;
        }
        d.set_item("refresh_seconds", h.refresh_seconds)?;
        d.set_item("window_hit_rate", s.window_hit_rate)?;
        Ok(d)
    }
}
