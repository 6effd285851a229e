//! y = x W^T (+ b) for a few rows of x on the CPU (a decode step's projections): one call that
//! reads W once, row by row, with the expert pass's small matrix product (`gemm_nt`: weight
//! rows prefetched ahead, every row read once for all of x's rows), instead of torch's GEMM
//! call, whose per-call cost and cache-cold weight reads dominate at one to a few rows.
//! Each output element is the dot product `gemm_nt` computes, whatever the thread split (with
//! bfloat16 weights at the default kernel on an AVX-512 BF16 CPU, `matmul_bf16::gemm_nt_bf16`'s).
//!
//! Many rows (a prefill's projections) run through `matmul`'s packed kernels instead, a
//! bfloat16 weight widened to f32 a block of rows at a time: torch has no fast bfloat16 GEMM
//! on a CPU without AMX or AVX-512 BF16 (about a sixth of its float32 speed on AVX2), and the
//! widening costs one pass over the weight per call against the `rows` passes the product
//! makes. Those elements are within float32 rounding of `gemm_nt`'s; the thread count still
//! never changes a bit (the blocks do not depend on it).

// the expert pass's threshold: a decode step's 16-row q/k/v projection (2M multiply-adds) splits
// in two, its smaller ones run on one thread (docs/benchmarks.md, "Decode blocks' sums together")
use crate::expert_pairs::{gemm_nt, packed_runs, Element, Isa, PARALLEL_MIN_MACS};
use crate::matmul::matmul_nt;

/// From this many rows of x on, the product runs through `matmul_nt`'s packed kernels, which
/// outrun `gemm_nt` once they have enough rows to amortize their packing (the expert pass's
/// WIDE_MIN_PAIRS, measured there).
pub const PACKED_MIN_ROWS: usize = 64;

/// Weight rows per block of the packed path: each block's widened copy (at most 1 MiB for
/// K = 2048) stays in the L2 cache while the product reads it, and enough blocks for the
/// threads to share. Fixed, so that the split never depends on the thread count.
const PACKED_BLOCK_ROWS: usize = 128;

/// out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), on up to `threads` threads (each a
/// contiguous run of W's rows). `packed`: W kept packed (`Element::pack_matrix`, the experts'
/// packing: r3srv.kernels.packed_weights), which the product then reads where the CPU runs its
/// products (`expert_pairs::packed_runs`), with their bits (many float32 rows take the row
/// tiles, which pack the same values per call). Errors name the first inconsistent length.
#[allow(clippy::too_many_arguments)]
pub fn linear<W: Element>(
    x: &[W],
    w: &[W],
    bias: Option<&[W]>,
    n: usize,
    out: &mut [W],
    threads: usize,
    isa: Isa,
    packed: Option<&[W::Packed]>,
) -> Result<(), String> {
    if n == 0 || !w.len().is_multiple_of(n) {
        return Err(format!("linear: the weight holds {} values, not [{n}, K]", w.len()));
    }
    let k = w.len() / n;
    if k == 0 || !x.len().is_multiple_of(k) || out.len() != x.len() / k * n {
        return Err(format!("linear: x holds {} and out {} values for a [{n}, {k}] weight", x.len(), out.len()));
    }
    if let Some(b) = bias {
        if b.len() != n {
            return Err(format!("linear: {} biases for {n} outputs", b.len()));
        }
    }
    if let Some(p) = packed {
        if p.len() != W::packed_len(n, k) {
            return Err(format!("linear: the packed weight holds {} values, not a packed [{n}, {k}]", p.len()));
        }
    }
    let m = x.len() / k;
    // float32 with many rows at the default kernel: the row tiles where the CPU runs them, no
    // per-call packing of x or copies of parts of the result (a named kernel keeps `matmul_nt`);
    // they pack each part's weights themselves (a kept copy's values, the same bits)
    if m >= PACKED_MIN_ROWS && isa == Isa::Auto && crate::row_tiles::runs() {
        if let (Some(xf), Some(wf)) = (W::as_f32s(x), W::as_f32s(w)) {
            let bias = bias.map(|b| W::as_f32s(b).expect("a float32 bias (float32 weights)"));
            let out = W::as_f32s_mut(out).expect("a float32 out (float32 weights)");
            crate::row_tiles::linear(xf, wf, bias, n, out, threads);
            return Ok(());
        }
    }
    let kept = packed.filter(|_| packed_runs::<W>(isa));
    let packed = kept.is_none() && m >= PACKED_MIN_ROWS;
    // bfloat16 weights at the default kernel, on an AVX-512 BF16 CPU: x's bfloat16 rows taken as
    // the pairs the dot products read (not widened), against the weight rows
    let dot =
        if kept.is_some() || packed || !k.is_multiple_of(2) { None } else { crate::expert_pairs::dot_products(isa, w) };
    let mut pairs = crate::aligned::Lines::default();
    let widened: Vec<f32>;
    let xf: &[f32] = match (dot, W::as_f32s(x)) {
        _ if kept.is_some() => &[], // the packed rows read x
        (Some(_), _) => {
            crate::matmul_bf16::extend_pairs(W::as_bf16s(x).expect("bfloat16 x (bfloat16 weights)"), &mut pairs);
            &[] // the dot products read the pairs only
        }
        (None, Some(xf)) => xf,
        (None, None) => {
            widened = x.iter().map(|v| v.to_f32()).collect();
            &widened
        }
    };
    let parts: Vec<(usize, usize)> = if packed {
        (0..n).step_by(PACKED_BLOCK_ROWS).map(|r| (r, (r + PACKED_BLOCK_ROWS).min(n))).collect()
    } else {
        // runs of whole blocks (4 rows; a packed weight's 64), so that each row is computed as
        // it is on one thread
        let block = if kept.is_some() { W::PACKED_ROWS } else { 4 };
        let threads = threads.min(m * n * k / PARALLEL_MIN_MACS).clamp(1, n.div_ceil(block));
        let per = n.div_ceil(block).div_ceil(threads) * block;
        (0..n).step_by(per).map(|r| (r, (r + per).min(n))).collect()
    };
    let threads = threads.min(m * n * k / PARALLEL_MIN_MACS).clamp(1, parts.len());
    let run = |&(first, end): &(usize, usize)| {
        let mut part = vec![0.0f32; m * (end - first)];
        let rows = &w[first * k..end * k];
        if let Some(kept) = kept {
            let each = kept.len() / n.div_ceil(W::PACKED_ROWS);
            let blocks = &kept[first / W::PACKED_ROWS * each..end.div_ceil(W::PACKED_ROWS) * each];
            W::packed_rows(x, k, blocks, end - first, &mut part);
        } else if packed {
            let block: Vec<f32>;
            let rows = match W::as_f32s(rows) {
                Some(rows) => rows,
                None => {
                    block = rows.iter().map(|v| v.to_f32()).collect();
                    &block
                }
            };
            matmul_nt(rows, end - first, xf, &mut part);
        } else if let Some(w) = dot {
            crate::matmul_bf16::gemm_nt_bf16(&w[first * k..end * k], end - first, &pairs, &mut part);
        } else {
            gemm_nt(isa, rows, end - first, xf, &mut part);
        }
        part
    };
    // threads take parts from a shared counter (a preempted thread holds up no one)
    let results: Vec<std::sync::Mutex<Vec<f32>>> = parts.iter().map(|_| Default::default()).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    crate::workers::run_on_threads(threads, &|| loop {
        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some(p) = parts.get(i) else { break };
        let part = run(p);
        *results[i].lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = part;
    });
    let results: Vec<Vec<f32>> =
        results.into_iter().map(|r| r.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner())).collect();
    for (&(first, end), part) in parts.iter().zip(&results) {
        let width = end - first;
        for (row, src) in part.chunks_exact(width).enumerate() {
            let dst = &mut out[row * n + first..row * n + end];
            match bias {
                Some(b) => {
                    for ((d, &s), bv) in dst.iter_mut().zip(src).zip(&b[first..end]) {
                        *d = W::from_f32(s + bv.to_f32());
                    }
                }
                None => {
                    for (d, &s) in dst.iter_mut().zip(src) {
                        *d = W::from_f32(s);
                    }
                }
            }
        }
    }
    Ok(())
}

/// The names of the matrix kernels this CPU runs, the portable one first.
pub fn isa_names() -> Vec<&'static str> {
    Isa::available().into_iter().map(Isa::name).collect()
}

#[cfg(feature = "python")]
pub(crate) mod python {
    //! `r3srv._core.linear_cpu`, called by r3srv.kernels.linear_cpu, which passes the tensors
    //! as data addresses after checking their dtype, device and contiguity.

    use pyo3::exceptions::PyValueError;
    use pyo3::prelude::*;

    use super::linear;
    use crate::expert_pairs::{Bf16, Element, Isa};

    /// # Safety
    /// As `linear_cpu` requires of its caller, with `W` the tensors' element type.
    unsafe fn run<W: Element>(
        py: Python<'_>,
        addresses: [usize; 4],
        shape: [usize; 3],
        threads: usize,
        isa: Isa,
        packed: Option<usize>,
    ) -> PyResult<()> {
        use std::slice::{from_raw_parts, from_raw_parts_mut};
        let [x, w, bias, out] = addresses;
        let [m, n, k] = shape;
        let x = from_raw_parts(x as *const W, m * k);
        let w = from_raw_parts(w as *const W, n * k);
        let bias = (bias != 0).then(|| from_raw_parts(bias as *const W, n));
        let out = from_raw_parts_mut(out as *mut W, m * n);
        let packed = packed.map(|p| from_raw_parts(p as *const W::Packed, W::packed_len(n, k)));
        py.detach(|| linear(x, w, bias, n, out, threads, isa, packed)).map_err(PyValueError::new_err)
    }

    /// The matrix kernels this CPU runs ("scalar", "avx2", "avx512"), the portable one first.
    #[pyfunction]
    pub fn matrix_isas() -> Vec<&'static str> {
        super::isa_names()
    }

    /// Whether float32 products of many rows (PACKED_MIN_ROWS or more) run in the row tiles on
    /// this CPU (`row_tiles::runs`) at the default matrix kernel.
    #[pyfunction]
    pub fn linear_row_tiles() -> bool {
        crate::row_tiles::runs()
    }

    /// out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]) for the tensors at `addresses` (x, w,
    /// bias (0: none), out), all of `dtype` ("float32" or "bfloat16"), of `shape` (M, N, K),
    /// on up to `threads` threads when the work is large enough, with the matrix kernel `isa`
    /// names (one of `matrix_isas()`; None: `Isa::default_kernel()`); `packed`: the address of
    /// w's packed copy (r3srv.kernels.packed_weights), read where the CPU runs its products.
    /// Runs with the GIL released.
    #[pyfunction]
    #[pyo3(signature = (addresses, shape, dtype, threads, isa=None, packed=None))]
    pub fn linear_cpu(
        py: Python<'_>,
        addresses: [usize; 4],
        shape: [usize; 3],
        dtype: &str,
        threads: usize,
        isa: Option<&str>,
        packed: Option<usize>,
    ) -> PyResult<()> {
        let [x, w, _, out] = addresses;
        if [x, w, out].contains(&0) || shape.contains(&0) || packed == Some(0) {
            return Err(PyValueError::new_err("linear_cpu needs non-null tensors and non-empty shapes"));
        }
        let isa = match isa {
            None => Isa::default_kernel(),
            Some(name) => Isa::available().into_iter().find(|i| i.name() == name).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "this CPU runs no matrix kernel {name:?} (it runs {:?})",
                    super::isa_names()
                ))
            })?,
        };
        // SAFETY: the caller (r3srv.kernels.linear_cpu) passes the data addresses of live,
        // contiguous CPU tensors of exactly these shapes and dtype (a packed copy: of w's packed
        // length for this dtype), keeps them alive for the call, and `out` is a fresh tensor
        // that aliases none of the others.
        unsafe {
            match dtype {
                "float32" => run::<f32>(py, addresses, shape, threads, isa, packed),
                "bfloat16" => run::<Bf16>(py, addresses, shape, threads, isa, packed),
                other => Err(PyValueError::new_err(format!("unsupported linear dtype {other:?}"))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::expert_pairs::{gemv, Bf16};

    fn values(seed: u64, n: usize) -> Vec<f32> {
        crate::testing::noise(n, seed).into_iter().map(|v| v / 2.0).collect()
    }

    /// Every row of the result is `gemv`'s, bit for bit, plus the bias, on 1-3 threads.
    fn cases<W: Element>() {
        for isa in [Isa::Scalar, Isa::best()] {
            for (m, n, k) in [(1, 1, 1), (1, 5, 7), (3, 9, 16), (2, 64, 40), (32, 1030, 256)] {
                let x: Vec<W> = values(1, m * k).into_iter().map(W::from_f32).collect();
                let w: Vec<W> = values(2, n * k).into_iter().map(W::from_f32).collect();
                let b: Vec<W> = values(3, n).into_iter().map(W::from_f32).collect();
                let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                for bias in [None, Some(&b[..])] {
                    let mut want = vec![W::from_f32(0.0); m * n];
                    for (row, dst) in xf.chunks_exact(k).zip(want.chunks_exact_mut(n)) {
                        let mut y = vec![0.0f32; n];
                        gemv(isa, &w, row, &mut y);
                        for (i, d) in dst.iter_mut().enumerate() {
                            *d = W::from_f32(y[i] + bias.map_or(0.0, |b| b[i].to_f32()));
                        }
                    }
                    for threads in [1, 2, 3] {
                        let mut out = vec![W::from_f32(f32::NAN); m * n];
                        linear(&x, &w, bias, n, &mut out, threads, isa, None).unwrap();
                        let same = out.iter().zip(&want).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
                        assert!(same, "{isa:?} {m}x{n}x{k} bias={} threads={threads}", bias.is_some());
                    }
                }
            }
        }
    }

    #[test]
    fn rows_are_gemv_bit_for_bit_on_any_thread_count() {
        const { assert!(32 * 1030 * 256 >= 2 * PARALLEL_MIN_MACS, "the largest case must split") };
        cases::<f32>();
        cases::<Bf16>();
    }

    /// The packed path (PACKED_MIN_ROWS rows or more): the definition within float32 rounding
    /// of sums of order 1 (bfloat16 outputs: within their own rounding), and the same bits on
    /// any thread count.
    fn packed_cases<W: Element>(rel: f64) {
        for (m, n, k) in [(PACKED_MIN_ROWS, 5, 7), (100, 130, 64), (300, 300, 160)] {
            let x: Vec<W> = values(4, m * k).into_iter().map(W::from_f32).collect();
            let w: Vec<W> = values(5, n * k).into_iter().map(W::from_f32).collect();
            let b: Vec<W> = values(6, n).into_iter().map(W::from_f32).collect();
            let mut one = vec![W::from_f32(f32::NAN); m * n];
            linear(&x, &w, Some(&b), n, &mut one, 1, Isa::best(), None).unwrap();
            for (i, got) in one.iter().enumerate() {
                let (row, col) = (i / n, i % n);
                let dot: f64 = (0..k).map(|c| x[row * k + c].to_f32() as f64 * w[col * k + c].to_f32() as f64).sum();
                let want = dot + b[col].to_f32() as f64;
                let got = got.to_f32() as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()) + rel * want.abs(),
                    "{m}x{n}x{k} [{row}, {col}]: {got} vs {want}"
                );
            }
            for threads in [2, 3] {
                let mut out = vec![W::from_f32(f32::NAN); m * n];
                linear(&x, &w, Some(&b), n, &mut out, threads, Isa::best(), None).unwrap();
                assert!(
                    out.iter().zip(&one).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()),
                    "{m}x{n}x{k} threads={threads}"
                );
            }
        }
    }

    #[test]
    fn many_rows_run_packed_within_rounding_on_any_thread_count() {
        const {
            assert!(
                300 * 300 * 160 >= 3 * PARALLEL_MIN_MACS && 300 > 2 * PACKED_BLOCK_ROWS,
                "the largest case must split in three"
            )
        };
        packed_cases::<f32>(0.0);
        packed_cases::<Bf16>(1.0 / 256.0);
    }

    /// bfloat16 at the default kernel on an AVX-512 BF16 CPU: dot products of the rows as pairs,
    /// the definition within float32 sums' and the output's rounding, a row's bits the same alone,
    /// in a batch and on any thread count.
    #[test]
    fn bfloat16_rows_in_dot_products_match_the_definition() {
        if crate::testing::skips_without_bf16() {
            return;
        }
        for (m, n, k) in [(1, 5, 2), (3, 9, 34), (16, 1030, 256)] {
            let x: Vec<Bf16> = values(7, m * k).into_iter().map(Bf16::from_f32).collect();
            let w: Vec<Bf16> = values(8, n * k).into_iter().map(Bf16::from_f32).collect();
            let mut one = vec![Bf16(0); m * n];
            linear(&x, &w, None, n, &mut one, 1, Isa::default_kernel(), None).unwrap();
            for (i, got) in one.iter().enumerate() {
                let (row, col) = (i / n, i % n);
                let want: f64 = (0..k).map(|c| x[row * k + c].to_f32() as f64 * w[col * k + c].to_f32() as f64).sum();
                assert!(
                    (got.to_f32() as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()) + want.abs() / 256.0,
                    "{m}x{n}x{k} [{row}, {col}]"
                );
            }
            for threads in [2, 3] {
                let mut out = vec![Bf16(0); m * n];
                linear(&x, &w, None, n, &mut out, threads, Isa::default_kernel(), None).unwrap();
                assert_eq!(out, one, "{m}x{n}x{k} threads={threads}");
            }
            let mut alone = vec![Bf16(0); n];
            linear(&x[(m - 1) * k..], &w, None, n, &mut alone, 1, Isa::default_kernel(), None).unwrap();
            assert_eq!(alone[..], one[(m - 1) * n..], "{m}x{n}x{k}: the last row alone");
        }
    }

    /// A weight kept packed (`Element::pack_matrix`): a few rows (a decode step's) get the packed
    /// products' bits (`Element::packed_rows`, the expert chunks' products) plus the bias, within
    /// float32 rounding of the definition (bfloat16 outputs: their own rounding), a row's
    /// the same alone and on any thread count; float32 rows past PACKED_MIN_ROWS take the row
    /// tiles, as without the copy.
    fn kept_cases<W: Element>() {
        if !crate::expert_pairs::packed_runs::<W>(Isa::Auto) {
            eprintln!("skipped: this CPU does not run the packed products of this type");
            return;
        }
        for (m, n, k) in [(1, 5, 2), (3, 70, 33), (7, 130, 64), (16, 1030, 256), (PACKED_MIN_ROWS + 3, 200, 96)] {
            let x: Vec<W> = values(9, m * k).into_iter().map(W::from_f32).collect();
            let w: Vec<W> = values(10, n * k).into_iter().map(W::from_f32).collect();
            let b: Vec<W> = values(11, n).into_iter().map(W::from_f32).collect();
            let mut kept = vec![W::Packed::default(); W::packed_len(n, k)];
            W::pack_matrix(&w, n, &mut kept);
            let mut want = vec![W::from_f32(0.0); m * n];
            if m < PACKED_MIN_ROWS {
                let mut sums = vec![0.0f32; m * n];
                W::packed_rows(&x, k, &kept, n, &mut sums);
                for (i, (d, s)) in want.iter_mut().zip(&sums).enumerate() {
                    *d = W::from_f32(s + b[i % n].to_f32());
                }
            } else {
                linear(&x, &w, Some(&b), n, &mut want, 1, Isa::Auto, None).unwrap();
            }
            for (i, got) in want.iter().enumerate() {
                let (row, col) = (i / n, i % n);
                let dot: f64 = (0..k).map(|c| x[row * k + c].to_f32() as f64 * w[col * k + c].to_f32() as f64).sum();
                let want = dot + b[col].to_f32() as f64;
                let rounding = if W::as_bf16s(&[]).is_some() { want.abs() / 256.0 } else { 0.0 };
                let got = got.to_f32() as f64;
                assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()) + rounding, "{m}x{n}x{k} [{row}, {col}]");
            }
            for threads in [1, 2, 3] {
                let mut out = vec![W::from_f32(f32::NAN); m * n];
                linear(&x, &w, Some(&b), n, &mut out, threads, Isa::Auto, Some(&kept)).unwrap();
                let same = out.iter().zip(&want).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
                assert!(same, "{m}x{n}x{k} threads={threads}");
            }
            let mut alone = vec![W::from_f32(0.0); n];
            linear(&x[(m - 1) * k..], &w, Some(&b), n, &mut alone, 1, Isa::Auto, Some(&kept)).unwrap();
            let same =
                alone.iter().zip(&want[(m - 1) * n..]).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
            assert!(same, "{m}x{n}x{k}: the last row alone");
            let err = linear(&x[(m - 1) * k..], &w, None, n, &mut alone, 1, Isa::Auto, Some(&kept[1..])).unwrap_err();
            assert!(err.contains("packed weight"), "{err}");
        }
    }

    #[test]
    fn kept_packed_weights_give_the_packed_products_bits() {
        kept_cases::<f32>();
        kept_cases::<Bf16>();
    }

    #[test]
    fn bad_lengths_are_errors() {
        let (x, w) = (values(1, 6), values(2, 12));
        let mut out = vec![0.0f32; 8];
        assert!(linear(&x, &w, None, 0, &mut out, 1, Isa::Scalar, None).unwrap_err().contains("weight"));
        assert!(linear(&x, &w, None, 5, &mut out, 1, Isa::Scalar, None).unwrap_err().contains("weight"));
        assert!(linear(&x, &w, None, 2, &mut out, 1, Isa::Scalar, None).unwrap_err().contains("x holds"));
        let mut out = vec![0.0f32; 8]; // x [2, 3], w [4, 3]
        assert!(linear(&x, &w, Some(&[0.0; 3]), 4, &mut out, 1, Isa::Scalar, None).unwrap_err().contains("biases"));
        linear(&x, &w, Some(&[0.0; 4]), 4, &mut out, 1, Isa::Scalar, None).unwrap();
    }
}
