//! RMSNorm of float32 or bfloat16 rows on the CPU: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w.
//! float32 rows follow torch's float32 rms_norm (the sum of squares in float32, then one
//! reciprocal square root per row); bfloat16 rows the HF reference r3srv.models.layers.rms_norm
//! follows (normalized in float32, rounded to bfloat16, then multiplied by the weight and
//! rounded again, as torch's bfloat16 multiply does). torch's CPU kernel is a composite of
//! several ops and costs more per call than a decode step's few rows take to normalize
//! (docs/benchmarks.md), and a decode step calls it once or more per layer (r3srv.ops.norm's
//! kernel_rms_norm, the CPU backend's).

use crate::expert_pairs::{Bf16, Element};

/// Lanes of running sums, so that consecutive multiply-adds do not wait on each other and the
/// compiler vectorizes the loop.
const LANES: usize = 8;

/// Normalizes each `w.len()`-long row of `x` into `out`, the rows split over up to `threads`
/// threads where there are enough of them (a row's bits do not depend on it). Errors on
/// lengths that do not match.
pub fn rms_norm<W: Element>(x: &[W], w: &[W], eps: f32, out: &mut [W], threads: usize) -> Result<(), String> {
    let dim = w.len();
    if dim == 0 || !x.len().is_multiple_of(dim) || out.len() != x.len() {
        return Err(format!("rms_norm: {} inputs and {} outputs for rows of {dim}", x.len(), out.len()));
    }
    let threads = threads.min(x.len() / dim / ROWS_PER_ITEM).max(1);
    if threads == 1 {
        normalize_rows(x, w, eps, out);
        return Ok(());
    }
    let mut items: Vec<(&[W], &mut [W])> =
        x.chunks(ROWS_PER_ITEM * dim).zip(out.chunks_mut(ROWS_PER_ITEM * dim)).collect();
    crate::workers::take_in_turn(threads, &mut items, &|items| {
        for (x, out) in items {
            normalize_rows(x, w, eps, out);
        }
    });
    Ok(())
}

/// Rows a thread takes at a time: a few microseconds of work.
const ROWS_PER_ITEM: usize = 64;

/// `rms_norm` of checked lengths on this thread, in the fastest code this CPU runs.
fn normalize_rows<W: Element>(x: &[W], w: &[W], eps: f32, out: &mut [W]) {
    let dim = w.len();
    #[cfg(target_arch = "x86_64")]
    if let (Some(xb), Some(wb), Some(ob)) = (W::as_bf16s(x), W::as_bf16s(w), W::as_bf16s_mut(out)) {
        if dim.is_multiple_of(16) && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX2 and AVX-512F; rows of a multiple of 16 values.
            unsafe { rows_bf16_avx512(xb, wb, eps, ob) };
            return;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        unsafe { rows_avx2(x, w, eps, out) };
        return;
    }
    rows(x, w, eps, out);
}

#[inline(always)]
fn rows<W: Element>(x: &[W], w: &[W], eps: f32, out: &mut [W]) {
    for (row, dst) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        normalize_row(row, w, eps, dst);
    }
}

/// `rows` compiled for AVX2: its loops vectorize 8 wide (no FMA: the same bits).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_avx2<W: Element>(x: &[W], w: &[W], eps: f32, out: &mut [W]) {
    rows(x, w, eps, out);
}

/// One row: dst = w * round(row / sqrt(mean(row^2) + eps)) (all of w's length), rounding to
/// `W` (nothing to round for f32: then it is torch's float32 arithmetic, row * scale * w).
/// Always inlined: it vectorizes as wide as its caller is compiled (qk_rope's AVX2 copy).
#[inline(always)]
pub fn normalize_row<W: Element>(row: &[W], w: &[W], eps: f32, dst: &mut [W]) {
    let dim = w.len();
    let mut lanes = [0f32; LANES];
    let whole = dim / LANES * LANES;
    for chunk in row[..whole].chunks_exact(LANES) {
        for i in 0..LANES {
            let v = chunk[i].to_f32();
            lanes[i] += v * v;
        }
    }
    let mut sum: f32 = lanes.iter().sum();
    for v in &row[whole..dim] {
        let v = v.to_f32();
        sum += v * v;
    }
    let scale = 1.0 / (sum / dim as f32 + eps).sqrt();
    for ((o, v), g) in dst.iter_mut().zip(row).zip(w) {
        *o = W::from_f32(W::round(v.to_f32() * scale) * g.to_f32());
    }
}

/// `rows` of bfloat16 rows of a multiple of 16 values in AVX-512 registers (the per-token
/// kernels' rows: bf16_512): the same bits, each row's scale as `scale_bf16_avx512` finds it
/// (four rows' side by side: each is a long chain of dependent adds) and its values as
/// `normalized16` gives them.
///
/// # Safety
/// The CPU must support AVX2 and AVX-512F; w.len() a multiple of 16 that divides x.len() ==
/// out.len().
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f")]
unsafe fn rows_bf16_avx512(x: &[Bf16], w: &[Bf16], eps: f32, out: &mut [Bf16]) {
    use crate::bf16_512::store16;
    const ROWS: usize = 4;
    let dim = w.len();
    assert!(x.len() == out.len() && x.len().is_multiple_of(dim));
    for (rows, dst) in x.chunks(ROWS * dim).zip(out.chunks_mut(ROWS * dim)) {
        // SAFETY: the caller's contract, rows of dim values.
        let scales: [f32; ROWS] = std::array::from_fn(|r| {
            rows.get(r * dim..(r + 1) * dim).map_or(1.0, |row| unsafe { scale_bf16_avx512(row, eps) })
        });
        for ((row, dst), scale) in rows.chunks_exact(dim).zip(dst.chunks_exact_mut(dim)).zip(scales) {
            for c in (0..dim).step_by(16) {
                // SAFETY: c + 16 <= dim values of the row, the weight and dst.
                unsafe { store16(dst.as_mut_ptr().add(c), normalized16(row, w, scale, c)) };
            }
        }
    }
}

/// `normalize_row`'s 1 / sqrt(mean square + eps) of a bfloat16 row of a multiple of 16 values:
/// the squares summed in the same 8 lanes in the same order (16 at a time, their two halves
/// added in turn), the lanes then in order.
///
/// # Safety
/// The CPU must support AVX2 and AVX-512F; row.len() must be a multiple of 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f")]
pub(crate) unsafe fn scale_bf16_avx512(row: &[Bf16], eps: f32) -> f32 {
    use crate::bf16_512::load16;
    use std::arch::x86_64::*;
    let dim = row.len();
    assert!(dim.is_multiple_of(16));
    let mut sums = _mm256_setzero_ps();
    for c in (0..dim).step_by(16) {
        // SAFETY: c + 16 <= dim values of the row.
        let v = unsafe { load16(row.as_ptr().add(c)) };
        let squares = _mm512_mul_ps(v, v);
        sums = _mm256_add_ps(sums, _mm512_castps512_ps256(squares));
        sums = _mm256_add_ps(sums, _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(squares))));
    }
    let mut lanes = [0f32; LANES];
    // SAFETY: 8 floats stored into 8.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sums) };
    let sum: f32 = lanes.iter().sum();
    1.0 / (sum / dim as f32 + eps).sqrt()
}

/// Values c..c + 16 of a bfloat16 row normalized by `scale` and weighed by `w`, rounded as
/// `normalize_row` rounds them (in f32 lanes).
///
/// # Safety
/// The CPU must support AVX-512F; c + 16 <= row.len() == w.len().
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn normalized16(row: &[Bf16], w: &[Bf16], scale: f32, c: usize) -> std::arch::x86_64::__m512 {
    use crate::bf16_512::{load16, round16};
    use std::arch::x86_64::*;
    assert!(c + 16 <= row.len() && row.len() == w.len());
    // SAFETY: 16 values at c of the row and of the weight.
    unsafe {
        let v = round16(_mm512_mul_ps(load16(row.as_ptr().add(c)), _mm512_set1_ps(scale)));
        round16(_mm512_mul_ps(v, load16(w.as_ptr().add(c))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::noise;

    fn reference(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
        let dim = w.len();
        x.chunks(dim)
            .flat_map(|row| {
                let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
                let scale = 1.0 / (ms + eps as f64).sqrt();
                row.iter().zip(w).map(move |(&v, &g)| v as f64 * scale * g as f64).collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn rows_equal_the_float64_definition() {
        for (seed, (rows, dim)) in [(1, 256), (3, 64), (2, 13), (5, 1), (4, 200)].into_iter().enumerate() {
            let x = noise(rows * dim, seed as u64);
            let w: Vec<f32> = noise(dim, 100 + seed as u64).iter().map(|v| v + 2.5).collect();
            let mut out = vec![0f32; rows * dim];
            rms_norm(&x, &w, 1e-6, &mut out, 1).unwrap();
            for (got, want) in out.iter().zip(reference(&x, &w, 1e-6)) {
                assert!((*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "{got} vs {want} ({rows}x{dim})");
            }
        }
    }

    /// bfloat16 rows: the float32 normalization rounded, times the weight, rounded (the HF
    /// reference's two roundings), against the same steps on the float32 kernel's values.
    #[test]
    fn bfloat16_rows_round_as_the_reference_does() {
        use crate::expert_pairs::Bf16;
        // rows of a multiple of 16 take the AVX-512 kernel where the CPU has it (four at a
        // time, and a last group of fewer), the others the portable loop
        for (rows, dim) in [(3, 256), (2, 13), (1, 64), (9, 16), (5, 1024), (4, 48)] {
            let x: Vec<Bf16> = noise(rows * dim, 7).into_iter().map(Bf16::from_f32).collect();
            let w: Vec<Bf16> = noise(dim, 8).into_iter().map(|v| Bf16::from_f32(v + 2.5)).collect();
            let (xf, ones) = (x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>(), vec![1.0f32; dim]);
            let mut normed = vec![0f32; rows * dim];
            rms_norm(&xf, &ones, 1e-6, &mut normed, 1).unwrap(); // the same sums, unscaled
            let mut out = vec![Bf16(0); rows * dim];
            rms_norm(&x, &w, 1e-6, &mut out, 1).unwrap();
            for (i, got) in out.iter().enumerate() {
                let want = Bf16::from_f32(Bf16::from_f32(normed[i]).to_f32() * w[i % dim].to_f32());
                assert_eq!(*got, want, "{rows}x{dim} [{i}]");
            }
        }
    }

    /// The AVX-512 bfloat16 rows give the portable loop's bits, on rows with huge and tiny
    /// values (a sum of squares that overflows to infinity, denormals), infinities and NaNs.
    #[test]
    fn the_avx512_bfloat16_rows_give_the_portable_bits() {
        use crate::expert_pairs::Bf16;
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avx512f")) {
            eprintln!("skipped: this CPU has no AVX-512F (the bfloat16 rows' kernel)");
            return;
        }
        let specials = [f32::MAX, 1e-40, -3e-39, f32::INFINITY, f32::NAN, 0.0, -0.0, 3e38];
        for (seed, (rows, dim)) in [(3, 16), (7, 64), (5, 256), (2, 128)].into_iter().enumerate() {
            let mut values = noise(rows * dim, 30 + seed as u64);
            for (i, v) in values.iter_mut().enumerate() {
                match i % 11 {
                    0 => *v *= 1e-38,
                    1 => *v *= 1e30,
                    _ => {}
                }
            }
            // the specials in the second row
            for (i, &special) in specials.iter().enumerate() {
                values[dim + i % dim] = special;
            }
            let x: Vec<Bf16> = values.into_iter().map(Bf16::from_f32).collect();
            let w: Vec<Bf16> = noise(dim, 40 + seed as u64).into_iter().map(Bf16::from_f32).collect();
            let (mut fast, mut portable) = (vec![Bf16(0); rows * dim], vec![Bf16(1); rows * dim]);
            rms_norm(&x, &w, 1e-6, &mut fast, 1).unwrap();
            super::rows(&x, &w, 1e-6, &mut portable);
            assert_eq!(fast, portable, "{rows}x{dim}");
        }
    }

    /// A row's bits do not depend on the threads: 300 rows (items of 64 and a last of 44) on
    /// 1, 2 and 3 threads, float32 and bfloat16.
    #[test]
    fn threads_give_the_same_bits() {
        use crate::expert_pairs::Bf16;
        let (rows, dim) = (300, 128);
        let x = noise(rows * dim, 70);
        let w = noise(dim, 71);
        let runs = |threads: usize| {
            let mut out = vec![0f32; rows * dim];
            rms_norm(&x, &w, 1e-6, &mut out, threads).unwrap();
            let (xb, wb): (Vec<Bf16>, Vec<Bf16>) =
                (x.iter().map(|&v| Bf16::from_f32(v)).collect(), w.iter().map(|&v| Bf16::from_f32(v)).collect());
            let mut outb = vec![Bf16(0); rows * dim];
            rms_norm(&xb, &wb, 1e-6, &mut outb, threads).unwrap();
            (out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), outb)
        };
        let one = runs(1);
        for threads in [2, 3] {
            assert!(runs(threads) == one, "{threads} threads");
        }
    }

    #[test]
    fn mismatched_lengths_are_errors() {
        let mut out = vec![0f32; 6];
        assert!(rms_norm(&[1.0f32; 6], &[1.0; 4], 1e-6, &mut out, 1).is_err());
        assert!(rms_norm(&[1.0f32; 8], &[1.0; 4], 1e-6, &mut out, 1).is_err());
        assert!(rms_norm(&[1.0f32; 6], &[], 1e-6, &mut out, 1).is_err());
    }
}
