//! RMSNorm of float32 rows on the CPU: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, the
//! arithmetic of torch's float32 rms_norm (the sum of squares in float32, then one reciprocal
//! square root per row). torch's CPU kernel is a composite of several ops and costs more per
//! call than a decode step's few rows take to normalize (docs/benchmarks.md), and a decode step
//! calls it once or more per layer (r3srv.ops.norm's kernel_rms_norm, the CPU backend's).

/// Lanes of running sums, so that consecutive multiply-adds do not wait on each other and the
/// compiler vectorizes the loop.
const LANES: usize = 8;

/// Normalizes each `w.len()`-long row of `x` into `out`. Errors on lengths that do not match.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<(), String> {
    let dim = w.len();
    if dim == 0 || !x.len().is_multiple_of(dim) || out.len() != x.len() {
        return Err(format!("rms_norm: {} inputs and {} outputs for rows of {dim}", x.len(), out.len()));
    }
    for (row, dst) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        normalize_row(row, w, eps, dst);
    }
    Ok(())
}

/// One row: dst = row / sqrt(mean(row^2) + eps) * w (all of w's length).
pub fn normalize_row(row: &[f32], w: &[f32], eps: f32, dst: &mut [f32]) {
    let dim = w.len();
    let mut lanes = [0f32; LANES];
    let whole = dim / LANES * LANES;
    for chunk in row[..whole].chunks_exact(LANES) {
        for i in 0..LANES {
            lanes[i] += chunk[i] * chunk[i];
        }
    }
    let mut sum: f32 = lanes.iter().sum();
    for v in &row[whole..dim] {
        sum += v * v;
    }
    let scale = 1.0 / (sum / dim as f32 + eps).sqrt();
    for ((o, v), g) in dst.iter_mut().zip(row).zip(w) {
        *o = v * scale * g;
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

    #[test]
    fn mismatched_lengths_are_errors() {
        let mut out = vec![0f32; 6];
        assert!(rms_norm(&[1.0; 6], &[1.0; 4], 1e-6, &mut out).is_err());
        assert!(rms_norm(&[1.0; 8], &[1.0; 4], 1e-6, &mut out).is_err());
        assert!(rms_norm(&[1.0; 6], &[], 1e-6, &mut out).is_err());
    }
}
