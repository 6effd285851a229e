//! The PyO3 binding: `r3srv._core.encode_routed_experts` and `decode_routed_experts`, and the
//! CPU kernels' raw-tensor entries (r3srv.kernels.paged_decode_cpu, paged_prefill_cpu, rms_norm_cpu, router_cpu).
//! Reads the ndarray's fields directly (no slicing through Python), writes the base64 text
//! straight into a new compact ASCII str, and decodes straight into a new array's memory.

use std::os::raw::c_int;
use std::ptr;

use numpy::npyffi::{self, npy_intp, NPY_ARRAY_F_CONTIGUOUS, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyString};

use crate::b64::decode_range;
use crate::decode::{check_size, plan_decode};
use crate::encode::Plan;
use crate::layout::ArrayView;
use crate::npy_header::MAX_NDIM;
use crate::paged_attn::{paged_decode, Bf16, Element, Isa, PagedDecode, Strided};
use crate::paged_prefill::PagedPrefill;

/// Payloads at least this large are encoded with the GIL released.
pub(crate) const DETACH_MIN_BYTES: usize = 64 * 1024;

/// `r3srv.serial._encode_reference`, for dtypes the fast path does not cover.
static REFERENCE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// Threads for large contiguous payloads (r3srv.settings.encode_threads, default 1, capped by
/// the CPUs available). Two threads lost on a shared 2-core machine (docs/encoding.md); on an
/// idle many-core host they split the work and the page faults.
static ENCODE_THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
/// Huge pages for large outputs (r3srv.settings.huge_pages, default on).
static HUGE_PAGES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fn worker_threads() -> usize {
    *ENCODE_THREADS.get_or_init(|| 1)
}

/// Fixes the encoder's settings for this process (r3srv.serial passes r3srv.settings on
/// import): the first call wins, and any encode before it fixes the defaults. Returns the
/// base64 kernel in use, which is `base64_isa` only when this CPU has it.
#[pyfunction]
fn configure_encoder(threads: usize, huge_pages: bool, base64_isa: &str) -> PyResult<&'static str> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    ENCODE_THREADS.get_or_init(|| threads.clamp(1, cpus));
    HUGE_PAGES.get_or_init(|| huge_pages);
    #[cfg(target_arch = "x86_64")]
    {
        use crate::b64_x86::{choose_isa, Isa};
        let wanted = match base64_isa {
            "auto" => None,
            name => Some(
                Isa::from_name(name).ok_or_else(|| PyValueError::new_err(format!("unknown base64 kernel {name:?}")))?,
            ),
        };
        Ok(choose_isa(wanted).name())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = base64_isa;
        Ok("portable")
    }
}

/// The base64 kernel the encoder and decoder use: "avx512vbmi", "avx2" (our streaming kernel
/// for large outputs, base64-simd's AVX2 below) or "portable" (base64-simd's own dispatch).
#[pyfunction]
fn encoder_isa() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        crate::b64_x86::active_isa().name()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "portable"
    }
}

/// Outputs at least this large get huge pages. glibc serves allocations above its largest
/// dynamic mmap threshold (32 MiB on 64-bit) with fresh `mmap` memory every time; smaller
/// ones are soon reused heap memory, where the advice measured slower (docs/benchmarks.md).
const HUGE_PAGES_MIN_BYTES: usize = 32 << 20;

/// Huge pages for a large fresh output buffer (crate::huge_pages::advise_fresh): one fault per
/// 2 MiB instead of per 4 KiB, and no trap per fault, about half the faulting time
/// (docs/benchmarks.md). settings.huge_pages (`R3SRV_HUGEPAGES=0`) turns it off.
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    if len >= HUGE_PAGES_MIN_BYTES && *HUGE_PAGES.get_or_init(|| true) {
        // SAFETY: the caller's fresh output buffer of `len` bytes, alive for the call.
        unsafe { crate::huge_pages::advise_fresh(ptr, len) }
    }
}

/// `dtype.str` for the dtypes that np.save writes as a plain descr string; `None` means
/// "let the reference handle it" (structured, subarray, user and string dtypes).
fn descr_of(dtype: &Bound<'_, PyArrayDescr>, buf: &mut [u8; 24]) -> PyResult<Option<usize>> {
    let kind = dtype.kind();
    let itemsize = dtype.itemsize();
    match kind {
        b'b' | b'i' | b'u' | b'f' | b'c' => {
            buf[0] = if itemsize == 1 {
                b'|'
            } else {
                match dtype.byteorder() {
                    b'>' => b'>',
                    b'<' => b'<',
                    _ if cfg!(target_endian = "little") => b'<',
                    _ => b'>',
                }
            };
            buf[1] = kind;
            let digits = itemsize.to_string();
            buf[2..2 + digits.len()].copy_from_slice(digits.as_bytes());
            Ok(Some(2 + digits.len()))
        }
        b'M' | b'm' | b'S' | b'U' | b'V' if !dtype.has_fields() && !dtype.has_subarray() => {
            let s = dtype.getattr(pyo3::intern!(dtype.py(), "str"))?;
            let s = s.cast::<PyString>()?.to_str()?;
            if s.len() > buf.len() || !s.is_ascii() {
                return Ok(None);
            }
            buf[..s.len()].copy_from_slice(s.as_bytes());
            Ok(Some(s.len()))
        }
        _ => Ok(None),
    }
}

pub(crate) fn prompt_start_value(prompt_start: Option<&Bound<'_, PyAny>>, len: usize) -> PyResult<usize> {
    let Some(obj) = prompt_start else { return Ok(0) };
    let out_of_range = |shown: String| {
        PyValueError::new_err(format!(
            "prompt_start={shown} is out of range for routed experts of length {len}: \
             it must satisfy 0 <= prompt_start <= {len}"
        ))
    };
    match obj.extract::<i64>() {
        Ok(v) if v >= 0 && (v as u64) <= len as u64 => Ok(v as usize),
        Ok(v) => Err(out_of_range(v.to_string())),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Err(out_of_range(obj.str()?.to_string())),
        Err(_) => Err(PyTypeError::new_err(format!("prompt_start must be an int, got {}", obj.get_type().name()?))),
    }
}

/// An ndarray argument, or a TypeError naming the function that wanted one.
pub(crate) fn as_array<'a, 'py>(array: &'a Bound<'py, PyAny>, what: &str) -> PyResult<&'a Bound<'py, PyUntypedArray>> {
    array.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} expects a numpy.ndarray, got {}",
            array.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })
}

/// `array[prompt_start:]` without slicing through Python: the same strides, the first axis
/// shortened, the data pointer advanced.
pub(crate) struct SlicedRows<'a> {
    shape: [usize; MAX_NDIM],
    ndim: usize,
    ptr: *const u8,
    strides: &'a [isize],
    itemsize: usize,
    /// The validated prompt_start.
    pub(crate) start: usize,
}

impl SlicedRows<'_> {
    pub(crate) fn view(&self) -> ArrayView<'_> {
        ArrayView { ptr: self.ptr, shape: &self.shape[..self.ndim], strides: self.strides, itemsize: self.itemsize }
    }
}

pub(crate) fn sliced_rows<'a>(
    arr: &'a Bound<'_, PyUntypedArray>,
    prompt_start: Option<&Bound<'_, PyAny>>,
    what: &str,
) -> PyResult<SlicedRows<'a>> {
    let ndim = arr.ndim();
    if ndim == 0 {
        return Err(PyValueError::new_err(format!(
            "{what} needs an array with at least one dimension, got a 0-d array"
        )));
    }
    let dims = arr.shape();
    let start = prompt_start_value(prompt_start, dims[0])?;
    let strides = arr.strides();
    let mut shape = [0usize; MAX_NDIM];
    shape[..ndim].copy_from_slice(dims);
    shape[0] = dims[0] - start;
    // SAFETY: `arr` is a live ndarray (a checked cast); reading its data pointer field.
    let base = unsafe { (*arr.as_array_ptr()).fields.data as *const u8 };
    Ok(SlicedRows {
        shape,
        ndim,
        ptr: base.wrapping_offset(start as isize * strides[0]),
        strides,
        itemsize: arr.dtype().itemsize(),
        start,
    })
}

/// A new compact ASCII str of `len` chars, and its buffer to fill before the str is shared.
///
/// # Safety
/// The caller fills every byte of the buffer with ASCII before handing the str to anyone, and
/// does not use the buffer after that.
pub(crate) unsafe fn new_ascii_str<'py>(py: Python<'py>, len: usize) -> PyResult<(Bound<'py, PyAny>, &'py mut [u8])> {
    // SAFETY: PyUnicode_New(n, 127) returns a new compact ASCII str of n one-byte chars (or NULL,
    // checked), owned by the returned Bound; its buffer is exactly n bytes long.
    let s = ffi::PyUnicode_New(len as ffi::Py_ssize_t, 127);
    if s.is_null() {
        return Err(PyErr::fetch(py));
    }
    let text = Bound::from_owned_ptr(py, s);
    Ok((text, std::slice::from_raw_parts_mut(ffi::PyUnicode_DATA(s) as *mut u8, len)))
}

/// A new str of `len` chars, between double quotes when `json_quoted` (a JSON string as is:
/// base64 never needs escaping), and the buffer of the `len` chars inside them.
///
/// # Safety
/// As for `new_ascii_str`: the caller fills the returned buffer with ASCII before sharing the str.
pub(crate) unsafe fn new_text<'py>(
    py: Python<'py>,
    len: usize,
    json_quoted: bool,
) -> PyResult<(Bound<'py, PyAny>, &'py mut [u8])> {
    if !json_quoted {
        return new_ascii_str(py, len);
    }
    let (text, whole) = new_ascii_str(py, len + 2)?;
    whole[0] = b'"';
    whole[len + 1] = b'"';
    Ok((text, &mut whole[1..len + 1]))
}

/// Runs `fill` on an output buffer, with the GIL released when the payload is large.
///
/// The str is not shared yet and the caller's argument keeps the array's rows alive. Another
/// Python thread that writes to the rows meanwhile gets torn text, one that frees them
/// (`resize(refcheck=False)`) undefined behaviour, as with any GIL-free reader; the server's
/// arrays are private copies.
pub(crate) fn fill_detached<F: FnOnce(&mut [u8]) + Send>(py: Python<'_>, payload_len: usize, out: &mut [u8], fill: F) {
    if payload_len >= DETACH_MIN_BYTES {
        py.detach(|| {
            advise_huge_pages(out.as_mut_ptr(), out.len());
            fill(out)
        });
    } else {
        fill(out);
    }
}

/// Encodes `array[prompt_start:]` as base64 of its `.npy` bytes, equal byte for byte to
/// `r3srv.serial.numpy2base64(array[prompt_start:])`. With `json_quoted=True` the str is that
/// text between double quotes: a JSON string as is (base64 never needs escaping), which the
/// server embeds with `msgspec.Raw` instead of having msgspec scan 17 MB for escapes.
#[pyfunction]
#[pyo3(
    signature = (array, prompt_start=None, *, json_quoted=false),
    text_signature = "(array, prompt_start=0, *, json_quoted=False)"
)]
fn encode_routed_experts<'py>(
    py: Python<'py>,
    array: &Bound<'py, PyAny>,
    prompt_start: Option<&Bound<'py, PyAny>>,
    json_quoted: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let arr = as_array(array, "encode_routed_experts")?;
    let rows = sliced_rows(arr, prompt_start, "encode_routed_experts")?;
    let dtype = arr.dtype();
    if dtype.has_object() {
        // np.save's own message.
        return Err(PyValueError::new_err("Object arrays cannot be saved when allow_pickle=False"));
    }
    let mut descr_buf = [0u8; 24];
    // SAFETY: `array` is a live object (borrowed with the GIL held) and numpy's C API is loaded.
    let exact = unsafe { npyffi::PyArray_CheckExact(py, array.as_ptr()) } != 0;
    let descr_len = if exact { descr_of(&dtype, &mut descr_buf)? } else { None };
    let Some(descr_len) = descr_len else {
        let reference = REFERENCE.get_or_try_init(py, || -> PyResult<_> {
            Ok(py.import("r3srv.serial")?.getattr("_encode_reference")?.unbind())
        })?;
        return reference.bind(py).call1((array, rows.start, json_quoted));
    };
    let descr = std::str::from_utf8(&descr_buf[..descr_len]).expect("ASCII descr");
    let plan = Plan::new(descr, rows.view());
    // SAFETY: the buffer is filled whole (exactly encoded_len chars) before the str is returned;
    // the view describes the array's own memory, which `array` keeps alive.
    unsafe {
        let (text, out) = new_text(py, plan.encoded_len(), json_quoted)?;
        let threads = if plan.payload_len() >= DETACH_MIN_BYTES { worker_threads() } else { 1 };
        fill_detached(py, plan.payload_len(), out, |out| plan.write(out, threads));
        Ok(text)
    }
}

/// Accepts exactly the descr strings np.save writes for plain dtypes: a byte order, one of
/// the kinds numpy can save without pickle, an item size, and a datetime unit for M/m.
fn checked_descr(descr: &str) -> PyResult<&str> {
    let b = descr.as_bytes();
    let bad = || PyValueError::new_err(format!("unsupported dtype {descr:?} in routed experts text"));
    if b.len() < 3 || b.len() > 20 || !matches!(b[0], b'<' | b'>' | b'|' | b'=') {
        return Err(bad());
    }
    if !b"biufcmMSUV".contains(&b[1]) {
        return Err(bad());
    }
    let digits = b[2..].iter().take_while(|c| c.is_ascii_digit()).count();
    if digits == 0 || digits > 6 {
        return Err(bad());
    }
    let rest = &b[2 + digits..];
    let unit_ok = rest.is_empty()
        || (matches!(b[1], b'm' | b'M')
            && rest.len() >= 3
            && rest[0] == b'['
            && rest[rest.len() - 1] == b']'
            && rest[1..rest.len() - 1].iter().all(u8::is_ascii_alphanumeric));
    if !unit_ok {
        return Err(bad());
    }
    Ok(descr)
}

/// The bytes of a base64 text argument: an ASCII str's own buffer, or a bytes object's.
pub(crate) fn ascii_bytes<'a>(py: Python<'_>, text: &'a Bound<'_, PyAny>, what: &str) -> PyResult<&'a [u8]> {
    let not_ascii = || PyValueError::new_err("routed experts text is not ASCII base64");
    if let Ok(s) = text.cast::<PyString>() {
        // SAFETY: `s` is a live str borrowed from the caller for this call; a compact ASCII
        // str's data is its length in bytes, and PyUnicode_AsUTF8AndSize's buffer (checked for
        // NULL) lives as long as the str. Python strs are immutable.
        unsafe {
            if ffi::PyUnicode_IS_COMPACT_ASCII(s.as_ptr()) != 0 {
                // The common case: read the str's own ASCII buffer.
                let n = ffi::PyUnicode_GET_LENGTH(s.as_ptr()) as usize;
                Ok(std::slice::from_raw_parts(ffi::PyUnicode_DATA(s.as_ptr()) as *const u8, n))
            } else {
                // Any other str (non-ASCII, or a legacy representation): its UTF-8 view.
                let mut n: ffi::Py_ssize_t = 0;
                let p = ffi::PyUnicode_AsUTF8AndSize(s.as_ptr(), &mut n);
                if p.is_null() {
                    drop(PyErr::fetch(py)); // lone surrogates: not base64 either
                    return Err(not_ascii());
                }
                let b = std::slice::from_raw_parts(p as *const u8, n as usize);
                if !b.is_ascii() {
                    return Err(not_ascii());
                }
                Ok(b)
            }
        }
    } else if let Ok(b) = text.cast::<PyBytes>() {
        Ok(b.as_bytes())
    } else {
        Err(PyTypeError::new_err(format!("{what} expects str or bytes, got {}", text.get_type().name()?)))
    }
}

/// Decodes base64 `.npy` text (str or bytes) into a new array that owns the decoded rows.
#[pyfunction]
fn decode_routed_experts<'py>(py: Python<'py>, text: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let bytes = ascii_bytes(py, text, "decode_routed_experts")?;
    let plan = plan_decode(bytes).map_err(PyValueError::new_err)?;
    let descr = checked_descr(&plan.header.descr)?;
    let dtype = PyArrayDescr::new(py, descr)
        .map_err(|e| PyValueError::new_err(format!("unsupported dtype {descr:?} in routed experts text: {e}")))?;
    if dtype.has_object() || dtype.has_fields() || dtype.itemsize() == 0 {
        return Err(PyValueError::new_err(format!("unsupported dtype {descr:?} in routed experts text")));
    }
    check_size(&plan.header.shape, dtype.itemsize(), plan.data_len).map_err(PyValueError::new_err)?;
    let mut dims: Vec<npy_intp> = plan.header.shape.iter().map(|&d| d as npy_intp).collect();
    let flags: c_int = if plan.header.fortran_order { NPY_ARRAY_F_CONTIGUOUS } else { 0 };
    // SAFETY: PyArray_NewFromDescr steals `dtype`'s reference and returns a new array (NULL is
    // turned into the error) that owns exactly data_len bytes (check_size matched shape x
    // itemsize to it); nobody else sees the array before it is returned, so writing its
    // buffer, even with the GIL released, races with nothing.
    unsafe {
        let raw = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
            dtype.into_dtype_ptr(),
            dims.len() as c_int,
            dims.as_mut_ptr(),
            ptr::null_mut(),
            ptr::null_mut(),
            flags,
            ptr::null_mut(),
        );
        let array = Bound::from_owned_ptr_or_err(py, raw)?;
        let data = (*(raw as *mut npyffi::PyArrayObject)).fields.data as *mut u8;
        let dst = if plan.data_len == 0 { &mut [][..] } else { std::slice::from_raw_parts_mut(data, plan.data_len) };
        let start = plan.data_start;
        let result = if plan.data_len >= DETACH_MIN_BYTES {
            // `text` (kept alive by the caller) is immutable; the array is not shared yet.
            py.detach(|| decode_range(bytes, start, dst))
        } else {
            decode_range(bytes, start, dst)
        };
        result.map_err(PyValueError::new_err)?;
        Ok(array)
    }
}

/// A tensor as r3srv.kernels.paged_decode_cpu hands it over: (data pointer, rows, heads, dim,
/// row stride, head stride), strides in elements, the last dim contiguous.
type TensorArg = (usize, usize, usize, usize, usize, usize);

fn usable<T>(ptr: usize) -> PyResult<()> {
    if ptr == 0 || !ptr.is_multiple_of(std::mem::align_of::<T>()) {
        return Err(PyValueError::new_err(format!("a tensor's data pointer {ptr:#x} is null or misaligned")));
    }
    Ok(())
}

/// A slice over `len` elements at `ptr` (none when `len` is 0, whatever the pointer).
///
/// # Safety
/// Unless `len` is 0, `ptr` must point to `len` initialized elements of T that stay alive and
/// unmodified (or, for `slice_mut`, unaliased) for 'a.
unsafe fn slice<'a, T>(ptr: usize, len: usize) -> PyResult<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    usable::<T>(ptr)?;
    // SAFETY: the caller's contract; pointer non-null and aligned (checked).
    Ok(unsafe { std::slice::from_raw_parts(ptr as *const T, len) })
}

/// # Safety
/// As `slice`, and nothing else reads or writes the memory for 'a.
unsafe fn slice_mut<'a, T>(ptr: usize, len: usize) -> PyResult<&'a mut [T]> {
    if len == 0 {
        return Ok(&mut []);
    }
    usable::<T>(ptr)?;
    // SAFETY: the caller's contract; pointer non-null and aligned (checked).
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, len) })
}

/// # Safety
/// `arg` must describe a live tensor: its pointer valid for the elements its shape and strides span.
unsafe fn strided<'a, T>(arg: TensorArg) -> PyResult<Strided<'a, T>> {
    let (ptr, rows, heads, dim, row_stride, head_stride) = arg;
    let len = Strided::<T>::span(rows, heads, dim, row_stride, head_stride)
        .ok_or_else(|| PyValueError::new_err("a tensor's shape and strides overflow"))?;
    // SAFETY: the caller's contract (the span is exactly the elements the tensor's view reaches).
    let data = unsafe { slice::<T>(ptr, len)? };
    Strided::new(data, rows, heads, dim, row_stride, head_stride).map_err(PyValueError::new_err)
}

/// A decode step's new keys and values into the paged cache (crate::paged_attn::write_cache_rows):
/// the private half of r3srv.ops.cpu_decode's fused layer, which passes contiguous CPU tensors
/// k and v [rows, kv_heads, head_dim] and the layer's k_cache and v_cache [cache_rows, kv_heads,
/// head_dim] of one `dtype` ("float32" or "bfloat16", `row_len` = kv_heads x head_dim elements
/// a row), the step's int64 slots [rows], and keeps them alive across the call. Every slot is
/// checked before anything is written; caches that overlap each other or k / v are errors.
/// Keeps the GIL (a call takes microseconds).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn write_kv_cache(
    dtype: &str,
    k: usize,
    v: usize,
    k_cache: usize,
    v_cache: usize,
    slots: usize,
    rows: usize,
    row_len: usize,
    cache_rows: usize,
) -> PyResult<()> {
    let size = match dtype {
        "float32" => 4,
        "bfloat16" => 2,
        other => return Err(PyTypeError::new_err(format!("write_kv_cache takes float32 or bfloat16, not {other}"))),
    };
    let overflow = || PyValueError::new_err("write_kv_cache: the shapes overflow");
    let len = rows.checked_mul(row_len).ok_or_else(overflow)?;
    let cache_len = cache_rows.checked_mul(row_len).ok_or_else(overflow)?;
    let cache_bytes = cache_len.checked_mul(size).ok_or_else(overflow)?;
    let bytes = len.checked_mul(size).ok_or_else(overflow)?;
    let spans = [(k_cache, cache_bytes), (v_cache, cache_bytes), (k, bytes), (v, bytes)];
    let overlap = |(a, n): (usize, usize), (b, m): (usize, usize)| {
        n > 0 && m > 0 && a < b.saturating_add(m) && b < a.saturating_add(n)
    };
    if overlap(spans[0], spans[1]) || spans[2..].iter().any(|&s| overlap(spans[0], s) || overlap(spans[1], s)) {
        return Err(PyValueError::new_err("write_kv_cache: the caches overlap each other or the new rows"));
    }
    /// `src`'s rows into `dst` as elements of T (the dtype's width: only bytes are copied).
    ///
    /// # Safety
    /// As `write_kv_cache`'s caller promises, for these addresses and lengths.
    unsafe fn write<T: Copy>(
        src: usize,
        dst: usize,
        len: usize,
        cache_len: usize,
        slots: &[i64],
        row_len: usize,
    ) -> PyResult<()> {
        // SAFETY: the caller's contract: live tensors of these sizes; the caches overlap nothing
        // else passed (checked), so the one &mut aliases nothing.
        let (rows, cache) = unsafe { (slice::<T>(src, len)?, slice_mut::<T>(dst, cache_len)?) };
        crate::paged_attn::write_cache_rows(rows, row_len, slots, cache)
            .map_err(|e| PyValueError::new_err(format!("write_kv_cache: {e}")))
    }
    // SAFETY: the caller's contract above (live tensors of these sizes, int64 slots [rows]).
    unsafe {
        let slots = slice::<i64>(slots, rows)?;
        for (src, dst) in [(k, k_cache), (v, v_cache)] {
            if size == 4 {
                write::<f32>(src, dst, len, cache_len, slots, row_len)?;
            } else {
                write::<u16>(src, dst, len, cache_len, slots, row_len)?;
            }
        }
    }
    Ok(())
}

static PAGED_DECODE_ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();

/// The ISA the paged decode attention kernel runs on this CPU: "avx512_bf16" (bfloat16 scores in
/// AVX-512 BF16 dot products), "avx512", "avx2" (AVX2 + FMA) or "portable".
#[pyfunction]
fn paged_decode_isa() -> &'static str {
    PAGED_DECODE_ISA.get_or_init(Isa::detect).name()
}

/// Paged decode attention over raw tensors (crate::paged_attn): the private half of
/// r3srv.kernels.paged_decode_cpu, which checks dtypes, devices, contiguity and that `out`
/// shares no memory with the inputs, and keeps every tensor alive across the call. q, k, v:
/// TensorArg; tables: (pointer, sequences, max blocks), int64, contiguous; lens and rows: int64
/// pointers of `sequences` elements; out: (pointer, tokens, heads, v_dim), contiguous; sinks:
/// float32 pointer of `heads` elements. Every index is checked in Rust before it is followed;
/// runs with the GIL released.
#[pyfunction]
#[pyo3(signature = (dtype, q, k, v, tables, lens, rows, out, page, scale, window, sinks, threads))]
#[allow(clippy::too_many_arguments)]
fn paged_decode_attention(
    py: Python<'_>,
    dtype: &str,
    q: TensorArg,
    k: TensorArg,
    v: TensorArg,
    tables: (usize, usize, usize),
    lens: usize,
    rows: usize,
    out: (usize, usize, usize, usize),
    page: usize,
    scale: f32,
    window: Option<usize>,
    sinks: Option<usize>,
    threads: usize,
) -> PyResult<()> {
    fn call<T: Element>(
        py: Python<'_>,
        q: TensorArg,
        k: TensorArg,
        v: TensorArg,
        tables: (usize, usize, usize),
        lens: usize,
        rows: usize,
        out: (usize, usize, usize, usize),
        page: usize,
        scale: f32,
        window: Option<usize>,
        sinks: Option<usize>,
        threads: usize,
    ) -> PyResult<()> {
        let (seqs, max_blocks) = (tables.1, tables.2);
        let out_len = out.1.checked_mul(out.2).and_then(|n| n.checked_mul(out.3));
        let out_len = out_len.ok_or_else(|| PyValueError::new_err("the output's shape overflows"))?;
        let table_len =
            seqs.checked_mul(max_blocks).ok_or_else(|| PyValueError::new_err("the tables' shape overflows"))?;
        // SAFETY: paged_decode_cpu passes live tensors of these shapes and strides and the dtype
        // T stands for, held by its caller for the whole call; `out` is a contiguous tensor that
        // shares no memory with the others (checked there), so the one &mut aliases nothing.
        let (decode, out) = unsafe {
            let decode = PagedDecode {
                q: strided::<T>(q)?,
                k: strided::<T>(k)?,
                v: strided::<T>(v)?,
                tables: slice::<i64>(tables.0, table_len)?,
                max_blocks,
                lens: slice::<i64>(lens, seqs)?,
                rows: slice::<i64>(rows, seqs)?,
                page,
                scale,
                window,
                sinks: match sinks {
                    Some(ptr) => Some(slice::<f32>(ptr, q.2)?),
                    None => None,
                },
            };
            (decode, slice_mut::<T>(out.0, out_len)?)
        };
        let isa = *PAGED_DECODE_ISA.get_or_init(Isa::detect);
        py.detach(|| paged_decode(&decode, out, threads, isa)).map_err(PyValueError::new_err)
    }
    match dtype {
        "float32" => call::<f32>(py, q, k, v, tables, lens, rows, out, page, scale, window, sinks, threads),
        "bfloat16" => call::<Bf16>(py, q, k, v, tables, lens, rows, out, page, scale, window, sinks, threads),
        other => Err(PyTypeError::new_err(format!("paged decode attention takes float32 or bfloat16, not {other}"))),
    }
}

/// Whether `dtype` prefill attention over heads of `head_dim` (with a window, with sinks) runs
/// in the dtype's flash kernel here at any context length (crate::flash_prefill::Prefill::flash_applies:
/// bfloat16 in AMX tiles or AVX-512 BF16 dot products, float32 in AVX-512 FMA).
#[pyfunction]
fn paged_prefill_flash(dtype: &str, head_dim: usize, windowed: bool, sinks: bool) -> PyResult<bool> {
    use crate::flash_prefill::Prefill;
    match dtype {
        "float32" => Ok(f32::flash_applies(head_dim, windowed, sinks)),
        "bfloat16" => Ok(Bf16::flash_applies(head_dim, windowed, sinks)),
        other => Err(PyTypeError::new_err(format!("prefill attention takes float32 or bfloat16, not {other}"))),
    }
}

/// The tiles the dtype's flash prefill kernel runs in here ("amx", "avx512", "avx2"; None: no
/// flash kernel on this CPU), as `paged_prefill_attention` chooses them now (AMX tiles only while
/// allowed, settings.amx_tiles).
#[pyfunction]
fn paged_prefill_flash_tiles(dtype: &str) -> PyResult<Option<&'static str>> {
    use crate::flash_prefill::Flash;
    match dtype {
        "float32" => Ok(f32::fastest().map(|t| t.name())),
        "bfloat16" => Ok(Bf16::fastest().map(|t| t.name())),
        other => Err(PyTypeError::new_err(format!("prefill attention takes float32 or bfloat16, not {other}"))),
    }
}

/// Prefill attention over raw tensors (crate::flash_prefill::Prefill: the dtype's fastest kernel): the private half of
/// r3srv.kernels.paged_prefill_cpu, which checks dtypes, devices, contiguity and that `out`
/// shares no memory with the inputs, and keeps every tensor alive across the call. q, k, v:
/// TensorArg; spans: (pointer to the q_starts, q_lens and context_lens, each `spans` int64,
/// one after the other, spans); slots: (int64 pointer, count), the spans' context slots in
/// span order; out: (pointer, tokens, heads, v_dim), contiguous; sinks: float32 pointer of
/// `heads` elements; flash_tiles: None (the widest flash tiles this CPU runs), or a narrower
/// kernel named to measure it: "amx", "avx512" or "avx2" tiles (a ValueError where this CPU does not
/// run them for the dtype), "portable" (`paged_prefill`'s kernel, no flash).
/// Every index is checked in Rust before it is followed; runs with the GIL released.
#[pyfunction]
#[pyo3(signature = (dtype, q, k, v, spans, slots, out, scale, window, sinks, threads, flash_tiles=None))]
#[allow(clippy::too_many_arguments)]
fn paged_prefill_attention(
    py: Python<'_>,
    dtype: &str,
    q: TensorArg,
    k: TensorArg,
    v: TensorArg,
    spans: (usize, usize),
    slots: (usize, usize),
    out: (usize, usize, usize, usize),
    scale: f32,
    window: Option<usize>,
    sinks: Option<usize>,
    threads: usize,
    flash_tiles: Option<&str>,
) -> PyResult<()> {
    use crate::flash_prefill::Tiles;
    fn call<T: crate::flash_prefill::Prefill>(
        py: Python<'_>,
        q: TensorArg,
        k: TensorArg,
        v: TensorArg,
        spans: (usize, usize),
        slots: (usize, usize),
        out: (usize, usize, usize, usize),
        scale: f32,
        window: Option<usize>,
        sinks: Option<usize>,
        threads: usize,
        tiles: Option<Option<Tiles>>,
    ) -> PyResult<()> {
        let n = spans.1;
        let out_len = out.1.checked_mul(out.2).and_then(|x| x.checked_mul(out.3));
        let out_len = out_len.ok_or_else(|| PyValueError::new_err("the output's shape overflows"))?;
        let span_len = n.checked_mul(3).ok_or_else(|| PyValueError::new_err("the spans' shape overflows"))?;
        // SAFETY: paged_prefill_cpu passes live tensors of these shapes and strides and the dtype
        // T stands for, held by its caller for the whole call; `out` is a contiguous tensor that
        // shares no memory with the others (checked there), so the one &mut aliases nothing.
        let (prefill, out) = unsafe {
            let columns = slice::<i64>(spans.0, span_len)?;
            let prefill = PagedPrefill {
                q: strided::<T>(q)?,
                k: strided::<T>(k)?,
                v: strided::<T>(v)?,
                q_starts: &columns[..n],
                q_lens: &columns[n..2 * n],
                context_lens: &columns[2 * n..],
                slots: slice::<i64>(slots.0, slots.1)?,
                scale,
                window,
                sinks: match sinks {
                    Some(ptr) => Some(slice::<f32>(ptr, q.2)?),
                    None => None,
                },
            };
            (prefill, slice_mut::<T>(out.0, out_len)?)
        };
        let isa = *PAGED_DECODE_ISA.get_or_init(Isa::detect);
        // tiles: None the widest flash tiles, Some(None) the portable kernel, Some(Some(t)) t's tiles
        py.detach(|| match tiles {
            Some(None) => crate::paged_prefill::paged_prefill(&prefill, out, threads, isa),
            tiles => T::prefill(&prefill, out, threads, isa, tiles.flatten()),
        })
        .map_err(PyValueError::new_err)
    }
    let tiles = match flash_tiles {
        None => None,
        Some("portable") => Some(None),
        Some(name) => Some(Some(Tiles::parse(name).ok_or_else(|| {
            PyValueError::new_err(format!("no prefill kernel named {name:?} (avx512, avx2, portable)"))
        })?)),
    };
    match dtype {
        "float32" => call::<f32>(py, q, k, v, spans, slots, out, scale, window, sinks, threads, tiles),
        "bfloat16" => call::<Bf16>(py, q, k, v, spans, slots, out, scale, window, sinks, threads, tiles),
        other => Err(PyTypeError::new_err(format!("prefill attention takes float32 or bfloat16, not {other}"))),
    }
}

/// RMSNorm of float32 rows (crate::rms_norm): the private half of the CPU backend's RMSNorm (r3srv.ops.norm),
/// which passes contiguous float32 CPU tensors x [rows, dim], w [dim] and a fresh out like x,
/// and keeps them alive across the call; a prefill's rows split over up to `threads` threads.
/// Keeps the GIL: a call takes less than releasing it.
#[pyfunction]
#[pyo3(signature = (x, w, out, rows, dim, eps, threads=1))]
fn rms_norm_f32(x: usize, w: usize, out: usize, rows: usize, dim: usize, eps: f32, threads: usize) -> PyResult<()> {
    // SAFETY: the caller's contract above.
    unsafe { rms_norm_rows::<f32>(x, w, out, rows, dim, eps, threads) }
}

/// `rms_norm_f32` for bfloat16 tensors (the HF reference's roundings: crate::rms_norm).
#[pyfunction]
#[pyo3(signature = (x, w, out, rows, dim, eps, threads=1))]
fn rms_norm_bf16(x: usize, w: usize, out: usize, rows: usize, dim: usize, eps: f32, threads: usize) -> PyResult<()> {
    // SAFETY: the caller's contract of rms_norm_f32, with bfloat16 tensors.
    unsafe { rms_norm_rows::<crate::expert_pairs::Bf16>(x, w, out, rows, dim, eps, threads) }
}

/// # Safety
/// x [rows, dim], w [dim] and out [rows, dim] of `W` are live, contiguous and held by the caller
/// for the whole call; `out` aliases neither of the others.
unsafe fn rms_norm_rows<W: crate::expert_pairs::Element>(
    x: usize,
    w: usize,
    out: usize,
    rows: usize,
    dim: usize,
    eps: f32,
    threads: usize,
) -> PyResult<()> {
    let len = rows.checked_mul(dim).ok_or_else(|| PyValueError::new_err("rms_norm: rows x dim overflows"))?;
    // SAFETY: kernels/rms_norm_cpu.py passes live contiguous tensors of `W` of these sizes, held by the
    // caller for the whole call; `out` is a new tensor, so the one &mut aliases nothing.
    let (x, w, out) = unsafe { (slice::<W>(x, len)?, slice::<W>(w, dim)?, slice_mut::<W>(out, len)?) };
    crate::rms_norm::rms_norm(x, w, eps, out, threads).map_err(PyValueError::new_err)
}

/// Routing inputs at least this large are routed with the GIL released; below it releasing and
/// taking it back costs a noticeable part of the call (a decode step's few rows).
const ROUTE_DETACH_MIN_LOGITS: usize = 1 << 16;

/// Top-k expert selection (crate::router_cpu): the private half of
/// r3srv.kernels.router_cpu.route_cpu, which passes a contiguous float32 or bfloat16 CPU tensor
/// of logits [tokens, experts] (`shape` = (tokens, experts, top_k)), fresh contiguous float32
/// weights and int32 ids [tokens, top_k], and optionally one layer of a capture buffer as
/// (address, row stride in elements, item size in bytes: 1, 2, 4 or 8) whose integer dtype
/// holds the expert ids, and keeps them all alive across the call. Every length is checked
/// here; a capture that overlaps the logits is a ValueError. A prefill's rows split over up to
/// `threads` threads.
#[pyfunction]
#[pyo3(signature = (logits, dtype, shape, scoring, renormalize, scaling, weights, ids, capture=None, threads=1))]
#[allow(clippy::too_many_arguments)]
fn route_experts(
    py: Python<'_>,
    logits: usize,
    dtype: &str,
    shape: (usize, usize, usize),
    scoring: &str,
    renormalize: bool,
    scaling: f32,
    weights: usize,
    ids: usize,
    capture: Option<(usize, usize, usize)>,
    threads: usize,
) -> PyResult<()> {
    use crate::router_cpu::{capture_ids, capture_len, Routing, Scoring};

    let (tokens, experts, top_k) = shape;
    let scoring = Scoring::from_name(scoring).ok_or_else(|| {
        PyValueError::new_err(format!("unknown router scoring {scoring:?}; expected 'softmax' or 'sigmoid'"))
    })?;
    let routing = Routing { top_k, scoring, renormalize, scaling };
    let overflow = || PyValueError::new_err("route_experts: the shapes overflow");
    let num_logits = tokens.checked_mul(experts).ok_or_else(overflow)?;
    let num_ids = tokens.checked_mul(top_k).ok_or_else(overflow)?;
    let logit_size = match dtype {
        "float32" => 4,
        "bfloat16" => 2,
        other => {
            return Err(PyTypeError::new_err(format!("route_experts takes float32 or bfloat16 logits, not {other}")))
        }
    };
    if let Some((address, row_stride, itemsize)) = capture {
        let span = capture_len(tokens, top_k, row_stride).and_then(|n| n.checked_mul(itemsize)).ok_or_else(overflow)?;
        let logit_bytes = num_logits * logit_size; // no overflow: the logits tensor exists
        if span > 0 && num_logits > 0 && address < logits + logit_bytes && logits < address.saturating_add(span) {
            return Err(PyValueError::new_err("route_experts: the capture rows overlap the logits"));
        }
    }
    // SAFETY: router_cpu.route_cpu passes live tensors of these shapes and dtypes, held by its
    // caller for the whole call; weights and ids are fresh tensors, and the capture rows do not
    // overlap the logits (checked above), so the &mut slices alias nothing.
    let (weights, ids) = unsafe { (slice_mut::<f32>(weights, num_ids)?, slice_mut::<i32>(ids, num_ids)?) };
    // SAFETY: as above.
    unsafe {
        match logit_size {
            4 => route_rows(py, slice::<f32>(logits, num_logits)?, experts, &routing, weights, ids, threads)?,
            _ => route_rows(py, slice::<Bf16>(logits, num_logits)?, experts, &routing, weights, ids, threads)?,
        }
    }
    let Some((address, row_stride, itemsize)) = capture else { return Ok(()) };
    let len = capture_len(tokens, top_k, row_stride).ok_or_else(overflow)?;
    // SAFETY: as above: the capture rows span `len` elements of a live integer tensor of
    // `itemsize` bytes that overlaps neither the logits nor the fresh ids.
    unsafe {
        match itemsize {
            1 => capture_ids(ids, top_k, slice_mut::<u8>(address, len)?, row_stride),
            2 => capture_ids(ids, top_k, slice_mut::<u16>(address, len)?, row_stride),
            4 => capture_ids(ids, top_k, slice_mut::<u32>(address, len)?, row_stride),
            8 => capture_ids(ids, top_k, slice_mut::<u64>(address, len)?, row_stride),
            other => return Err(PyValueError::new_err(format!("capture ids of {other} bytes"))),
        }
    }
    .map_err(PyValueError::new_err)
}

/// crate::router_cpu::route, with the GIL released for large inputs.
fn route_rows<L: Element>(
    py: Python<'_>,
    logits: &[L],
    experts: usize,
    routing: &crate::router_cpu::Routing,
    weights: &mut [f32],
    ids: &mut [i32],
    threads: usize,
) -> PyResult<()> {
    let mut run = || crate::router_cpu::route(logits, experts, routing, weights, ids, threads);
    if logits.len() >= ROUTE_DETACH_MIN_LOGITS { py.detach(run) } else { run() }.map_err(PyValueError::new_err)
}

/// One attention layer's q/k norms and RoPE (crate::qk_rope): the private half of
/// r3srv.kernels.qk_rope_cpu, which passes contiguous float32 CPU tensors at `addresses` (qkv,
/// q_norm, k_norm (0: no norms), cos, sin, and fresh q, k, v) of `shape` (tokens, heads,
/// kv_heads, head_dim, rotary), and keeps them alive across the call; the tokens split over up
/// to `threads` threads. Keeps the GIL for a decode step's few tokens (a call takes less than
/// releasing it), releases it for a prefill's.
#[pyfunction]
#[pyo3(signature = (addresses, shape, eps, threads=1))]
fn qk_norm_rope_f32(
    py: Python<'_>,
    addresses: [usize; 8],
    shape: [usize; 5],
    eps: f32,
    threads: usize,
) -> PyResult<()> {
    // SAFETY: the caller's contract above.
    unsafe { qk_norm_rope_tensors::<f32>(py, addresses, shape, eps, threads) }
}

/// `qk_norm_rope_f32` for bfloat16 tensors (every op rounded to bfloat16, as torch's: crate::qk_rope).
#[pyfunction]
#[pyo3(signature = (addresses, shape, eps, threads=1))]
fn qk_norm_rope_bf16(
    py: Python<'_>,
    addresses: [usize; 8],
    shape: [usize; 5],
    eps: f32,
    threads: usize,
) -> PyResult<()> {
    // SAFETY: the caller's contract of qk_norm_rope_f32, with bfloat16 tensors.
    unsafe { qk_norm_rope_tensors::<crate::expert_pairs::Bf16>(py, addresses, shape, eps, threads) }
}

/// The fewest tokens a qk_norm_rope call releases the GIL for.
const QK_ROPE_DETACH_MIN_TOKENS: usize = 64;

/// # Safety
/// As `qk_norm_rope_f32` requires of its caller, with tensors of `W`.
unsafe fn qk_norm_rope_tensors<W: crate::expert_pairs::Element>(
    py: Python<'_>,
    addresses: [usize; 8],
    shape: [usize; 5],
    eps: f32,
    threads: usize,
) -> PyResult<()> {
    let [qkv, q_norm, k_norm, cos, sin, q, k, v] = addresses;
    let [tokens, heads, kv_heads, head_dim, rotary] = shape;
    let overflow = || PyValueError::new_err("qk_norm_rope: the shape overflows");
    let width = heads.checked_add(kv_heads.checked_mul(2).ok_or_else(overflow)?).ok_or_else(overflow)?;
    let cell = |a: usize, b: usize| a.checked_mul(b).ok_or_else(overflow);
    let (q_len, kv_len) = (cell(cell(tokens, heads)?, head_dim)?, cell(cell(tokens, kv_heads)?, head_dim)?);
    let (qkv_len, rope_len) = (cell(cell(tokens, width)?, head_dim)?, cell(tokens, rotary)?);
    // SAFETY: the caller's contract; q, k and v are new tensors, so the &muts alias nothing.
    let (qkv, cos, sin, q, k, v, norms) = unsafe {
        let norms = match (q_norm, k_norm) {
            (0, 0) => None,
            (qn, kn) => Some((slice::<W>(qn, head_dim)?, slice::<W>(kn, head_dim)?)),
        };
        (
            slice::<W>(qkv, qkv_len)?,
            slice::<W>(cos, rope_len)?,
            slice::<W>(sin, rope_len)?,
            slice_mut::<W>(q, q_len)?,
            slice_mut::<W>(k, kv_len)?,
            slice_mut::<W>(v, kv_len)?,
            norms,
        )
    };
    let norms = norms.map(|(q, k)| crate::qk_rope::HeadNorms { q, k, eps });
    let s = crate::qk_rope::Heads { tokens, heads, kv_heads, head_dim, rotary };
    let mut run = move || crate::qk_rope::qk_norm_rope(qkv, s, norms.as_ref(), cos, sin, q, k, v, threads);
    if tokens >= QK_ROPE_DETACH_MIN_TOKENS { py.detach(run) } else { run() }.map_err(PyValueError::new_err)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_routed_experts, m)?)?;
    m.add_function(wrap_pyfunction!(decode_routed_experts, m)?)?;
    m.add_function(wrap_pyfunction!(configure_encoder, m)?)?;
    m.add_function(wrap_pyfunction!(encoder_isa, m)?)?;
    m.add_function(wrap_pyfunction!(crate::huge_pages::python::advise_huge_pages, m)?)?;
    m.add_function(wrap_pyfunction!(crate::workers::python::use_openmp_threads, m)?)?;
    m.add_function(wrap_pyfunction!(crate::workers::python::kernel_threads, m)?)?;
    crate::formats::python::register(m)?;
    crate::lists::python::register(m)?;
    m.add_function(wrap_pyfunction!(crate::expert_pairs::python::expert_pairs_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(crate::expert_pairs::python::expert_pairs_isa, m)?)?;
    m.add_function(wrap_pyfunction!(crate::expert_pairs::python::expert_pairs_wide_min_pairs, m)?)?;
    m.add_function(wrap_pyfunction!(crate::expert_pairs::python::expert_pairs_bf16_products, m)?)?;
    m.add_function(wrap_pyfunction!(crate::expert_pairs::python::expert_pairs_allow_amx, m)?)?;
    m.add_function(wrap_pyfunction!(crate::expert_pairs::python::expert_pairs_packed_runs, m)?)?;
    m.add_function(wrap_pyfunction!(crate::expert_pairs::python::expert_pairs_packed_len, m)?)?;
    m.add_function(wrap_pyfunction!(crate::expert_pairs::python::expert_pairs_pack, m)?)?;
    m.add_function(wrap_pyfunction!(crate::pair_projection::python::project_pairs_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(crate::pair_projection::python::add_low_rank_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(paged_decode_isa, m)?)?;
    m.add_function(wrap_pyfunction!(write_kv_cache, m)?)?;
    m.add_function(wrap_pyfunction!(paged_prefill_attention, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm_f32, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(paged_prefill_flash, m)?)?;
    m.add_function(wrap_pyfunction!(paged_prefill_flash_tiles, m)?)?;
    m.add_function(wrap_pyfunction!(route_experts, m)?)?;
    m.add_function(wrap_pyfunction!(crate::linear::python::linear_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(crate::linear::python::matrix_isas, m)?)?;
    m.add_function(wrap_pyfunction!(crate::linear::python::linear_row_tiles, m)?)?;
    m.add_function(wrap_pyfunction!(qk_norm_rope_f32, m)?)?;
    m.add_function(wrap_pyfunction!(qk_norm_rope_bf16, m)?)?;
    Ok(())
}
