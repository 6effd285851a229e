//! Shared by the unit tests: deterministic inputs without a random-number crate.

/// `n` values in [-2, 2) from a xorshift generator seeded with `seed`.
pub fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// Whether a test skips here, saying so: this CPU lacks AVX-512 BF16 (the dot-product kernels).
pub(crate) fn skips_without_bf16() -> bool {
    let skip = !crate::matmul_bf16::runs();
    if skip {
        eprintln!("skipped: this CPU lacks AVX-512 BF16");
    }
    skip
}
