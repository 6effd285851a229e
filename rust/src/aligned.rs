//! Growable buffers of 4-byte values whose first value starts a cache line (64 bytes): AMX tile
//! loads and stores run several times slower where each 64-byte tile row straddles two lines, as
//! a `Vec<u32>`'s 16-byte aligned rows do (docs/benchmarks.md, "Cache-line aligned tile rows").
//! Rows of whole tiles (multiples of 64 bytes) then start lines too.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// One cache line of storage.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u32; 16]);

/// Values the buffers hold: 4 bytes, any bit pattern valid (u32, f32).
pub trait Word: Copy + 'static {}
impl Word for u32 {}
impl Word for f32 {}

const PER_LINE: usize = 16;

/// A `Vec`-like buffer of `len` values of `T` in whole, aligned cache lines.
pub struct Lines<T: Word> {
    lines: Vec<Line>,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: Word> Default for Lines<T> {
    fn default() -> Self {
        Lines { lines: Vec::new(), len: 0, _values: PhantomData }
    }
}

impl<T: Word> Lines<T> {
    /// `len` copies of `value`.
    pub fn filled(len: usize, value: T) -> Self {
        let mut lines = Lines::default();
        lines.resize(len, value);
        lines
    }

    /// Empties the buffer, keeping its storage.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// `len` values: the first min(len, old length) kept, any new ones `value`.
    pub fn resize(&mut self, len: usize, value: T) {
        self.reserve_total(len);
        let old = self.len;
        self.len = len;
        if len > old {
            self[old..].fill(value);
        }
    }

    /// `values` appended.
    pub fn extend_from_slice(&mut self, values: &[T]) {
        let at = self.len;
        self.reserve_total(at + values.len());
        self.len = at + values.len();
        self[at..].copy_from_slice(values);
    }

    /// `count` bytes at `bytes` (a multiple of 4) appended as values, in memory order.
    ///
    /// # Safety
    /// The `count` bytes at `bytes` must be readable and lie outside this buffer.
    pub unsafe fn extend_from_bytes(&mut self, bytes: *const u8, count: usize) {
        assert!(count.is_multiple_of(4), "Lines::extend_from_bytes: not whole values");
        let at = self.len;
        self.reserve_total(at + count / 4);
        // SAFETY: the storage holds at + count / 4 values; the caller's bytes are readable and
        // do not overlap it.
        unsafe { std::ptr::copy_nonoverlapping(bytes, self.as_mut_ptr().add(at) as *mut u8, count) };
        self.len = at + count / 4;
    }

    /// Storage for `len` values (the lines past the current ones zero).
    fn reserve_total(&mut self, len: usize) {
        let lines = len.div_ceil(PER_LINE);
        if self.lines.len() < lines {
            self.lines.resize(lines, Line([0; PER_LINE]));
        }
    }
}

impl<T: Word> Deref for Lines<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the lines hold at least `len` 4-byte values, each bit pattern a valid T.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const T, self.len) }
    }
}

impl<T: Word> DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as `deref`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut T, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_start_cache_lines_and_keep_values_like_a_vec() {
        let mut mine: Lines<u32> = Lines::default();
        let mut vec: Vec<u32> = Vec::new();
        for (step, len) in [5usize, 40, 17, 0, 100, 3].into_iter().enumerate() {
            mine.resize(len, step as u32);
            vec.resize(len, step as u32);
            assert_eq!(&mine[..], &vec[..]);
            assert_eq!(mine.as_ptr() as usize % 64, 0);
            let more: Vec<u32> = (0..step as u32 * 7).collect();
            mine.extend_from_slice(&more);
            vec.extend_from_slice(&more);
            let bytes: Vec<u8> = (0..8 * step as u8).collect();
            // SAFETY: the bytes of a live Vec of its own.
            unsafe { mine.extend_from_bytes(bytes.as_ptr(), bytes.len()) };
            vec.extend(bytes.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())));
            assert_eq!(&mine[..], &vec[..]);
        }
        mine.clear();
        assert!(mine.is_empty());
    }
}
