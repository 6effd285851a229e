//! Array geometry without Python: the `array[start:]` view, numpy's contiguity flags for it,
//! and reading its bytes in the order `np.save` writes them.

use crate::b64::Base64Stream;

/// Where `gather_c_order` sends the bytes it reads: the base64 stream itself (npy, and raw rows
/// of the array's own type), or a converter in front of it (`formats`).
pub trait ByteSink {
    /// `data` always holds whole elements of the array being read.
    fn put(&mut self, data: &[u8]);
}

impl ByteSink for Base64Stream<'_> {
    fn put(&mut self, data: &[u8]) {
        self.write(data);
    }
}

/// Byte view of an n-d array: `ptr` points at element `[0, 0, ...]`.
#[derive(Clone, Copy)]
pub struct ArrayView<'a> {
    pub ptr: *const u8,
    pub shape: &'a [usize],
    pub strides: &'a [isize],
    pub itemsize: usize,
}

// SAFETY: a view only reads; whoever builds one promises (as for `Plan::write`) that the memory
// stays valid and unchanged while any thread uses it, so sharing it across the encoder's threads
// adds no data race.
unsafe impl Send for ArrayView<'_> {}
// SAFETY: as for Send: no interior mutability, only reads of memory that does not change.
unsafe impl Sync for ArrayView<'_> {}

impl ArrayView<'_> {
    pub fn size(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn nbytes(&self) -> usize {
        self.size() * self.itemsize
    }
}

/// numpy's contiguity flags (`_UpdateContiguousFlags`, numpy >= 1.23 relaxed strides): size-1
/// axes never matter, and any zero-length axis makes the array both C- and F-contiguous.
pub fn contiguity(shape: &[usize], strides: &[isize], itemsize: usize) -> (bool, bool) {
    if shape.contains(&0) {
        return (true, true);
    }
    let mut c = true;
    let mut sd = itemsize as isize;
    for i in (0..shape.len()).rev() {
        if shape[i] != 1 {
            if strides[i] != sd {
                c = false;
                break;
            }
            sd *= shape[i] as isize;
        }
    }
    let mut f = true;
    let mut sd = itemsize as isize;
    for i in 0..shape.len() {
        if shape[i] != 1 {
            if strides[i] != sd {
                f = false;
                break;
            }
            sd *= shape[i] as isize;
        }
    }
    (c, f)
}

/// How np.save lays out the bytes of an array.
pub enum SaveOrder {
    /// One run of memory (C- or F-contiguous); `fortran` is the header's fortran_order.
    Contiguous { fortran: bool },
    /// Neither: np.save writes the elements in C order.
    Gather,
}

pub fn save_order(view: &ArrayView) -> SaveOrder {
    match contiguity(view.shape, view.strides, view.itemsize) {
        (true, _) => SaveOrder::Contiguous { fortran: false },
        (false, true) => SaveOrder::Contiguous { fortran: true },
        (false, false) => SaveOrder::Gather,
    }
}

/// Scratch size for gathering strided rows: a multiple of 3 so flushes need no carry.
const GATHER_CHUNK: usize = 3 * 16 * 1024;
/// Runs at least this long go to the encoder straight from the array's memory.
const DIRECT_RUN: usize = 4096;

/// Streams the elements of a non-contiguous `view` in C order into `stream`, in pieces of
/// whole elements.
///
/// # Safety
/// `view` must describe readable memory for every index within its shape.
pub unsafe fn gather_c_order<S: ByteSink + ?Sized>(view: &ArrayView, stream: &mut S) {
    if view.size() == 0 {
        return;
    }
    let nd = view.shape.len();
    // Fold trailing axes that are laid out back to back into one run.
    let mut run = view.itemsize;
    let mut k = nd;
    while k > 0 && (view.shape[k - 1] == 1 || view.strides[k - 1] == run as isize) {
        run *= view.shape[k - 1];
        k -= 1;
    }
    // Outer axes [0, k) are walked with an odometer; if k == nd the last axis is walked
    // element by element (run == itemsize).
    let (outer, inner_n, inner_stride) =
        if k == nd { (nd - 1, view.shape[nd - 1], view.strides[nd - 1]) } else { (k, 1, 0) };
    let mut scratch: Vec<u8> = Vec::with_capacity(GATHER_CHUNK);
    let mut idx = [0usize; crate::npy_header::MAX_NDIM];
    let mut base = view.ptr;
    loop {
        let mut p = base;
        for _ in 0..inner_n {
            let bytes = std::slice::from_raw_parts(p, run);
            if run >= DIRECT_RUN {
                stream.put(&scratch);
                scratch.clear();
                stream.put(bytes);
            } else {
                if scratch.len() + run > GATHER_CHUNK {
                    stream.put(&scratch);
                    scratch.clear();
                }
                scratch.extend_from_slice(bytes);
            }
            p = p.offset(inner_stride);
        }
        // Advance the odometer over axes [0, outer).
        let mut ax = outer;
        loop {
            if ax == 0 {
                stream.put(&scratch);
                return;
            }
            ax -= 1;
            idx[ax] += 1;
            base = base.offset(view.strides[ax]);
            if idx[ax] < view.shape[ax] {
                break;
            }
            base = base.offset(-(view.strides[ax] * view.shape[ax] as isize));
            idx[ax] = 0;
        }
    }
}

/// Streams every element of `view` in C order into `sink`: a C-contiguous array in one piece
/// straight from its memory, any other layout through `gather_c_order`.
///
/// # Safety
/// As for `gather_c_order`.
pub unsafe fn read_c_order<S: ByteSink + ?Sized>(view: &ArrayView, sink: &mut S) {
    let n = view.nbytes();
    if n == 0 {
        return;
    }
    if contiguity(view.shape, view.strides, view.itemsize).0 {
        sink.put(std::slice::from_raw_parts(view.ptr, n));
    } else {
        gather_c_order(view, sink);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::b64::{encoded_len, Base64Stream};

    #[test]
    fn contiguity_matches_numpy_rules() {
        assert_eq!(contiguity(&[3, 4], &[4, 1], 1), (true, false));
        assert_eq!(contiguity(&[3, 4], &[1, 3], 1), (false, true));
        assert_eq!(contiguity(&[3, 1], &[1, 99], 1), (true, true)); // size-1 axes ignored
        assert_eq!(contiguity(&[0, 4], &[7, 7], 1), (true, true)); // empty: both
        assert_eq!(contiguity(&[3, 4], &[8, 1], 1), (false, false));
        assert_eq!(contiguity(&[3], &[-1], 1), (false, false));
        assert_eq!(contiguity(&[], &[], 8), (true, true));
    }

    fn gather(view: &ArrayView) -> Vec<u8> {
        let n = view.nbytes();
        let mut out = vec![0u8; encoded_len(n)];
        let mut s = Base64Stream::new(&mut out);
        // SAFETY: every view in these tests lies inside its `data` vector.
        unsafe { gather_c_order(view, &mut s) };
        s.finish();
        out
    }

    fn encode(bytes: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; encoded_len(bytes.len())];
        crate::b64::encode_into(bytes, &mut out);
        out
    }

    #[test]
    fn gather_transposed_reversed_and_broadcast() {
        let data: Vec<u8> = (0..24u8).collect();
        // (4, 6) C array transposed to (6, 4): element [i, j] = data[j * 6 + i].
        let v = ArrayView { ptr: data.as_ptr(), shape: &[6, 4], strides: &[1, 6], itemsize: 1 };
        let want: Vec<u8> = (0..6).flat_map(|i| (0..4).map(move |j| (j * 6 + i) as u8)).collect();
        assert_eq!(gather(&v), encode(&want));
        // Reversed rows of a (4, 3) u16 array (itemsize 2): rows 3, 2, 1, 0.
        // SAFETY: offset 18 is inside the 24-byte `data`.
        let v = ArrayView { ptr: unsafe { data.as_ptr().add(18) }, shape: &[4, 3], strides: &[-6, 2], itemsize: 2 };
        let want: Vec<u8> = (0..4).rev().flat_map(|r| data[r * 6..r * 6 + 6].to_vec()).collect();
        assert_eq!(gather(&v), encode(&want));
        // Broadcast (zero stride) of one 5-byte row three times.
        let v = ArrayView { ptr: data.as_ptr(), shape: &[3, 5], strides: &[0, 1], itemsize: 1 };
        let want: Vec<u8> = (0..3).flat_map(|_| data[..5].to_vec()).collect();
        assert_eq!(gather(&v), encode(&want));
    }

    #[test]
    fn gather_large_runs_go_direct() {
        // Every other row of a (6, 5000) array: 5000-byte runs, above DIRECT_RUN.
        let data: Vec<u8> = (0..30000u32).map(|x| (x * 7 % 251) as u8).collect();
        let v = ArrayView { ptr: data.as_ptr(), shape: &[3, 5000], strides: &[10000, 1], itemsize: 1 };
        let want: Vec<u8> = (0..3).flat_map(|r| data[r * 10000..r * 10000 + 5000].to_vec()).collect();
        assert_eq!(gather(&v), encode(&want));
    }
}
