//! Arrays as raw little-endian numbers of a chosen type, base64-encoded in one pass, and the
//! dict form `{"data":"<that base64>","shape":[...],"start":N,"dtype":"<name>"}` as ready JSON
//! text. SGLang sends routed experts as raw int32; prime-rl and SkyRL send the dict form, each
//! with its own rule for the dtype, which a ladder states: the first type that holds every value.
//!
//! Elements are read in C order from the array's own memory (any layout, either byte order),
//! converted into a small buffer and streamed to the base64 encoder; an array already of the
//! target type, little-endian, goes to the encoder untouched.

use crate::b64::{encoded_len, Base64Stream};
use crate::layout::{read_c_order, ArrayView, ByteSink};

#[cfg(feature = "python")]
pub mod python;

/// The number types the formats read and write, named as numpy names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Num {
    Bool,
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F32,
    F64,
}

impl Num {
    pub const ALL: [Num; 11] =
        [Num::Bool, Num::U8, Num::I8, Num::U16, Num::I16, Num::U32, Num::I32, Num::U64, Num::I64, Num::F32, Num::F64];

    pub fn size(self) -> usize {
        match self {
            Num::Bool | Num::U8 | Num::I8 => 1,
            Num::U16 | Num::I16 => 2,
            Num::U32 | Num::I32 | Num::F32 => 4,
            Num::U64 | Num::I64 | Num::F64 => 8,
        }
    }

    /// numpy's name (`np.dtype(x).name`), which the dict form's `dtype` carries.
    pub fn name(self) -> &'static str {
        match self {
            Num::Bool => "bool",
            Num::U8 => "uint8",
            Num::I8 => "int8",
            Num::U16 => "uint16",
            Num::I16 => "int16",
            Num::U32 => "uint32",
            Num::I32 => "int32",
            Num::U64 => "uint64",
            Num::I64 => "int64",
            Num::F32 => "float32",
            Num::F64 => "float64",
        }
    }

    pub fn from_name(name: &str) -> Option<Num> {
        Num::ALL.into_iter().find(|n| n.name() == name)
    }

    /// From numpy's `dtype.kind` and `dtype.itemsize`; None for every other dtype.
    pub fn from_kind(kind: u8, size: usize) -> Option<Num> {
        Num::ALL.into_iter().find(|n| n.size() == size && n.kind() == kind)
    }

    fn kind(self) -> u8 {
        match self {
            Num::Bool => b'b',
            Num::U8 | Num::U16 | Num::U32 | Num::U64 => b'u',
            Num::I8 | Num::I16 | Num::I32 | Num::I64 => b'i',
            Num::F32 | Num::F64 => b'f',
        }
    }

    pub fn is_float(self) -> bool {
        self.kind() == b'f'
    }

    /// The smallest and largest value of an integer type (bool: 0 and 1).
    pub fn int_bounds(self) -> Option<(i128, i128)> {
        Some(match self {
            Num::Bool => (0, 1),
            Num::U8 => (0, u8::MAX as i128),
            Num::I8 => (i8::MIN as i128, i8::MAX as i128),
            Num::U16 => (0, u16::MAX as i128),
            Num::I16 => (i16::MIN as i128, i16::MAX as i128),
            Num::U32 => (0, u32::MAX as i128),
            Num::I32 => (i32::MIN as i128, i32::MAX as i128),
            Num::U64 => (0, u64::MAX as i128),
            Num::I64 => (i64::MIN as i128, i64::MAX as i128),
            Num::F32 | Num::F64 => return None,
        })
    }
}

/// How the array's elements are stored: their type, and whether in the other byte order than
/// this CPU's (numpy's `dtype.isnative` false).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Source {
    pub num: Num,
    pub swapped: bool,
}

/// numpy's bool: one byte, any non-zero byte is true.
#[derive(Clone, Copy)]
struct B8(u8);

/// A number as stored: read from any (unaligned) address in either byte order, and put into
/// little-endian order for the output. Plain loops over these vectorize.
trait Prim: Copy {
    const SIZE: usize;
    /// # Safety
    /// `p` must point at `SIZE` readable bytes.
    unsafe fn load<const SWAP: bool>(p: *const u8) -> Self;
    /// The value whose in-memory bytes are this one's little-endian bytes.
    fn le(self) -> Self;
}

macro_rules! int_prims {
    ($($t:ty),*) => {$(
        impl Prim for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            #[inline(always)]
            unsafe fn load<const SWAP: bool>(p: *const u8) -> Self {
                // SAFETY: the caller's contract; read_unaligned takes any address.
                let v = unsafe { p.cast::<$t>().read_unaligned() };
                if SWAP { v.swap_bytes() } else { v }
            }
            #[inline(always)]
            fn le(self) -> Self {
                self.to_le()
            }
        }
    )*};
}
int_prims!(u8, i8, u16, i16, u32, i32, u64, i64);

macro_rules! float_prims {
    ($($t:ty => $bits:ty),*) => {$(
        impl Prim for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            #[inline(always)]
            unsafe fn load<const SWAP: bool>(p: *const u8) -> Self {
                // SAFETY: the caller's contract.
                <$t>::from_bits(unsafe { <$bits as Prim>::load::<SWAP>(p) })
            }
            #[inline(always)]
            fn le(self) -> Self {
                <$t>::from_bits(self.to_bits().to_le())
            }
        }
    )*};
}
float_prims!(f32 => u32, f64 => u64);

impl Prim for B8 {
    const SIZE: usize = 1;
    #[inline(always)]
    unsafe fn load<const SWAP: bool>(p: *const u8) -> Self {
        // SAFETY: the caller's contract.
        B8(unsafe { p.read() })
    }
    #[inline(always)]
    fn le(self) -> Self {
        self
    }
}

/// `as`, numpy's `astype` for the conversions the formats allow: integers into integers that
/// hold them (checked before), integers and floats into floats (IEEE round to nearest even).
trait Cast<T> {
    fn cast(self) -> T;
}

macro_rules! casts {
    ($($s:ty),*) => {$( casts!(@from $s; u8, i8, u16, i16, u32, i32, u64, i64, f32, f64); )*};
    (@from $s:ty; $($t:ty),*) => {$(
        impl Cast<$t> for $s {
            #[inline(always)]
            fn cast(self) -> $t { self as $t }
        }
    )*};
}
casts!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64);

macro_rules! bool_casts {
    ($($t:ty),*) => {$(
        impl Cast<$t> for B8 {
            #[inline(always)]
            fn cast(self) -> $t { (self.0 != 0) as u8 as $t }
        }
    )*};
}
bool_casts!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64);

/// Converts whole source elements into target elements, little-endian. `dst` must be aligned
/// for the target type (ConvertSink's buffer is u64-aligned) and hold as many of them as `src`
/// holds source elements.
type ConvertFn = fn(&[u8], &mut [u8]);

fn convert<S: Prim + Cast<T>, T: Prim, const SWAP: bool>(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / S::SIZE;
    assert!(dst.len() == n * T::SIZE && dst.as_ptr().align_offset(std::mem::align_of::<T>()) == 0);
    // SAFETY: checked just above: `dst` is aligned for T and holds exactly n of them, and every
    // bit pattern is a valid T (integers and floats).
    let out = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<T>(), n) };
    let p = src.as_ptr();
    for (i, d) in out.iter_mut().enumerate() {
        // SAFETY: element i lies within `src`, which holds n whole elements.
        *d = unsafe { S::load::<SWAP>(p.add(i * S::SIZE)) }.cast().le();
    }
}

fn pick_swap<S: Prim + Cast<T>, T: Prim>(swapped: bool) -> ConvertFn {
    if swapped {
        convert::<S, T, true>
    } else {
        convert::<S, T, false>
    }
}

fn converter(src: Source, dst: Num) -> ConvertFn {
    macro_rules! into {
        ($s:ty) => {
            match dst {
                Num::U8 => pick_swap::<$s, u8>(src.swapped),
                Num::I8 => pick_swap::<$s, i8>(src.swapped),
                Num::U16 => pick_swap::<$s, u16>(src.swapped),
                Num::I16 => pick_swap::<$s, i16>(src.swapped),
                Num::U32 => pick_swap::<$s, u32>(src.swapped),
                Num::I32 => pick_swap::<$s, i32>(src.swapped),
                Num::U64 => pick_swap::<$s, u64>(src.swapped),
                Num::I64 => pick_swap::<$s, i64>(src.swapped),
                Num::F32 => pick_swap::<$s, f32>(src.swapped),
                Num::F64 => pick_swap::<$s, f64>(src.swapped),
                Num::Bool => unreachable!("bool is not a target type"),
            }
        };
    }
    match src.num {
        Num::Bool => into!(B8),
        Num::U8 => into!(u8),
        Num::I8 => into!(i8),
        Num::U16 => into!(u16),
        Num::I16 => into!(i16),
        Num::U32 => into!(u32),
        Num::I32 => into!(i32),
        Num::U64 => into!(u64),
        Num::I64 => into!(i64),
        Num::F32 => into!(f32),
        Num::F64 => into!(f64),
    }
}

/// Smallest and largest value of whole integer elements, folded into `acc`.
type RangeFn = fn(&[u8], &mut Option<(i128, i128)>);

fn range_of<S: Prim + Ord + Into<i128>, const SWAP: bool>(src: &[u8], acc: &mut Option<(i128, i128)>) {
    let n = src.len() / S::SIZE;
    if n == 0 {
        return;
    }
    let p = src.as_ptr();
    // SAFETY (both loads): element i < n lies within `src`, which holds n whole elements.
    let first = unsafe { S::load::<SWAP>(p) };
    let (mut lo, mut hi) = (first, first);
    for i in 1..n {
        let v = unsafe { S::load::<SWAP>(p.add(i * S::SIZE)) };
        lo = lo.min(v);
        hi = hi.max(v);
    }
    let (lo, hi) = (lo.into(), hi.into());
    *acc = Some(acc.map_or((lo, hi), |(a, b)| (a.min(lo), b.max(hi))));
}

fn bool_range(src: &[u8], acc: &mut Option<(i128, i128)>) {
    // As u8, then any non-zero byte counts as 1.
    let mut bytes = None;
    range_of::<u8, false>(src, &mut bytes);
    if let Some((lo, hi)) = bytes {
        let (lo, hi) = ((lo != 0) as i128, (hi != 0) as i128);
        *acc = Some(acc.map_or((lo, hi), |(a, b)| (a.min(lo), b.max(hi))));
    }
}

fn ranger(src: Source) -> Option<RangeFn> {
    macro_rules! of {
        ($s:ty) => {
            if src.swapped {
                range_of::<$s, true>
            } else {
                range_of::<$s, false>
            }
        };
    }
    Some(match src.num {
        Num::Bool => bool_range,
        Num::U8 => of!(u8),
        Num::I8 => of!(i8),
        Num::U16 => of!(u16),
        Num::I16 => of!(i16),
        Num::U32 => of!(u32),
        Num::I32 => of!(i32),
        Num::U64 => of!(u64),
        Num::I64 => of!(i64),
        Num::F32 | Num::F64 => return None,
    })
}

struct RangeSink {
    f: RangeFn,
    acc: Option<(i128, i128)>,
}

impl ByteSink for RangeSink {
    fn put(&mut self, data: &[u8]) {
        (self.f)(data, &mut self.acc);
    }
}

/// Source elements converted per piece of this many bytes of output (a multiple of 3 and of 8,
/// so each piece is whole groups for base64 and whole elements of every type).
const CONVERT_CHUNK: usize = 3 * 8 * 2048;

struct ConvertSink<'s, 'o> {
    f: ConvertFn,
    src_size: usize,
    dst_size: usize,
    /// u64s, so that its bytes are aligned for every target type.
    buf: Vec<u64>,
    out: &'s mut Base64Stream<'o>,
}

impl ByteSink for ConvertSink<'_, '_> {
    fn put(&mut self, data: &[u8]) {
        let per = CONVERT_CHUNK / self.dst_size;
        // SAFETY: a u64 buffer seen as its bytes (any bit pattern is a valid u8).
        let buf = unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr().cast::<u8>(), self.buf.len() * 8) };
        for piece in data.chunks(per * self.src_size) {
            let n = piece.len() / self.src_size * self.dst_size;
            (self.f)(piece, &mut buf[..n]);
            self.out.write(&buf[..n]);
        }
    }
}

/// The rows of a view as raw little-endian numbers of one type.
pub struct RawPlan<'a> {
    view: ArrayView<'a>,
    src: Source,
    dst: Num,
}

impl<'a> RawPlan<'a> {
    /// The rows as `dst`, if every value converts (see `pick`).
    ///
    /// # Safety
    /// The view must describe readable memory that stays valid and unchanged meanwhile.
    pub unsafe fn new(view: ArrayView<'a>, src: Source, dst: Num) -> Result<Self, String> {
        Self::pick(view, src, &[dst])
    }

    /// The rows as the first type of `ladder` that holds them: an integer type holding every
    /// value (read only when the source type's own range does not settle it), or a float type.
    /// Float rows only go into float types.
    ///
    /// # Safety
    /// As for `new`.
    pub unsafe fn pick(view: ArrayView<'a>, src: Source, ladder: &[Num]) -> Result<Self, String> {
        debug_assert_eq!(view.itemsize, src.num.size());
        let mut range: Option<Option<(i128, i128)>> = None;
        for &dst in ladder {
            if dst == Num::Bool {
                return Err("bool is not a type the rows can be written as".into());
            }
            let fits = match (src.num.int_bounds(), dst.int_bounds()) {
                (_, None) => true,        // into a float: astype's rounding
                (None, Some(_)) => false, // floats never into integers
                (Some((slo, shi)), Some((lo, hi))) => {
                    (lo <= slo && shi <= hi) || {
                        let r = *range.get_or_insert_with(|| value_range(&view, src));
                        r.is_none_or(|(vlo, vhi)| lo <= vlo && vhi <= hi)
                    }
                }
            };
            if fits {
                return Ok(RawPlan { view, src, dst });
            }
        }
        let names: Vec<&str> = ladder.iter().map(|n| n.name()).collect();
        Err(match range.flatten() {
            Some((lo, hi)) => format!("{} values in [{lo}, {hi}] fit none of {}", src.num.name(), names.join(", ")),
            None => format!("{} values cannot be written as {} exactly", src.num.name(), names.join(", ")),
        })
    }

    pub fn dtype(&self) -> Num {
        self.dst
    }

    pub fn payload_len(&self) -> usize {
        self.view.size() * self.dst.size()
    }

    pub fn encoded_len(&self) -> usize {
        encoded_len(self.payload_len())
    }

    /// Streams the converted rows into `stream`.
    ///
    /// # Safety
    /// As for `new`.
    pub unsafe fn stream_into(&self, stream: &mut Base64Stream) {
        let as_is = self.src.num == self.dst && !self.src.swapped && cfg!(target_endian = "little");
        if as_is {
            read_c_order(&self.view, stream);
        } else {
            let mut sink = ConvertSink {
                f: converter(self.src, self.dst),
                src_size: self.src.num.size(),
                dst_size: self.dst.size(),
                buf: vec![0; CONVERT_CHUNK.min(self.payload_len()).div_ceil(8)],
                out: stream,
            };
            read_c_order(&self.view, &mut sink);
        }
    }

    /// Fills `out` (exactly `encoded_len()` bytes) with the base64 text.
    ///
    /// # Safety
    /// As for `new`.
    pub unsafe fn write(&self, out: &mut [u8]) {
        debug_assert_eq!(out.len(), self.encoded_len());
        let mut stream = Base64Stream::new(out);
        self.stream_into(&mut stream);
        stream.finish();
    }
}

/// Smallest and largest value of an integer view; None when it is empty.
///
/// # Safety
/// As for `RawPlan::new`.
unsafe fn value_range(view: &ArrayView, src: Source) -> Option<(i128, i128)> {
    let mut sink = RangeSink { f: ranger(src)?, acc: None };
    read_c_order(view, &mut sink);
    sink.acc
}

/// What opens the dict form, up to its base64 data.
pub const DICT_HEAD: &[u8] = br#"{"data":""#;

/// The rest of the dict form after the data: `","shape":[..],"start":N,"dtype":".."}`, compact
/// JSON in that key order (clients find the data by the exact bytes `"routed_experts":{"data":"`).
pub fn dict_tail(shape: &[usize], start: Option<u64>, dtype: Num) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let start = start.map(|s| format!(",\"start\":{s}")).unwrap_or_default();
    format!("\",\"shape\":[{}]{start},\"dtype\":\"{}\"}}", dims.join(","), dtype.name()).into_bytes()
}

/// The rows in the dict form.
pub struct DictPlan<'a> {
    raw: RawPlan<'a>,
    tail: Vec<u8>,
}

impl<'a> DictPlan<'a> {
    pub fn new(raw: RawPlan<'a>, start: Option<u64>) -> Self {
        let tail = dict_tail(raw.view.shape, start, raw.dst);
        DictPlan { raw, tail }
    }

    pub fn raw(&self) -> &RawPlan<'a> {
        &self.raw
    }

    pub fn len(&self) -> usize {
        DICT_HEAD.len() + self.raw.encoded_len() + self.tail.len()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// Fills `out` (exactly `len()` bytes) with the JSON text.
    ///
    /// # Safety
    /// As for `RawPlan::new`.
    pub unsafe fn write(&self, out: &mut [u8]) {
        debug_assert_eq!(out.len(), self.len());
        let (head, rest) = out.split_at_mut(DICT_HEAD.len());
        head.copy_from_slice(DICT_HEAD);
        let (data, tail) = rest.split_at_mut(self.raw.encoded_len());
        self.raw.write(data);
        tail.copy_from_slice(&self.tail);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::b64::encode_into;

    fn c_strides(shape: &[usize], itemsize: usize) -> Vec<isize> {
        let mut s = vec![0isize; shape.len()];
        let mut acc = itemsize as isize;
        for i in (0..shape.len()).rev() {
            s[i] = acc;
            acc *= shape[i] as isize;
        }
        s
    }

    fn b64(bytes: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; encoded_len(bytes.len())];
        encode_into(bytes, &mut out);
        out
    }

    fn raw(view: ArrayView, src: Source, ladder: &[Num]) -> Result<(Num, Vec<u8>), String> {
        // SAFETY: every view in these tests lies inside its live data vector.
        unsafe {
            let plan = RawPlan::pick(view, src, ladder)?;
            let mut out = vec![0u8; plan.encoded_len()];
            plan.write(&mut out);
            Ok((plan.dtype(), out))
        }
    }

    const NATIVE: bool = false;

    #[test]
    fn u8_rows_widen_to_int32_little_endian() {
        let data: Vec<u8> = (0..2 * 3 * 4).map(|i| (i * 37 % 251) as u8).collect();
        let shape = [2, 3, 4];
        let strides = c_strides(&shape, 1);
        let view = ArrayView { ptr: data.as_ptr(), shape: &shape, strides: &strides, itemsize: 1 };
        let (dtype, text) = raw(view, Source { num: Num::U8, swapped: NATIVE }, &[Num::I32]).unwrap();
        assert_eq!(dtype, Num::I32);
        let want: Vec<u8> = data.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect();
        assert_eq!(text, b64(&want));
    }

    #[test]
    fn same_type_goes_through_untouched_and_swapped_is_swapped_back() {
        let values: Vec<u16> = (0..50).map(|i| i * 1000 + 7).collect();
        let le: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let be: Vec<u8> = values.iter().flat_map(|v| v.to_be_bytes()).collect();
        let shape = [50];
        let strides = [2isize];
        let native_le = cfg!(target_endian = "little");
        let (native, foreign) = if native_le { (&le, &be) } else { (&be, &le) };
        for (bytes, swapped) in [(native, false), (foreign, true)] {
            let view = ArrayView { ptr: bytes.as_ptr(), shape: &shape, strides: &strides, itemsize: 2 };
            let (_, text) = raw(view, Source { num: Num::U16, swapped }, &[Num::U16]).unwrap();
            assert_eq!(text, b64(&le), "swapped={swapped}");
        }
    }

    #[test]
    fn ladder_takes_the_first_type_holding_every_value() {
        let prime = [Num::U8, Num::U16, Num::I32];
        let skyrl = [Num::U8, Num::I16, Num::I32];
        for (max, want_prime, want_skyrl) in [
            (255u32, Num::U8, Num::U8),
            (256, Num::U16, Num::I16),
            (32767, Num::U16, Num::I16),
            (32768, Num::U16, Num::I32),
            (65535, Num::U16, Num::I32),
            (65536, Num::I32, Num::I32),
        ] {
            let values = [0u32, 3, max, 1];
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
            let view = ArrayView { ptr: bytes.as_ptr(), shape: &[4], strides: &[4], itemsize: 4 };
            let src = Source { num: Num::U32, swapped: NATIVE };
            assert_eq!(raw(view, src, &prime).unwrap().0, want_prime, "max={max}");
            let (dtype, text) = raw(view, src, &skyrl).unwrap();
            assert_eq!(dtype, want_skyrl, "max={max}");
            let mut want = Vec::new();
            for &v in &values {
                match dtype {
                    Num::U8 => want.push(v as u8),
                    Num::I16 => want.extend((v as i16).to_le_bytes()),
                    _ => want.extend((v as i32).to_le_bytes()),
                }
            }
            assert_eq!(text, b64(&want), "max={max}");
        }
    }

    #[test]
    fn values_that_fit_nowhere_and_floats_into_integers_are_errors() {
        let values = [-1i32, 5];
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let view = ArrayView { ptr: bytes.as_ptr(), shape: &[2], strides: &[4], itemsize: 4 };
        let err = raw(view, Source { num: Num::I32, swapped: NATIVE }, &[Num::U8, Num::U16]).unwrap_err();
        assert!(err.contains("[-1, 5]") && err.contains("uint8, uint16"), "{err}");
        let floats = [1.0f32, 2.0];
        let fb: Vec<u8> = floats.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let view = ArrayView { ptr: fb.as_ptr(), shape: &[2], strides: &[4], itemsize: 4 };
        assert!(raw(view, Source { num: Num::F32, swapped: NATIVE }, &[Num::I32]).is_err());
        let (dtype, text) = raw(view, Source { num: Num::F32, swapped: NATIVE }, &[Num::I32, Num::F64]).unwrap();
        assert_eq!(dtype, Num::F64);
        let want: Vec<u8> = floats.iter().flat_map(|&v| (v as f64).to_le_bytes()).collect();
        assert_eq!(text, b64(&want));
        assert!(raw(view, Source { num: Num::F32, swapped: NATIVE }, &[Num::Bool]).is_err());
    }

    #[test]
    fn strided_rows_are_read_in_c_order() {
        // (4, 6) u8 transposed to (6, 4), then converted to int16.
        let data: Vec<u8> = (0..24u8).collect();
        let view = ArrayView { ptr: data.as_ptr(), shape: &[6, 4], strides: &[1, 6], itemsize: 1 };
        let (_, text) = raw(view, Source { num: Num::U8, swapped: NATIVE }, &[Num::I16]).unwrap();
        let want: Vec<u8> = (0..6).flat_map(|i| (0..4).flat_map(move |j| ((j * 6 + i) as i16).to_le_bytes())).collect();
        assert_eq!(text, b64(&want));
    }

    #[test]
    fn large_inputs_cross_chunk_edges() {
        let n = CONVERT_CHUNK + 12345;
        let data: Vec<u8> = (0..n).map(|i| (i * 31 % 253) as u8).collect();
        let view = ArrayView { ptr: data.as_ptr(), shape: &[n], strides: &[1], itemsize: 1 };
        let (_, text) = raw(view, Source { num: Num::U8, swapped: NATIVE }, &[Num::I32]).unwrap();
        let want: Vec<u8> = data.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect();
        assert!(text == b64(&want));
    }

    #[test]
    fn bool_is_zero_or_one() {
        let data = [0u8, 1, 2, 255];
        let view = ArrayView { ptr: data.as_ptr(), shape: &[4], strides: &[1], itemsize: 1 };
        let (dtype, text) = raw(view, Source { num: Num::Bool, swapped: NATIVE }, &[Num::U8]).unwrap();
        assert_eq!(dtype, Num::U8);
        assert_eq!(text, b64(&[0, 1, 1, 1]));
    }

    #[test]
    fn dict_form_is_compact_json_in_key_order() {
        let data = [1u8, 2, 3, 4, 5, 6];
        let shape = [1, 2, 3];
        let strides = c_strides(&shape, 1);
        let view = ArrayView { ptr: data.as_ptr(), shape: &shape, strides: &strides, itemsize: 1 };
        for (start, want_start) in [(Some(7u64), ",\"start\":7"), (None, "")] {
            // SAFETY: the view lies inside `data`.
            let plan = unsafe { RawPlan::new(view, Source { num: Num::U8, swapped: NATIVE }, Num::U8) }.unwrap();
            let dict = DictPlan::new(plan, start);
            let mut out = vec![0u8; dict.len()];
            // SAFETY: as above.
            unsafe { dict.write(&mut out) };
            let want = format!(
                "{{\"data\":\"{}\",\"shape\":[1,2,3]{want_start},\"dtype\":\"uint8\"}}",
                String::from_utf8(b64(&data)).unwrap()
            );
            assert_eq!(String::from_utf8(out).unwrap(), want);
        }
    }

    #[test]
    fn names_and_kinds_round_trip() {
        for n in Num::ALL {
            assert_eq!(Num::from_name(n.name()), Some(n));
            assert_eq!(Num::from_kind(n.kind(), n.size()), Some(n));
        }
        assert_eq!(Num::from_kind(b'f', 2), None);
        assert_eq!(Num::from_kind(b'c', 8), None);
        assert_eq!(Num::from_name("float16"), None);
    }
}
