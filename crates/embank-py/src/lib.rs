//! `embank._native`: the private extension module behind the `embank` package.
//!
//! Batch calls take numpy arrays and release the GIL while the engine works.
//! Every engine error becomes an exception from `embank.errors`, chosen by
//! [`to_py_err`] — the one place that maps error kinds.

use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

use embank_core as core;
use embank_core::{ErrorKind, Initializer, MissingDefault};
use embank_net as net;
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// Maps an engine error to the matching class of `embank.errors`.
fn to_py_err(e: core::Error) -> PyErr {
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
/// One exported chunk, or the error that ended the export.
type ExportChunk = Result<(Vec<u64>, Vec<f32>), core::Error>;

fn slice<'a, T: numpy::Element>(a: &'a PyReadonlyArray1<'_, T>, what: &str) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| PyValueError::new_err(format!("{what} must be a C-contiguous array")))
}

/// An open store: embedded (a directory in this process) or remote (shards over TCP).
#[pyclass(module = "embank._native", frozen)]
struct Store {
    inner: Backend,
}

enum Backend {
    Local(Arc<core::Store>),
    Remote(net::Client),
}

/// A table of either backend; every method has the same meaning on both.
/// (One per Python table object: the remote variant's size does not matter.)
#[derive(Clone)]
#[allow(clippy::large_enum_variant)]
enum TableBackend {
    Local(core::Table),
    Remote(net::RemoteTable),
}

/// Calls the same method on whichever backend holds the table.
macro_rules! on_table {
    ($t:expr, $x:ident => $e:expr) => {
        match $t {
            TableBackend::Local($x) => $e,
            TableBackend::Remote($x) => $e,
        }
    };
}

#[pymethods]
impl Store {
    #[staticmethod]
    #[allow(clippy::too_many_arguments)] // mirrors the keyword arguments of embank.open
    #[pyo3(signature = (path, create=true, verify=false, cache_bytes=core::store::CACHE_BYTES_DEFAULT, io_engine="auto", io_depth=core::store::IO_DEPTH_DEFAULT, mmap_random_access=true, keep_checkpoints=2))]
    fn open(
        py: Python<'_>,
        path: PathBuf,
        create: bool,
        verify: bool,
        cache_bytes: u64,
        io_engine: &str,
        io_depth: u32,
        mmap_random_access: bool,
        keep_checkpoints: usize,
    ) -> PyResult<Store> {
        let io_engine = core::IoChoice::parse(io_engine).map_err(to_py_err)?;
        let options = core::StoreOptions {
            create,
            verify,
            cache_bytes,
            io_engine,
            io_depth,
            mmap_random_access,
            keep_checkpoints,
            ..Default::default()
        };
        let store = py.detach(|| core::Store::open(&path, options)).map_err(to_py_err)?;
        Ok(Store { inner: Backend::Local(Arc::new(store)) })
    }

    /// Connects to the shards of a remote store (`embank serve` processes).
    #[staticmethod]
    #[pyo3(signature = (addrs, token=None, timeout=30.0, connect_timeout=5.0, keys_per_request_max=500, in_flight_per_shard=8))]
    fn connect(
        py: Python<'_>,
        addrs: Vec<String>,
        token: Option<String>,
        timeout: f64,
        connect_timeout: f64,
        keys_per_request_max: usize,
        in_flight_per_shard: usize,
    ) -> PyResult<Store> {
        let secs = |what: &str, s: f64| {
            if s.is_finite() && s > 0.0 {
                Ok(std::time::Duration::from_secs_f64(s))
            } else {
                Err(to_py_err(core::Error::config(format!("{what} must be a positive number of seconds, got {s}"))))
            }
        };
        let options = net::ClientOptions {
            token,
            keys_per_request_max,
            timeout: secs("timeout", timeout)?,
            connect_timeout: secs("connect_timeout", connect_timeout)?,
            in_flight_per_shard,
        };
        let client = py.detach(|| net::Client::connect(&addrs, options)).map_err(to_py_err)?;
        Ok(Store { inner: Backend::Remote(client) })
    }

    /// The store's directory, or `tcp://host:port,...` for a remote store.
    #[getter]
    fn path(&self) -> String {
        match &self.inner {
            Backend::Local(s) => s.path().display().to_string(),
            Backend::Remote(c) => c.url(),
        }
    }

    #[getter]
    fn remote(&self) -> bool {
        matches!(self.inner, Backend::Remote(_))
    }

    #[getter]
    fn closed(&self) -> bool {
        match &self.inner {
            Backend::Local(s) => s.is_closed(),
            Backend::Remote(c) => c.is_closed(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (name, dim, init_kind, init_a, init_b, seed, capacity, growth, load_factor_max, missing_kind, missing_value, medium="mmap", placement="auto", optimizer_json=None, staleness_bound=None, lease_seconds=60.0, lifecycle_json=None))]
    fn create_table(
        &self,
        py: Python<'_>,
        name: &str,
        dim: u32,
        init_kind: &str,
        init_a: f32,
        init_b: f32,
        seed: u64,
        capacity: u64,
        growth: bool,
        load_factor_max: f64,
        missing_kind: &str,
        missing_value: f32,
        medium: &str,
        placement: &str,
        optimizer_json: Option<&str>,
        staleness_bound: Option<u32>,
        lease_seconds: f64,
        lifecycle_json: Option<&str>,
    ) -> PyResult<Table> {
        let mut o = core::TableOptions::new(dim);
        o.init = match init_kind {
            "zeros" => Initializer::Zeros,
            "uniform" => Initializer::Uniform { low: init_a, high: init_b },
            "normal" => Initializer::Normal { mean: init_a, std: init_b },
            "constant" => Initializer::Constant { value: init_a },
            other => return Err(PyValueError::new_err(format!("unknown initializer {other:?}"))),
        };
        o.missing = match missing_kind {
            "zeros" => MissingDefault::Zeros,
            "value" => MissingDefault::Value { value: missing_value },
            "init" => MissingDefault::Init,
            other => return Err(PyValueError::new_err(format!("unknown missing-row default {other:?}"))),
        };
        o.seed = seed;
        o.capacity = capacity;
        o.growth = growth;
        o.load_factor_max = load_factor_max;
        o.medium = core::MediumKind::parse(medium).map_err(to_py_err)?;
        o.placement = core::Placement::parse(placement).map_err(to_py_err)?;
        o.staleness_bound = staleness_bound;
        o.lease_seconds = lease_seconds;
        if let Some(j) = optimizer_json {
            o.optimizer = serde_json::from_str(j)
                .map_err(|e| PyValueError::new_err(format!("bad optimizer description {j:?}: {e}")))?;
        }
        if let Some(j) = lifecycle_json {
            o.lifecycle = serde_json::from_str(j)
                .map_err(|e| PyValueError::new_err(format!("bad admission/eviction options {j:?}: {e}")))?;
        }
        let inner = py
            .detach(|| match &self.inner {
                Backend::Local(s) => s.create_table(name, o).map(TableBackend::Local),
                Backend::Remote(c) => c.create_table(name, o).map(TableBackend::Remote),
            })
            .map_err(to_py_err)?;
        Ok(Table { inner })
    }

    fn table(&self, py: Python<'_>, name: &str) -> PyResult<Table> {
        let inner = py
            .detach(|| match &self.inner {
                Backend::Local(s) => s.table(name).map(TableBackend::Local),
                Backend::Remote(c) => c.table(name).map(TableBackend::Remote),
            })
            .map_err(to_py_err)?;
        Ok(Table { inner })
    }

    fn tables(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        py.detach(|| match &self.inner {
            Backend::Local(s) => s.tables(),
            Backend::Remote(c) => c.tables(),
        })
        .map_err(to_py_err)
    }

    fn drop_table(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        py.detach(|| match &self.inner {
            Backend::Local(s) => s.drop_table(name),
            Backend::Remote(c) => c.drop_table(name),
        })
        .map_err(to_py_err)
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| match &self.inner {
            Backend::Local(s) => s.flush(),
            Backend::Remote(c) => c.flush(),
        })
        .map_err(to_py_err)
    }

    /// Embedded: flushes and closes every table. Remote: flushes the shards, then
    /// closes this client's connections (the servers keep running).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| match &self.inner {
            Backend::Local(s) => s.close(),
            Backend::Remote(c) => {
                if c.is_closed() {
                    return Ok(());
                }
                let flushed = c.flush();
                c.close();
                flushed
            }
        })
        .map_err(to_py_err)
    }

    fn checkpoint(&self, py: Python<'_>, batch_id: u64) -> PyResult<()> {
        py.detach(|| match &self.inner {
            Backend::Local(s) => s.checkpoint(batch_id),
            Backend::Remote(c) => c.checkpoint(batch_id),
        })
        .map_err(to_py_err)
    }

    /// The retained checkpoints as a JSON list.
    fn checkpoints_json(&self, py: Python<'_>) -> PyResult<String> {
        let list = py
            .detach(|| match &self.inner {
                Backend::Local(s) => s.checkpoints(),
                Backend::Remote(c) => c.checkpoints(),
            })
            .map_err(to_py_err)?;
        Ok(serde_json::to_string(&list).expect("checkpoints serialize"))
    }

    /// Streams a table as it was at a checkpoint (embedded stores).
    fn export_checkpoint(&self, name: &str, batch_id: u64, chunk_keys: usize) -> PyResult<Export> {
        let Backend::Local(store) = &self.inner else {
            return Err(to_py_err(core::Error::new(
                ErrorKind::Unsupported,
                "exporting a checkpoint runs where the store is (embank export --checkpoint on the shard)",
            )));
        };
        let dim = store.table(name).map_err(to_py_err)?.dim();
        let (store, name) = (Arc::clone(store), name.to_owned());
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
        let Backend::Local(store) = &self.inner else {
            return Err(to_py_err(core::Error::new(
                ErrorKind::Unsupported,
                "incremental exports run where the store is",
            )));
        };
        let dim = store.table(name).map_err(to_py_err)?.dim();
        let (keys, rows, deleted) = py.detach(|| store.export_changes(name, batch_id)).map_err(to_py_err)?;
        let n = keys.len();
        Ok((
            PyArray1::from_vec(py, keys),
            PyArray1::from_vec(py, rows).reshape([n, dim])?,
            PyArray1::from_vec(py, deleted),
        ))
    }

    fn restore(&self, py: Python<'_>, batch_id: u64) -> PyResult<()> {
        py.detach(|| match &self.inner {
            Backend::Local(s) => s.restore(batch_id),
            Backend::Remote(c) => c.restore(batch_id),
        })
        .map_err(to_py_err)
    }

    /// Statistics as a JSON document.
    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        py.detach(|| match &self.inner {
            Backend::Local(s) => s.stats().map(|st| serde_json::to_string(&st).expect("stats serialize")),
            Backend::Remote(c) => c.stats().map(|v| v.to_string()),
        })
        .map_err(to_py_err)
    }
}

/// One table of a store.
#[pyclass(module = "embank._native", frozen)]
struct Table {
    inner: TableBackend,
}

#[pymethods]
impl Table {
    #[getter]
    fn name(&self) -> String {
        on_table!(&self.inner, t => t.name().to_owned())
    }

    #[getter]
    fn dim(&self) -> usize {
        on_table!(&self.inner, t => t.dim())
    }

    /// Creation options as a JSON document.
    fn meta_json(&self) -> String {
        on_table!(&self.inner, t => serde_json::to_string(&t.meta()).expect("meta serializes"))
    }

    fn pull<'py>(&self, py: Python<'py>, keys: PyReadonlyArray1<'py, u64>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let keys = slice(&keys, "keys")?;
        let out = PyArray2::<f32>::zeros(py, [keys.len(), self.dim()], false);
        {
            let mut rw = out.readwrite();
            let rows = rw.as_slice_mut().expect("new array is contiguous");
            py.detach(|| on_table!(&self.inner, t => t.pull(keys, rows))).map_err(to_py_err)?;
        }
        Ok(out)
    }

    fn lookup<'py>(&self, py: Python<'py>, keys: PyReadonlyArray1<'py, u64>) -> PyResult<LookupResult<'py>> {
        let keys = slice(&keys, "keys")?;
        let out = PyArray2::<f32>::zeros(py, [keys.len(), self.dim()], false);
        let found = PyArray1::<bool>::zeros(py, [keys.len()], false);
        {
            let mut rw = out.readwrite();
            let mut fw = found.readwrite();
            let rows = rw.as_slice_mut().expect("new array is contiguous");
            let mask = fw.as_slice_mut().expect("new array is contiguous");
            py.detach(|| on_table!(&self.inner, t => t.lookup(keys, rows, mask))).map_err(to_py_err)?;
        }
        Ok((out, found))
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
        py.detach(|| on_table!(&self.inner, t => t.push(keys, rows))).map_err(to_py_err)
    }

    fn delete(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>) -> PyResult<u64> {
        let keys = slice(&keys, "keys")?;
        py.detach(|| on_table!(&self.inner, t => t.delete(keys))).map_err(to_py_err)
    }

    fn push_grad(
        &self,
        py: Python<'_>,
        keys: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
    ) -> PyResult<()> {
        let keys = slice(&keys, "keys")?;
        let grads = grads.as_slice().map_err(|_| PyValueError::new_err("grads must be a C-contiguous array"))?;
        py.detach(|| on_table!(&self.inner, t => t.push_grad(keys, grads))).map_err(to_py_err)
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
            py.detach(|| on_table!(&self.inner, t => t.pull_held(worker, keys, rows, timeout))).map_err(to_py_err)?;
        }
        Ok(out)
    }

    fn push_grad_held(
        &self,
        py: Python<'_>,
        worker: u64,
        keys: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
    ) -> PyResult<()> {
        let keys = slice(&keys, "keys")?;
        let grads = grads.as_slice().map_err(|_| PyValueError::new_err("grads must be a C-contiguous array"))?;
        py.detach(|| on_table!(&self.inner, t => t.push_grad_held(worker, keys, grads))).map_err(to_py_err)
    }

    fn release(&self, py: Python<'_>, worker: u64) -> PyResult<u64> {
        py.detach(|| match &self.inner {
            TableBackend::Local(t) => Ok(t.release(worker)),
            TableBackend::Remote(t) => t.release(worker),
        })
        .map_err(to_py_err)
    }

    fn set_lr(&self, py: Python<'_>, lr: f32) -> PyResult<()> {
        py.detach(|| on_table!(&self.inner, t => t.set_lr(lr))).map_err(to_py_err)
    }

    /// Queues a background load of these rows into the row cache; returns at once.
    fn lookahead(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>) -> PyResult<bool> {
        let keys = slice(&keys, "keys")?;
        py.detach(|| on_table!(&self.inner, t => t.lookahead(keys))).map_err(to_py_err)
    }

    fn evict_expired(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| on_table!(&self.inner, t => t.evict_expired())).map_err(to_py_err)
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(py.detach(|| on_table!(&self.inner, t => t.len())).map_err(to_py_err)? as usize)
    }

    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        py.detach(|| match &self.inner {
            TableBackend::Local(t) => t.stats().map(|s| serde_json::to_string(&s).expect("stats serialize")),
            TableBackend::Remote(t) => t.stats().map(|v| v.to_string()),
        })
        .map_err(to_py_err)
    }

    /// Starts a streaming export; chunks of at most `chunk_keys` keys come from the iterator.
    fn export(&self, chunk_keys: usize) -> Export {
        let table = self.inner.clone();
        Export::spawn(self.dim(), move |send| on_table!(&table, t => t.export(chunk_keys, send)))
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
        let mut guard = self.rx.lock();
        let Some(rx) = guard.take() else { return Ok(None) };
        // The receiver is Send but not Sync: move it into the GIL-free section and back.
        let (rx, message) = py.detach(move || {
            let m = rx.recv();
            (rx, m)
        });
        *guard = Some(rx);
        match message {
            Ok(Ok((keys, rows))) => {
                let n = keys.len();
                let keys = PyArray1::from_vec(py, keys);
                let rows = PyArray1::from_vec(py, rows).reshape([n, self.dim])?;
                Ok(Some((keys, rows)))
            }
            Ok(Err(e)) => {
                *guard = None;
                Err(to_py_err(e))
            }
            Err(_) => {
                *guard = None;
                Ok(None)
            }
        }
    }
}

/// Runs the `embank` command line with `argv` (program name first); returns the exit code.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| embank_cli::run(argv))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Store>()?;
    m.add_class::<Table>()?;
    m.add_class::<Export>()?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
