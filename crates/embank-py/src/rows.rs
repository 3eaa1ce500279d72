//! Rows as stored, sized, encoded and decoded by the core's codec (`embank_core::layout`):
//! the one row format Python uses on the host (`embank.decode_rows`,
//! `Table.row_bytes`). Only device code (the GPU cache's decoder) decodes on its own.

use embank_core as core;
use embank_core::{DType, RecordLayout};
use numpy::{PyArray2, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::{detached, to_py_err};

/// The element type of stored rows named exactly as tables report it (`f32`, `f16`,
/// `int8`; not `DType::parse`'s aliases, which name the types a table is created with).
fn stored_dtype(name: &str) -> PyResult<DType> {
    DType::ALL.into_iter().find(|d| d.name() == name).ok_or_else(|| {
        to_py_err(core::Error::invalid(format!("stored dtype must be one of f32, f16, int8; got '{name}'")))
    })
}

/// An array's shape as `(n, width)`, or an error naming the shape expected and the one
/// given (written as Python writes a shape).
fn shape_2d(shape: &[usize], width: usize, what: impl FnOnce() -> String) -> PyResult<usize> {
    match shape {
        [n, w] if *w == width => Ok(*n),
        _ => {
            let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
            let given = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
            Err(to_py_err(core::Error::invalid(format!("{}, got shape {given}", what()))))
        }
    }
}

/// `dim`, refused when 0 (a row of no values has no bytes to step by).
fn dim_checked(dim: usize) -> PyResult<usize> {
    if dim == 0 {
        return Err(to_py_err(core::Error::invalid("dim must be at least 1, got 0")));
    }
    Ok(dim)
}

/// Bytes of one stored row of `dim` values of `dtype` (`"f32"`, `"f16"`, `"int8"`).
#[pyfunction]
pub(crate) fn row_bytes(dtype: &str, dim: usize) -> PyResult<usize> {
    Ok(stored_dtype(dtype)?.row_bytes(dim))
}

/// Rows (`(n, dim)` float32, C-contiguous) encoded as stored rows of `dtype`: `(n,
/// row_bytes)` uint8, what `Table.lookup_stored` returns for them.
#[pyfunction]
pub(crate) fn encode_rows<'py>(
    py: Python<'py>,
    rows: PyReadonlyArrayDyn<'py, f32>,
    dtype: &str,
    dim: usize,
) -> PyResult<Bound<'py, PyArray2<u8>>> {
    let dt = stored_dtype(dtype)?;
    let dim = dim_checked(dim)?;
    let n = shape_2d(rows.shape(), dim, || format!("rows to encode as {dtype} x {dim} are (n, {dim}) float32"))?;
    let src = rows.as_slice().map_err(|_| to_py_err(core::Error::invalid("rows must be a C-contiguous array")))?;
    let out = PyArray2::<u8>::zeros(py, [n, dt.row_bytes(dim)], false);
    {
        let mut w = out.readwrite();
        let dst = w.as_slice_mut().expect("new array is contiguous");
        detached(py, || {
            core::encode_rows(dt, dim, src, dst);
            Ok(())
        })?;
    }
    Ok(out)
}

/// Stored rows (`(n, row_bytes)` uint8, C-contiguous) decoded to `(n, dim)` float32: exactly
/// what `Table.lookup` returns for them.
#[pyfunction]
pub(crate) fn decode_rows<'py>(
    py: Python<'py>,
    stored: PyReadonlyArrayDyn<'py, u8>,
    dtype: &str,
    dim: usize,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let dt = stored_dtype(dtype)?;
    let dim = dim_checked(dim)?;
    let layout = RecordLayout::new(dim, 0, dt);
    let rb = layout.row_bytes();
    let n = shape_2d(stored.shape(), rb, || format!("stored rows of {dtype} x {dim} are (n, {rb}) uint8"))?;
    let src =
        stored.as_slice().map_err(|_| to_py_err(core::Error::invalid("stored rows must be a C-contiguous array")))?;
    let out = PyArray2::<f32>::zeros(py, [n, dim], false);
    {
        let mut w = out.readwrite();
        let dst = w.as_slice_mut().expect("new array is contiguous");
        detached(py, || {
            for (row, o) in src.chunks_exact(rb).zip(dst.chunks_exact_mut(dim)) {
                layout.decode_row(row, o);
            }
            Ok(())
        })?;
    }
    Ok(out)
}
