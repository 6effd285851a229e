//! A wide chunk's matrix products for float32 experts with the chunk's pairs as the vector
//! lanes: its inputs laid out as panels of LANES pairs ([blocks][K][LANES]), each product
//! out[r][p] = sum_k w[r][k] * in[k][p] a weight element broadcast against a panel row, written
//! straight into the next product's panels. No operand is packed per call (the weights are read
//! in place, row by row; the panels are the gather the chunk makes anyway) and the activation
//! runs on the panels between the products, so both products of a chunk run at close to the
//! FMA units' peak, where a general GEMM packs both operands of each (`matmul`).
//!
//! Every output element is one fused multiply-add chain over k in order, from zero, whatever
//! the tile or the instruction set (AVX-512F or AVX2 with FMA: the same bits), and independent
//! of the chunk's other pairs.

use crate::aligned::Lines;
use crate::expert_pairs::Isa;

/// Pairs per panel: one AVX-512 register, two AVX2 registers.
pub const LANES: usize = 16;

/// Tiles of weight rows x panels: 8 x 2 in AVX-512's 32 registers (16 sums), 6 x 1 in AVX2's 16
/// (12 sums, two registers per panel row).
const TILE_512: (usize, usize) = (8, 2);
const TILE_256: (usize, usize) = (6, 1);

/// Panels the rows of `n` pairs take.
pub fn blocks(n: usize) -> usize {
    n.div_ceil(LANES)
}

/// Whether `isa` runs the panel kernels here: AVX2 with FMA or wider (not the portable kernel).
pub fn runs(isa: Isa) -> bool {
    cfg!(target_arch = "x86_64") && isa != Isa::Scalar && isa.runs()
}

/// panels [blocks(n)][k][LANES] = the n `rows` (k values each) as columns, zero past the last;
/// whole 8 columns at a time transposed in AVX2 registers where `isa` runs the panels (8 x 8
/// transposes outran AVX-512's 16 x 16, docs/benchmarks.md).
pub fn gather<'a>(isa: Isa, rows: impl ExactSizeIterator<Item = &'a [f32]>, k: usize, panels: &mut Lines<f32>) {
    let n = rows.len();
    // every value is written below (no clearing: a chunk's scratch is reused)
    panels.resize(blocks(n) * k * LANES, 0.0);
    let rows: Vec<&[f32]> = rows.collect();
    for (block, panel) in rows.chunks(LANES).zip(panels.chunks_exact_mut(k * LANES)) {
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if runs(isa) {
            // SAFETY: runs(isa) checked the CPU; every row holds k values (asserted inside).
            done = unsafe { transpose::rows_to_columns(block, k, panel, LANES) };
        }
        for (c, lanes) in panel.chunks_exact_mut(LANES).enumerate().skip(done) {
            for (l, lane) in lanes.iter_mut().enumerate() {
                *lane = block.get(l).map_or(0.0, |row| row[c]);
            }
        }
    }
}

/// out [n, width] = the first n columns of panels [blocks][width][LANES], transposed as `gather`.
pub fn scatter(isa: Isa, panels: &[f32], width: usize, out: &mut [f32]) {
    for (rows, panel) in out.chunks_mut(LANES * width).zip(panels.chunks_exact(width * LANES)) {
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if runs(isa) {
            // SAFETY: runs(isa) checked the CPU; rows holds whole rows of `width` (asserted inside).
            done = unsafe { transpose::panel_to_rows(panel, width, rows) };
        }
        for (c, lanes) in panel.chunks_exact(LANES).enumerate().skip(done) {
            for (row, &v) in rows.chunks_exact_mut(width).zip(lanes) {
                row[c] = v;
            }
        }
    }
}

/// 8 x 8 transposes in AVX2 registers between a block's rows and its panel (or the row tiles'
/// packed weights, `row_tiles::pack`).
#[cfg(target_arch = "x86_64")]
pub(crate) mod transpose {
    use super::LANES;
    use std::arch::x86_64::*;

    /// The transpose of 8 rows of 8.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        // pairs of rows interleaved, then 4 x 4 blocks within each 128-bit lane, then the lanes
        let mut t = [_mm256_setzero_ps(); 8];
        for i in 0..4 {
            t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm256_setzero_ps(); 8];
        for i in 0..2 {
            let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
            u[4 * i] = _mm256_shuffle_ps::<0x44>(a, c);
            u[4 * i + 1] = _mm256_shuffle_ps::<0xEE>(a, c);
            u[4 * i + 2] = _mm256_shuffle_ps::<0x44>(b, d);
            u[4 * i + 3] = _mm256_shuffle_ps::<0xEE>(b, d);
        }
        let mut out = [_mm256_setzero_ps(); 8];
        for j in 0..4 {
            out[j] = _mm256_permute2f128_ps::<0x20>(u[j], u[4 + j]);
            out[4 + j] = _mm256_permute2f128_ps::<0x31>(u[j], u[4 + j]);
        }
        out
    }

    /// out[c * stride + l] (l < LANES) = block's row l's value c (at most LANES rows of k
    /// values), zero past the last row, for the first whole 8 columns c (each 8 of them two 8 x
    /// 8 transposes, a half of the lanes each): a panel [k][LANES] at stride LANES; returns how
    /// many columns it wrote.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn rows_to_columns(block: &[&[f32]], k: usize, out: &mut [f32], stride: usize) -> usize {
        assert!(block.len() <= LANES && block.iter().all(|row| row.len() >= k) && stride >= LANES);
        let whole = k / 8 * 8;
        assert!(whole == 0 || out.len() >= (whole - 1) * stride + LANES);
        for c in (0..whole).step_by(8) {
            for half in 0..2 {
                let mut r = [_mm256_setzero_ps(); 8];
                for (r, row) in r.iter_mut().zip(block.iter().skip(8 * half)) {
                    *r = _mm256_loadu_ps(row.as_ptr().add(c));
                }
                for (j, v) in transpose8(r).into_iter().enumerate() {
                    _mm256_storeu_ps(out.as_mut_ptr().add((c + j) * stride + 8 * half), v);
                }
            }
        }
        whole
    }

    /// rows [n, width] (n <= LANES) = the first n columns of panel [width][LANES], for the first
    /// whole 8 of `width`; returns how many of `width` it wrote.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn panel_to_rows(panel: &[f32], width: usize, rows: &mut [f32]) -> usize {
        assert!(rows.len().is_multiple_of(width) && rows.len() <= LANES * width && panel.len() >= width * LANES);
        let whole = width / 8 * 8;
        let n = rows.len() / width;
        for c in (0..whole).step_by(8) {
            for half in 0..2 {
                let mut r = [_mm256_setzero_ps(); 8];
                for (j, r) in r.iter_mut().enumerate() {
                    *r = _mm256_loadu_ps(panel.as_ptr().add((c + j) * LANES + 8 * half));
                }
                for (i, v) in transpose8(r).into_iter().enumerate().take(n.saturating_sub(8 * half)) {
                    _mm256_storeu_ps(rows.as_mut_ptr().add((8 * half + i) * width + c), v);
                }
            }
        }
        whole
    }
}

/// out [blocks][rows][LANES] = w [rows, k] @ panels [blocks][k][LANES], for the panels of
/// `blocks` blocks, in `isa`'s registers (AVX-512 for `Auto`). The caller checks `runs(isa)`.
pub fn product(isa: Isa, w: &[f32], rows: usize, k: usize, panels: &[f32], blocks: usize, out: &mut Lines<f32>) {
    assert!(runs(isa), "pair_panels::product: this CPU does not run {isa:?}'s panel kernel");
    assert_eq!(w.len(), rows * k, "pair_panels::product: the weight is not [{rows}, {k}]");
    assert_eq!(panels.len(), blocks * k * LANES, "pair_panels::product: the panels are not [{blocks}, {k}, {LANES}]");
    out.resize(blocks * rows * LANES, 0.0); // every value is written (each_tile)
    #[cfg(target_arch = "x86_64")]
    // SAFETY: runs(isa) checked the CPU; the lengths were checked above, and every tile stays
    // within them (each_tile).
    unsafe {
        if isa != Isa::Avx2Fma {
            tiles_512(w, rows, k, panels, blocks, out)
        } else {
            tiles_256(w, rows, k, panels, blocks, out)
        }
    }
}

/// `$tile::<take, 2 or 1>$args` for a `take` among the listed row counts.
macro_rules! tile_call {
    ($tile:ident, $take:expr, $two:expr, $args:tt, $($m:literal)*) => {
        match ($take, $two) {
            $(($m, true) => tile_call!(@ $tile, $m, 2, $args),
              ($m, false) => tile_call!(@ $tile, $m, 1, $args),)*
            _ => unreachable!("tiles take at most 8 rows"),
        }
    };
    (@ $tile:ident, $m:literal, $v:literal, ($($arg:expr),*)) => { $tile::<$m, $v>($($arg),*) };
}

/// The loop over tiles of at most $shape's weight rows x panels, each one call of
/// `$tile::<ROWS, VECTORS>`, remainders in smaller tiles.
macro_rules! each_tile {
    ($tile:ident, $shape:expr, $w:ident, $rows:ident, $k:ident, $panels:ident, $blocks:ident, $out:ident) => {{
        let (max_rows, max_vectors) = $shape;
        let mut b = 0;
        while b < $blocks {
            let two = max_vectors == 2 && b + 2 <= $blocks;
            let mut r = 0;
            while r < $rows {
                let (w, p, o) = ($w.as_ptr().add(r * $k), $panels.as_ptr().add(b * $k * LANES),
                                 $out.as_mut_ptr().add((b * $rows + r) * LANES));
                let take = ($rows - r).min(max_rows);
                tile_call!($tile, take, two, (w, $k, p, o, $rows), 1 2 3 4 5 6 7 8);
                r += take;
            }
            b += if two { 2 } else { 1 };
        }
    }};
}

/// # Safety
/// AVX-512F; the slices hold what `product` checked.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tiles_512(w: &[f32], rows: usize, k: usize, panels: &[f32], blocks: usize, out: &mut [f32]) {
    each_tile!(tile_512, TILE_512, w, rows, k, panels, blocks, out)
}

/// # Safety
/// AVX2 and FMA; the slices hold what `product` checked.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tiles_256(w: &[f32], rows: usize, k: usize, panels: &[f32], blocks: usize, out: &mut [f32]) {
    each_tile!(tile_256, TILE_256, w, rows, k, panels, blocks, out)
}

/// At a tile's column c, a line of each of the next tile's weight rows into L2 (one per 16
/// columns): a chunk's first panels meet every weight row cold from memory, and few panels (an
/// expert of 64 to 100 pairs) leave too little work per row to hide that (docs/benchmarks.md,
/// "Wide float32 expert chunks in pair panels"). Past the last row it asks for the next
/// expert's rows, or for nothing: a prefetch never faults.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_next_tile<const ROWS: usize>(w: *const f32, k: usize, c: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T2};
    if c.is_multiple_of(16) {
        for i in 0..ROWS {
            // SAFETY: a prefetch reads nothing and never faults; the address is only computed.
            unsafe { _mm_prefetch::<_MM_HINT_T2>(w.wrapping_add((ROWS + i) * k + c) as *const i8) };
        }
    }
}

/// out's ROWS x VECTORS panel rows from w's ROWS rows (from `w`, k each) against VECTORS
/// panels (from `p`, k x LANES each); out's panels are `rows` x LANES apart.
///
/// # Safety
/// AVX-512F; the rows and panels lie within their slices.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile_512<const ROWS: usize, const VECTORS: usize>(
    w: *const f32,
    k: usize,
    p: *const f32,
    o: *mut f32,
    rows: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); VECTORS]; ROWS];
    for c in 0..k {
        prefetch_next_tile::<ROWS>(w, k, c);
        let mut v = [_mm512_setzero_ps(); VECTORS];
        for (j, v) in v.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(p.add((j * k + c) * LANES));
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            let a = _mm512_set1_ps(*w.add(i * k + c));
            for (acc, &v) in acc.iter_mut().zip(&v) {
                *acc = _mm512_fmadd_ps(a, v, *acc);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (j, &acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.add((j * rows + i) * LANES), acc);
        }
    }
}

/// `tile_512` in AVX2 registers (two per panel row): the same chains, the same bits.
///
/// # Safety
/// AVX2 and FMA; the rows and panels lie within their slices.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn tile_256<const ROWS: usize, const VECTORS: usize>(
    w: *const f32,
    k: usize,
    p: *const f32,
    o: *mut f32,
    rows: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[[_mm256_setzero_ps(); 2]; VECTORS]; ROWS];
    for c in 0..k {
        prefetch_next_tile::<ROWS>(w, k, c);
        let mut v = [[_mm256_setzero_ps(); 2]; VECTORS];
        for (j, v) in v.iter_mut().enumerate() {
            let at = p.add((j * k + c) * LANES);
            *v = [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))];
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            let a = _mm256_set1_ps(*w.add(i * k + c));
            for (acc, v) in acc.iter_mut().zip(&v) {
                acc[0] = _mm256_fmadd_ps(a, v[0], acc[0]);
                acc[1] = _mm256_fmadd_ps(a, v[1], acc[1]);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (j, acc) in acc.iter().enumerate() {
            let at = o.add((j * rows + i) * LANES);
            _mm256_storeu_ps(at, acc[0]);
            _mm256_storeu_ps(at.add(8), acc[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::noise;

    const SHAPES_N: [usize; 6] = [1, 5, 15, 16, 17, 40];
    const SHAPES_K: [usize; 7] = [1, 7, 8, 16, 20, 33, 48];

    fn rows_of(n: usize, k: usize) -> Vec<f32> {
        noise(n * k, (n * 100 + k) as u64)
    }

    /// The instruction sets whose transposes and tiles this CPU runs, and the portable code.
    fn kernels() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2Fma, Isa::Avx512, Isa::Auto]
            .into_iter()
            .filter(|&isa| isa == Isa::Scalar || runs(isa))
            .collect()
    }

    #[test]
    fn gather_and_scatter_move_every_value_and_pad_with_zeros() {
        let mut panels = Lines::filled(4096, f32::NAN); // stale values must not survive
        for isa in kernels() {
            for n in SHAPES_N {
                for k in SHAPES_K {
                    let x = rows_of(n, k);
                    gather(isa, x.chunks_exact(k), k, &mut panels);
                    assert_eq!(panels.len(), blocks(n) * k * LANES);
                    for p in 0..blocks(n) * LANES {
                        for c in 0..k {
                            let want = if p < n { x[p * k + c] } else { 0.0 };
                            let got = panels[(p / LANES * k + c) * LANES + p % LANES];
                            assert_eq!(got.to_bits(), want.to_bits(), "{isa:?} n={n} k={k} [{p}, {c}]");
                        }
                    }
                    let mut back = vec![f32::NAN; n * k];
                    scatter(isa, &panels, k, &mut back);
                    assert_eq!(back, x, "{isa:?} n={n} k={k}");
                }
            }
        }
    }

    /// Each output is the fused multiply-add chain over k in order from zero (f32::mul_add, the
    /// portable definition), bit for bit, on every tile shape and remainder and in both
    /// instruction sets; the lanes past the last pair stay zero.
    #[test]
    fn products_are_fused_chains_in_order_in_every_instruction_set() {
        let isas: Vec<Isa> = [Isa::Avx2Fma, Isa::Avx512, Isa::Auto].into_iter().filter(|&isa| runs(isa)).collect();
        if isas.is_empty() {
            eprintln!("skipped: this CPU has neither AVX2 with FMA nor AVX-512 (the panel kernels' instruction sets)");
            return;
        }
        let mut panels = Lines::default();
        for rows in [1, 2, 5, 6, 7, 8, 9, 13, 17] {
            for k in [1, 5, 16, 33] {
                let w = noise(rows * k, (rows * 31 + k) as u64);
                for n in [1, 16, 17, 40, 50] {
                    let x = rows_of(n, k);
                    gather(Isa::Scalar, x.chunks_exact(k), k, &mut panels);
                    for &isa in &isas {
                        let mut out = Lines::filled(3, f32::NAN);
                        product(isa, &w, rows, k, &panels, blocks(n), &mut out);
                        for p in 0..blocks(n) * LANES {
                            for r in 0..rows {
                                let want = if p < n {
                                    (0..k).fold(0.0f32, |acc, c| w[r * k + c].mul_add(x[p * k + c], acc))
                                } else {
                                    0.0
                                };
                                let got = out[(p / LANES * rows + r) * LANES + p % LANES];
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{isa:?} rows={rows} k={k} n={n} [{r}, {p}]: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn mismatched_lengths_are_refused() {
        if !runs(Isa::Avx2Fma) {
            eprintln!("skipped: this CPU lacks AVX2 with FMA");
            return;
        }
        let w = vec![0.0f32; 12];
        let caught = |panels: usize, rows: usize| {
            std::panic::catch_unwind(|| {
                product(Isa::Avx2Fma, &w, rows, 4, &vec![0.0; panels], 1, &mut Lines::default())
            })
            .is_err()
        };
        assert!(!caught(4 * LANES, 3));
        assert!(caught(4 * LANES, 4), "a weight of 12 values is not [4, 4]");
        assert!(caught(3 * LANES, 3), "a panel of 3 rows for k = 4");
    }
}
