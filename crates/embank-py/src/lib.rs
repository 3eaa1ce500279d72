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

/// An open store.
#[pyclass(module = "embank._native", frozen)]
struct Store {
    inner: Arc<core::Store>,
}

#[pymethods]
impl Store {
    #[staticmethod]
    #[allow(clippy::too_many_arguments)] // mirrors the keyword arguments of embank.open
    #[pyo3(signature = (path, create=true, verify=false, cache_bytes=core::store::CACHE_BYTES_DEFAULT, io_engine="auto", io_depth=core::store::IO_DEPTH_DEFAULT, mmap_random_access=true))]
    fn open(
        py: Python<'_>,
        path: PathBuf,
        create: bool,
        verify: bool,
        cache_bytes: u64,
        io_engine: &str,
        io_depth: u32,
        mmap_random_access: bool,
    ) -> PyResult<Store> {
        let io_engine = core::IoChoice::parse(io_engine).map_err(to_py_err)?;
        let options = core::StoreOptions {
            create,
            verify,
            cache_bytes,
            io_engine,
            io_depth,
            mmap_random_access,
            ..Default::default()
        };
        let store = py.detach(|| core::Store::open(&path, options)).map_err(to_py_err)?;
        Ok(Store { inner: Arc::new(store) })
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path().to_owned()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (name, dim, init_kind, init_a, init_b, seed, capacity, growth, load_factor_max, missing_kind, missing_value, medium="mmap", placement="auto", optimizer_json=None))]
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
        if let Some(j) = optimizer_json {
            o.optimizer = serde_json::from_str(j)
                .map_err(|e| PyValueError::new_err(format!("bad optimizer description {j:?}: {e}")))?;
        }
        let inner = py.detach(|| self.inner.create_table(name, o)).map_err(to_py_err)?;
        Ok(Table { inner })
    }

    fn table(&self, name: &str) -> PyResult<Table> {
        Ok(Table { inner: self.inner.table(name).map_err(to_py_err)? })
    }

    fn tables(&self) -> PyResult<Vec<String>> {
        self.inner.tables().map_err(to_py_err)
    }

    fn drop_table(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        py.detach(|| self.inner.drop_table(name)).map_err(to_py_err)
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.flush()).map_err(to_py_err)
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.close()).map_err(to_py_err)
    }

    /// Statistics as a JSON document.
    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        let stats = py.detach(|| self.inner.stats()).map_err(to_py_err)?;
        Ok(serde_json::to_string(&stats).expect("stats serialize"))
    }
}

/// One table of a store.
#[pyclass(module = "embank._native", frozen)]
struct Table {
    inner: core::Table,
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

    /// Creation options as a JSON document.
    fn meta_json(&self) -> String {
        serde_json::to_string(&self.inner.meta()).expect("meta serializes")
    }

    fn pull<'py>(&self, py: Python<'py>, keys: PyReadonlyArray1<'py, u64>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let keys = slice(&keys, "keys")?;
        let out = PyArray2::<f32>::zeros(py, [keys.len(), self.inner.dim()], false);
        {
            let mut rw = out.readwrite();
            let rows = rw.as_slice_mut().expect("new array is contiguous");
            py.detach(|| self.inner.pull(keys, rows)).map_err(to_py_err)?;
        }
        Ok(out)
    }

    fn lookup<'py>(&self, py: Python<'py>, keys: PyReadonlyArray1<'py, u64>) -> PyResult<LookupResult<'py>> {
        let keys = slice(&keys, "keys")?;
        let out = PyArray2::<f32>::zeros(py, [keys.len(), self.inner.dim()], false);
        let found = PyArray1::<bool>::zeros(py, [keys.len()], false);
        {
            let mut rw = out.readwrite();
            let mut fw = found.readwrite();
            let rows = rw.as_slice_mut().expect("new array is contiguous");
            let mask = fw.as_slice_mut().expect("new array is contiguous");
            py.detach(|| self.inner.lookup(keys, rows, mask)).map_err(to_py_err)?;
        }
        Ok((out, found))
    }

    fn push(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>, rows: PyReadonlyArray2<'_, f32>) -> PyResult<()> {
        let keys = slice(&keys, "keys")?;
        let shape = rows.shape();
        if shape[0] != keys.len() || shape[1] != self.inner.dim() {
            return Err(to_py_err(core::Error::invalid(format!(
                "push: rows have shape ({}, {}), expected ({}, {}) for {} keys of table {:?} (dim {})",
                shape[0],
                shape[1],
                keys.len(),
                self.inner.dim(),
                keys.len(),
                self.inner.name(),
                self.inner.dim()
            ))));
        }
        let rows = rows.as_slice().map_err(|_| PyValueError::new_err("rows must be a C-contiguous array"))?;
        py.detach(|| self.inner.push(keys, rows)).map_err(to_py_err)
    }

    fn delete(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>) -> PyResult<u64> {
        let keys = slice(&keys, "keys")?;
        py.detach(|| self.inner.delete(keys)).map_err(to_py_err)
    }

    fn push_grad(
        &self,
        py: Python<'_>,
        keys: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
    ) -> PyResult<()> {
        let keys = slice(&keys, "keys")?;
        let grads = grads.as_slice().map_err(|_| PyValueError::new_err("grads must be a C-contiguous array"))?;
        py.detach(|| self.inner.push_grad(keys, grads)).map_err(to_py_err)
    }

    fn set_lr(&self, lr: f32) -> PyResult<()> {
        self.inner.set_lr(lr).map_err(to_py_err)
    }

    /// Queues a background load of these rows into the row cache; returns at once.
    fn lookahead(&self, keys: PyReadonlyArray1<'_, u64>) -> PyResult<bool> {
        let keys = slice(&keys, "keys")?;
        self.inner.lookahead(keys).map_err(to_py_err)
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.inner.len().map_err(to_py_err)? as usize)
    }

    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        let stats = py.detach(|| self.inner.stats()).map_err(to_py_err)?;
        Ok(serde_json::to_string(&stats).expect("stats serialize"))
    }

    /// Starts a streaming export; chunks of at most `chunk_keys` keys come from the iterator.
    fn export(&self, chunk_keys: usize) -> Export {
        let (tx, rx) = sync_channel::<ExportChunk>(2);
        let table = self.inner.clone();
        std::thread::spawn(move || {
            let result = table.export(chunk_keys, |keys, rows| {
                tx.send(Ok((keys.to_vec(), rows.to_vec())))
                    .map_err(|_| core::Error::new(ErrorKind::Closed, "export abandoned by its reader"))
            });
            if let Err(e) = result {
                let _ = tx.send(Err(e));
            }
        });
        Export { rx: Mutex::new(Some(rx)), dim: self.inner.dim() }
    }
}

/// Iterator over `(keys, rows)` chunks of an export.
#[pyclass(module = "embank._native", frozen)]
struct Export {
    rx: Mutex<Option<Receiver<ExportChunk>>>,
    dim: usize,
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
