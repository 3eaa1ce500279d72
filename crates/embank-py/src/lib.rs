//! `embank._native`: the private extension module behind the `embank` package.
//!
//! Batch calls take numpy arrays and release the GIL while the engine works.
//! Every engine error becomes an exception from `embank.errors`, chosen by
//! [`to_py_err`] — the one place that maps error kinds.

use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

use embank_core as core;
use embank_core::{ErrorKind, StoreApi, TableApi};
use embank_net as net;
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

mod fused;
mod gpu;
mod gpu_train;
mod plan;
mod rows;

/// Maps an engine error to the matching class of `embank.errors`.
pub(crate) fn to_py_err(e: core::Error) -> PyErr {
    let class = match e.kind() {
        ErrorKind::Io => "EmbankIOError",
        ErrorKind::Config => "ConfigError",
        ErrorKind::InvalidInput => "InvalidInputError",
        ErrorKind::NotFound => "NotFoundError",
        ErrorKind::AlreadyExists => "TableExistsError",
        ErrorKind::TableFull => "TableFullError",
        ErrorKind::ChecksumMismatch | ErrorKind::Recover | ErrorKind::Corrupt => "CorruptStoreError",
        ErrorKind::FormatVersion => "FormatVersionError",
        ErrorKind::Locked => "StoreLockedError",
        ErrorKind::Closed => "StoreClosedError",
        ErrorKind::Unsupported => "UnsupportedError",
        ErrorKind::Timeout => "EmbankTimeoutError",
        ErrorKind::Unauthorized => "UnauthorizedError",
        ErrorKind::Unavailable => "ShardUnavailableError",
    };
    let message = e.to_string();
    Python::attach(|py| {
        static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
        let module = ERRORS.get_or_try_init(py, || py.import("embank.errors").map(|m| m.unbind()));
        match module.and_then(|m| m.bind(py).getattr(class)) {
            Ok(cls) => match cls.cast_into::<PyType>() {
                Ok(t) => PyErr::from_type(t, message),
                Err(_) => PyValueError::new_err(message),
            },
            Err(import_error) => import_error,
        }
    })
}

/// Rows and found-mask of a lookup.
type LookupResult<'py> = (Bound<'py, PyArray2<f32>>, Bound<'py, PyArray1<bool>>);
/// Stored rows (uint8) and the found-mask of a `lookup_stored`.
type StoredResult<'py> = (Bound<'py, PyArray2<u8>>, Bound<'py, PyArray1<bool>>);
/// One exported chunk, or the error that ended the export.
type ExportChunk = Result<(Vec<u64>, Vec<f32>), core::Error>;

fn slice<'a, T: numpy::Element>(a: &'a PyReadonlyArray1<'_, T>, what: &str) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| PyValueError::new_err(format!("{what} must be a C-contiguous array")))
}

/// An open store: embedded (a directory in this process) or remote (shards over TCP),
/// behind the one store interface of the core.
#[pyclass(module = "embank._native", frozen)]
pub(crate) struct Store {
    inner: Arc<dyn StoreApi>,
    /// The same store when it is embedded (what a publisher reads from).
    pub(crate) embedded: Option<Arc<core::Store>>,
    /// The same store when it is remote (its replicas' counters).
    client: Option<net::Client>,
}

/// Runs a call on the store interface with the GIL released, mapping its error.
pub(crate) fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> Result<T, core::Error> + Send) -> PyResult<T> {
    py.detach(f).map_err(to_py_err)
}

/// `embank.open`'s keyword arguments, as they cross into Rust (absent: the default).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct OpenOptions {
    create: Option<bool>,
    verify: Option<bool>,
    cache_bytes: Option<u64>,
    io_engine: Option<String>,
    io_depth: Option<u32>,
    mmap_random_access: Option<bool>,
    huge_pages: Option<bool>,
    row_writes: Option<String>,
    keep_checkpoints: Option<usize>,
    background_repair: Option<bool>,
    pooled_cache_bytes: Option<u64>,
    hot_placement: Option<core::HotOptions>,
    shared_tier: Option<net::redis_tier::RedisTierConfig>,
}

#[pymethods]
impl Store {
    /// Opens (or creates) the store at `path`; `options_json` is an [`OpenOptions`]
    /// object (`embank.open`'s keyword arguments).
    #[staticmethod]
    #[pyo3(signature = (path, options_json="{}"))]
    fn open(py: Python<'_>, path: PathBuf, options_json: &str) -> PyResult<Store> {
        let o: OpenOptions =
            serde_json::from_str(options_json).map_err(|e| to_py_err(core::Error::config(format!("open: {e}"))))?;
        let d = core::StoreOptions::default();
        let options = core::StoreOptions {
            create: o.create.unwrap_or(d.create),
            verify: o.verify.unwrap_or(d.verify),
            cache_bytes: o.cache_bytes.unwrap_or(d.cache_bytes),
            io_engine: match &o.io_engine {
                Some(e) => core::IoChoice::parse(e).map_err(to_py_err)?,
                None => d.io_engine,
            },
            io_depth: o.io_depth.unwrap_or(d.io_depth),
            mmap_random_access: o.mmap_random_access.unwrap_or(d.mmap_random_access),
            huge_pages: o.huge_pages.unwrap_or(d.huge_pages),
            row_writes: match &o.row_writes {
                Some(w) => core::RowWrites::parse(w).map_err(to_py_err)?,
                None => d.row_writes,
            },
            keep_checkpoints: o.keep_checkpoints.unwrap_or(d.keep_checkpoints),
            background_repair: o.background_repair.unwrap_or(d.background_repair),
            pooled_cache_bytes: o.pooled_cache_bytes.unwrap_or(d.pooled_cache_bytes),
            hot_placement: o.hot_placement,
            ..d
        };
        let tier = match &o.shared_tier {
            Some(c) => {
                let t = net::redis_tier::RedisClusterTier::new(c).map_err(|e| to_py_err(core::Error::config(e)))?;
                Some(Arc::new(t) as Arc<dyn core::SharedTier>)
            }
            None => None,
        };
        let store = Arc::new(detached(py, || core::Store::open(&path, options))?);
        if tier.is_some() {
            store.set_shared_tier(tier).map_err(to_py_err)?;
        }
        Ok(Store { inner: store.clone(), embedded: Some(store), client: None })
    }

    /// Connects to the shards of a remote store (`embank serve` processes): `addrs`, one
    /// replica group per shard; `options_json` a [`net::ClientSettings`].
    #[staticmethod]
    #[pyo3(signature = (addrs, options_json="{}"))]
    fn connect(py: Python<'_>, addrs: Vec<Vec<String>>, options_json: &str) -> PyResult<Store> {
        let config: net::ClientSettings =
            serde_json::from_str(options_json).map_err(|e| to_py_err(core::Error::config(format!("connect: {e}"))))?;
        let client = detached(py, || config.connect(&addrs))?;
        Ok(Store { inner: Arc::new(client.clone()), embedded: None, client: Some(client) })
    }

    /// The store's directory, or `tcp://host:port,...` for a remote store.
    #[getter]
    fn path(&self) -> String {
        self.inner.location()
    }

    #[getter]
    fn remote(&self) -> bool {
        self.inner.is_remote()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Creates a table from its options as one JSON object (the fields of
    /// `embank_core::TableOptions`; absent ones take their defaults).
    fn create_table(&self, py: Python<'_>, name: &str, options_json: &str) -> PyResult<Table> {
        let options = core::TableOptions::from_json(options_json).map_err(to_py_err)?;
        Ok(Table { inner: detached(py, || self.inner.create_table(name, options))? })
    }

    fn table(&self, py: Python<'_>, name: &str) -> PyResult<Table> {
        Ok(Table { inner: detached(py, || self.inner.table(name))? })
    }

    fn tables(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        detached(py, || self.inner.tables())
    }

    fn drop_table(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        detached(py, || self.inner.drop_table(name))
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        detached(py, || self.inner.flush())
    }

    fn wait_repaired(&self, py: Python<'_>) -> PyResult<()> {
        detached(py, || self.inner.wait_repaired())
    }

    /// Embedded: flushes and closes every table. Remote: flushes the shards, then
    /// closes this client's connections (the servers keep running).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        detached(py, || self.inner.close())
    }

    #[pyo3(signature = (batch_id, meta=None))]
    fn checkpoint(&self, py: Python<'_>, batch_id: u64, meta: Option<Vec<u8>>) -> PyResult<()> {
        let meta = meta.unwrap_or_default();
        detached(py, || self.inner.checkpoint(batch_id, &meta))
    }

    /// What each replica of a remote store did (`embank_net::Client::replica_counts`), as
    /// JSON; `[]` for an embedded store.
    fn replica_counts_json(&self) -> String {
        self.client.as_ref().map_or_else(|| "[]".to_string(), |c| serde_json::json!(c.replica_counts()).to_string())
    }

    /// Which checkpoint each shard serves, as JSON.
    fn served_json(&self, py: Python<'_>) -> PyResult<String> {
        Ok(detached(py, || self.inner.served())?.to_string())
    }

    /// Starts a publisher of this (embedded) store's checkpoints: options as the JSON of
    /// `embank_net::stream::PublishOptions`.
    fn publisher(&self, py: Python<'_>, options_json: &str) -> PyResult<Publisher> {
        let Some(store) = self.embedded.clone() else {
            return Err(to_py_err(core::Error::new(
                ErrorKind::Unsupported,
                "a publisher runs where the store is: open it with embank.open (or run `embank publish` on the shard)",
            )));
        };
        let opts: net::stream::PublishOptions = serde_json::from_str(options_json)
            .map_err(|e| to_py_err(core::Error::config(format!("publisher options: {e}"))))?;
        let p = detached(py, || net::stream::Publisher::start(store, opts))?;
        Ok(Publisher { inner: Mutex::new(Some(Arc::new(p))) })
    }

    /// The retained checkpoints as a JSON list (metadata as hex strings).
    fn checkpoints_json(&self, py: Python<'_>) -> PyResult<String> {
        let list = detached(py, || self.inner.checkpoints())?;
        Ok(serde_json::to_string(&list).expect("checkpoints serialize"))
    }

    /// Streams a table as it was at a checkpoint (embedded stores).
    fn export_checkpoint(&self, py: Python<'_>, name: &str, batch_id: u64, chunk_keys: usize) -> PyResult<Export> {
        let dim = detached(py, || self.inner.table(name))?.dim();
        let (store, name) = (Arc::clone(&self.inner), name.to_owned());
        Ok(Export::spawn(dim, move |send| store.export_checkpoint(&name, batch_id, chunk_keys, send)))
    }

    /// Keys written since a checkpoint with their rows, and keys deleted since.
    #[allow(clippy::type_complexity)]
    fn export_changes<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        batch_id: u64,
    ) -> PyResult<(Bound<'py, PyArray1<u64>>, Bound<'py, PyArray2<f32>>, Bound<'py, PyArray1<u64>>)> {
        let (keys, rows, deleted, dim) = detached(py, || {
            let (keys, rows, deleted) = self.inner.export_changes(name, batch_id)?;
            Ok((keys, rows, deleted, self.inner.table(name)?.dim()))
        })?;
        let n = keys.len();
        Ok((
            PyArray1::from_vec(py, keys),
            PyArray1::from_vec(py, rows).reshape([n, dim])?,
            PyArray1::from_vec(py, deleted),
        ))
    }

    /// Keys of a table looked up as they were at a retained checkpoint (embedded stores).
    fn lookup_checkpoint<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        batch_id: u64,
        keys: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<LookupResult<'py>> {
        let keys = slice(&keys, "keys")?;
        let dim = detached(py, || self.inner.table(name))?.dim();
        let out = PyArray2::<f32>::zeros(py, [keys.len(), dim], false);
        let found = PyArray1::<bool>::zeros(py, [keys.len()], false);
        {
            let mut rw = out.readwrite();
            let mut fw = found.readwrite();
            let rows = rw.as_slice_mut().expect("new array is contiguous");
            let mask = fw.as_slice_mut().expect("new array is contiguous");
            detached(py, || self.inner.lookup_checkpoint(name, batch_id, keys, rows, mask))?;
        }
        Ok((out, found))
    }

    fn restore(&self, py: Python<'_>, batch_id: u64) -> PyResult<()> {
        detached(py, || self.inner.restore(batch_id))
    }

    /// Statistics as a JSON document.
    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        detached(py, || self.inner.stats_json().map(|v| v.to_string()))
    }
}

/// One table of a store, behind the one table interface of the core.
#[pyclass(module = "embank._native", frozen)]
pub(crate) struct Table {
    pub(crate) inner: Arc<dyn TableApi>,
}

#[pymethods]
impl Table {
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_owned()
    }

    #[getter]
    fn dim(&self) -> usize {
        self.inner.dim()
    }

    /// True for a table of a remote store.
    #[getter]
    fn remote(&self) -> bool {
        self.inner.is_remote()
    }

    /// Creation options as a JSON document.
    fn meta_json(&self) -> String {
        serde_json::to_string(&self.inner.meta()).expect("meta serializes")
    }

    fn pull<'py>(&self, py: Python<'py>, keys: PyReadonlyArray1<'py, u64>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let keys = slice(&keys, "keys")?;
        let out = PyArray2::<f32>::zeros(py, [keys.len(), self.dim()], false);
        {
            let mut rw = out.readwrite();
            let rows = rw.as_slice_mut().expect("new array is contiguous");
            detached(py, || self.inner.pull(keys, rows))?;
        }
        Ok(out)
    }

    #[pyo3(signature = (keys, min_checkpoint=None))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'py, u64>,
        min_checkpoint: Option<u64>,
    ) -> PyResult<LookupResult<'py>> {
        let keys = slice(&keys, "keys")?;
        let out = PyArray2::<f32>::zeros(py, [keys.len(), self.dim()], false);
        let found = PyArray1::<bool>::zeros(py, [keys.len()], false);
        {
            let mut rw = out.readwrite();
            let mut fw = found.readwrite();
            let rows = rw.as_slice_mut().expect("new array is contiguous");
            let mask = fw.as_slice_mut().expect("new array is contiguous");
            detached(py, || self.inner.lookup_min(keys, rows, mask, min_checkpoint))?;
        }
        Ok((out, found))
    }

    /// Rows of `keys` as stored (`row_bytes` bytes each: f32 floats, f16 halves, or int8
    /// bytes then scale and bias) and the found-mask; never creates rows.
    fn lookup_stored<'py>(&self, py: Python<'py>, keys: PyReadonlyArray1<'py, u64>) -> PyResult<StoredResult<'py>> {
        let keys = slice(&keys, "keys")?;
        let meta = self.inner.meta();
        let rb = meta.dtype.row_bytes(meta.dim as usize);
        let out = PyArray2::<u8>::zeros(py, [keys.len(), rb], false);
        let found = PyArray1::<bool>::zeros(py, [keys.len()], false);
        {
            let mut rw = out.readwrite();
            let mut fw = found.readwrite();
            let rows = rw.as_slice_mut().expect("new array is contiguous");
            let mask = fw.as_slice_mut().expect("new array is contiguous");
            detached(py, || self.inner.lookup_stored(keys, rows, mask))?;
        }
        Ok((out, found))
    }

    /// `f32`s of optimizer state stored after each row (0 without an optimizer).
    #[getter]
    fn state_len(&self) -> usize {
        self.inner.meta().optimizer.state_len(self.dim())
    }

    /// Rows of `keys` with their optimizer state after each (`dim + state_len` columns)
    /// and the found-mask; missing keys get the missing default and the initial state.
    fn lookup_with_state<'py>(&self, py: Python<'py>, keys: PyReadonlyArray1<'py, u64>) -> PyResult<LookupResult<'py>> {
        let keys = slice(&keys, "keys")?;
        let out = PyArray2::<f32>::zeros(py, [keys.len(), self.dim() + self.state_len()], false);
        let found = PyArray1::<bool>::zeros(py, [keys.len()], false);
        {
            let mut rw = out.readwrite();
            let mut fw = found.readwrite();
            let records = rw.as_slice_mut().expect("new array is contiguous");
            let mask = fw.as_slice_mut().expect("new array is contiguous");
            detached(py, || self.inner.lookup_with_state(keys, records, mask))?;
        }
        Ok((out, found))
    }

    /// Writes rows with their optimizer state (`dim + state_len` columns).
    fn push_with_state(
        &self,
        py: Python<'_>,
        keys: PyReadonlyArray1<'_, u64>,
        records: PyReadonlyArray2<'_, f32>,
    ) -> PyResult<()> {
        let keys = slice(&keys, "keys")?;
        let records = records.as_slice().map_err(|_| PyValueError::new_err("records must be a C-contiguous array"))?;
        detached(py, || self.inner.push_with_state(keys, records))
    }

    /// Hot placement of `keys`; the report as JSON.
    fn place_hot(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>) -> PyResult<String> {
        let keys = slice(&keys, "keys")?;
        let r = detached(py, || self.inner.place_hot(keys))?;
        Ok(r.to_string())
    }

    fn home_fraction(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>) -> PyResult<(f64, u64)> {
        let keys = slice(&keys, "keys")?;
        detached(py, || self.inner.home_fraction(keys))
    }

    /// Pooled rows of bags: `offsets` has one entry more than there are bags.
    #[pyo3(signature = (ids, offsets, weights=None, mode="sum"))]
    fn lookup_pooled<'py>(
        &self,
        py: Python<'py>,
        ids: PyReadonlyArray1<'py, u64>,
        offsets: PyReadonlyArray1<'py, u64>,
        weights: Option<PyReadonlyArray1<'py, f32>>,
        mode: &str,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let ids = slice(&ids, "ids")?;
        let offsets: Vec<usize> = slice(&offsets, "offsets")?.iter().map(|&o| o as usize).collect();
        let weights = match &weights {
            Some(w) => Some(slice(w, "weights")?),
            None => None,
        };
        let mode = core::Pooling::parse(mode).map_err(to_py_err)?;
        let bags = offsets.len().saturating_sub(1);
        let out = PyArray2::<f32>::zeros(py, [bags, self.dim()], false);
        {
            let mut rw = out.readwrite();
            let rows = rw.as_slice_mut().expect("new array is contiguous");
            detached(py, || self.inner.lookup_pooled(ids, &offsets, weights, mode, rows))?;
        }
        Ok(out)
    }

    fn push(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>, rows: PyReadonlyArray2<'_, f32>) -> PyResult<()> {
        let keys = slice(&keys, "keys")?;
        let shape = rows.shape();
        let dim = self.dim();
        if shape[0] != keys.len() || shape[1] != dim {
            return Err(to_py_err(core::Error::invalid(format!(
                "push: rows have shape ({}, {}), expected ({}, {dim}) for {} keys of table {:?} (dim {dim})",
                shape[0],
                shape[1],
                keys.len(),
                keys.len(),
                self.name(),
            ))));
        }
        let rows = rows.as_slice().map_err(|_| PyValueError::new_err("rows must be a C-contiguous array"))?;
        detached(py, || self.inner.push(keys, rows))
    }

    fn delete(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>) -> PyResult<u64> {
        let keys = slice(&keys, "keys")?;
        detached(py, || self.inner.delete(keys))
    }

    /// `step`: the training step the gradients belong to (`None`: a step of its own).
    #[pyo3(signature = (keys, grads, step=None))]
    fn push_grad(
        &self,
        py: Python<'_>,
        keys: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
        step: Option<u64>,
    ) -> PyResult<()> {
        let keys = slice(&keys, "keys")?;
        let grads = grads.as_slice().map_err(|_| PyValueError::new_err("grads must be a C-contiguous array"))?;
        detached(py, || match step {
            Some(s) => self.inner.push_grad_at(keys, grads, s, false),
            None => self.inner.push_grad(keys, grads),
        })
    }

    /// The training step of the table's last update (the optimizers with a table step).
    fn optimizer_step(&self, py: Python<'_>) -> PyResult<u64> {
        detached(py, || self.inner.optimizer_step())
    }

    /// A worker's pull under the table's staleness bound (holds until its push_grad_held).
    fn pull_held<'py>(
        &self,
        py: Python<'py>,
        worker: u64,
        keys: PyReadonlyArray1<'py, u64>,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let keys = slice(&keys, "keys")?;
        if !(timeout.is_finite() && timeout >= 0.0) {
            return Err(to_py_err(core::Error::config(format!("timeout must be >= 0 seconds, got {timeout}"))));
        }
        let timeout = std::time::Duration::from_secs_f64(timeout);
        let out = PyArray2::<f32>::zeros(py, [keys.len(), self.dim()], false);
        {
            let mut rw = out.readwrite();
            let rows = rw.as_slice_mut().expect("new array is contiguous");
            detached(py, || self.inner.pull_held(worker, keys, rows, timeout))?;
        }
        Ok(out)
    }

    #[pyo3(signature = (worker, keys, grads, step=None))]
    fn push_grad_held(
        &self,
        py: Python<'_>,
        worker: u64,
        keys: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
        step: Option<u64>,
    ) -> PyResult<()> {
        let keys = slice(&keys, "keys")?;
        let grads = grads.as_slice().map_err(|_| PyValueError::new_err("grads must be a C-contiguous array"))?;
        detached(py, || match step {
            Some(s) => self.inner.push_grad_held_at(worker, keys, grads, s),
            None => self.inner.push_grad_held(worker, keys, grads),
        })
    }

    fn release(&self, py: Python<'_>, worker: u64) -> PyResult<u64> {
        detached(py, || self.inner.release(worker))
    }

    fn set_lr(&self, py: Python<'_>, lr: f32) -> PyResult<()> {
        detached(py, || self.inner.set_lr(lr))
    }

    /// Queues a background load of these rows into the row cache; returns at once.
    fn lookahead(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>) -> PyResult<bool> {
        let keys = slice(&keys, "keys")?;
        detached(py, || self.inner.lookahead(keys))
    }

    fn evict_expired(&self, py: Python<'_>) -> PyResult<u64> {
        detached(py, || self.inner.evict_expired())
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(detached(py, || self.inner.len())? as usize)
    }

    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        detached(py, || self.inner.stats_json().map(|v| v.to_string()))
    }

    /// Starts a streaming export; chunks of at most `chunk_keys` keys come from the iterator.
    fn export(&self, chunk_keys: usize) -> Export {
        let table = Arc::clone(&self.inner);
        Export::spawn(self.dim(), move |send| table.export(chunk_keys, send))
    }
}

/// Iterator over `(keys, rows)` chunks of an export.
#[pyclass(module = "embank._native", frozen)]
struct Export {
    rx: Mutex<Option<Receiver<ExportChunk>>>,
    dim: usize,
}

impl Export {
    /// Runs `export` on a helper thread; each chunk it hands to `send` reaches the
    /// iterator through a bounded channel, and an error ends the iteration.
    fn spawn<F>(dim: usize, export: F) -> Export
    where
        F: FnOnce(&mut dyn FnMut(&[u64], &[f32]) -> Result<(), core::Error>) -> Result<(), core::Error>
            + Send
            + 'static,
    {
        let (tx, rx) = sync_channel::<ExportChunk>(2);
        std::thread::spawn(move || {
            let mut send = |keys: &[u64], rows: &[f32]| {
                tx.send(Ok((keys.to_vec(), rows.to_vec())))
                    .map_err(|_| core::Error::new(ErrorKind::Closed, "export abandoned by its reader"))
            };
            if let Err(e) = export(&mut send) {
                let _ = tx.send(Err(e));
            }
        });
        Export { rx: Mutex::new(Some(rx)), dim }
    }
}

#[pymethods]
impl Export {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[allow(clippy::type_complexity)]
    fn __next__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<(Bound<'py, PyArray1<u64>>, Bound<'py, PyArray2<f32>>)>> {
        // The GIL goes first, then the receiver's lock is taken: a thread that holds the
        // lock never waits for the GIL, so a second reader (holding the GIL until it
        // detaches too) cannot deadlock with it. The second reader waits for the first's
        // chunk without the GIL.
        let message = py.detach(|| {
            let mut guard = self.rx.lock();
            let m = guard.as_ref()?.recv();
            if !matches!(m, Ok(Ok(_))) {
                *guard = None; // the export ended (an error, or every chunk read)
            }
            Some(m)
        });
        match message {
            None | Some(Err(_)) => Ok(None),
            Some(Ok(Ok((keys, rows)))) => {
                let n = keys.len();
                let keys = PyArray1::from_vec(py, keys);
                let rows = PyArray1::from_vec(py, rows).reshape([n, self.dim])?;
                Ok(Some((keys, rows)))
            }
            Some(Ok(Err(e))) => Err(to_py_err(e)),
        }
    }
}

/// A publisher of an embedded store's checkpoints to an update stream.
///
/// The lock only guards the handle: it is held to clone or take it, never across a GIL
/// release or a wait, so a thread holding the GIL that takes it cannot wait for a thread
/// that waits for the GIL. Calls run on the cloned handle with the GIL released; `close`
/// stops the thread and wakes a `flush` in flight.
#[pyclass(module = "embank._native", frozen)]
struct Publisher {
    inner: Mutex<Option<Arc<net::stream::Publisher>>>,
}

impl Publisher {
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&net::stream::Publisher) -> Result<T, core::Error> + Send,
    ) -> PyResult<T> {
        let Some(p) = self.inner.lock().clone() else {
            return Err(to_py_err(core::Error::new(ErrorKind::Closed, "the publisher is closed")));
        };
        detached(py, || f(&p))
    }
}

#[pymethods]
impl Publisher {
    /// A checkpoint was taken: publish up to the newest (in the background).
    fn notify(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |p| p.notify())
    }

    fn flush(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let t = std::time::Duration::from_secs_f64(timeout.clamp(0.0, 1e6));
        self.with(py, |p| p.flush(t))
    }

    fn status_json(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |p| Ok(serde_json::to_string(&p.status()).expect("status serializes")))
    }

    fn close(&self, py: Python<'_>) {
        let p = self.inner.lock().take();
        if let Some(p) = p {
            py.detach(move || p.close());
        }
    }
}

/// A client config file or the `http://` URL of one (`embank.connect("cluster.toml")`)
/// as JSON, paths resolved.
#[pyfunction]
fn client_config_json(py: Python<'_>, source: &str) -> PyResult<String> {
    let source = net::MapSource::parse(source);
    let map = detached(py, || source.load())?;
    let mut c = serde_json::to_value(&map.config).expect("config serializes");
    // The shards as they resolve now (a `service` names its replicas by DNS).
    c["shards"] = map.groups.iter().map(|g| serde_json::json!({ "replicas": g })).collect();
    Ok(c.to_string())
}

/// Keys at or above which `shard_of` releases the GIL (below, releasing costs more than
/// hashing).
const SHARD_OF_DETACHED_KEYS_MIN: usize = 4096;

/// The shard of each key among `shards`, as `embank.connect` routes it
/// ([`net::proto::shard_of`]).
#[pyfunction]
fn shard_of<'py>(
    py: Python<'py>,
    keys: PyReadonlyArray1<'py, u64>,
    shards: u32,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    if shards == 0 {
        return Err(to_py_err(core::Error::new(ErrorKind::InvalidInput, "shard_of: shards must be at least 1")));
    }
    let keys = slice(&keys, "keys")?;
    let route = || keys.iter().map(|&k| net::proto::shard_of(k, shards)).collect::<Vec<u32>>();
    let out = if keys.len() >= SHARD_OF_DETACHED_KEYS_MIN { py.detach(route) } else { route() };
    Ok(PyArray1::from_vec(py, out))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Store>()?;
    m.add_class::<Table>()?;
    m.add_class::<Export>()?;
    m.add_class::<Publisher>()?;
    m.add_class::<fused::Collection>()?;
    m.add_class::<fused::Step>()?;
    m.add_class::<fused::Grads>()?;
    m.add_class::<gpu::GpuTable>()?;
    m.add_class::<gpu_train::TrainKernels>()?;
    m.add_function(wrap_pyfunction!(gpu::gpu_emulator, m)?)?;
    m.add_function(wrap_pyfunction!(rows::row_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(rows::encode_rows, m)?)?;
    m.add_function(wrap_pyfunction!(rows::decode_rows, m)?)?;
    m.add_function(wrap_pyfunction!(client_config_json, m)?)?;
    m.add_function(wrap_pyfunction!(shard_of, m)?)?;
    m.add_function(wrap_pyfunction!(plan::plan_json, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
