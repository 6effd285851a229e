//! The paged decode kernel's products in AVX-512 registers (crate::paged_attn's Isa::Avx512):
//! two keys to a register for the scores, 16 value dims to a register for the weighted sums.
//! Each lane runs the multiply-adds of the AVX2 kernels' lanes in their order, and each score
//! is reduced as they reduce it, so both give the same bits (`paged_attn`'s test
//! `the_avx512_path_gives_the_avx2_bits`) with half the multiply-add instructions
//! (docs/benchmarks.md, "Decode attention two keys to a register").

use crate::paged_attn::{
    in_head_blocks, reduce4, score_one_by_one_avx2, weigh_chunk, Element, PagedDecode, HEAD_BLOCK, TILE,
};

/// crate::paged_attn's `score_tile` with two keys to an AVX-512 register (key 2i in the low 8
/// lanes, 2i + 1 in the high 8): each lane takes the multiply-adds of `score_keys_avx2`'s 8-lane
/// sums in the same order, and each key's 8 lanes are reduced by the same `reduce4`.
///
/// # Safety
/// The CPU must support AVX2, FMA and AVX-512F.
#[target_feature(enable = "avx2,fma,avx512f")]
pub(crate) unsafe fn score_tile<T: Element>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    q: &[f32],
    scores: &mut [f32],
) {
    // SAFETY: forwarded, the caller's contract.
    unsafe { in_head_blocks!(q.len() / d.q.dim, score_heads_512::<T>(d, kv_head, slots, q, scores)) };
}

/// `score_heads_avx2`'s blocks (4 keys for one or two heads, 2 for three or four) as pairs of
/// keys in AVX-512 registers.
///
/// # Safety
/// The CPU must support AVX2, FMA and AVX-512F.
#[inline(always)]
unsafe fn score_heads_512<T: Element, const NH: usize>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    q: &[f32],
    scores: &mut [f32],
    g0: usize,
) {
    // SAFETY: forwarded, the caller's contract.
    unsafe {
        if NH <= 2 {
            score_key_pairs_512::<T, NH, 2>(d, kv_head, slots, q, scores, g0)
        } else {
            score_key_pairs_512::<T, NH, 1>(d, kv_head, slots, q, scores, g0)
        }
    }
}

/// `score_keys_avx2::<T, NH, 2 * KP>` with each pair of keys in one register; a last group of
/// fewer keys one by one, as there.
///
/// # Safety
/// The CPU must support AVX2, FMA and AVX-512F.
#[inline(always)]
unsafe fn score_key_pairs_512<T: Element, const NH: usize, const KP: usize>(
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
                let mut totals = [0f32; 4];
                _mm_storeu_ps(totals.as_mut_ptr(), reduce4(a, b, c, e));
                for (i, total) in totals.iter().take(kb).enumerate() {
                    let mut total = *total;
                    for (x, y) in heads_q[h * dim + whole..(h + 1) * dim].iter().zip(&keys[i][whole..]) {
                        total = x.mul_add(y.to_f32(), total);
                    }
                    scores[(g0 + h) * TILE + j0 + i] = total * d.scale;
                }
            }
        }
    }
    // SAFETY: forwarded, the caller's contract.
    unsafe { score_one_by_one_avx2::<T, NH>(d, kv_head, &slots[grouped..], q, &mut scores[grouped..], g0) };
}

/// crate::paged_attn's `weigh_values` with 16 value dims to an AVX-512 register (32 for one or two heads, 16 for
/// three or four, then `weigh_chunk`'s 8 and the dims left one by one): each dim's sum runs over
/// the keys in order, as in `weigh_heads_avx2`: the same bits.
///
/// # Safety
/// The CPU must support AVX2, FMA and AVX-512F.
#[target_feature(enable = "avx2,fma,avx512f")]
pub(crate) unsafe fn weigh_values<T: Element>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    scores: &[f32],
    acc: &mut [f32],
) {
    // SAFETY: forwarded, the caller's contract.
    unsafe { in_head_blocks!(acc.len() / d.v.dim, weigh_heads_512::<T>(d, kv_head, slots, scores, acc)) };
}

/// `weigh_heads_avx2` for heads g0..g0 + NH in AVX-512 registers.
///
/// # Safety
/// The CPU must support AVX2, FMA and AVX-512F.
#[inline(always)]
unsafe fn weigh_heads_512<T: Element, const NH: usize>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    scores: &[f32],
    acc: &mut [f32],
    g0: usize,
) {
    let v_dim = d.v.dim;
    let n = slots.len();
    assert!(n <= TILE && (g0 + NH) * TILE <= scores.len() && (g0 + NH) * v_dim <= acc.len());
    let mut rows = [std::ptr::null::<T>(); TILE];
    for (row, &slot) in rows.iter_mut().zip(slots) {
        *row = d.v.at(slot, kv_head).as_ptr(); // bounds-checked: v_dim readable elements
    }
    let probs: [*const f32; NH] = std::array::from_fn(|h| scores[(g0 + h) * TILE..].as_ptr());
    let sums_at: [*mut f32; NH] = std::array::from_fn(|h| acc[(g0 + h) * v_dim..].as_mut_ptr());
    let rows = &rows[..n];
    let mut c = 0;
    // SAFETY: as weigh_heads_avx2's; AVX-512F too by the caller's contract.
    unsafe {
        if NH <= 2 {
            while c + 32 <= v_dim {
                weigh_chunk_512::<T, NH, 2>(rows, &probs, &sums_at, c);
                c += 32;
            }
        }
        while c + 16 <= v_dim {
            weigh_chunk_512::<T, NH, 1>(rows, &probs, &sums_at, c);
            c += 16;
        }
        if c + 8 <= v_dim {
            weigh_chunk::<T, NH, 1>(rows, &probs, &sums_at, c);
            c += 8;
        }
        for i in c..v_dim {
            for h in 0..NH {
                let mut sum = *sums_at[h].add(i);
                for (j, &row) in rows.iter().enumerate() {
                    sum = (*probs[h].add(j)).mul_add((*row.add(i)).to_f32(), sum);
                }
                *sums_at[h].add(i) = sum;
            }
        }
    }
}

/// Dims c..c + W * 16 of weigh_heads_512: W * NH running sums in registers over the keys.
///
/// # Safety
/// As `weigh_chunk`, with W * 16 dims; AVX-512F.
#[inline(always)]
unsafe fn weigh_chunk_512<T: Element, const NH: usize, const W: usize>(
    rows: &[*const T],
    probs: &[*const f32; NH],
    sums_at: &[*mut f32; NH],
    c: usize,
) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let mut sums: [[__m512; W]; NH] =
            std::array::from_fn(|h| std::array::from_fn(|w| _mm512_loadu_ps(sums_at[h].add(c + 16 * w))));
        for (j, &row) in rows.iter().enumerate() {
            let v: [__m512; W] = std::array::from_fn(|w| T::load16(row.add(c + 16 * w)));
            for (h, lanes) in sums.iter_mut().enumerate() {
                let p = _mm512_set1_ps(*probs[h].add(j));
                for (sum, &x) in lanes.iter_mut().zip(&v) {
                    *sum = _mm512_fmadd_ps(p, x, *sum);
                }
            }
        }
        for (h, lanes) in sums.iter().enumerate() {
            for (w, &sum) in lanes.iter().enumerate() {
                _mm512_storeu_ps(sums_at[h].add(c + 16 * w), sum);
            }
        }
    }
}
