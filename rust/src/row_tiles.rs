//! out [M, N] = x [M, K] @ w [N, K]^T (+ bias) in AVX-512 register tiles of ROWS rows of x by
//! COLS outputs, for float32 prefill projections (many rows of x: each COLS outputs' weight rows
//! packed as their transpose [K][COLS] per part of the call, 64 KiB at K = 256, kept in L2
//! while the rows stream past) and for float32 experts kept packed so (`pack_matrix`,
//! `packed_product`: every chunk of the expert pass, its pairs' token rows read wherever they
//! lie). x's rows are read in place, one element broadcast a row and step, and the sums stored
//! straight into `out`: no transposes of x or of the result, where the pair panels (the AVX2
//! expert chunks' orientation) take both, and no packing of x, where a general GEMM (torch's
//! MKL, the `gemm` crate) packs both operands every call: at K = 256 those copies are a large
//! share of the call (docs/benchmarks.md, "Prefill projections in row tiles", "Float32 experts
//! packed in row tiles").
//!
//! Every output element is one fused multiply-add chain over k in order from zero, the bias
//! added after (the pair panels' definition: the same bits), whatever the tile, remainder or
//! thread split.

use crate::expert_pairs::PARALLEL_MIN_MACS;

/// Outputs per tile: four 16-lane registers a row.
pub const COLS: usize = 64;
/// Rows of x per tile: 6 x 4 sums within the 32 registers, with the four weight loads.
const ROWS: usize = 6;
/// Rows of x per part of the work: a part packs its COLS outputs' weights once for these rows
/// (the packing then about 1% of a part at K = 256), and a 2,048-row prefill's projections
/// still split into enough parts for two threads where N is a single block (the router's).
const PART_ROWS: usize = 1024;

/// Whether this CPU runs the row tiles (AVX-512F; the packing's transposes in AVX2).
pub fn runs() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// out [m, n] = x [m, k] @ w [n, k]^T (+ bias [n]) on up to `threads` threads (parts of COLS
/// outputs by PART_ROWS rows taken from a shared counter). The caller checked the lengths
/// (`linear`'s errors) and `runs()`.
pub fn linear(x: &[f32], w: &[f32], bias: Option<&[f32]>, n: usize, out: &mut [f32], threads: usize) {
    assert!(runs(), "row_tiles::linear: this CPU lacks AVX-512F");
    assert!(n > 0 && w.len() >= n && w.len().is_multiple_of(n), "row_tiles::linear: the weight is not [{n}, K > 0]");
    let k = w.len() / n;
    let m = x.len() / k;
    assert!(x.len() == m * k && out.len() == m * n && bias.is_none_or(|b| b.len() == n));
    if m == 0 {
        return;
    }
    let parts: Vec<(usize, usize)> =
        (0..n).step_by(COLS).flat_map(|c| (0..m).step_by(PART_ROWS).map(move |r| (c, r))).collect();
    let threads = threads.min(m * n * k / PARALLEL_MIN_MACS).clamp(1, parts.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out_at = out.as_mut_ptr() as usize; // parts write disjoint blocks of out
    crate::workers::run_on_threads(threads, &|| {
        let mut packed = crate::aligned::Lines::filled(k * COLS, 0f32);
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(&(c0, r0)) = parts.get(i) else { break };
            let cols = (n - c0).min(COLS);
            pack(&w[c0 * k..(c0 + cols) * k], k, &mut packed);
            let rows: Vec<&[f32]> = x[r0 * k..m.min(r0 + PART_ROWS) * k].chunks_exact(k).collect();
            // SAFETY: runs() (asserted); the part's rows of x (k values each), its block of out
            // (rows r0.. of n values, columns c0..c0 + cols) and the packed [k][COLS] weights
            // lie within their slices, and no other part writes that block.
            unsafe {
                part(
                    &rows,
                    k,
                    &packed,
                    bias.map(|b| &b[c0..c0 + cols]),
                    (out_at as *mut f32).add(r0 * n + c0),
                    n,
                    cols,
                );
            }
        }
    });
}

/// Floats of a [n, k] matrix packed in row tiles (`pack_matrix`): its COLS-output blocks, the
/// last padded with zero outputs.
pub fn packed_len(n: usize, k: usize) -> usize {
    n.div_ceil(COLS) * k * COLS
}

/// out [blocks][k][COLS] = w [n, k] in row tiles: each COLS outputs' rows as their transpose,
/// the outputs past n zero (`packed_product` reads it; float32 experts keep their weights so,
/// r3srv.kernels.expert_pairs_cpu).
pub fn pack_matrix(w: &[f32], n: usize, out: &mut [f32]) {
    assert!(n > 0 && w.len().is_multiple_of(n), "row_tiles::pack_matrix: the weight is not [{n}, K]");
    let k = w.len() / n;
    assert_eq!(
        out.len(),
        packed_len(n, k),
        "row_tiles::pack_matrix: the output is not [{}, {k}, {COLS}]",
        n.div_ceil(COLS)
    );
    if k == 0 {
        return;
    }
    for (c0, block) in (0..n).step_by(COLS).zip(out.chunks_exact_mut(k * COLS)) {
        pack(&w[c0 * k..(c0 + COLS).min(n) * k], k, block);
    }
}

/// out [rows.len(), n] = rows @ w^T on this thread, w [n, k] packed by `pack_matrix`; the rows
/// (k values each) wherever they lie: an expert's chunk of pairs, its tokens' rows read in place.
pub fn packed_product(rows: &[&[f32]], packed: &[f32], n: usize, out: &mut [f32]) {
    assert!(runs(), "row_tiles::packed_product: this CPU lacks AVX-512F");
    assert!(n > 0 && !rows.is_empty(), "row_tiles::packed_product: no outputs or no rows");
    let k = rows[0].len();
    assert!(rows.iter().all(|r| r.len() == k), "row_tiles::packed_product: rows of different lengths");
    assert_eq!(packed.len(), packed_len(n, k), "row_tiles::packed_product: the weight is not packed [{n}, {k}]");
    assert_eq!(out.len(), rows.len() * n, "row_tiles::packed_product: the output is not [{}, {n}]", rows.len());
    for (c0, block) in (0..n).step_by(COLS).zip(packed.chunks_exact(k * COLS)) {
        // SAFETY: runs() (asserted); every row holds k values, out [rows, n] holds columns
        // c0..c0 + cols of each, and the block is [k][COLS].
        unsafe { part(rows, k, block, None, out.as_mut_ptr().add(c0), n, (n - c0).min(COLS)) };
    }
}

/// packed [k][COLS] = the transpose of `rows` [cols, k] (cols <= COLS), zero past the last:
/// whole 8 columns of k at a time in AVX2 transposes where the CPU has them (the pair panels'),
/// the rest one value at a time.
fn pack(rows: &[f32], k: usize, packed: &mut [f32]) {
    use crate::pair_panels::LANES;
    let cols = rows.len() / k;
    if cols < COLS {
        packed[..k * COLS].fill(0.0);
    }
    let rows: Vec<&[f32]> = rows.chunks_exact(k).collect();
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        for (q, block) in rows.chunks(LANES).enumerate() {
            // SAFETY: the CPU has AVX2; every row holds k values and packed [k][COLS] holds
            // lanes 16 q.. of each of its k rows.
            done = unsafe { crate::pair_panels::transpose::rows_to_columns(block, k, &mut packed[LANES * q..], COLS) };
        }
    }
    for (c, row) in rows.iter().enumerate() {
        for (kk, &v) in row.iter().enumerate().skip(done) {
            packed[kk * COLS + c] = v;
        }
    }
}

/// A part's rows of x (k values each, wherever they lie) against the packed weights, into out's
/// rows (`stride` apart) at their first `cols` columns, in tiles of ROWS rows and a last one of
/// fewer.
///
/// # Safety
/// AVX-512F; every row holds k values; out holds rows.len() x stride values past `out` (its
/// first `cols` of each written).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn part(
    rows: &[&[f32]],
    k: usize,
    packed: &[f32],
    bias: Option<&[f32]>,
    out: *mut f32,
    stride: usize,
    cols: usize,
) {
    for (r, tile_rows) in rows.chunks(ROWS).enumerate() {
        let o = out.add(r * ROWS * stride);
        let x = |i: usize| tile_rows[i].as_ptr();
        match tile_rows.len() {
            1 => tile::<1>([x(0)], k, packed, bias, o, stride, cols),
            2 => tile::<2>([x(0), x(1)], k, packed, bias, o, stride, cols),
            3 => tile::<3>([x(0), x(1), x(2)], k, packed, bias, o, stride, cols),
            4 => tile::<4>([x(0), x(1), x(2), x(3)], k, packed, bias, o, stride, cols),
            5 => tile::<5>([x(0), x(1), x(2), x(3), x(4)], k, packed, bias, o, stride, cols),
            _ => tile::<ROWS>(std::array::from_fn(x), k, packed, bias, o, stride, cols),
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn part(_: &[&[f32]], _: usize, _: &[f32], _: Option<&[f32]>, _: *mut f32, _: usize, _: usize) {
    unreachable!("runs() is false off x86_64")
}

/// R rows of x (at `x`, k values each) against the packed weights: R x COLS sums in registers,
/// stored (bias added) into out's R rows, `stride` apart, at their first `cols` columns.
///
/// # Safety
/// As `part`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile<const R: usize>(
    x: [*const f32; R],
    k: usize,
    packed: &[f32],
    bias: Option<&[f32]>,
    out: *mut f32,
    stride: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    let p = packed.as_ptr();
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    for kk in 0..k {
        let w: [__m512; 4] = std::array::from_fn(|c| _mm512_loadu_ps(p.add(kk * COLS + 16 * c)));
        for (i, acc) in acc.iter_mut().enumerate() {
            let a = _mm512_set1_ps(*x[i].add(kk));
            for (acc, &w) in acc.iter_mut().zip(&w) {
                *acc = _mm512_fmadd_ps(a, w, *acc);
            }
        }
    }
    for c in 0..4 {
        let first = 16 * c;
        if first >= cols {
            break;
        }
        let mask: __mmask16 = if cols - first >= 16 { 0xFFFF } else { (1u16 << (cols - first)) - 1 };
        let b = match bias {
            Some(b) => _mm512_maskz_loadu_ps(mask, b.as_ptr().add(first)),
            None => _mm512_setzero_ps(),
        };
        for (i, acc) in acc.iter().enumerate() {
            let v = if bias.is_some() { _mm512_add_ps(acc[c], b) } else { acc[c] };
            _mm512_mask_storeu_ps(out.add(i * stride + first), mask, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::noise;

    /// Every element is the fused multiply-add chain over k in order from zero plus the bias,
    /// bit for bit, on remainders of rows and columns, parts and 1-3 threads.
    #[test]
    fn elements_are_fused_chains_in_order_on_any_split() {
        if !runs() {
            eprintln!("skipped: this CPU lacks AVX-512F (the row tiles' instruction set)");
            return;
        }
        for (m, n, k) in [(1, 1, 1), (5, 63, 7), (7, 64, 16), (13, 65, 33), (64, 130, 256), (2100, 70, 64)] {
            let (x, w, b) = (noise(m * k, m as u64), noise(n * k, n as u64 + 7), noise(n, k as u64));
            for bias in [None, Some(&b[..])] {
                let want: Vec<f32> = (0..m * n)
                    .map(|e| {
                        let (r, c) = (e / n, e % n);
                        let chain = (0..k).fold(0.0f32, |acc, kk| x[r * k + kk].mul_add(w[c * k + kk], acc));
                        bias.map_or(chain, |b| chain + b[c])
                    })
                    .collect();
                for threads in [1, 2, 3] {
                    let mut out = vec![f32::NAN; m * n];
                    linear(&x, &w, bias, n, &mut out, threads);
                    let same = out.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{m}x{n}x{k} bias={} threads={threads}", bias.is_some());
                }
            }
        }
        // no rows: nothing to do
        linear(&[], &noise(8, 1), None, 2, &mut [], 2);
    }

    /// `packed_product` over `pack_matrix`: rows read wherever they lie (repeated, out of
    /// order), each element the fused chain, bit for bit, on remainders of rows, of columns
    /// (zero-padded outputs) and of k's whole eights.
    #[test]
    fn packed_products_are_fused_chains_in_order() {
        if !runs() {
            eprintln!("skipped: this CPU lacks AVX-512F (the row tiles' instruction set)");
            return;
        }
        for (m, n, k) in [(1, 1, 1), (7, 64, 16), (13, 65, 33), (40, 130, 256), (9, 20, 7)] {
            let (x, w) = (noise(50 * k, k as u64), noise(n * k, n as u64 + 3));
            let mut packed = vec![f32::NAN; packed_len(n, k)];
            pack_matrix(&w, n, &mut packed);
            let picks: Vec<usize> = (0..m).map(|i| (i * 17 + 5) % 50).collect();
            let rows: Vec<&[f32]> = picks.iter().map(|&t| &x[t * k..(t + 1) * k]).collect();
            let mut out = vec![f32::NAN; m * n];
            packed_product(&rows, &packed, n, &mut out);
            for (e, got) in out.iter().enumerate() {
                let (r, c) = (e / n, e % n);
                let want = (0..k).fold(0.0f32, |acc, kk| rows[r][kk].mul_add(w[c * k + kk], acc));
                assert_eq!(got.to_bits(), want.to_bits(), "{m}x{n}x{k} [{r}, {c}]");
            }
        }
    }
}
