//! Transparent huge pages (2 MiB) for a range of memory, on Linux; nothing elsewhere.
//!
//! Advised before its pages are first touched: a large fresh output buffer (`advise_fresh`:
//! one fault per 2 MiB) and a model's weights on the CPU (`advise`, through r3srv.huge_pages:
//! a CPU decode step streams every expert weight it needs once, and with 4 KiB pages every
//! 4 KiB is a TLB miss and a stop for the hardware prefetcher, which does not cross pages).
//! Only the 2 MiB-aligned interior of a range is touched; the advice never changes contents.

/// The huge page size of x86-64 and most aarch64 kernels.
const HUGE: usize = 2 << 20;

/// The 2 MiB-aligned interior [start, end) of `len` bytes at `ptr`, if it holds a whole page.
fn interior(ptr: usize, len: usize) -> Option<(usize, usize)> {
    let start = ptr.checked_next_multiple_of(HUGE)?;
    let end = ptr.checked_add(len)? / HUGE * HUGE;
    (end > start).then_some((start, end))
}

/// Marks the interior of `len` bytes at `ptr` for huge pages (MADV_HUGEPAGE): the pages that
/// fault in from now on come as huge pages where the kernel has them; pages already touched
/// stay as they are. Returns the bytes marked: 0 where the range holds no whole huge page or
/// the kernel declines (huge pages off, memory that is not anonymous). Advisory only.
///
/// # Safety
/// `len` bytes at `ptr` must be one live allocation of the caller's.
pub unsafe fn advise(ptr: *mut u8, len: usize) -> usize {
    #[cfg(target_os = "linux")]
    if let Some((start, end)) = interior(ptr as usize, len) {
        // SAFETY: [start, end) lies inside the caller's allocation; madvise only changes how
        // its pages are backed, never their contents.
        let advised = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        return if advised == 0 { end - start } else { 0 };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
    0
}

/// `advise`, then the interior populated in one call (MADV_POPULATE_WRITE, Linux 5.14; on
/// older kernels its pages fault as usual): for a fresh buffer about to be written whole.
///
/// # Safety
/// As `advise`.
#[cfg(feature = "python")] // the encoder's outputs (python.rs)
pub(crate) unsafe fn advise_fresh(ptr: *mut u8, len: usize) {
    // SAFETY: the caller's allocation, as `advise` requires.
    if unsafe { advise(ptr, len) } > 0 {
        #[cfg(target_os = "linux")]
        if let Some((start, end)) = interior(ptr as usize, len) {
            // SAFETY: as in `advise`; populating writes zeros only to pages not yet present.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_POPULATE_WRITE) };
        }
    }
}

#[cfg(feature = "python")]
pub(crate) mod python {
    use pyo3::prelude::*;

    /// `advise` for `nbytes` at `address` (a tensor's memory, which the caller keeps alive).
    #[pyfunction]
    pub fn advise_huge_pages(address: usize, nbytes: usize) -> usize {
        // SAFETY: the caller (r3srv.huge_pages) passes a live tensor's storage address and size
        // and holds the tensor for the call.
        unsafe { super::advise(address as *mut u8, nbytes) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interior_is_the_whole_aligned_pages_inside() {
        assert_eq!(interior(0, HUGE), Some((0, HUGE)));
        assert_eq!(interior(1, 2 * HUGE), Some((HUGE, 2 * HUGE)));
        assert_eq!(interior(1, 2 * HUGE - 1), Some((HUGE, 2 * HUGE)));
        assert_eq!(interior(1, 2 * HUGE - 2), None);
        assert_eq!(interior(HUGE - 1, HUGE + 1), Some((HUGE, 2 * HUGE)));
        assert_eq!(interior(5, 100), None);
        assert_eq!(interior(usize::MAX - 10, 100), None);
    }

    #[test]
    fn advice_keeps_the_contents_and_only_counts_whole_pages() {
        let len = 6 * HUGE;
        let mut data: Vec<u32> = (0..len as u32 / 4).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let expected = data.clone();
        // SAFETY: the vector's own memory, alive for the calls.
        let advised = unsafe { advise(data.as_mut_ptr() as *mut u8, len) };
        assert!(advised == 0 || (advised >= 5 * HUGE && advised <= len && advised % HUGE == 0), "{advised} bytes");
        assert!(data == expected, "the contents changed");
        // SAFETY: as above; a range without a whole huge page is left alone
        assert_eq!(unsafe { advise(data.as_mut_ptr() as *mut u8, HUGE - 1) }, 0);
    }
}
