//! The bfloat16 flash prefill kernel (crate::flash_prefill's walk, crate::paged_prefill_bf16's
//! packing with the keys' pairs padded to whole tiles) in AMX tiles, where the processor has
//! them (crate::amx::runs): 32 rows at a time (each key and value tile loaded serves two row
//! tiles: the packed keys and values stream from L2), STEP key blocks' scores q.k as float32
//! sums of TDPBF16PS (the next step's in the tiles while the vector units run this step's
//! softmax), the online softmax over them in AVX-512, and p.v in TDPBF16PS into a block of sums
//! that the rows' running sums, rescaled, take in AVX-512. The softmax: e^x as 2^(x log2 e) by a
//! polynomial and VSCALEFPS; a row's running maximum kept while no weight passes 2^LAZY over it
//! (most steps skip the pass for their maximum and the rescaling); the weights rounded to
//! bfloat16 and their sum taken as rounded, as the dot-product kernel does (here by dot products
//! with ones: denormals as zero, as the tiles read them). Sums inside a tile run in AMX's own
//! order: within float32 rounding of the dot-product kernel, not its bits; a row's result
//! depends only on its own context (a tile's sums of one row read only that row's query and
//! weights, a row's steps start at position 0 whatever its tile, and its blocks past its
//! position add zero weights).
//!
//! Tiles (one configuration, crate::amx's: 16 rows of 64 bytes), 2 x 2 as in crate::amx:
//! tmm0..tmm3 the sums of 32 rows x 32 keys (or value columns), tmm4/tmm5 the rows' queries or
//! weights (16 pairs each), tmm6/tmm7 the keys' or values' pairs.

#[cfg(target_arch = "x86_64")]
use crate::flash_prefill::{normalize, padded, Scratch, KEYS};
#[cfg(target_arch = "x86_64")]
use crate::paged_prefill::PagedPrefill;
#[cfg(target_arch = "x86_64")]
use crate::paged_prefill_bf16::Packed;

/// Rows of one tile.
const TILE: usize = crate::amx::TILE;
/// Rows of one call: two tiles' (each key and value tile loaded serves both).
pub(crate) const ROWS: usize = 2 * TILE;
/// Key blocks of one step of the online softmax.
pub(crate) const STEP: usize = 4;
/// Floats between two rows of a step's scores: its STEP * KEYS and a cache line more, so that a
/// tile's 16 rows do not crowd the few L1 sets that rows a power of two apart share.
pub(crate) const SCORES_ROW: usize = STEP * KEYS + 16;
/// Pairs between two rows of a step's weights: its STEP * KEYS / 2 and a cache line more (as above).
pub(crate) const WEIGHTS_ROW: usize = STEP * KEYS / 2 + 16;

/// Pairs of a head's query and key, rounded up to whole tiles (the packed keys' rows a block).
pub(crate) fn key_pairs(head_dim: usize) -> usize {
    crate::amx::rounded_pairs(head_dim.div_ceil(2))
}

/// 2^f = sum of EXP2_POLY[i] f^i for |f| <= 1/2, within 2.7e-6 relative (coefficients fitted
/// to the relative error, minimax-like, then rounded to f32; the Rust test below checks the
/// bound over the interval in the kernel's own FMA steps).
const EXP2_POLY: [f32; 5] = [0.999_999_3, 0.693_121_7, 0.240_247_44, 0.055_918_686, 0.009_570_379];

/// 2^t for the 16 lanes where `seen` (zero elsewhere), within 2.7e-6 of itself: t = n + f,
/// |f| <= 1/2, 2^f by a polynomial of degree 4 fitted to its relative error (`EXP2_POLY`; the
/// Taylor polynomial of degree 5 it replaces was within 3.2e-6, one FMA more), 2^n applied by
/// VSCALEFPS. Zero below 2^-125.5, so that no result is subnormal: each subnormal result takes
/// a microcode assist (scores spread over a few hundred made the kernel seven times slower).
/// The softmax's weights, rounded to bfloat16 (8 bits) after it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp2_16(t: std::arch::x86_64::__m512, seen: u16) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
    let f = _mm512_sub_ps(t, n);
    let mut y = _mm512_set1_ps(EXP2_POLY[4]);
    for c in EXP2_POLY[..4].iter().rev() {
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(*c));
    }
    let normal = _mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(seen, t, _mm512_set1_ps(-125.5));
    _mm512_maskz_scalef_ps(normal, y, n)
}

/// The first `visible` of 16 * c.. as a lane mask.
#[inline(always)]
fn lanes_seen(visible: usize, c: usize) -> u16 {
    match visible.saturating_sub(16 * c) {
        0 => 0,
        v if v >= 16 => u16::MAX,
        v => ((1u32 << v) - 1) as u16,
    }
}

/// Scores [ROWS, SCORES_ROW] into `scores` = the queries (`qs`, [ROWS, d2p] pairs) @ key blocks
/// b0..b0 + nb, four tiles of 16 keys a block.
///
/// # Safety
/// Tiles configured (crate::amx::config); the buffers as `tile` sizes them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scores_of(packed: &Packed, qs: *const u32, d2p: usize, b0: usize, nb: usize, scores: *mut f32) {
    let k_block = d2p * KEYS;
    for j in 0..nb {
        for half in 0..2 {
            // SAFETY: the queries' two row tiles read pairs kt * 16.. of d2p, rows 0..32; the
            // keys' tiles rows kt * 16.. of block b0 + j's d2p, keys 32 * half.. (16 each) of
            // KEYS; the scores' 32 rows hold SCORES_ROW floats.
            crate::amx::block(
                qs,
                qs.add(TILE * d2p),
                d2p * 4,
                packed.k.as_ptr().add((b0 + j) * k_block + 32 * half),
                KEYS * 4,
                TILE * KEYS * 4,
                d2p / TILE,
                scores.add(j * KEYS + 32 * half),
                scores.add(TILE * SCORES_ROW + j * KEYS + 32 * half),
                SCORES_ROW * 4,
            );
        }
    }
}

/// A weight may pass its row's running maximum by up to 2^LAZY before the row takes a new one.
const LAZY: f32 = 8.0;

/// The scaled scores' maximum over a row's first `visible` (a step's first, or one whose weights
/// would pass 2^LAZY: most steps skip it).
///
/// # Safety
/// The CPU has AVX-512F; row holds `visible` floats rounded up to whole 16-lane vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn maximum(row: *const f32, visible: usize, scale: std::arch::x86_64::__m512) -> f32 {
    use std::arch::x86_64::*;
    let mut top = _mm512_set1_ps(f32::NEG_INFINITY);
    for c in 0..visible.div_ceil(16) {
        let x = _mm512_mul_ps(_mm512_loadu_ps(row.add(16 * c)), scale);
        top = _mm512_mask_max_ps(top, lanes_seen(visible, c), top, x);
    }
    _mm512_reduce_max_ps(top)
}

/// A row's weights 2^(score x scale_log2e - top log2 e) of its first `visible` scores, rounded to
/// bfloat16 pairs of adjacent keys into `out` (`vectors` x 8 pairs, zero past `visible`); returns
/// their sum as rounded (by dot products with `ones`: denormals as zero, as the tiles read them)
/// and whether a weight passed 2^LAZY (then `out` is to be written again from a higher top).
///
/// # Safety
/// The CPU has AVX-512F and AVX-512 BF16; row holds `vectors` x 16 floats, out `vectors` x 8 pairs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn weigh(
    row: *const f32,
    visible: usize,
    vectors: usize,
    scale_log2e: std::arch::x86_64::__m512,
    top: f32,
    out: *mut u32,
    ones: std::arch::x86_64::__m512bh,
) -> (f32, bool) {
    use std::arch::x86_64::*;
    let shift = _mm512_set1_ps(top * std::f32::consts::LOG2_E);
    let lazy = _mm512_set1_ps(LAZY);
    let (mut even_sum, mut odd_sum) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut over: u16 = 0;
    // vectors c and c + 1 weighed in their `seen` lanes, stored as bfloat16 pairs and added to
    // the two running sums (every other pair of vectors, each pair's two weights times 1.0);
    // returns their exponents
    let mut weigh_pair = |c: usize, seen: [u16; 2]| -> [__m512; 2] {
        let t: [__m512; 2] =
            std::array::from_fn(|h| _mm512_fmsub_ps(_mm512_loadu_ps(row.add(16 * (c + h))), scale_log2e, shift));
        let pairs: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(exp2_16(t[1], seen[1]), exp2_16(t[0], seen[0])));
        _mm512_storeu_si512(out.add(8 * c) as *mut _, pairs);
        (even_sum, odd_sum) =
            (odd_sum, _mm512_dpbf16_ps(even_sum, std::mem::transmute::<__m512i, __m512bh>(pairs), ones));
        t
    };
    // the pairs of vectors the row sees whole (most of a step's) without lane masks, their
    // largest exponent held against 2^LAZY once
    let whole = (visible / 16).min(vectors) / 2 * 2;
    let mut top_t = _mm512_set1_ps(f32::NEG_INFINITY);
    for c in (0..whole).step_by(2) {
        let t = weigh_pair(c, [u16::MAX; 2]);
        top_t = _mm512_max_ps(_mm512_max_ps(top_t, t[0]), t[1]);
    }
    over |= _mm512_cmp_ps_mask::<_CMP_GT_OQ>(top_t, lazy);
    for c in (whole..vectors).step_by(2) {
        if 16 * c >= visible {
            _mm512_storeu_si512(out.add(8 * c) as *mut _, _mm512_setzero_si512());
            continue;
        }
        let seen = [lanes_seen(visible, c), lanes_seen(visible, c + 1)];
        let t = weigh_pair(c, seen);
        for h in 0..2 {
            over |= _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(seen[h], t[h], lazy);
        }
    }
    (_mm512_reduce_add_ps(_mm512_add_ps(even_sum, odd_sum)), over != 0)
}

/// The rows' attention over their first `blocks` key blocks into s.acc ([q.len(), padded(v_dim)],
/// normalized); row i's query at q[i], its position pos[i]. The online softmax takes STEP blocks
/// at a time: a row's sum once per STEP * KEYS keys, its maximum and the rescaling of its running
/// sums only where a step's weights would pass 2^LAZY.
///
/// # Safety
/// crate::amx::runs(); q.len() <= ROWS, each pointing at head_dim bfloat16s; `packed` packed
/// with key_pairs(head_dim) pairs a key; `blocks` covers every row's position and no more than
/// packed; s sized for ROWS rows and those pairs (`Scratch::new`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn tile(
    p: &PagedPrefill<'_, crate::paged_attn::Bf16>,
    packed: &Packed,
    q: &[*const crate::paged_attn::Bf16],
    pos: &[usize],
    blocks: usize,
    s: &mut Scratch,
) {
    use std::arch::asm;
    use std::arch::x86_64::*;
    let n = q.len();
    debug_assert!(n <= ROWS && pos.len() == n);
    let (d2, d2p, dv) = (p.q.dim / 2, key_pairs(p.q.dim), padded(p.v.dim));
    let (k_block, v_block) = (d2p * KEYS, KEYS / 2 * dv);
    debug_assert_eq!(packed.pairs, d2p);
    assert!(s.queries.len() >= ROWS * d2p && s.block.len() >= ROWS * dv && s.acc.len() >= ROWS * dv);
    assert!(s.scores.len() >= 2 * ROWS * SCORES_ROW && s.weights.len() >= ROWS * WEIGHTS_ROW);
    assert!(packed.k.len() >= blocks * k_block && packed.v.len() >= blocks * v_block);
    // the rows' queries as [ROWS, d2p] pairs, zero past the rows and their pairs; the weights of
    // rows past n stay zero (each step writes every weight its tiles read of rows < n)
    for (i, row) in s.queries[..ROWS * d2p].chunks_exact_mut(d2p).enumerate() {
        match q.get(i) {
            Some(&qr) => {
                for (k, dst) in row[..d2].iter_mut().enumerate() {
                    *dst = (qr as *const u32).add(k).read_unaligned();
                }
                row[d2..].fill(0);
            }
            None => row.fill(0),
        }
    }
    s.weights[n * WEIGHTS_ROW..ROWS * WEIGHTS_ROW].fill(0);
    s.acc[..n * dv].fill(0.0);
    let mut max = [f32::NEG_INFINITY; ROWS];
    let mut total = [0f32; ROWS];
    let mut fix_rows = [1f32; ROWS];
    let cfg = crate::amx::config();
    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
    let scale = _mm512_set1_ps(p.scale);
    // bfloat16 1.0 in both halves of every pair
    let ones: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3f80_3f80));
    let scale_log2e = _mm512_set1_ps(p.scale * std::f32::consts::LOG2_E);
    // every write of the loop through these (the asm's tile stores among them)
    let (qs, scores, weights, block) =
        (s.queries.as_ptr(), s.scores.as_mut_ptr(), s.weights.as_mut_ptr(), s.block.as_mut_ptr());
    let steps = blocks.div_ceil(STEP);
    // two buffers of scores: a step's products run in the tiles while the previous step's
    // softmax runs in the vector units
    let scores_at = |t: usize| scores.add(t % 2 * ROWS * SCORES_ROW);
    scores_of(packed, qs, d2p, 0, STEP.min(blocks), scores_at(0));
    for t in 0..steps {
        let (b0, next) = (t * STEP, (t + 1) * STEP);
        let nb = STEP.min(blocks - b0);
        if next < blocks {
            scores_of(packed, qs, d2p, next, STEP.min(blocks - next), scores_at(t + 1));
        }
        let scores = scores_at(t);
        // the online softmax, row by row: scaled, keys after the row's query weigh zero; e^x
        // as 2^(x log2 e)
        let vectors = 4 * nb;
        for i in 0..n {
            let visible = (pos[i] + 1).saturating_sub(b0 * KEYS).min(nb * KEYS);
            let row = scores.add(i * SCORES_ROW);
            let out = weights.add(i * WEIGHTS_ROW);
            // the row's running maximum stays while no weight of the step passes 2^LAZY over it;
            // a first step, or one that would pass it, takes the step's own maximum (`maximum`)
            let (mut top, mut fix) = (max[i], 1.0);
            if t == 0 {
                top = maximum(row, visible, scale).max(max[i]);
                fix = crate::paged_attn::exp(max[i] - top);
            }
            let (mut sum, mut over) = weigh(row, visible, vectors, scale_log2e, top, out, ones);
            if over {
                let step_top = maximum(row, visible, scale).max(max[i]);
                // blocks the row sees none of leave it exactly as it was
                fix = if step_top == max[i] { 1.0 } else { crate::paged_attn::exp(max[i] - step_top) };
                top = step_top;
                (sum, over) = weigh(row, visible, vectors, scale_log2e, top, out, ones);
                debug_assert!(!over);
            }
            fix_rows[i] = fix;
            total[i] = total[i] * fix + sum;
            max[i] = top;
        }
        // the blocks' p . v [ROWS, dv], 32 columns at a time
        let vp = packed.v.as_ptr().add(b0 * v_block);
        for c0 in (0..dv).step_by(32) {
            // SAFETY: the weights' two row tiles read rows 0..32, 16 pairs at 16 * step of a
            // row's WEIGHTS_ROW; the values' rows 16 * step.. of the blocks' nb * KEYS / 2, columns
            // c0..c0 + 32 of dv; the block's sums hold ROWS x dv.
            crate::amx::block(
                weights,
                weights.add(TILE * WEIGHTS_ROW),
                WEIGHTS_ROW * 4,
                vp.add(c0),
                dv * 4,
                TILE * dv * 4,
                nb * KEYS / 2 / TILE,
                block.add(c0),
                block.add(TILE * dv + c0),
                dv * 4,
            );
        }
        // the rows' running sums rescaled to their new maximum, and the blocks' added
        for (i, &fix) in fix_rows[..n].iter().enumerate() {
            let acc = s.acc.as_mut_ptr().add(i * dv);
            let add = block.add(i * dv);
            let f = _mm512_set1_ps(fix);
            for c in (0..dv).step_by(16) {
                _mm512_storeu_ps(
                    acc.add(c),
                    _mm512_fmadd_ps(_mm512_loadu_ps(acc.add(c)), f, _mm512_loadu_ps(add.add(c))),
                );
            }
        }
    }
    asm!("tilerelease", options(nostack, nomem));
    normalize(&mut s.acc[..n * dv], &total[..n], dv);
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// `exp2_16` of 16 exponents, every lane seen but the last.
    #[target_feature(enable = "avx512f")]
    unsafe fn exp2_lanes(t: &[f32; 16]) -> [f32; 16] {
        use std::arch::x86_64::*;
        let mut out = [0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), exp2_16(_mm512_loadu_ps(t.as_ptr()), 0x7fff));
        out
    }

    #[test]
    fn exp2_is_within_its_bound_and_zero_where_unseen_or_subnormal() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: this CPU lacks AVX-512F (the AMX kernel's exponentials)");
            return;
        }
        let mut worst = 0f64;
        // exponents over [-40, 8] a thousandth apart (every fraction of a power of two many times)
        for chunk in 0..3000 {
            let t: [f32; 16] = std::array::from_fn(|i| -40.0 + (chunk * 16 + i) as f32 * 0.001);
            // SAFETY: checked above.
            let y = unsafe { exp2_lanes(&t) };
            for (i, (&t, &y)) in t.iter().zip(&y).enumerate() {
                if i == 15 {
                    assert_eq!(y, 0.0, "an unseen lane");
                    continue;
                }
                worst = worst.max((y as f64 / (t as f64).exp2() - 1.0).abs());
            }
        }
        assert!(worst <= 2.7e-6, "2^t off by {worst} relative");
        // SAFETY: checked above.
        let y = unsafe {
            exp2_lanes(&[
                -125.6,
                -126.0,
                -200.0,
                f32::NEG_INFINITY,
                -125.4,
                0.0,
                1.0,
                8.0,
                0.5,
                -0.5,
                2.0,
                3.0,
                4.0,
                5.0,
                6.0,
                7.0,
            ])
        };
        assert_eq!(&y[..4], &[0.0; 4], "below 2^-125.5: zero, no subnormal");
        assert!(y[4] > 0.0 && y[4].is_normal());
    }
}
