//! The paged decode kernel's bfloat16 scores in AVX-512 BF16 dot products (crate::paged_attn's
//! Isa::Avx512Bf16): a GQA block of eight query heads in one 8-lane register, so that each
//! VDPBF16PS adds two dims of one key to all eight heads' scores. A key's pair of dims is
//! broadcast from where it lies in the cache and the queries are read as [pairs, 8 heads]
//! (`transpose_queries`, once a sequence), so no score needs a reduction across lanes (the
//! float32 scorer reduces every score's 8 lanes) and each instruction does twice a float32
//! FMA's multiply-adds. The sums are the dot product's own (bfloat16 pairs, float32 sums,
//! subnormal inputs as zero): close to the float32 scorer's, not its bits.

use crate::paged_attn::{Element, PagedDecode, TILE};

/// The query heads a register's lanes hold.
pub(crate) const HEADS: usize = 8;
/// Keys scored together: as many independent chains of dot products.
const KEYS: usize = 8;

/// The group's queries `q` ([heads, dim] in f32, each a bfloat16 widened) as bfloat16 pairs in
/// blocks of HEADS heads: `qt[(b * pairs + p) * HEADS + h]` holds dims 2p and 2p + 1 of head
/// b * HEADS + h (the low half the even dim), for the blocks of whole HEADS heads.
pub(crate) fn transpose_queries(q: &[f32], dim: usize, qt: &mut [u32]) {
    let pairs = dim / 2;
    let blocks = q.len() / dim / HEADS;
    for b in 0..blocks {
        for h in 0..HEADS {
            let head = &q[(b * HEADS + h) * dim..][..dim];
            for (p, two) in head.chunks_exact(2).enumerate() {
                qt[(b * pairs + p) * HEADS + h] = two[0].to_bits() >> 16 | (two[1].to_bits() & 0xffff_0000);
            }
        }
    }
}

/// `scores[h * TILE + j] = q_h . k_j * scale` for the HEADS heads of one block (`qt`: that
/// block's [pairs, HEADS]) and the keys at `slots`, T bfloat16 (rows of an even dim).
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512 BF16 and AVX-512VL (the rest is asserted: T bfloat16,
/// an even head dim, `qt` of dim / 2 * HEADS pairs, `scores` of HEADS rows of TILE).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512vl")]
pub(crate) unsafe fn score_block<T: Element>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    qt: &[u32],
    scores: &mut [f32],
) {
    use std::arch::x86_64::*;
    let pairs = d.q.dim / 2;
    assert!(T::BF16 && d.q.dim.is_multiple_of(2) && qt.len() >= pairs * HEADS && scores.len() >= HEADS * TILE);
    let scale = _mm256_set1_ps(d.scale);
    for j0 in (0..slots.len()).step_by(KEYS) {
        let n = KEYS.min(slots.len() - j0);
        // a last group of fewer keys repeats its last one (computed, not stored)
        let keys: [*const u32; KEYS] =
            std::array::from_fn(|i| d.k.at(slots[j0 + i.min(n - 1)], kv_head).as_ptr() as *const u32);
        let mut acc = [_mm256_setzero_ps(); KEYS];
        for p in 0..pairs {
            // SAFETY: p < pairs: each key row holds 2 * pairs bfloat16 (read unaligned), qt
            // pairs * HEADS pairs; the CPU's features by the caller's contract.
            unsafe {
                let qp: __m256bh =
                    std::mem::transmute(_mm256_loadu_si256(qt.as_ptr().add(p * HEADS) as *const __m256i));
                for (a, k) in acc.iter_mut().zip(&keys) {
                    let kp: __m256bh = std::mem::transmute(_mm256_set1_epi32(k.add(p).read_unaligned() as i32));
                    *a = _mm256_dpbf16_ps(*a, qp, kp);
                }
            }
        }
        let mut lanes = [[0f32; HEADS]; KEYS];
        for (dst, a) in lanes.iter_mut().zip(&acc) {
            // SAFETY: HEADS floats stored into HEADS.
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), _mm256_mul_ps(*a, scale)) };
        }
        for (i, key) in lanes.iter().enumerate().take(n) {
            for (h, &s) in key.iter().enumerate() {
                scores[h * TILE + j0 + i] = s;
            }
        }
    }
}
