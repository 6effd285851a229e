//! The bfloat16 flash prefill kernel (crate::flash_prefill's walk) in AVX-512 BF16 dot products
//! (VDPBF16PS, as `matmul_bf16`): the two products, the scores q.k and the weighted values p.v,
//! run on bfloat16 pairs with float32 sums, twice the float32 FMA's rate. Keys are packed as
//! [head_dim / 2, KEYS] pairs a block, values as [KEYS / 2, v_dim] pairs of adjacent keys (v_dim
//! padded to whole blocks of 64 columns); the weights p are rounded to bfloat16 for the second
//! product (as bfloat16 flash attentions do) and the denominator summed from the rounded weights.

use crate::aligned::Lines;
use crate::flash_prefill::{advance_row, exp_row, padded, Flash, Running, Scratch, Tiles, KEYS, ROWS};
#[cfg(target_arch = "x86_64")]
use crate::flash_prefill::{load_sums, masked_scores, store_sums};
use crate::matmul_bf16::pair_bits;
use crate::paged_attn::Bf16;
use crate::paged_prefill::PagedPrefill;

/// Whether this kernel computes bfloat16 prefills of heads of `head_dim` (with a window, with
/// sinks): the CPU has AVX-512 BF16, no window or sinks, an even head_dim. The one statement of
/// the rule: the CPU backend asks it (paged_prefill_cpu.flash_applies) to choose this kernel
/// over SDPA for long contexts.
pub fn applies_to(head_dim: usize, windowed: bool, sinks: bool) -> bool {
    crate::matmul_bf16::runs() && Bf16::takes(head_dim, windowed, sinks)
}

/// One span's keys and values of one KV head, packed: k [blocks, pairs, KEYS] (pairs: D/2, for
/// AMX tiles rounded up to whole tiles with zero pairs) and v [blocks, KEYS/2, padded(Dv)],
/// positions past the context zero.
pub(crate) struct Packed {
    pub(crate) k: Lines<u32>,
    pub(crate) v: Lines<u32>,
    pub(crate) pairs: usize,
}

fn pack(p: &PagedPrefill<'_, Bf16>, slots: &[i64], g: usize, pairs: usize) -> Packed {
    let (d2, dv) = (pairs, padded(p.v.dim));
    let blocks = slots.len().div_ceil(KEYS);
    let (k_block, v_block) = (d2 * KEYS, KEYS / 2 * dv);
    let mut k = Lines::filled(blocks * k_block, 0u32);
    let mut v = Lines::filled(blocks * v_block, 0u32);
    for (pos, &slot) in slots.iter().enumerate() {
        let (b, j) = (pos / KEYS, pos % KEYS);
        let key = p.k.at(slot as usize, g);
        let kb = &mut k[b * k_block..][..k_block];
        for (i, two) in key.chunks_exact(2).enumerate() {
            kb[i * KEYS + j] = pair_bits(two[0].0, two[1].0);
        }
        // the value goes into its pair's low half (even position) or high half (odd)
        let vb = &mut v[b * v_block + j / 2 * dv..][..dv];
        let shift = 16 * (j % 2);
        for (dst, x) in vb.iter_mut().zip(p.v.at(slot as usize, g)) {
            *dst |= (x.0 as u32) << shift;
        }
    }
    Packed { k, v, pairs }
}

impl Flash for Bf16 {
    type Packed = Packed;

    fn pack(p: &PagedPrefill<'_, Self>, slots: &[i64], kv_head: usize, tiles: Tiles) -> Packed {
        let pairs = if tiles == Tiles::Amx { crate::flash_amx::key_pairs(p.q.dim) } else { p.q.dim / 2 };
        pack(p, slots, kv_head, pairs)
    }

    fn takes(head_dim: usize, windowed: bool, sinks: bool) -> bool {
        !windowed && !sinks && head_dim.is_multiple_of(2)
    }

    /// AMX tiles (crate::amx::runs) or AVX-512 BF16 dot products (which have no AVX2 form).
    fn runs(tiles: Tiles) -> bool {
        match tiles {
            Tiles::Amx => crate::matmul_bf16::Products::Tiles.runs(),
            Tiles::Avx512 => crate::matmul_bf16::runs(),
            Tiles::Avx2 => false,
        }
    }

    /// AMX tiles where the expert pass may take them (settings.amx_tiles, one switch for both).
    fn allowed(tiles: Tiles) -> bool {
        tiles != Tiles::Amx || crate::matmul_bf16::tiles_allowed()
    }

    unsafe fn amx_tile(
        p: &PagedPrefill<'_, Self>,
        packed: &Packed,
        q: &[*const Self],
        pos: &[usize],
        blocks: usize,
        s: &mut Scratch,
    ) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded, the caller's contract (runs(Tiles::Amx)); packed in its pairs (`pack`).
        unsafe {
            crate::flash_amx::tile(p, packed, q, pos, blocks, s)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (p, packed, q, pos, blocks, s);
            unreachable!("runs is false off x86_64")
        }
    }

    unsafe fn tile<const R: usize>(
        tiles: Tiles,
        p: &PagedPrefill<'_, Self>,
        packed: &Packed,
        q: &[*const Self; ROWS],
        pos: &[usize; ROWS],
        blocks: std::ops::Range<usize>,
        running: &mut Running,
        acc: &mut [f32],
        s: &mut Scratch,
    ) {
        debug_assert_eq!(tiles, Tiles::Avx512);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded, the caller's contract (runs(tiles): AVX-512F and AVX-512 BF16); a
        // query's bfloat16 pairs read as u32s.
        unsafe {
            tile::<R>(p, packed, &q.map(|q| q as *const u32), pos, blocks, running, acc, s)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (p, packed, q, pos, blocks, running, acc, s);
            unreachable!("runs is false off x86_64")
        }
    }
}

/// R rows' attention over key blocks `blocks` into their sums `acc_rows` (`Flash::tile`).
///
/// # Safety
/// As `Flash::tile`; q[..R] point at the rows' queries (head_dim bfloat16 each).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize>(
    p: &PagedPrefill<'_, Bf16>,
    packed: &Packed,
    q: &[*const u32; ROWS],
    pos: &[usize; ROWS],
    blocks: std::ops::Range<usize>,
    running: &mut Running,
    acc_rows: &mut [f32],
    s: &mut Scratch,
) {
    use std::arch::x86_64::*;
    let (d2, dv) = (p.q.dim / 2, padded(p.v.dim));
    let (k_block, v_block) = (packed.pairs * KEYS, KEYS / 2 * dv);
    let (mut max, mut total) = running.rows::<R>();
    for b in blocks {
        // scores: q . k for the block's keys
        let kp = packed.k.as_ptr().add(b * k_block);
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for kk in 0..d2 {
            let w: [__m512bh; 4] = std::array::from_fn(|c| {
                std::mem::transmute(_mm512_loadu_si512(kp.add(kk * KEYS + 16 * c) as *const _))
            });
            for (a, qr) in acc.iter_mut().zip(q) {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(qr.add(kk).read_unaligned() as i32));
                for (a, w) in a.iter_mut().zip(&w) {
                    *a = _mm512_dpbf16_ps(*a, *w, x);
                }
            }
        }
        // scaled, keys after a row's query at -inf, and each row's running maximum
        let tops = masked_scores(&acc, p.scale, pos, b, &max, &mut s.scores);
        // the online softmax, row by row
        for i in 0..R {
            let scores = &mut s.scores[i * KEYS..(i + 1) * KEYS];
            let fix = exp_row(scores, tops[i], max[i]);
            // the weights rounded to bfloat16 pairs, and their sum as rounded
            let sp = scores.as_ptr();
            let mut sum = _mm512_setzero_ps();
            for half in 0..2 {
                let pairs =
                    _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sp.add(32 * half + 16)), _mm512_loadu_ps(sp.add(32 * half)));
                let pairs: __m512i = std::mem::transmute(pairs);
                _mm512_storeu_si512(s.weights.as_mut_ptr().add(i * KEYS / 2 + 16 * half) as *mut _, pairs);
                let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(pairs));
                let odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(-65536)));
                sum = _mm512_add_ps(sum, _mm512_add_ps(even, odd));
            }
            advance_row(
                &mut max[i],
                &mut total[i],
                &mut acc_rows[i * dv..(i + 1) * dv],
                tops[i],
                fix,
                _mm512_reduce_add_ps(sum),
            );
        }
        // values: acc += p . v, 64 columns at a time
        let vp = packed.v.as_ptr().add(b * v_block);
        for c0 in (0..dv).step_by(64) {
            let mut acc = load_sums::<R>(acc_rows, dv, c0);
            for kk in 0..KEYS / 2 {
                let w: [__m512bh; 4] = std::array::from_fn(|c| {
                    std::mem::transmute(_mm512_loadu_si512(vp.add(kk * dv + c0 + 16 * c) as *const _))
                });
                for (i, a) in acc.iter_mut().enumerate() {
                    let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(s.weights[i * KEYS / 2 + kk] as i32));
                    for (a, w) in a.iter_mut().zip(&w) {
                        *a = _mm512_dpbf16_ps(*a, *w, x);
                    }
                }
            }
            store_sums(&acc, acc_rows, dv, c0);
        }
    }
    running.keep(max, total);
}
