//! The float32 flash prefill kernel (crate::flash_prefill's walk) in FMA register tiles: keys
//! packed as [head_dim, lanes] runs of a block's KEYS, values as [KEYS, lanes] runs of their
//! columns (v_dim padded to whole blocks of 64), so that both products, the scores q.k and the
//! weighted values p.v, are register tiles fed by one broadcast a row and a few loads a step
//! from one run: the rate of a GEMM, where `paged_prefill`'s kernel shares each key row's load
//! among fewer running sums. AVX-512 tiles take 6 rows x 64 lanes (one run a block); AVX2's 16
//! registers take 6 rows x 16 lanes, a block's keys or each 64 value columns in four runs. Both
//! keep every chain's order (the same bits).

use crate::aligned::Lines;
use crate::flash_prefill::{advance_row, exp_row, padded, Flash, Running, Scratch, Tiles, KEYS, ROWS};
#[cfg(target_arch = "x86_64")]
use crate::flash_prefill::{load_sums, masked_scores, store_sums, sum_halves};
#[cfg(target_arch = "x86_64")]
use crate::paged_attn::lane_max;
use crate::paged_prefill::PagedPrefill;

/// Whether this kernel computes float32 prefills (with a window, with sinks) at any context
/// length: the CPU has AVX-512F, no window or sinks. The one statement of the rule: the CPU
/// backend asks it (paged_prefill_cpu.flash_applies) to choose this kernel over SDPA for long
/// contexts. AVX2 tiles take only the contexts the portable kernel would (to the backend's
/// RUST_PREFILL_MAX_CONTEXT): past them SDPA runs as fast (docs/benchmarks.md).
pub fn applies_to(_head_dim: usize, windowed: bool, sinks: bool) -> bool {
    f32::runs(Tiles::Avx512) && f32::takes(0, windowed, sinks)
}

/// One span's keys and values of one KV head, packed in runs of `lanes(tiles)`: k [blocks,
/// KEYS / lanes, D, lanes] and v [blocks, padded(Dv) / lanes, KEYS, lanes], positions past the
/// context zero; each tile's pass reads its run's rows one after another.
pub(crate) struct Packed {
    k: Lines<f32>,
    v: Lines<f32>,
}

/// The keys or value columns a tile's register row holds: four zmm, or two ymm.
fn lanes(tiles: Tiles) -> usize {
    match tiles {
        Tiles::Avx512 => KEYS,
        Tiles::Avx2 => 16,
        Tiles::Amx => unreachable!("no float32 AMX tiles"),
    }
}

/// `Flash::pack` in runs of W lanes (a constant: the runs' arithmetic is shifts and masks).
fn pack<const W: usize>(p: &PagedPrefill<'_, f32>, slots: &[i64], kv_head: usize) -> Packed {
    let (d, dv) = (p.q.dim, padded(p.v.dim));
    let blocks = slots.len().div_ceil(KEYS);
    let (k_block, v_block) = (d * KEYS, KEYS * dv);
    let mut k = Lines::filled(blocks * k_block, 0f32);
    let mut v = Lines::filled(blocks * v_block, 0f32);
    for (pos, &slot) in slots.iter().enumerate() {
        let (b, j) = (pos / KEYS, pos % KEYS);
        let kb = &mut k[b * k_block + j / W * d * W + j % W..];
        for (i, &x) in p.k.at(slot as usize, kv_head).iter().enumerate() {
            kb[i * W] = x;
        }
        for (r, run) in p.v.at(slot as usize, kv_head).chunks(W).enumerate() {
            v[b * v_block + r * KEYS * W + j * W..][..run.len()].copy_from_slice(run);
        }
    }
    Packed { k, v }
}

impl Flash for f32 {
    type Packed = Packed;

    fn pack(p: &PagedPrefill<'_, f32>, slots: &[i64], kv_head: usize, tiles: Tiles) -> Packed {
        match lanes(tiles) {
            KEYS => pack::<KEYS>(p, slots, kv_head),
            16 => pack::<16>(p, slots, kv_head),
            other => unreachable!("no tiles of {other} lanes"),
        }
    }

    fn takes(_head_dim: usize, windowed: bool, sinks: bool) -> bool {
        !windowed && !sinks
    }

    fn runs(tiles: Tiles) -> bool {
        #[cfg(target_arch = "x86_64")]
        return match tiles {
            Tiles::Avx512 => is_x86_feature_detected!("avx512f"),
            Tiles::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            Tiles::Amx => false,
        };
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = tiles;
            false
        }
    }

    unsafe fn tile<const R: usize>(
        tiles: Tiles,
        p: &PagedPrefill<'_, f32>,
        packed: &Packed,
        q: &[*const f32; ROWS],
        pos: &[usize; ROWS],
        blocks: std::ops::Range<usize>,
        running: &mut Running,
        acc: &mut [f32],
        s: &mut Scratch,
    ) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded, the caller's contract (runs(tiles): AVX-512F, or AVX2 and FMA).
        unsafe {
            match tiles {
                Tiles::Avx512 => tile_512::<R>(p, packed, q, pos, blocks, running, acc, s),
                Tiles::Avx2 => tile_256::<R>(p, packed, q, pos, blocks, running, acc, s),
                Tiles::Amx => unreachable!("no float32 AMX tiles"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (tiles, p, packed, q, pos, blocks, running, acc, s);
            unreachable!("runs is false off x86_64")
        }
    }
}

/// R rows' attention over key blocks `blocks` into their sums `acc_rows` (`Flash::tile`), in
/// AVX-512 registers.
///
/// # Safety
/// As `Flash::tile`; q[..R] point at the rows' queries (head_dim float32 each).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_512<const R: usize>(
    p: &PagedPrefill<'_, f32>,
    packed: &Packed,
    q: &[*const f32; ROWS],
    pos: &[usize; ROWS],
    blocks: std::ops::Range<usize>,
    running: &mut Running,
    acc_rows: &mut [f32],
    s: &mut Scratch,
) {
    use std::arch::x86_64::*;
    let (d, dv) = (p.q.dim, padded(p.v.dim));
    let (k_block, v_block) = (d * KEYS, KEYS * dv);
    let (mut max, mut total) = running.rows::<R>();
    for b in blocks {
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
            let sum = _mm512_add_ps(
                _mm512_add_ps(_mm512_loadu_ps(sp), _mm512_loadu_ps(sp.add(16))),
                _mm512_add_ps(_mm512_loadu_ps(sp.add(32)), _mm512_loadu_ps(sp.add(48))),
            );
            let (lo, hi) =
                (_mm512_castps512_ps256(sum), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sum))));
            let row = &mut acc_rows[i * dv..(i + 1) * dv];
            advance_row(&mut max[i], &mut total[i], row, tops[i], fix, sum_halves(lo, hi));
        }
        // values: acc += p . v, 64 columns at a time
        let vp = packed.v.as_ptr().add(b * v_block);
        for c0 in (0..dv).step_by(64) {
            let mut acc = load_sums::<R>(acc_rows, dv, c0);
            for kk in 0..KEYS {
                let w: [__m512; 4] = std::array::from_fn(|c| _mm512_loadu_ps(vp.add(c0 * KEYS + kk * 64 + 16 * c)));
                for (i, a) in acc.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(s.scores[i * KEYS + kk]);
                    for (a, w) in a.iter_mut().zip(&w) {
                        *a = _mm512_fmadd_ps(x, *w, *a);
                    }
                }
            }
            store_sums(&acc, acc_rows, dv, c0);
        }
    }
    running.keep(max, total);
}

/// `tile_512` in AVX2 registers: 6 rows x 16 lanes (12 sums of 16 registers), the block's scores
/// and each 64 value columns in four passes of 16; every product, score and sum as `tile_512`
/// computes it (the same bits).
///
/// # Safety
/// As `Flash::tile`; q[..R] point at the rows' queries (head_dim float32 each).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_256<const R: usize>(
    p: &PagedPrefill<'_, f32>,
    packed: &Packed,
    q: &[*const f32; ROWS],
    pos: &[usize; ROWS],
    blocks: std::ops::Range<usize>,
    running: &mut Running,
    acc_rows: &mut [f32],
    s: &mut Scratch,
) {
    use std::arch::x86_64::*;
    let (d, dv) = (p.q.dim, padded(p.v.dim));
    let (k_block, v_block) = (d * KEYS, KEYS * dv);
    let (mut max, mut total) = running.rows::<R>();
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let (scale, hidden) = (_mm256_set1_ps(p.scale), _mm256_set1_ps(f32::NEG_INFINITY));
    for b in blocks {
        // scores: q . k for the block's keys, 16 at a time, scaled, keys after a row's query at -inf
        let kp = packed.k.as_ptr().add(b * k_block);
        for c0 in (0..KEYS).step_by(16) {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for kk in 0..d {
                let at = kp.add(c0 * d + kk * 16);
                let w = [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))];
                for (a, qr) in acc.iter_mut().zip(q) {
                    let x = _mm256_set1_ps(qr.add(kk).read());
                    a[0] = _mm256_fmadd_ps(x, w[0], a[0]);
                    a[1] = _mm256_fmadd_ps(x, w[1], a[1]);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                let visible = _mm256_set1_epi32((pos[i] + 1).saturating_sub(b * KEYS).min(KEYS) as i32);
                for (h, a) in a.iter().enumerate() {
                    let first = (c0 + 8 * h) as i32;
                    let seen = _mm256_cmpgt_epi32(visible, _mm256_add_epi32(lane, _mm256_set1_epi32(first)));
                    let x = _mm256_blendv_ps(hidden, _mm256_mul_ps(*a, scale), _mm256_castsi256_ps(seen));
                    _mm256_storeu_ps(s.scores.as_mut_ptr().add(i * KEYS + c0 + 8 * h), x);
                }
            }
        }
        // the online softmax, row by row (a row's new maximum: max is exact in any order)
        for i in 0..R {
            let scores = &mut s.scores[i * KEYS..(i + 1) * KEYS];
            let top = max[i].max(lane_max(scores));
            let fix = exp_row(scores, top, max[i]);
            let half = |h: usize| {
                let at = scores.as_ptr().add(8 * h);
                _mm256_add_ps(
                    _mm256_add_ps(_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(16))),
                    _mm256_add_ps(_mm256_loadu_ps(at.add(32)), _mm256_loadu_ps(at.add(48))),
                )
            };
            advance_row(
                &mut max[i],
                &mut total[i],
                &mut acc_rows[i * dv..(i + 1) * dv],
                top,
                fix,
                sum_halves(half(0), half(1)),
            );
        }
        // values: acc += p . v, 16 columns at a time
        let vp = packed.v.as_ptr().add(b * v_block);
        for c0 in (0..dv).step_by(16) {
            let sums = acc_rows.as_mut_ptr().add(c0);
            let mut acc: [[__m256; 2]; R] = std::array::from_fn(|i| {
                let at = sums.add(i * dv);
                [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))]
            });
            let weights = s.scores.as_ptr();
            for kk in 0..KEYS {
                let at = vp.add(c0 * KEYS + kk * 16);
                let w = [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))];
                for (i, a) in acc.iter_mut().enumerate() {
                    let x = _mm256_set1_ps(*weights.add(i * KEYS + kk));
                    a[0] = _mm256_fmadd_ps(x, w[0], a[0]);
                    a[1] = _mm256_fmadd_ps(x, w[1], a[1]);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                let at = sums.add(i * dv);
                _mm256_storeu_ps(at, a[0]);
                _mm256_storeu_ps(at.add(8), a[1]);
            }
        }
    }
    running.keep(max, total);
}
