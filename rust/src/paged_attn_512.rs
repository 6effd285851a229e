//! The paged decode kernel's scores in AVX-512 registers (crate::paged_attn's Isa::Avx512), two
//! keys to a register (its weighted sums run 16 value dims to a register in paged_attn's
//! `weigh_chunk`). Each lane runs the multiply-adds of the AVX2 scorer's lanes in their order,
//! and each score is reduced as there, so both give the same bits (`paged_attn`'s test
//! `the_avx512_path_gives_the_avx2_bits`) with half the multiply-add instructions
//! (docs/benchmarks.md, "Decode attention two keys to a register").

use crate::paged_attn::{key_scores, score_one_by_one_avx2, Element, PagedDecode, TILE};

/// crate::paged_attn's `score_keys_avx2::<T, NH, 2 * KP>` with two keys to an AVX-512 register
/// (key 2i in the low 8 lanes, 2i + 1 in the high 8): each lane takes the multiply-adds of the
/// AVX2 8-lane sums in the same order, and each key's 8 lanes are reduced by the same `reduce4`;
/// a last group of fewer keys one by one, as there.
///
/// # Safety
/// The CPU must support AVX2, FMA and AVX-512F.
#[inline(always)]
pub(crate) unsafe fn score_key_pairs<T: Element, const NH: usize, const KP: usize>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    q: &[f32],
    scores: &mut [f32],
    g0: usize,
) {
    use std::arch::x86_64::*;
    let dim = d.q.dim;
    let whole = dim / 8 * 8;
    let heads_q = &q[g0 * dim..(g0 + NH) * dim];
    let kb = 2 * KP;
    let grouped = slots.len() / kb * kb;
    for j0 in (0..grouped).step_by(kb) {
        let keys: [&[T]; 4] = std::array::from_fn(|i| d.k.at(slots[j0 + i.min(kb - 1)], kv_head));
        // SAFETY: each key holds `dim` elements and each query row `dim` (q is [heads, dim]):
        // every 8-wide load at c < whole stays inside them; AVX2, FMA and AVX-512F by the
        // caller's contract.
        unsafe {
            let mut sums = [[_mm512_setzero_ps(); KP]; NH];
            for c in (0..whole).step_by(8) {
                let kc: [__m512; KP] =
                    std::array::from_fn(|i| T::load8x2(keys[2 * i].as_ptr().add(c), keys[2 * i + 1].as_ptr().add(c)));
                for (h, row) in sums.iter_mut().enumerate() {
                    let q8 = _mm256_castps_pd(_mm256_loadu_ps(heads_q.as_ptr().add(h * dim + c)));
                    let qc = _mm512_castpd_ps(_mm512_broadcast_f64x4(q8)); // the same 8 in both halves
                    for (sum, &k) in row.iter_mut().zip(&kc) {
                        *sum = _mm512_fmadd_ps(qc, k, *sum);
                    }
                }
            }
            let halves = |a: __m512| -> [__m256; 2] {
                [_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)))]
            };
            for (h, row) in sums.iter().enumerate() {
                let [a, b] = halves(row[0]);
                let [c, e] = if KP == 2 { halves(row[KP - 1]) } else { [a, b] };
                let q_h = &heads_q[h * dim..(h + 1) * dim];
                key_scores(d, [a, b, c, e], &keys[..kb], q_h, whole, &mut scores[(g0 + h) * TILE + j0..][..kb]);
            }
        }
    }
    // SAFETY: forwarded, the caller's contract.
    unsafe { score_one_by_one_avx2::<T, NH>(d, kv_head, &slots[grouped..], q, &mut scores[grouped..], g0) };
}
