//! bfloat16 rows in AVX-512 registers for the per-token kernels (`rms_norm`, `qk_rope`): 16
//! values widened to f32 lanes, f32 lanes rounded to bfloat16 exactly as `Bf16::round` rounds
//! them (nearest, ties to even, NaN to the one quiet NaN: integer ops, not VCVTNEPS2BF16, which
//! flushes denormals), and 16 rounded lanes narrowed back and stored. The compiler's own
//! vectorization of those loops ran 8 lanes wide with a NaN blend and a pack per 8 values.

use std::arch::x86_64::*;

use crate::expert_pairs::Bf16;

/// The 16 values at `src` as f32 lanes (exact).
///
/// # Safety
/// The CPU must support AVX-512F; `src` must point to 16 readable values.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn load16(src: *const Bf16) -> __m512 {
    // SAFETY: 16 values (32 bytes) at src, the caller's contract.
    let half = unsafe { _mm256_loadu_si256(src as *const __m256i) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half)))
}

/// Each lane rounded to bfloat16 and kept in f32: `Bf16::round` lane by lane.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn round16(v: __m512) -> __m512 {
    let bits = _mm512_castps_si512(v);
    let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let rounded = _mm512_and_si512(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
        _mm512_set1_epi32(0xffff_0000u32 as i32),
    );
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7fc0_0000)))
}

/// Stores 16 lanes that `round16` rounded (their low halves zero) as bfloat16 at `dst`.
///
/// # Safety
/// The CPU must support AVX-512F; `dst` must point to 16 writable values.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn store16(dst: *mut Bf16, rounded: __m512) {
    let high = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(_mm512_castps_si512(rounded)));
    // SAFETY: 16 values (32 bytes) at dst, the caller's contract.
    unsafe { _mm256_storeu_si256(dst as *mut __m256i, high) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::expert_pairs::Element;

    /// Every lane rounds and stores as `Bf16::from_f32`, on ties, odd and even halves, the
    /// largest finite values (which round to infinity), infinities, NaNs and denormals.
    #[test]
    fn lanes_round_and_store_as_bf16_from_f32_does() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        let mut values: Vec<f32> = [
            0.0,
            -0.0,
            1.0,
            -1.5,
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MIN_POSITIVE,
            1e-40,
            -3e-39,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffc1_2345),
        ]
        .to_vec();
        // ties and their neighbours around even and odd bfloat16 values
        for high in [0x3f80u32, 0x3f81, 0xc2a7, 0x0001, 0x7f7f] {
            for low in [0x0000u32, 0x7fff, 0x8000, 0x8001, 0xffff] {
                values.push(f32::from_bits(high << 16 | low));
            }
        }
        values.extend(crate::testing::noise(64, 9).iter().map(|v| v * 1e3));
        values.resize(values.len().div_ceil(16) * 16, 0.5);
        for chunk in values.chunks_exact(16) {
            let mut stored = [Bf16(0); 16];
            // SAFETY: AVX-512F checked above; 16 values read and written.
            unsafe { store16(stored.as_mut_ptr(), round16(_mm512_loadu_ps(chunk.as_ptr()))) };
            let widened: [f32; 16] = std::array::from_fn(|i| stored[i].to_f32());
            let mut again = [0f32; 16];
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(again.as_mut_ptr(), load16(stored.as_ptr())) };
            for (i, &v) in chunk.iter().enumerate() {
                assert_eq!(stored[i], Bf16::from_f32(v), "{v:e} ({:#x})", v.to_bits());
                assert_eq!(again[i].to_bits(), widened[i].to_bits());
            }
        }
    }
}
