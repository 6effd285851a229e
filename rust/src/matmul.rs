//! out [n, rows] = vs [n, K] @ m [rows, K]^T through the `gemm` crate's packed, cache-blocked
//! kernels: for the expert pass's large chunks (a prefill's hundreds of pairs per expert),
//! where they run the FMA units at close to their peak, against about two thirds of it for
//! `gemm_nt`'s dot products. Its summation order is the crate's, not `gemm_nt`'s.

/// out [n, rows] = vs [n, cols] @ m [rows, cols]^T, with cols = m.len() / rows.
pub fn matmul_nt(m: &[f32], rows: usize, vs: &[f32], out: &mut [f32]) {
    let Some(cols) = crate::expert_pairs::nt_cols("matmul_nt", m.len(), rows, vs.len(), out) else { return };
    let n = vs.len() / cols;
    // SAFETY: every pointer covers the extent its strides give, as nt_cols checked:
    // dst [n, rows] row-major, lhs [n, cols] row-major, rhs = m^T read as [cols, rows] with a
    // column stride of cols. beta = 1 with read_dst false: dst = lhs @ rhs.
    unsafe {
        gemm::gemm(
            n,
            rows,
            cols,
            out.as_mut_ptr(),
            1,
            rows as isize,
            false,
            vs.as_ptr(),
            1,
            cols as isize,
            m.as_ptr(),
            cols as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::noise;

    #[test]
    fn matches_the_definition_in_f64() {
        for (rows, cols, n) in [(1, 1, 1), (3, 7, 5), (256, 128, 97), (17, 256, 64), (64, 9, 300)] {
            let (m, vs) = (noise(rows * cols, rows as u64 + 1), noise(n * cols, cols as u64 + 2));
            let mut out = vec![f32::NAN; n * rows];
            matmul_nt(&m, rows, &vs, &mut out);
            for j in 0..n {
                for r in 0..rows {
                    let want: f64 = (0..cols).map(|c| m[r * cols + c] as f64 * vs[j * cols + c] as f64).sum();
                    let got = out[j * rows + r] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{rows}x{cols} n={n} [{j}, {r}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}
