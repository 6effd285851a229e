//! The PyO3 binding of `lists`: `r3srv._core.encode_int_lists` and `encode_float_lists`
//! (r3srv.serial wraps them: it hands over C-contiguous int32 values,
//! float32 or float64 values, and int64 offsets, and keeps the references as oracles).

use numpy::PyReadonlyArray1;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::{check_offsets, write_float_list, write_float_lists, write_int_lists};
use crate::python::new_ascii_str;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_int_lists, m)?)?;
    m.add_function(wrap_pyfunction!(encode_float_lists, m)?)?;
    Ok(())
}

fn slice<'a, T: numpy::Element>(array: &'a PyReadonlyArray1<'_, T>, what: &str) -> PyResult<&'a [T]> {
    array.as_slice().map_err(|_| PyValueError::new_err(format!("{what} must be C-contiguous")))
}

fn offsets_of<'a>(offsets: &'a PyReadonlyArray1<'_, i64>, len: usize) -> PyResult<&'a [i64]> {
    let offsets = slice(offsets, "offsets")?;
    check_offsets(offsets, len).map_err(PyValueError::new_err)?;
    Ok(offsets)
}

/// The finished bytes as a new ASCII str (they are ASCII: digits, signs, brackets, letters).
fn ascii<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: the buffer is filled whole with ASCII bytes before the str is returned.
    unsafe {
        let (text, out) = new_ascii_str(py, bytes.len())?;
        out.copy_from_slice(bytes);
        Ok(text)
    }
}

/// `json.dumps` (compact) of the rows of int32 `values` cut by int64 `offsets`: `[[..],[..]]`.
#[pyfunction]
fn encode_int_lists<'py>(
    py: Python<'py>,
    values: PyReadonlyArray1<'py, i32>,
    offsets: PyReadonlyArray1<'py, i64>,
) -> PyResult<Bound<'py, PyAny>> {
    let values = slice(&values, "values")?;
    let offsets = offsets_of(&offsets, values.len())?;
    let mut out = Vec::with_capacity(2 + offsets.len() * 3 + values.len() * 7);
    write_int_lists(values, offsets, &mut out);
    ascii(py, &out)
}

/// `json.dumps` (compact) of float32 or float64 `values`: one flat list when `offsets` is
/// None, else the rows they cut, `[[..],[..]]`.
#[pyfunction]
#[pyo3(signature = (values, offsets=None))]
fn encode_float_lists<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyAny>,
    offsets: Option<PyReadonlyArray1<'py, i64>>,
) -> PyResult<Bound<'py, PyAny>> {
    fn write<T: numpy::Element + Copy + Into<f64>>(values: &[T], offsets: Option<&[i64]>) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + values.len() * 21 + offsets.map_or(0, |o| o.len() * 3));
        match offsets {
            None => write_float_list(values, &mut out),
            Some(offsets) => write_float_lists(values, offsets, &mut out),
        }
        out
    }
    let out = if let Ok(v) = values.extract::<PyReadonlyArray1<'py, f32>>() {
        let v = slice(&v, "values")?;
        let o = offsets.as_ref().map(|o| offsets_of(o, v.len())).transpose()?;
        write(v, o)
    } else if let Ok(v) = values.extract::<PyReadonlyArray1<'py, f64>>() {
        let v = slice(&v, "values")?;
        let o = offsets.as_ref().map(|o| offsets_of(o, v.len())).transpose()?;
        write(v, o)
    } else {
        return Err(PyTypeError::new_err("values must be a 1-d float32 or float64 numpy array"));
    };
    ascii(py, &out)
}
