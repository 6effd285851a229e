//! Software prefetch of memory a kernel reads (or writes) next, shared by the matrix and
//! attention kernels.
//!
//! The lines go to the L2 cache (hint T2), not L1: a prefetch into L1 holds one of the core's
//! few L1 miss buffers until its line arrives from DRAM, and a kernel that asks for a whole row
//! block (dozens of lines) at once then stalls its own loads behind them; the L2 tracks many
//! more misses, and a line in L2 is a few cycles from use. Even into L2 a burst of a block's
//! lines stalls the loads behind it, so the matrix kernels ask a step's worth at a time
//! (`prefetch_l2_bytes`).

/// Asks for every 64-byte line of `data` to be brought into the L2 cache.
#[inline(always)]
pub(crate) fn prefetch_l2<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    every_line::<{ std::arch::x86_64::_MM_HINT_T2 }, T>(data);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// PREFETCH with `HINT` of every 64-byte line of `data`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn every_line<const HINT: i32, T>(data: &[T]) {
    let base = data.as_ptr() as *const i8;
    for offset in (0..std::mem::size_of_val(data)).step_by(64) {
        // SAFETY: the address lies within `data`; a prefetch never faults or writes anyway.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(base.add(offset)) };
    }
}

/// Asks for the lines of bytes [from, from + count) of `data` (clipped to it) to be brought into
/// the L2 cache. A kernel reading rows a block at a time spreads the next blocks' prefetches
/// over its steps this way, a step's worth each: asked all at a block's start, they filled the
/// core's miss buffers and stalled its loads (docs/benchmarks.md, "Prefetches spread over a
/// block's steps").
#[inline(always)]
pub(crate) fn prefetch_l2_bytes<T>(data: &[T], from: usize, count: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T2};
        // a plain loop (not `step_by`): it runs in the matrix kernels' inner loops
        let end = (from + count).min(std::mem::size_of_val(data));
        let base = data.as_ptr() as *const i8;
        let mut offset = from;
        while offset < end {
            // SAFETY: the address lies within `data`; a prefetch never faults or writes anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T2>(base.add(offset)) };
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, from, count);
}

/// Asks for every 64-byte line of `data` with the intent to write it (PREFETCHW, into the L1
/// cache): a kernel about to store into lines that are in no cache of its core otherwise
/// waits on each one's ownership from L3 or memory when it stores.
#[inline(always)]
pub(crate) fn prefetch_for_write<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    every_line::<{ std::arch::x86_64::_MM_HINT_ET0 }, T>(data);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}
