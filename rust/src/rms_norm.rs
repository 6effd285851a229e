//! RMSNorm of float32 or bfloat16 rows on the CPU: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w.
//! float32 rows follow torch's float32 rms_norm (the sum of squares in float32, then one
//! reciprocal square root per row); bfloat16 rows the HF reference r3srv.models.layers.rms_norm
//! follows (normalized in float32, rounded to bfloat16, then multiplied by the weight and
//! rounded again, as torch's bfloat16 multiply does). torch's CPU kernel is a composite of
//! several ops and costs more per call than a decode step's few rows take to normalize
//! (docs/benchmarks.md), and a decode step calls it once or more per layer (r3srv.ops.norm's
//! kernel_rms_norm, the CPU backend's).

use crate::expert_pairs::Element;

/// Lanes of running sums, so that consecutive multiply-adds do not wait on each other and the
/// compiler vectorizes the loop.
const LANES: usize = 8;

/// Normalizes each `w.len()`-long row of `x` into `out`. Errors on lengths that do not match.
pub fn rms_norm<W: Element>(x: &[W], w: &[W], eps: f32, out: &mut [W]) -> Result<(), String> {
    let dim = w.len();
    if dim == 0 || !x.len().is_multiple_of(dim) || out.len() != x.len() {
        return Err(format!("rms_norm: {} inputs and {} outputs for rows of {dim}", x.len(), out.len()));
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        unsafe { rows_avx2(x, w, eps, out) };
        return Ok(());
    }
    rows(x, w, eps, out);
    Ok(())
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
            rms_norm(&x, &w, 1e-6, &mut out).unwrap();
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
        for (rows, dim) in [(3, 256), (2, 13), (1, 64)] {
            let x: Vec<Bf16> = noise(rows * dim, 7).into_iter().map(Bf16::from_f32).collect();
            let w: Vec<Bf16> = noise(dim, 8).into_iter().map(|v| Bf16::from_f32(v + 2.5)).collect();
            let (xf, ones) = (x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>(), vec![1.0f32; dim]);
            let mut normed = vec![0f32; rows * dim];
            rms_norm(&xf, &ones, 1e-6, &mut normed).unwrap(); // the same sums, unscaled
            let mut out = vec![Bf16(0); rows * dim];
            rms_norm(&x, &w, 1e-6, &mut out).unwrap();
            for (i, got) in out.iter().enumerate() {
                let want = Bf16::from_f32(Bf16::from_f32(normed[i]).to_f32() * w[i % dim].to_f32());
                assert_eq!(*got, want, "{rows}x{dim} [{i}]");
            }
        }
    }

    #[test]
    fn mismatched_lengths_are_errors() {
        let mut out = vec![0f32; 6];
        assert!(rms_norm(&[1.0f32; 6], &[1.0; 4], 1e-6, &mut out).is_err());
        assert!(rms_norm(&[1.0f32; 8], &[1.0; 4], 1e-6, &mut out).is_err());
        assert!(rms_norm(&[1.0f32; 6], &[], 1e-6, &mut out).is_err());
    }
}
