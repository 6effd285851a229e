//! base64(np.save(array)) in one pass: header and rows are encoded straight into the
//! caller's output buffer (the new Python str), reading rows from the array's own memory.

use crate::b64::{encode_into, encoded_len, Base64Stream};
use crate::layout::{gather_c_order, save_order, ArrayView, SaveOrder};
use crate::npy_header::write_header;

/// Contiguous payloads at least this large may be split across threads (when the caller
/// asks for more than one): each thread also takes its share of the page faults of the
/// fresh output buffer.
pub const PARALLEL_MIN_BYTES: usize = 4 << 20;

/// A prepared encoding: the header bytes and how to read the rows.
pub struct Plan<'a> {
    header: Vec<u8>,
    view: ArrayView<'a>,
    order: SaveOrder,
}

impl<'a> Plan<'a> {
    pub fn new(descr: &str, view: ArrayView<'a>) -> Self {
        let order = save_order(&view);
        let fortran = matches!(order, SaveOrder::Contiguous { fortran: true });
        let mut header = Vec::with_capacity(128);
        write_header(&mut header, descr, fortran, view.shape);
        Plan { header, view, order }
    }

    pub fn payload_len(&self) -> usize {
        self.header.len() + self.view.nbytes()
    }

    /// Length of the base64 text, i.e. of the str to allocate.
    pub fn encoded_len(&self) -> usize {
        encoded_len(self.payload_len())
    }

    /// Fills `out` (exactly `encoded_len()` bytes) with the base64 text.
    ///
    /// # Safety
    /// The view must describe readable memory that stays valid and unchanged meanwhile.
    pub unsafe fn write(&self, out: &mut [u8], threads: usize) {
        debug_assert_eq!(out.len(), self.encoded_len());
        let mut stream = Base64Stream::new(out);
        stream.write(&self.header);
        match self.order {
            SaveOrder::Contiguous { .. } => {
                let n = self.view.nbytes();
                let data: &[u8] = if n == 0 { &[] } else { std::slice::from_raw_parts(self.view.ptr, n) };
                if threads > 1 && n >= PARALLEL_MIN_BYTES {
                    // Close the header's open group, then split the 3-aligned rest.
                    let seam = stream.open_group_needs().min(n);
                    stream.write(&data[..seam]);
                    let rest = &data[seam..];
                    let chars = encoded_len(rest.len());
                    let tail = stream.split_tail(chars);
                    encode_parallel(rest, tail, threads);
                    stream.finish();
                } else {
                    stream.write(data);
                    stream.finish();
                }
            }
            SaveOrder::Gather => {
                gather_c_order(&self.view, &mut stream);
                stream.finish();
            }
        }
    }
}

/// Encodes `src` into `dst` (exactly `encoded_len(src.len())`) on `threads` threads.
fn encode_parallel(src: &[u8], dst: &mut [u8], threads: usize) {
    let groups = src.len() / 3;
    let per = groups.div_ceil(threads) * 3;
    std::thread::scope(|s| {
        let mut src_rest = src;
        let mut dst_rest = dst;
        let mut first = None;
        while !src_rest.is_empty() {
            let take = per.min(src_rest.len());
            let (a, b) = src_rest.split_at(take);
            let (da, db) = std::mem::take(&mut dst_rest).split_at_mut(encoded_len(take));
            src_rest = b;
            dst_rest = db;
            if first.is_none() {
                first = Some((a, da));
            } else {
                s.spawn(move || encode_into(a, da));
            }
        }
        if let Some((a, da)) = first {
            encode_into(a, da);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(header_descr: &str, shape: &[usize], data: &[u8], threads: usize) -> Vec<u8> {
        let strides: Vec<isize> = {
            let mut s = vec![0isize; shape.len()];
            let mut acc = 1isize;
            for i in (0..shape.len()).rev() {
                s[i] = acc;
                acc *= shape[i] as isize;
            }
            s
        };
        let view = ArrayView { ptr: data.as_ptr(), shape, strides: &strides, itemsize: 1 };
        let plan = Plan::new(header_descr, view);
        let mut out = vec![0u8; plan.encoded_len()];
        // SAFETY: the view describes `data` (contiguous, of its size), alive and unchanged.
        unsafe { plan.write(&mut out, threads) };
        out
    }

    #[test]
    fn two_threads_equal_one() {
        let n = PARALLEL_MIN_BYTES + 12345;
        let data: Vec<u8> = (0..n).map(|i| (i * 31 % 253) as u8).collect();
        let one = plain("|u1", &[n], &data, 1);
        let two = plain("|u1", &[n], &data, 2);
        let three = plain("|u1", &[n], &data, 3);
        assert!(one == two && one == three);
        // And against a one-shot encode of header + data.
        let mut whole = Vec::new();
        write_header(&mut whole, "|u1", false, &[n]);
        whole.extend_from_slice(&data);
        let mut want = vec![0u8; encoded_len(whole.len())];
        encode_into(&whole, &mut want);
        assert!(one == want);
    }

    #[test]
    fn empty_array_is_header_only() {
        let out = plain("|u1", &[0, 48, 8], &[], 1);
        let mut h = Vec::new();
        write_header(&mut h, "|u1", false, &[0, 48, 8]);
        let mut want = vec![0u8; encoded_len(h.len())];
        encode_into(&h, &mut want);
        assert_eq!(out, want);
    }
}
