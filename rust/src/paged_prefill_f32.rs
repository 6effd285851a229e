//! The float32 flash prefill kernel (crate::flash_prefill's walk) in AVX-512 FMA: keys packed as
//! [head_dim, KEYS] a block, values as [KEYS, v_dim] (v_dim padded to whole blocks of 64
//! columns), so that both products, the scores q.k and the weighted values p.v, are register
//! tiles of 6 rows x 64 lanes fed by one broadcast a row and four loads a step: the rate of
//! a GEMM, where `paged_prefill`'s kernel shares each key row's load among fewer running sums.

use crate::flash_prefill::{advance_row, exp_row, normalize, padded, Flash, Scratch, KEYS, ROWS};
#[cfg(target_arch = "x86_64")]
use crate::flash_prefill::{load_sums, masked_scores, store_sums};
use crate::paged_prefill::PagedPrefill;

/// Whether this kernel computes float32 prefills (with a window, with sinks): the CPU has
/// AVX-512F, no window or sinks. The one statement of the rule: the CPU backend asks it
/// (paged_prefill_cpu.flash_applies) to choose this kernel over SDPA for long contexts.
pub fn applies_to(_head_dim: usize, windowed: bool, sinks: bool) -> bool {
    runs() && !windowed && !sinks
}

/// Whether this CPU has AVX-512F, detected once.
fn runs() -> bool {
    static RUNS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *RUNS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") {
            return true;
        }
        false
    })
}

/// One span's keys and values of one KV head, packed: k [blocks, D, KEYS] and
/// v [blocks, KEYS, padded(Dv)], positions past the context zero.
pub(crate) struct Packed {
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Flash for f32 {
    type Packed = Packed;

    fn pack(p: &PagedPrefill<'_, f32>, slots: &[i64], kv_head: usize) -> Packed {
        let (d, dv) = (p.q.dim, padded(p.v.dim));
        let blocks = slots.len().div_ceil(KEYS);
        let (k_block, v_block) = (d * KEYS, KEYS * dv);
        let mut k = vec![0f32; blocks * k_block];
        let mut v = vec![0f32; blocks * v_block];
        for (pos, &slot) in slots.iter().enumerate() {
            let (b, j) = (pos / KEYS, pos % KEYS);
            let kb = &mut k[b * k_block..][..k_block];
            for (i, &x) in p.k.at(slot as usize, kv_head).iter().enumerate() {
                kb[i * KEYS + j] = x;
            }
            v[b * v_block + j * dv..][..p.v.dim].copy_from_slice(p.v.at(slot as usize, kv_head));
        }
        Packed { k, v }
    }

    unsafe fn tile<const R: usize>(p: &PagedPrefill<'_, f32>, packed: &Packed, q: &[*const f32; ROWS],
                                   pos: &[usize; ROWS], blocks: usize, s: &mut Scratch) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded, the caller's contract (applies_to: AVX-512F).
        unsafe {
            tile::<R>(p, packed, q, pos, blocks, s)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (p, packed, q, pos, blocks, s);
            unreachable!("applies_to is false off x86_64")
        }
    }
}

/// R rows' attention over their key blocks into s.acc (normalized).
///
/// # Safety
/// As `Flash::tile`; q[..R] point at the rows' queries (head_dim float32 each).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile<const R: usize>(p: &PagedPrefill<'_, f32>, packed: &Packed, q: &[*const f32; ROWS],
                               pos: &[usize; ROWS], blocks: usize, s: &mut Scratch) {
    use std::arch::x86_64::*;
    let (d, dv) = (p.q.dim, padded(p.v.dim));
    let (k_block, v_block) = (d * KEYS, KEYS * dv);
    let mut max = [f32::NEG_INFINITY; R];
    let mut total = [0f32; R];
    s.acc[..R * dv].fill(0.0);
    for b in 0..blocks {
        // scores: q . k for the block's keys
        let kp = packed.k.as_ptr().add(b * k_block);
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for kk in 0..d {
            let w: [__m512; 4] = std::array::from_fn(|c| _mm512_loadu_ps(kp.add(kk * KEYS + 16 * c)));
            for (a, qr) in acc.iter_mut().zip(q) {
                let x = _mm512_set1_ps(qr.add(kk).read());
                for (a, w) in a.iter_mut().zip(&w) {
                    *a = _mm512_fmadd_ps(x, *w, *a);
                }
            }
        }
        // scaled, keys after a row's query at -inf, and each row's running maximum
        let tops = masked_scores(&acc, p.scale, pos, b, &max, &mut s.scores);
        // the online softmax, row by row
        for i in 0..R {
            let scores = &mut s.scores[i * KEYS..(i + 1) * KEYS];
            let fix = exp_row(scores, tops[i], max[i]);
            let sp = scores.as_ptr();
            let sum = _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(sp), _mm512_loadu_ps(sp.add(16))),
                                    _mm512_add_ps(_mm512_loadu_ps(sp.add(32)), _mm512_loadu_ps(sp.add(48))));
            advance_row(&mut max[i], &mut total[i], &mut s.acc[i * dv..(i + 1) * dv], tops[i], fix, _mm512_reduce_add_ps(sum));
        }
        // values: acc += p . v, 64 columns at a time
        let vp = packed.v.as_ptr().add(b * v_block);
        for c0 in (0..dv).step_by(64) {
            let mut acc = load_sums::<R>(&s.acc, dv, c0);
            for kk in 0..KEYS {
                let w: [__m512; 4] = std::array::from_fn(|c| _mm512_loadu_ps(vp.add(kk * dv + c0 + 16 * c)));
                for (i, a) in acc.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(s.scores[i * KEYS + kk]);
                    for (a, w) in a.iter_mut().zip(&w) {
                        *a = _mm512_fmadd_ps(x, *w, *a);
                    }
                }
            }
            store_sums(&acc, &mut s.acc, dv, c0);
        }
    }
    normalize(&mut s.acc[..R * dv], &total, dv);
}
