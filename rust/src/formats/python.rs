//! The PyO3 binding of `formats`: `r3srv._core.encode_raw`, `encode_packed` and
//! `decode_raw_base64` (r3srv.serial wraps them with their references and strict decoders).

use std::os::raw::c_int;
use std::ptr;

use numpy::npyffi::{self, npy_intp, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyString;

use super::{DictPlan, Num, RawPlan, Source};
use crate::b64::{decode_range, decoded_len};
use crate::layout::ArrayView;
use crate::python::{as_array, ascii_bytes, fill_detached, new_ascii_str, new_text, sliced_rows, DETACH_MIN_BYTES};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_raw, m)?)?;
    m.add_function(wrap_pyfunction!(encode_packed, m)?)?;
    m.add_function(wrap_pyfunction!(decode_raw_base64, m)?)?;
    Ok(())
}

/// A target type by numpy's name (every number type but bool).
fn target(name: &str) -> PyResult<Num> {
    match Num::from_name(name) {
        Some(n) if n != Num::Bool => Ok(n),
        _ => Err(PyValueError::new_err(format!(
            "unsupported dtype {name:?}: one of uint8, int8, uint16, int16, uint32, int32, uint64, int64, float32, float64"
        ))),
    }
}

/// What the array holds, for the formats: bool, an integer, float32 or float64, either byte order.
fn source_of(dtype: &Bound<'_, PyArrayDescr>, what: &str) -> PyResult<Source> {
    let num = if dtype.has_object() || dtype.has_fields() || dtype.has_subarray() {
        None
    } else {
        Num::from_kind(dtype.kind(), dtype.itemsize())
    };
    let Some(num) = num else {
        return Err(PyValueError::new_err(format!(
            "{what} reads bool, integer, float32 and float64 arrays, not {}",
            dtype.str().map(|s| s.to_string()).unwrap_or_default()
        )));
    };
    let swapped = match dtype.byteorder() {
        b'>' => cfg!(target_endian = "little"),
        b'<' => cfg!(target_endian = "big"),
        _ => false,
    };
    Ok(Source { num, swapped })
}

/// The plan for `view`, its values read (for the ladder) with the GIL released when large.
fn plan<'a>(py: Python<'_>, view: ArrayView<'a>, src: Source, ladder: &[Num]) -> PyResult<RawPlan<'a>> {
    // SAFETY (both arms): the view describes the array's own memory, which the caller's
    // argument keeps alive for this call (see fill_detached about other threads).
    let plan = if view.nbytes() >= DETACH_MIN_BYTES {
        py.detach(|| unsafe { RawPlan::pick(view, src, ladder) })
    } else {
        unsafe { RawPlan::pick(view, src, ladder) }
    };
    plan.map_err(PyValueError::new_err)
}

/// Base64 of `array[prompt_start:]` as little-endian `dtype` numbers in C order, no header:
/// equal byte for byte to `r3srv.serial.raw2base64(array[prompt_start:], dtype)`. Integers go
/// into integer types that hold every value (else ValueError), integers and floats into float
/// types as numpy's `astype` rounds them; floats never into integers. `json_quoted=True` adds
/// the two quotes of a JSON string.
#[pyfunction]
#[pyo3(
    signature = (array, dtype, prompt_start=None, *, json_quoted=false),
    text_signature = "(array, dtype, prompt_start=0, *, json_quoted=False)"
)]
fn encode_raw<'py>(
    py: Python<'py>,
    array: &Bound<'py, PyAny>,
    dtype: &str,
    prompt_start: Option<&Bound<'py, PyAny>>,
    json_quoted: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let dst = target(dtype)?;
    let arr = as_array(array, "encode_raw")?;
    let src = source_of(&arr.dtype(), "encode_raw")?;
    let rows = sliced_rows(arr, prompt_start, "encode_raw")?;
    let plan = plan(py, rows.view(), src, &[dst])?;
    // SAFETY: the buffer is filled whole (exactly encoded_len chars) before the str is returned;
    // the view describes the array's own memory, which `array` keeps alive.
    unsafe {
        let (text, out) = new_text(py, plan.encoded_len(), json_quoted)?;
        fill_detached(py, plan.payload_len(), out, |out| plan.write(out));
        Ok(text)
    }
}

/// The dict form of `array[prompt_start:]` as compact JSON text:
/// `{"data":"<base64>","shape":[...],"start":N,"dtype":"<name>"}` (no `start` key when `start`
/// is None), its dtype the first of `dtypes` (a name or a sequence of names) that holds every
/// value; equal byte for byte to `r3srv.serial.packed2json(array[prompt_start:], dtypes, start)`.
#[pyfunction]
#[pyo3(
    signature = (array, dtypes, prompt_start=None, *, start=None),
    text_signature = "(array, dtypes, prompt_start=0, *, start=None)"
)]
fn encode_packed<'py>(
    py: Python<'py>,
    array: &Bound<'py, PyAny>,
    dtypes: &Bound<'py, PyAny>,
    prompt_start: Option<&Bound<'py, PyAny>>,
    start: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let names: Vec<String> = if let Ok(one) = dtypes.cast::<PyString>() {
        vec![one.to_str()?.to_owned()]
    } else {
        dtypes
            .extract()
            .map_err(|_| PyTypeError::new_err("dtypes must be a dtype name or a sequence of dtype names"))?
    };
    if names.is_empty() {
        return Err(PyValueError::new_err("dtypes must name at least one dtype"));
    }
    let ladder = names.iter().map(|n| target(n)).collect::<PyResult<Vec<Num>>>()?;
    let start = match start {
        None => None,
        Some(s) => match s.extract::<i64>() {
            Ok(v) if v >= 0 => Some(v as u64),
            _ => return Err(PyValueError::new_err(format!("start must be a non-negative int, got {s}"))),
        },
    };
    let arr = as_array(array, "encode_packed")?;
    let src = source_of(&arr.dtype(), "encode_packed")?;
    let rows = sliced_rows(arr, prompt_start, "encode_packed")?;
    let dict = DictPlan::new(plan(py, rows.view(), src, &ladder)?, start);
    // SAFETY: the buffer is filled whole (exactly len() chars, all ASCII) before the str is
    // returned; the view describes the array's own memory, which `array` keeps alive.
    unsafe {
        let (text, out) = new_ascii_str(py, dict.len())?;
        fill_detached(py, dict.raw().payload_len(), out, |out| dict.write(out));
        Ok(text)
    }
}

/// Decodes padded standard base64 (str or bytes, no whitespace) of little-endian `dtype`
/// numbers into a new 1-d array that owns them; anything else is a ValueError.
#[pyfunction]
fn decode_raw_base64<'py>(py: Python<'py>, text: &Bound<'py, PyAny>, dtype: &str) -> PyResult<Bound<'py, PyAny>> {
    let num = target(dtype)?;
    let bytes = ascii_bytes(py, text, "decode_raw_base64")?;
    let n = decoded_len(bytes).map_err(PyValueError::new_err)?;
    if !n.is_multiple_of(num.size()) {
        return Err(PyValueError::new_err(format!(
            "the text holds {n} bytes, not a whole number of {dtype} values ({} bytes each)",
            num.size()
        )));
    }
    let kind = num.name().as_bytes()[0]; // u(int), i(nt), f(loat)
    let descr = format!("{}{}{}", if num.size() == 1 { '|' } else { '<' }, kind as char, num.size());
    let descr = PyArrayDescr::new(py, descr.as_str())?;
    let mut dims = [(n / num.size()) as npy_intp];
    // SAFETY: PyArray_NewFromDescr steals `descr`'s reference and returns a new 1-d array (NULL
    // is turned into the error) that owns exactly n bytes; nobody else sees it before it is
    // returned, so writing its buffer, even with the GIL released, races with nothing. `text`
    // (kept alive by the caller) is immutable.
    unsafe {
        let raw = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
            descr.into_dtype_ptr(),
            1 as c_int,
            dims.as_mut_ptr(),
            ptr::null_mut(),
            ptr::null_mut(),
            0,
            ptr::null_mut(),
        );
        let array = Bound::from_owned_ptr_or_err(py, raw)?;
        let data = (*(raw as *mut npyffi::PyArrayObject)).fields.data as *mut u8;
        let dst = if n == 0 { &mut [][..] } else { std::slice::from_raw_parts_mut(data, n) };
        let result =
            if n >= DETACH_MIN_BYTES { py.detach(|| decode_range(bytes, 0, dst)) } else { decode_range(bytes, 0, dst) };
        result.map_err(PyValueError::new_err)?;
        Ok(array)
    }
}
