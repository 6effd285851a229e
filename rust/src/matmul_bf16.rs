//! out [n, rows] = xs [n, K] @ m [rows, K]^T with bfloat16 operands and float32 sums, in the
//! AVX-512 BF16 dot-product instruction (VDPBF16PS: 32 multiply-adds of bfloat16 pairs into 16
//! float32 lanes, twice the float32 FMA's): the expert pass's wide bfloat16 chunks (a
//! prefill's hundreds of pairs per expert) with the weights packed into panels
//! (`matmul_nt_bf16`; in AMX tiles instead where they run, crate::amx), and its narrow chunks
//! and the linear layers of a few rows with the weight rows read in place (`gemm_nt_bf16`). The inputs xs arrive as float32 and are rounded to
//! bfloat16 (the experts' inputs are bfloat16 already; their activations are rounded, as a
//! bfloat16 model's experts do in transformers and vLLM). Its summation order is its own, and
//! the instruction treats subnormal inputs as zero; `reference` is the same product in portable
//! code, the tests' oracle beside an f64 one.

use crate::aligned::Lines;
use crate::expert_pairs::{Bf16, Element};

/// Weight rows per panel: four 16-lane registers of one k-pair each.
pub(crate) const PANEL_ROWS: usize = 64;
/// Vectors (xs rows) per register block: 4 x 6 accumulators, 4 weight registers and one
/// broadcast within the 32 registers.
const BLOCK_VECTORS: usize = 6;

/// Whether this CPU has AVX-512F and AVX-512 BF16, detected once.
pub fn runs() -> bool {
    static RUNS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *RUNS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16") {
            return true;
        }
        false
    })
}

/// A thread's buffers: xs as bfloat16 pairs [n, K2] and one weight panel [K2, PANEL_ROWS]
/// (K2 = K rounded up to pairs; an odd K's last pair holds a zero).
#[derive(Default)]
pub struct Buffers {
    xs: Lines<u32>,
    panel: Lines<u32>,
    // the vectors padded to whole AMX tiles where their pairs are not, a last partial block of
    // them, and every panel of the weight (crate::amx)
    tiles: Lines<u32>,
    tail: Lines<u32>,
    panels: Lines<u32>,
}

/// The instructions a panel's products run in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Products {
    /// AVX-512 BF16 dot products (VDPBF16PS)
    DotProducts,
    /// AMX tiles (TDPBF16PS, crate::amx)
    Tiles,
}

/// Whether `Products::fastest` may choose AMX tiles (settings.amx_tiles, through
/// `allow_tiles`): off, to measure the dot products on an AMX CPU.
static TILES_ALLOWED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Lets `Products::fastest` choose AMX tiles where they run (the default), or not.
pub fn allow_tiles(allowed: bool) {
    TILES_ALLOWED.store(allowed, std::sync::atomic::Ordering::Relaxed);
}

/// Whether AMX tiles may be chosen where they run (`allow_tiles`).
pub fn tiles_allowed() -> bool {
    TILES_ALLOWED.load(std::sync::atomic::Ordering::Relaxed)
}

impl Products {
    /// The fastest this CPU runs: AMX tiles where they run and are allowed (`allow_tiles`),
    /// else the dot products.
    pub fn fastest() -> Self {
        #[cfg(target_arch = "x86_64")]
        if tiles_allowed() && crate::amx::runs() {
            return Products::Tiles;
        }
        Products::DotProducts
    }

    /// Whether this CPU runs them.
    pub fn runs(self) -> bool {
        match self {
            Products::DotProducts => runs(),
            #[cfg(target_arch = "x86_64")]
            Products::Tiles => crate::amx::runs(),
            #[cfg(not(target_arch = "x86_64"))]
            Products::Tiles => false,
        }
    }
}

/// The pair of bfloat16 bits (lo, hi) as VDPBF16PS reads it: lo in the low 16 bits.
pub(crate) fn pair_bits(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

fn pair(lo: Bf16, hi: Bf16) -> u32 {
    pair_bits(lo.0, hi.0)
}

/// bfloat16 values (an even count) appended to `pairs` as the pairs the dot products read: in
/// memory consecutive values already are those pairs (value 2k the low half of pair k, as
/// `pair_bits` builds it, on a little-endian CPU: the dot products' x86).
pub(crate) fn extend_pairs(values: &[Bf16], pairs: &mut Lines<u32>) {
    assert!(values.len().is_multiple_of(2), "extend_pairs: an odd count of values");
    // SAFETY: the values' own 2 * len bytes, a slice apart from the buffer.
    unsafe { pairs.extend_from_bytes(values.as_ptr() as *const u8, 2 * values.len()) };
}

/// xs [n, K] rounded to bfloat16 pairs into `dst` [n, K2].
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512 BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn pack_vectors(xs: &[f32], cols: usize, dst: &mut Lines<u32>) {
    use std::arch::x86_64::*;
    let k2 = cols.div_ceil(2);
    dst.clear();
    dst.resize(xs.len() / cols * k2, 0);
    for (row, out) in xs.chunks_exact(cols).zip(dst.chunks_exact_mut(k2)) {
        // 32 values a time in the instruction's own rounding (to nearest even, subnormals to zero,
        // as the products treat them anyway), the rest one by one
        let mut c = 0;
        while c + 32 <= cols {
            let (lo, hi) = (_mm512_loadu_ps(row.as_ptr().add(c)), _mm512_loadu_ps(row.as_ptr().add(c + 16)));
            let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out.as_mut_ptr().add(c / 2) as *mut _, both);
            c += 32;
        }
        for (kk, p) in row[c..].chunks(2).enumerate() {
            out[c / 2 + kk] = pair(Bf16::from_f32(p[0]), p.get(1).map_or(Bf16(0), |&v| Bf16::from_f32(v)));
        }
    }
}

/// Rows first..first + PANEL_ROWS of m [rows, K] as [K2, PANEL_ROWS] pairs, rows past the end zero
/// (`pack_panel_into` a buffer of exactly that size).
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_panel(m: &[Bf16], rows: usize, cols: usize, first: usize, dst: &mut Lines<u32>) {
    dst.clear();
    dst.resize(cols.div_ceil(2) * PANEL_ROWS, 0);
    pack_panel_into(m, rows, cols, first, dst, true)
}

/// `pack_panel` into dst [K2P >= K2, PANEL_ROWS] pairs, the pairs past K2 zero: blocks of 16 rows
/// x 16 pairs transposed in registers, the edges (a last partial block of rows or of pairs) one
/// by one. `zeroed`: dst holds zeros already (else what the panel does not cover is zeroed here).
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_panel_into(m: &[Bf16], rows: usize, cols: usize, first: usize, dst: &mut [u32], zeroed: bool) {
    use std::arch::x86_64::*;
    let k2 = cols.div_ceil(2);
    assert!(dst.len() >= k2 * PANEL_ROWS && dst.len().is_multiple_of(PANEL_ROWS));
    let panel_rows = PANEL_ROWS.min(rows - first);
    if !zeroed {
        if panel_rows < PANEL_ROWS {
            dst.fill(0);
        } else {
            dst[k2 * PANEL_ROWS..].fill(0);
        }
    }
    // whole pairs of every row, 16 at a time (an odd K's last pair is an edge)
    let whole = cols / 32 * 16;
    for r0 in (0..panel_rows / 16 * 16).step_by(16) {
        for kk in (0..whole).step_by(16) {
            // the same pairs of the next 16 rows (the next panel's where this one ends) asked for
            // a block ahead: a block's 16 loads are 2 * cols bytes apart, a stride the hardware
            // prefetcher does not follow, and each waited on L3 or memory (docs/benchmarks.md)
            for row in first + r0 + 16..(first + r0 + 32).min(rows) {
                crate::prefetch::prefetch_l2(&m[row * cols + 2 * kk..][..32]);
            }
            // SAFETY: rows first + r0 .. + 16 exist and each holds pairs kk..kk + 16 (32 values);
            // dst holds K2 x PANEL_ROWS pairs and kk + 16 <= K2, r0 + 16 <= PANEL_ROWS.
            let rows16: [__m512i; 16] = std::array::from_fn(|i| {
                _mm512_loadu_si512(m.as_ptr().add((first + r0 + i) * cols + 2 * kk) as *const _)
            });
            for (c, column) in transpose16(rows16).iter().enumerate() {
                _mm512_storeu_si512(dst.as_mut_ptr().add((kk + c) * PANEL_ROWS + r0) as *mut _, *column);
            }
        }
    }
    let pack_one = |dst: &mut [u32], r: usize, kk: usize| {
        let row = &m[(first + r) * cols..(first + r + 1) * cols];
        dst[kk * PANEL_ROWS + r] = pair(row[2 * kk], row.get(2 * kk + 1).copied().unwrap_or(Bf16(0)));
    };
    for r in 0..panel_rows {
        let from = if r < panel_rows / 16 * 16 { whole } else { 0 };
        for kk in from..k2 {
            pack_one(dst, r, kk);
        }
    }
}

/// The 16 x 16 transpose of 32-bit elements: out[c] lane r = rows[r] lane c.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transpose16(r: [std::arch::x86_64::__m512i; 16]) -> [std::arch::x86_64::__m512i; 16] {
    use std::arch::x86_64::*;
    // 2 x 2 blocks of 32 bits, then 4 x 4 blocks within each 128-bit lane: u[4i + k]'s lane j
    // holds column 4j + k of rows 4i..4i + 4
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    let u: [__m512i; 16] = std::array::from_fn(|i| {
        let (g, k) = (i / 4 * 4, i % 4);
        let (a, b) = (t[g + (k >> 1)], t[g + 2 + (k >> 1)]);
        if k % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    // then the 128-bit lanes of the four row groups gathered per column
    std::array::from_fn(|c| {
        let (j, k) = (c / 4, c % 4);
        let (lo, hi) = if j % 2 == 0 {
            (_mm512_shuffle_i32x4::<0x88>(u[k], u[4 + k]), _mm512_shuffle_i32x4::<0x88>(u[8 + k], u[12 + k]))
        } else {
            (_mm512_shuffle_i32x4::<0xdd>(u[k], u[4 + k]), _mm512_shuffle_i32x4::<0xdd>(u[8 + k], u[12 + k]))
        };
        if j < 2 {
            _mm512_shuffle_i32x4::<0x88>(lo, hi)
        } else {
            _mm512_shuffle_i32x4::<0xdd>(lo, hi)
        }
    })
}

/// out [n, rows] = bf16(xs) [n, K] @ m [rows, K]^T, K = m.len() / rows.
///
/// # Panics
/// When the lengths disagree (as `matmul::matmul_nt`), or when this CPU lacks AVX-512 BF16
/// (`runs`).
pub fn matmul_nt_bf16(m: &[Bf16], rows: usize, xs: &[f32], out: &mut [f32], buffers: &mut Buffers) {
    assert!(runs(), "matmul_nt_bf16 needs AVX-512 BF16");
    let Some(cols) = crate::expert_pairs::nt_cols("matmul_nt_bf16", m.len(), rows, xs.len(), out) else { return };
    let mut pairs = std::mem::take(&mut buffers.xs);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: runs() checked the CPU.
    unsafe {
        pack_vectors(xs, cols, &mut pairs)
    };
    products(m, rows, cols, &pairs, out, buffers);
    buffers.xs = pairs;
}

/// `matmul_nt_bf16` of vectors given as bfloat16 pairs [n, K / 2] (even K): what
/// `pack_vectors` makes of bfloat16 values' widened copies, taken from them directly
/// (`extend_pairs`).
///
/// # Panics
/// When the lengths disagree, K is odd, or this CPU lacks AVX-512 BF16 (`runs`).
pub fn matmul_nt_pairs(m: &[Bf16], rows: usize, xs: &[u32], out: &mut [f32], buffers: &mut Buffers) {
    assert!(runs(), "matmul_nt_pairs needs AVX-512 BF16");
    let cols = m.len().checked_div(rows).unwrap_or(0);
    assert!(m.len() == rows * cols && cols.is_multiple_of(2), "matmul_nt_pairs: the matrix is not [rows, even K]");
    if cols == 0 {
        out.fill(0.0);
        return;
    }
    assert!(
        xs.len().is_multiple_of(cols / 2) && out.len() == xs.len() / (cols / 2) * rows,
        "matmul_nt_pairs: the vectors or the output disagree"
    );
    products(m, rows, cols, xs, out, buffers);
}

/// out [n, rows] = pairs [n, K2] @ m [rows, K]^T, panel by panel, in the fastest products
/// this CPU runs.
fn products(m: &[Bf16], rows: usize, cols: usize, pairs: &[u32], out: &mut [f32], buffers: &mut Buffers) {
    products_in(Products::fastest(), m, rows, cols, pairs, out, buffers)
}

/// `products` in the given instructions (which the CPU must run: `Products::runs`).
fn products_in(
    kind: Products,
    m: &[Bf16],
    rows: usize,
    cols: usize,
    pairs: &[u32],
    out: &mut [f32],
    buffers: &mut Buffers,
) {
    assert!(kind.runs(), "matmul_bf16: this CPU does not run {kind:?}");
    let k2 = cols.div_ceil(2);
    let n = pairs.len() / k2;
    #[cfg(target_arch = "x86_64")]
    if kind == Products::Tiles {
        // every panel first, each packed in place with its pairs padded to whole tiles; the
        // vectors read in place where their pairs are whole tiles, else padded as well
        let k2p = crate::amx::rounded_pairs(k2);
        let panel = k2p * PANEL_ROWS;
        let need = rows.div_ceil(PANEL_ROWS) * panel;
        if buffers.panels.len() < need {
            buffers.panels.resize(need, 0);
        }
        for (p, first) in (0..rows).step_by(PANEL_ROWS).enumerate() {
            // SAFETY: amx::runs() (asserted) includes AVX-512F, which the packing needs.
            unsafe { pack_panel_into(m, rows, cols, first, &mut buffers.panels[p * panel..(p + 1) * panel], false) };
        }
        let vectors = if k2p == k2 {
            pairs
        } else {
            crate::amx::pad_vectors(pairs, k2, &mut buffers.tiles);
            &buffers.tiles
        };
        // SAFETY: as above; the panels are whole tiles, the vectors [n, k2p] pairs, and out is
        // [n, rows].
        unsafe { crate::amx::products(vectors, k2p, n, &buffers.panels, rows, out, &mut buffers.tail) };
        return;
    }
    for first in (0..rows).step_by(PANEL_ROWS) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU runs the dot products (asserted); pairs hold n x K2, the panel K2 x
        // PANEL_ROWS pairs, and out is [n, rows], of which the panel writes columns
        // first..min(first + 64, rows).
        unsafe {
            pack_panel(m, rows, cols, first, &mut buffers.panel);
            panel_avx512(pairs, &buffers.panel, k2, n, rows, first, out)
        };
    }
}

/// Whether `packed_products` runs here and gives `products`' bits: the CPU has the dot products
/// and they are the fastest products it runs (where AMX tiles run and are allowed, a wide
/// product takes them, in an order of their own).
pub fn packed_runs() -> bool {
    runs() && Products::fastest() == Products::DotProducts
}

/// Pairs (u32) of a [rows, K] matrix packed by `pack_matrix`: its PANEL_ROWS-row panels, the
/// last padded with zero rows, K rounded up to pairs.
pub fn packed_len(rows: usize, cols: usize) -> usize {
    rows.div_ceil(PANEL_ROWS) * cols.div_ceil(2) * PANEL_ROWS
}

/// out [panels][K2][PANEL_ROWS] = m [rows, K] in the panels `products` packs for each call, kept
/// (bfloat16 experts' copy, r3srv.kernels.expert_pairs_cpu): `packed_products` then reads each
/// panel as one contiguous run.
///
/// # Panics
/// When the lengths disagree or the CPU lacks AVX-512 BF16 (`runs`).
pub fn pack_matrix(m: &[Bf16], rows: usize, out: &mut [u32]) {
    assert!(rows > 0 && m.len().is_multiple_of(rows), "matmul_bf16::pack_matrix: the matrix is not [{rows}, K]");
    let cols = m.len() / rows;
    assert_eq!(out.len(), packed_len(rows, cols), "matmul_bf16::pack_matrix: the output is not its packed length");
    assert!(runs(), "matmul_bf16::pack_matrix needs AVX-512F (and BF16: where its panels are read)");
    if cols == 0 {
        return;
    }
    let panel = cols.div_ceil(2) * PANEL_ROWS;
    for (first, dst) in (0..rows).step_by(PANEL_ROWS).zip(out.chunks_exact_mut(panel)) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: runs() (asserted) includes AVX-512F; dst holds the panel's K2 x PANEL_ROWS pairs.
        unsafe {
            pack_panel_into(m, rows, cols, first, dst, false)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (first, dst);
    }
}

/// out [n, rows] = pairs [n, K2] @ m^T, m [rows, K] packed by `pack_matrix`: `products` in
/// the dot products without packing a panel (the same bits), each vector's outputs its own.
///
/// # Panics
/// When the lengths disagree or the CPU lacks the dot products (`runs`; where AMX tiles run the
/// wide products, `packed_runs` is false and these are not their bits).
pub fn packed_products(pairs: &[u32], packed: &[u32], rows: usize, out: &mut [f32]) {
    assert!(runs(), "matmul_bf16::packed_products needs AVX-512 BF16");
    let panels = rows.div_ceil(PANEL_ROWS);
    assert!(rows > 0 && packed.len().is_multiple_of(panels * PANEL_ROWS), "packed_products: not a packed [{rows}, K]");
    let k2 = packed.len() / (panels * PANEL_ROWS);
    assert!(k2 > 0 && pairs.len().is_multiple_of(k2), "packed_products: the vectors are not [n, {k2}] pairs");
    let n = pairs.len() / k2;
    assert_eq!(out.len(), n * rows, "packed_products: the output is not [{n}, {rows}]");
    for (first, panel) in (0..rows).step_by(PANEL_ROWS).zip(packed.chunks_exact(k2 * PANEL_ROWS)) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: runs() (asserted): AVX-512F and BF16; pairs hold n x k2, the panel k2 x
        // PANEL_ROWS pairs, and out is [n, rows].
        unsafe {
            panel_avx512(pairs, panel, k2, n, rows, first, out)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (first, panel, n);
    }
}

/// One panel's columns of out for all n vectors, BLOCK_VECTORS at a time.
///
/// # Safety
/// As `matmul_nt_bf16` guarantees.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn panel_avx512(xs: &[u32], panel: &[u32], k2: usize, n: usize, rows: usize, first: usize, out: &mut [f32]) {
    let mut j = 0;
    let width = PANEL_ROWS.min(rows - first);
    while j < n {
        // the next block's rows of out asked for with the intent to write while this one
        // computes: out may be a buffer no cache holds (as in crate::amx::products)
        for v in (j + BLOCK_VECTORS..n).take(BLOCK_VECTORS) {
            crate::prefetch::prefetch_for_write(&out[v * rows + first..][..width]);
        }
        match n - j {
            6.. => block::<6>(xs, panel, k2, rows, first, j, out),
            5 => block::<5>(xs, panel, k2, rows, first, j, out),
            4 => block::<4>(xs, panel, k2, rows, first, j, out),
            3 => block::<3>(xs, panel, k2, rows, first, j, out),
            2 => block::<2>(xs, panel, k2, rows, first, j, out),
            _ => block::<1>(xs, panel, k2, rows, first, j, out),
        }
        j += (n - j).min(BLOCK_VECTORS);
    }
}

/// out[j + v, first + c] for v < V and c < PANEL_ROWS (within rows).
///
/// # Safety
/// As `panel_avx512`, with j + V <= n.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn block<const V: usize>(
    xs: &[u32],
    panel: &[u32],
    k2: usize,
    rows: usize,
    first: usize,
    j: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (xp, wp) = (xs.as_ptr().add(j * k2), panel.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); 4]; V];
    for kk in 0..k2 {
        let w: [__m512bh; 4] = std::array::from_fn(|q| {
            std::mem::transmute(_mm512_loadu_si512(wp.add(kk * PANEL_ROWS + 16 * q) as *const _))
        });
        for (v, acc) in acc.iter_mut().enumerate() {
            let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*xp.add(v * k2 + kk) as i32));
            for (a, w) in acc.iter_mut().zip(&w) {
                *a = _mm512_dpbf16_ps(*a, *w, x);
            }
        }
    }
    let width = PANEL_ROWS.min(rows - first);
    for (v, acc) in acc.iter().enumerate() {
        let dst = out.as_mut_ptr().add((j + v) * rows + first);
        for (q, a) in acc.iter().enumerate() {
            let lanes = width.saturating_sub(16 * q).min(16);
            if lanes > 0 {
                _mm512_mask_storeu_ps(dst.add(16 * q), ((1u32 << lanes) - 1) as u16, *a);
            }
        }
    }
}

/// out [n, rows] = xs [n, K] @ m [rows, K]^T for a few vectors (a decode's or a short prompt's
/// pairs of one expert), with no packing of the weights: each output the dot product of a
/// weight row and a vector as pairs (`xs`, from `pack_vectors`), 16 lanes of sums then their
/// `_mm512_reduce_add_ps`, in an order that depends on neither n nor the row's block, so a
/// vector gets the same bits in any batch. K must be even.
///
/// # Panics
/// When K is odd or the lengths disagree, or when this CPU lacks AVX-512 BF16 (`runs`).
pub fn gemm_nt_bf16(m: &[Bf16], rows: usize, xs: &[u32], out: &mut [f32]) {
    assert!(runs(), "gemm_nt_bf16 needs AVX-512 BF16");
    let cols = m.len().checked_div(rows).unwrap_or(0);
    assert!(m.len() == rows * cols && cols.is_multiple_of(2), "gemm_nt_bf16: the matrix is not [rows, even K]");
    let k2 = cols / 2;
    if k2 == 0 {
        out.fill(0.0);
        return;
    }
    assert!(
        xs.len().is_multiple_of(k2) && out.len() == xs.len() / k2 * rows,
        "gemm_nt_bf16: the vectors or the output disagree"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: runs() checked the CPU, the lengths were checked above.
    unsafe {
        nt_avx512(m, rows, k2, xs, out)
    };
}

/// Blocks of 4 rows x up to 4 vectors.
///
/// # Safety
/// As `gemm_nt_bf16` checks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn nt_avx512(m: &[Bf16], rows: usize, k2: usize, xs: &[u32], out: &mut [f32]) {
    let n = xs.len() / k2;
    crate::expert_pairs::each_block!(
        m,
        rows,
        2 * k2,
        n,
        4,
        |r| if r + 4 <= rows { 4 } else { 1 },
        |block, left, r, j, ahead| {
            match (block, left) {
                (4, 4..) => nt_block::<4, 4>(m, rows, k2, xs, out, r, j, ahead),
                (4, 3) => nt_block::<4, 3>(m, rows, k2, xs, out, r, j, ahead),
                (4, 2) => nt_block::<4, 2>(m, rows, k2, xs, out, r, j, ahead),
                (4, _) => nt_block::<4, 1>(m, rows, k2, xs, out, r, j, ahead),
                (_, 4..) => nt_block::<1, 4>(m, rows, k2, xs, out, r, j, ahead),
                (_, 3) => nt_block::<1, 3>(m, rows, k2, xs, out, r, j, ahead),
                (_, 2) => nt_block::<1, 2>(m, rows, k2, xs, out, r, j, ahead),
                _ => nt_block::<1, 1>(m, rows, k2, xs, out, r, j, ahead),
            }
        }
    );
}

/// out[j + v, r + l] for l < R, v < V, asking for `ahead` (rows a later block reads) a step's
/// bytes a step (prefetch::prefetch_l2_bytes).
///
/// # Safety
/// As `nt_avx512`, with r + R <= rows and j + V <= n.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn nt_block<const R: usize, const V: usize>(
    m: &[Bf16],
    rows: usize,
    k2: usize,
    xs: &[u32],
    out: &mut [f32],
    r: usize,
    j: usize,
    ahead: &[Bf16],
) {
    use std::arch::x86_64::*;
    let (mp, xp) = (m.as_ptr() as *const u32, xs.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    let mut c = 0;
    while c < k2 {
        crate::prefetch::prefetch_l2_bytes(ahead, c * 4 * R, 64 * R);
        // 16 pairs a step; the row's last step masked (loads past it read nothing)
        let mask: __mmask16 = if c + 16 <= k2 { 0xffff } else { ((1u32 << (k2 - c)) - 1) as __mmask16 };
        let x: [__m512bh; V] = std::array::from_fn(|v| {
            std::mem::transmute(_mm512_maskz_loadu_epi32(mask, xp.add((j + v) * k2 + c) as *const _))
        });
        for (l, row) in acc.iter_mut().enumerate() {
            let w: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi32(mask, mp.add((r + l) * k2 + c) as *const _));
            for (a, x) in row.iter_mut().zip(&x) {
                *a = _mm512_dpbf16_ps(*a, w, *x);
            }
        }
        c += 16;
    }
    if R == 4 {
        // the 4 rows' sums of each vector side by side: one 128-bit store a vector
        let sums = reduce_4x4(std::array::from_fn(|v| {
            std::array::from_fn(|l| if v < V { acc[l][v] } else { _mm512_setzero_ps() })
        }));
        for (v, quarter) in sums.iter().enumerate().take(V) {
            _mm_storeu_ps(out.as_mut_ptr().add((j + v) * rows + r), *quarter);
        }
    } else {
        for (l, row) in acc.iter().enumerate() {
            for (v, a) in row.iter().enumerate() {
                out[(j + v) * rows + r + l] = _mm512_reduce_add_ps(*a);
            }
        }
    }
}

/// `_mm512_reduce_add_ps` of 16 registers at once, `a[v][l]`'s sum in lane l of the v-th
/// 128-bit result: each register's lanes added in the tree `_mm512_reduce_add_ps` adds them
/// (lane i + lane i+8, then i + i+4, i + i+2, i + i+1), the same bits (the test
/// `the_four_by_four_reduction_keeps_the_bits_of_one_by_one`), in ~30 shuffles and adds where
/// one by one takes ~10 instructions a register: a decode step's blocks sum only 4 to 8 steps of
/// pairs, so their reductions cost as much as their products.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn reduce_4x4(a: [[std::arch::x86_64::__m512; 4]; 4]) -> [std::arch::x86_64::__m128; 4] {
    use std::arch::x86_64::*;
    // x[4l + v]: vector v's row l
    let x: [__m512; 16] = std::array::from_fn(|i| a[i % 4][i / 4]);
    // lanes i + i+8: two registers' 8 partial sums in one (the first's in the low half)
    let halves: [__m512; 8] = std::array::from_fn(|m| {
        let (p, q) = (x[2 * m], x[2 * m + 1]);
        _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(p, q), _mm512_shuffle_f32x4::<0b11_10_11_10>(p, q))
    });
    // lanes i + i+4: four registers' 4 partial sums, quarter k holding x[4n + k]'s
    let quarters: [__m512; 4] = std::array::from_fn(|n| {
        let (p, q) = (halves[2 * n], halves[2 * n + 1]);
        _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(p, q), _mm512_shuffle_f32x4::<0b11_01_11_01>(p, q))
    });
    // lanes i + i+2: quarter k holds x[8s + k]'s 2 partial sums, then x[8s + 4 + k]'s
    let pairs: [__m512; 2] = std::array::from_fn(|s| {
        let (p, q) = (_mm512_castps_pd(quarters[2 * s]), _mm512_castps_pd(quarters[2 * s + 1]));
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)))
    });
    // lanes i + i+1: lane 4k + t of the sum is x[4t + k]'s, so quarter v holds rows 0..4 of vector v
    let (p, q) = (pairs[0], pairs[1]);
    let sums = _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(p, q), _mm512_shuffle_ps::<0b11_01_11_01>(p, q));
    [
        _mm512_castps512_ps128(sums),
        _mm512_extractf32x4_ps::<1>(sums),
        _mm512_extractf32x4_ps::<2>(sums),
        _mm512_extractf32x4_ps::<3>(sums),
    ]
}

/// `matmul_nt_bf16` in portable code: each output the f32 sum, pair by pair, of the bfloat16
/// products (exact in f32); the order within a pair is the instruction's (high, then low).
pub fn reference(m: &[Bf16], rows: usize, xs: &[f32], out: &mut [f32]) {
    let Some(cols) = crate::expert_pairs::nt_cols("reference", m.len(), rows, xs.len(), out) else { return };
    for (x, o) in xs.chunks_exact(cols).zip(out.chunks_exact_mut(rows)) {
        for (w, o) in m.chunks_exact(cols).zip(o.iter_mut()) {
            let mut sum = 0f32;
            for (w, x) in w.chunks(2).zip(x.chunks(2)) {
                for i in (0..w.len()).rev() {
                    sum += w[i].to_f32() * Bf16::from_f32(x[i]).to_f32();
                }
            }
            *o = sum;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::noise;

    fn bf16s(n: usize, seed: u64) -> Vec<Bf16> {
        noise(n, seed).into_iter().map(Bf16::from_f32).collect()
    }

    /// Each output is the f64 product of m and bf16(xs) within its float32 sums' rounding.
    fn within_f64(m: &[Bf16], rows: usize, xs: &[f32], got: &[f32]) {
        let cols = m.len() / rows;
        for (j, (x, got)) in xs.chunks_exact(cols).zip(got.chunks_exact(rows)).enumerate() {
            for (r, (w, &got)) in m.chunks_exact(cols).zip(got).enumerate() {
                let terms = w.iter().zip(x).map(|(w, &x)| w.to_f32() as f64 * Bf16::from_f32(x).to_f32() as f64);
                let (exact, size): (f64, f64) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                let err = (got as f64 - exact).abs();
                assert!(err <= cols as f64 * f32::EPSILON as f64 * size, "{rows}x{cols} [{j}, {r}]: {err}");
            }
        }
    }

    /// Every shape class: one row, a partial panel, whole panels, odd K, n below, at and past a block.
    const SHAPES: [(usize, usize, usize); 8] =
        [(1, 2, 1), (3, 7, 5), (64, 256, 6), (65, 33, 7), (256, 128, 97), (200, 255, 13), (17, 1, 64), (128, 512, 300)];

    /// The dot products on every shape class: the portable order's bits and within float32
    /// rounding of f64; from kept panels (`pack_matrix`, `packed_products`) the same bits, a
    /// vector's outputs alone its outputs among others; the packing checks its lengths.
    #[test]
    fn matches_the_portable_order_and_f64() {
        if crate::testing::skips_without_bf16() {
            return;
        }
        let mut buffers = Buffers::default();
        for (rows, cols, n) in SHAPES {
            let (m, xs) = (bf16s(rows * cols, rows as u64 + 3), noise(n * cols, cols as u64 + 5));
            let (mut got, mut want) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
            let mut pairs = Lines::default();
            // SAFETY: skips_without_bf16 checked the CPU.
            unsafe { pack_vectors(&xs, cols, &mut pairs) };
            products_in(Products::DotProducts, &m, rows, cols, &pairs, &mut got, &mut buffers);
            reference(&m, rows, &xs, &mut want);
            assert_eq!(got, want, "{rows}x{cols} n={n}: the instruction's sums in the portable order");
            within_f64(&m, rows, &xs, &got);
            let mut packed = vec![u32::MAX; packed_len(rows, cols)];
            pack_matrix(&m, rows, &mut packed);
            let mut kept = vec![f32::NAN; n * rows];
            packed_products(&pairs, &packed, rows, &mut kept);
            assert_eq!(kept, want, "{rows}x{cols} n={n}: from kept panels");
            let (k2, last) = (cols.div_ceil(2), n - 1);
            let mut alone = vec![f32::NAN; rows];
            packed_products(&pairs[last * k2..], &packed, rows, &mut alone);
            assert_eq!(alone, want[last * rows..], "{rows}x{cols}: the last vector alone");
            // the fastest products here (AMX tiles where they run: their own order)
            matmul_nt_bf16(&m, rows, &xs, &mut got, &mut buffers);
            within_f64(&m, rows, &xs, &got);
        }
        let mut short = vec![0u32; 3];
        assert!(std::panic::catch_unwind(move || pack_matrix(&bf16s(64 * 4, 1), 64, &mut short)).is_err());
    }

    /// AMX tiles, where they run: every output within float32 rounding of the f64 product (the
    /// tiles sum a tile's 16 pairs in an order of their own: not the dot products' bits), and
    /// a vector's outputs the same bits alone as among others, on every shape class and on
    /// vector counts on both sides of the tiles' 16 and 32.
    #[test]
    fn amx_tiles_match_f64_and_keep_a_vectors_bits_in_any_batch() {
        if !Products::Tiles.runs() {
            eprintln!("skipped: this CPU (or its kernel) does not run AMX-BF16 tiles");
            return;
        }
        let mut buffers = Buffers::default();
        let extra = [(64, 256, 16), (64, 256, 31), (64, 256, 33), (130, 130, 47), (256, 128, 500)];
        for (rows, cols, n) in SHAPES.into_iter().chain(extra).filter(|&(_, cols, _)| cols % 2 == 0) {
            let (m, xs) = (bf16s(rows * cols, rows as u64 + 41), bf16s(n * cols, cols as u64 + 43));
            let mut pairs = Lines::default();
            extend_pairs(&xs, &mut pairs);
            let mut got = vec![f32::NAN; n * rows];
            products_in(Products::Tiles, &m, rows, cols, &pairs, &mut got, &mut buffers);
            let widened: Vec<f32> = xs.iter().map(|v| v.to_f32()).collect();
            within_f64(&m, rows, &widened, &got);
            let (k2, last) = (cols / 2, n - 1);
            let mut alone = vec![f32::NAN; rows];
            products_in(Products::Tiles, &m, rows, cols, &pairs[last * k2..], &mut alone, &mut buffers);
            assert_eq!(alone, got[last * rows..], "{rows}x{cols} n={n}: the last vector alone");
        }
    }

    /// Vectors given as bfloat16 pairs give the bits of their widened values through
    /// `matmul_nt_bf16` (every shape class of even K).
    #[test]
    fn pairs_read_directly_give_the_widened_vectors_bits() {
        if crate::testing::skips_without_bf16() {
            return;
        }
        let mut buffers = Buffers::default();
        for (rows, cols, n) in SHAPES.into_iter().filter(|&(_, cols, _)| cols % 2 == 0) {
            let (m, xs) = (bf16s(rows * cols, rows as u64 + 17), bf16s(n * cols, cols as u64 + 19));
            let mut pairs = Lines::default();
            extend_pairs(&xs, &mut pairs);
            assert_eq!(pairs[..], xs.chunks_exact(2).map(|p| pair(p[0], p[1])).collect::<Vec<_>>()[..]);
            let widened: Vec<f32> = xs.iter().map(|v| v.to_f32()).collect();
            let (mut got, mut want) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
            matmul_nt_pairs(&m, rows, &pairs, &mut got, &mut buffers);
            matmul_nt_bf16(&m, rows, &widened, &mut want, &mut buffers);
            assert_eq!(got, want, "{rows}x{cols} n={n}");
        }
    }

    /// Every panel of every shape class holds pair kk of row first + r at kk * 64 + r (the
    /// registers' transposes and the edges alike), zeros past the rows and K.
    #[test]
    fn panels_hold_each_rows_pairs() {
        if crate::testing::skips_without_bf16() {
            return;
        }
        let mut panel = Lines::default();
        for (rows, cols, _) in SHAPES {
            let m = bf16s(rows * cols, rows as u64 + 13);
            for first in (0..rows).step_by(PANEL_ROWS) {
                // SAFETY: runs() checked the CPU.
                unsafe { pack_panel(&m, rows, cols, first, &mut panel) };
                assert_eq!(panel.len(), cols.div_ceil(2) * PANEL_ROWS);
                for (i, &got) in panel.iter().enumerate() {
                    let (kk, r) = (i / PANEL_ROWS, i % PANEL_ROWS);
                    let at = |c: usize| if first + r < rows && c < cols { m[(first + r) * cols + c] } else { Bf16(0) };
                    assert_eq!(
                        got,
                        pair(at(2 * kk), at(2 * kk + 1)),
                        "{rows}x{cols} panel {first}: pair {kk} of row {r}"
                    );
                }
            }
        }
    }

    /// reduce_4x4's sums are `_mm512_reduce_add_ps`'s bits, register by register, on sums
    /// of mixed magnitudes (where the order of the adds shows in the last bits).
    #[test]
    fn the_four_by_four_reduction_keeps_the_bits_of_one_by_one() {
        if crate::testing::skips_without_bf16() {
            return;
        }
        use std::arch::x86_64::*;
        let mut order_shows = 0; // registers whose lane-by-lane sum has other bits than the tree's
        for seed in 0..200u64 {
            let lanes = noise(256, seed + 1);
            let scales = noise(256, seed + 1000);
            // magnitudes from 2^-12 to 2^12, so that a different tree gives other bits
            let values: Vec<f32> = lanes.iter().zip(&scales).map(|(v, s)| v * (3.0 * s).exp2().powi(2)).collect();
            // SAFETY: runs() checked the CPU (AVX-512F among it); each load reads 16 of the 256 values.
            unsafe {
                let regs: [[__m512; 4]; 4] = std::array::from_fn(|v| {
                    std::array::from_fn(|l| _mm512_loadu_ps(values.as_ptr().add(64 * v + 16 * l)))
                });
                let sums = reduce_4x4(regs);
                for v in 0..4 {
                    let mut got = [0f32; 4];
                    _mm_storeu_ps(got.as_mut_ptr(), sums[v]);
                    for l in 0..4 {
                        let tree = _mm512_reduce_add_ps(regs[v][l]);
                        assert_eq!(got[l].to_bits(), tree.to_bits(), "seed {seed}: v {v}, l {l}");
                        let in_order: f32 = values[64 * v + 16 * l..][..16].iter().sum();
                        order_shows += usize::from(in_order.to_bits() != tree.to_bits());
                    }
                }
            }
        }
        assert!(order_shows > 1000, "the inputs hardly depend on the order of the adds ({order_shows} of 3200)");
    }

    #[test]
    fn the_narrow_kernel_matches_f64_and_keeps_a_vectors_bits_in_any_batch() {
        if crate::testing::skips_without_bf16() {
            return;
        }
        for (rows, cols, n) in [(1, 2, 1), (3, 34, 5), (64, 256, 6), (65, 30, 7), (256, 128, 9), (17, 2048, 3)] {
            let (m, xs) = (bf16s(rows * cols, rows as u64 + 7), noise(n * cols, cols as u64 + 9));
            let mut pairs = Lines::default();
            // SAFETY: runs() checked the CPU.
            unsafe { pack_vectors(&xs, cols, &mut pairs) };
            let mut got = vec![f32::NAN; n * rows];
            gemm_nt_bf16(&m, rows, &pairs, &mut got);
            within_f64(&m, rows, &xs, &got);
            for j in 0..n {
                // the vector alone: the same bits
                let mut alone = vec![f32::NAN; rows];
                gemm_nt_bf16(&m, rows, &pairs[j * cols / 2..(j + 1) * cols / 2], &mut alone);
                assert_eq!(alone[..], got[j * rows..(j + 1) * rows], "{rows}x{cols} n={n}: vector {j} alone");
            }
        }
    }

    #[test]
    fn rounds_the_inputs_and_keeps_odd_k_apart() {
        // an odd K's padding must not read the next row's first value: a NaN there stays out
        let (rows, cols, n) = (3, 5, 2);
        let m = bf16s(rows * cols, 9);
        let mut xs = noise(n * cols, 11);
        xs[cols] = f32::NAN;
        let mut want = vec![0f32; n * rows];
        reference(&m, rows, &xs, &mut want);
        assert!(want[..rows].iter().all(|v| v.is_finite()) && want[rows..].iter().all(|v| v.is_nan()));
        if runs() {
            let mut got = vec![0f32; n * rows];
            matmul_nt_bf16(&m, rows, &xs, &mut got, &mut Buffers::default());
            assert_eq!(got[..rows], want[..rows]);
            assert!(got[rows..].iter().all(|v| v.is_nan()));
        }
    }
}
