//! The CPU expert pass, one call per MoE layer: for each pair p of token t, expert e = ids[p]
//! and weight w = weights[p] (every token's k slots, or an expert-parallel rank's own list of
//! pairs, `PairTokens`),
//!     h = w13[e] @ x[t] (+ b13[e]),  a = act(h),  o = w2[e] @ a (+ b2[e]),
//! and out[t] = the sum of its pairs' w * o in pair order. Pairs are grouped by expert, and
//! each expert's pairs run as small matrix products (`gemm_nt`) that read every weight row once
//! per chunk of pairs, in place (r3srv.kernels.expert_pairs_cpu); an expert with many pairs (a
//! prefill's) runs them in wide chunks instead: float32 experts in `pair_panels` (the pairs as
//! the vector lanes) on an AVX2 or AVX-512 CPU, else through `matmul`'s packed kernels. A narrow
//! chunk's output elements are each the same dot product, summed in the same order, whatever
//! the grouping or chunking, so a token whose experts have few pairs gets the bits it gets
//! alone; a wide chunk's are within float32 rounding of those. Experts handed over packed as
//! well (`PackedExperts`: float32 ones in row tiles on an AVX-512 CPU, bfloat16 ones in the dot
//! products' panels where those run) run every chunk, narrow or wide, over that copy, with the
//! wide chunks' bits (float32: the pair panels'). The thread count never
//! changes a bit. Tensors hold float32 or bfloat16 (`Element`); the arithmetic is float32 throughout,
//! bfloat16 rounded once at the end, except that bfloat16 experts round their activations to
//! bfloat16 before the second product (as transformers' bfloat16 experts do), which lets them
//! run in AVX-512 BF16 dot products (`matmul_bf16`) where the CPU has them.
//!
//! Threads (`workers`' pool) take chunks from a shared counter, and only for calls large
//! enough to pay for waking them (`PARALLEL_MIN_MACS`).

use std::sync::OnceLock;

// branch-free, within about 2 ulp of libm's: a loop of it vectorizes
use crate::aligned::Lines;
use crate::paged_attn::exp;
use crate::pair_panels;

/// What the experts' and tokens' tensors hold: read as f32, written from f32.
pub trait Element: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;

    /// `from_f32(v).to_f32()`: v rounded to this type, kept in f32 (the bfloat16 one in f32
    /// bits alone, so that loops of it vectorize).
    #[inline(always)]
    fn round(v: f32) -> f32 {
        Self::from_f32(v).to_f32()
    }

    /// The slice itself when it already holds f32.
    fn as_f32s(s: &[Self]) -> Option<&[f32]>;

    /// `as_f32s` of a slice to write.
    fn as_f32s_mut(s: &mut [Self]) -> Option<&mut [f32]>;

    /// The slice itself when it holds bfloat16.
    fn as_bf16s(s: &[Self]) -> Option<&[Bf16]>;

    /// `as_bf16s` of a slice to write.
    fn as_bf16s_mut(s: &mut [Self]) -> Option<&mut [Bf16]>;

    /// Eight elements from `p`, widened to f32. The impls are compiled for the features they
    /// use (`#[target_feature]`) so that their intrinsics inline into the kernels (see
    /// paged_attn's `Element::load8`).
    ///
    /// # Safety
    /// The CPU must support AVX2, and `p` must be valid for reading eight elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// Eight elements from `lo` in the low half and eight from `hi` in the high half, widened.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, and both pointers must be valid for reading eight elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8x2(lo: *const Self, hi: *const Self) -> std::arch::x86_64::__m512;

    /// What a packed copy of experts of this type holds (`PackedExperts`): f32 in row tiles,
    /// bfloat16 pairs (u32) in the dot products' panels.
    type Packed: Copy + Default + Send + Sync;

    /// Outputs a block of the packed copy holds (its last block padded to them).
    const PACKED_ROWS: usize;

    /// Values of a [n, k] matrix packed.
    fn packed_len(n: usize, k: usize) -> usize;

    /// out = w [n, k] packed (`packed_len(n, k)` values).
    fn pack_matrix(w: &[Self], n: usize, out: &mut [Self::Packed]);

    /// out [m, n] = x [m, k] @ w^T on this thread, w [n, k] packed (`pack_matrix`; or a run of
    /// its whole blocks), in the packed experts' products: a row's outputs its own, the same bits
    /// alone and in any batch. The CPU must run them (`packed_runs`).
    fn packed_rows(x: &[Self], k: usize, packed: &[Self::Packed], n: usize, out: &mut [f32]);
}

impl Element for f32 {
    type Packed = f32;
    const PACKED_ROWS: usize = crate::row_tiles::COLS;

    fn packed_len(n: usize, k: usize) -> usize {
        crate::row_tiles::packed_len(n, k)
    }

    fn pack_matrix(w: &[f32], n: usize, out: &mut [f32]) {
        crate::row_tiles::pack_matrix(w, n, out)
    }

    fn packed_rows(x: &[f32], k: usize, packed: &[f32], n: usize, out: &mut [f32]) {
        let rows: Vec<&[f32]> = x.chunks_exact(k).collect();
        crate::row_tiles::packed_product(&rows, packed, n, out)
    }

    fn to_f32(self) -> f32 {
        self
    }

    fn from_f32(v: f32) -> Self {
        v
    }

    fn as_f32s(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }

    fn as_f32s_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }

    fn as_bf16s(_: &[Self]) -> Option<&[Bf16]> {
        None
    }

    fn as_bf16s_mut(_: &mut [Self]) -> Option<&mut [Bf16]> {
        None
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2")]
    #[inline]
    unsafe fn load8x2(lo: *const Self, hi: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let lo = _mm512_castps256_ps512(_mm256_loadu_ps(lo));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castps_pd(lo), _mm256_castps_pd(_mm256_loadu_ps(hi))))
    }
}

/// A bfloat16: the upper half of an f32's bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Element for Bf16 {
    type Packed = u32;
    const PACKED_ROWS: usize = crate::matmul_bf16::PANEL_ROWS;

    fn packed_len(n: usize, k: usize) -> usize {
        crate::matmul_bf16::packed_len(n, k)
    }

    fn pack_matrix(w: &[Bf16], n: usize, out: &mut [u32]) {
        crate::matmul_bf16::pack_matrix(w, n, out)
    }

    fn packed_rows(x: &[Bf16], k: usize, packed: &[u32], n: usize, out: &mut [f32]) {
        // x's rows as pairs, as the experts' chunks take their tokens (an odd k padded a row at a time)
        let mut pairs = crate::aligned::Lines::default();
        if k.is_multiple_of(2) {
            crate::matmul_bf16::extend_pairs(x, &mut pairs);
        } else {
            assert!(crate::matmul_bf16::runs(), "packed_rows: bfloat16 pairs need AVX-512 BF16");
            let widened: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
            #[cfg(target_arch = "x86_64")]
            // SAFETY: runs() (asserted) includes AVX-512F and BF16; widened holds whole rows of k.
            unsafe {
                crate::matmul_bf16::pack_vectors(&widened, k, &mut pairs)
            };
        }
        crate::matmul_bf16::packed_products(&pairs, packed, n, out)
    }

    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }

    /// Rounded to nearest, ties to even, as torch rounds (NaN stays a quiet NaN).
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        Bf16((Self::round(v).to_bits() >> 16) as u16)
    }

    /// Branch-free (the NaN case a select) and in f32 lanes, so that loops of it vectorize.
    #[inline(always)]
    fn round(v: f32) -> f32 {
        let bits = v.to_bits();
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
        f32::from_bits(if v.is_nan() { 0x7fc0_0000 } else { rounded })
    }

    fn as_f32s(_: &[Self]) -> Option<&[f32]> {
        None
    }

    fn as_f32s_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }

    fn as_bf16s(s: &[Self]) -> Option<&[Bf16]> {
        Some(s)
    }

    fn as_bf16s_mut(s: &mut [Self]) -> Option<&mut [Bf16]> {
        Some(s)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2")]
    #[inline]
    unsafe fn load8x2(lo: *const Self, hi: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let both = _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(lo as *const __m128i)),
            _mm_loadu_si128(hi as *const __m128i),
        );
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(both)))
    }
}

/// The expert activations of r3srv.models.moe.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// `silu_and_mul`: h = [gate; up] (I rows each), a = silu(gate) * up.
    SiluAndMul,
    /// gpt-oss's `clamped_swiglu`: h interleaves gate and up rows (gate at even indices),
    /// gate clamped above at `limit`, up to [-limit, limit], a = (up + 1) * gate * sigmoid(alpha * gate).
    ClampedSwiglu { alpha: f32, limit: f32 },
    /// Nemotron-H's `relu_squared`: h = up (I rows), a = relu(up)^2.
    ReluSquared,
}

impl Activation {
    /// Rows of w13 per intermediate unit: 2 for the gated activations, 1 for relu^2.
    pub fn rows_per_unit(self) -> usize {
        match self {
            Activation::ReluSquared => 1,
            _ => 2,
        }
    }

    #[inline(always)]
    fn apply(self, h: &[f32], a: &mut [f32]) {
        let inter = a.len();
        match self {
            Activation::SiluAndMul => {
                let (gate, up) = h.split_at(inter);
                for ((a, &g), &u) in a.iter_mut().zip(gate).zip(up) {
                    *a = g / (1.0 + exp(-g)) * u;
                }
            }
            Activation::ClampedSwiglu { alpha, limit } => {
                for (a, pair) in a.iter_mut().zip(h.chunks_exact(2)) {
                    let gate = pair[0].min(limit);
                    let up = pair[1].clamp(-limit, limit);
                    *a = (up + 1.0) * (gate / (1.0 + exp(-(gate * alpha))));
                }
            }
            Activation::ReluSquared => {
                for (a, &u) in a.iter_mut().zip(h) {
                    let r = u.max(0.0);
                    *a = r * r;
                }
            }
        }
    }
}

/// A rank's stacked experts, read in place: w13 [E, R, H], w2 [E, H, I], b13 [E, R], b2 [E, H]
/// (R = I x `Activation::rows_per_unit`), and the weights' packed copy, if kept.
pub struct Experts<'a, W: Element> {
    pub w13: &'a [W],
    pub w2: &'a [W],
    pub b13: Option<&'a [W]>,
    pub b2: Option<&'a [W]>,
    pub num_experts: usize,
    pub hidden: usize,
    pub inter: usize,
    pub act: Activation,
    pub packed: Option<PackedExperts<'a>>,
}

/// Experts' weights kept packed (`pack_experts`): each expert's w13 and w2, one after another,
/// in 64-output blocks that are each one contiguous run of memory, which a core streams at its
/// full read bandwidth where the rows' blocks of four interleaved streams (`gemm_nt`,
/// `matmul_bf16::gemm_nt_bf16`) did not. Where the CPU runs their kernel (`packed_runs`) every
/// chunk's products, narrow or wide, read these, with the wide chunks' bits:
#[derive(Clone, Copy)]
pub enum PackedExperts<'a> {
    /// float32 weights in row tiles (`row_tiles::pack_matrix`; the tokens and outputs stay rows,
    /// no panels' transposes): every element the fused multiply-add chain over k in order, the
    /// pair panels' definition;
    F32 { w13: &'a [f32], w2: &'a [f32] },
    /// bfloat16 weights in the dot products' panels of pairs (`matmul_bf16::pack_matrix`), which
    /// a wide chunk packs every call: the dot products' bits.
    Bf16 { w13: &'a [u32], w2: &'a [u32] },
}

/// Values (`Element::Packed`) of one expert's w13 [rows13, hidden] and w2 [hidden, inter]
/// packed for weights of type `W`.
pub fn packed_lens<W: Element>(rows13: usize, hidden: usize, inter: usize) -> (usize, usize) {
    (W::packed_len(rows13, hidden), W::packed_len(hidden, inter))
}

/// out [E][packed_len(n, k)] = each of the E matrices of w [E, n, k] packed (`PackedExperts`),
/// on up to `threads` threads (an expert each).
pub fn pack_experts<W: Element>(
    w: &[W],
    experts: usize,
    n: usize,
    out: &mut [W::Packed],
    threads: usize,
) -> Result<(), String> {
    if experts == 0 || n == 0 || !w.len().is_multiple_of(experts * n) {
        return Err(format!("pack_experts: {} values are not [{experts}, {n}, K]", w.len()));
    }
    let k = w.len() / (experts * n);
    let each = W::packed_len(n, k);
    if out.len() != experts * each {
        return Err(format!("pack_experts: the output holds {} values, not {experts} x {each}", out.len()));
    }
    let mut jobs: Vec<(&[W], &mut [W::Packed])> = w.chunks_exact(n * k).zip(out.chunks_exact_mut(each)).collect();
    crate::workers::take_in_turn(threads.clamp(1, experts), &mut jobs, &|jobs| {
        for (w, out) in jobs {
            W::pack_matrix(w, n, out);
        }
    });
    Ok(())
}

/// Whether the chunks read packed experts of type `W` under `isa` (a named AVX2 or portable
/// kernel keeps its own bits): float32 ones where the CPU runs the row tiles and the AVX-512
/// kernels were not ruled out, bfloat16 ones under the default kernel where the dot products
/// run and are the products a wide chunk takes (`matmul_bf16::packed_runs`: not AMX tiles).
pub fn packed_runs<W: Element>(isa: Isa) -> bool {
    if W::as_bf16s(&[]).is_some() {
        isa == Isa::Auto && crate::matmul_bf16::packed_runs()
    } else {
        matches!(isa, Isa::Auto | Isa::Avx512) && crate::row_tiles::runs()
    }
}

impl<W: Element> Experts<'_, W> {
    fn rows13(&self) -> usize {
        self.inter * self.act.rows_per_unit()
    }

    fn check(&self) -> Result<(), String> {
        let (e, h, i, r) = (self.num_experts, self.hidden, self.inter, self.rows13());
        let want = |name: &str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(format!("{name} holds {got} values, expected {want}"))
            }
        };
        want("w13", self.w13.len(), e * r * h)?;
        want("w2", self.w2.len(), e * h * i)?;
        if let Some(b13) = self.b13 {
            want("b13", b13.len(), e * r)?;
        }
        if let Some(b2) = self.b2 {
            want("b2", b2.len(), e * h)?;
        }
        if let Some(packed) = self.packed {
            let (lens, bf16) = match packed {
                PackedExperts::F32 { w13, w2 } => ((w13.len(), w2.len()), false),
                PackedExperts::Bf16 { w13, w2 } => ((w13.len(), w2.len()), true),
            };
            if bf16 != W::as_bf16s(&[]).is_some() {
                return Err("packed experts of another dtype than the experts' (pack_experts)".into());
            }
            let (p13, p2) = packed_lens::<W>(r, h, i);
            want("packed w13", lens.0, e * p13)?;
            want("packed w2", lens.1, e * p2)?;
        }
        Ok(())
    }
}

#[inline(always)]
fn add<W: Element>(dst: &mut [f32], src: &[W]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s.to_f32();
    }
}

/// Which token each (token, expert, weight) pair belongs to.
#[derive(Clone, Copy, Debug)]
pub enum PairTokens<'a> {
    /// Every token's k slots in order (ids and weights [T, k]): pair p is token p / k.
    Grid,
    /// An explicit list ([P]): pair p is token tokens[p] (an expert-parallel rank's own pairs).
    List(&'a [i32]),
}

/// out [T, H] = sum over the pairs p of token t of weights[p] * expert_{ids[p]}(x[t]), summed
/// in pair order. A pair of weight 0 (another rank's expert) contributes nothing and is
/// skipped. An expert's pairs run in wide chunks from `wide_min` pairs on (None: the kernel's
/// own threshold, `wide_min_pairs`). Errors name the first inconsistent input.
#[allow(clippy::too_many_arguments)]
pub fn expert_pairs<W: Element>(
    experts: &Experts<W>,
    x: &[W],
    tokens: PairTokens,
    ids: &[i32],
    weights: &[f32],
    out: &mut [W],
    threads: usize,
    isa: Isa,
    wide_min: Option<usize>,
) -> Result<(), String> {
    experts.check()?;
    let hid = experts.hidden;
    if hid == 0 || !x.len().is_multiple_of(hid) || out.len() != x.len() || x.is_empty() {
        return Err(format!(
            "x holds {} values and out {}, expected equal nonzero multiples of hidden={hid}",
            x.len(),
            out.len()
        ));
    }
    let num_tokens = x.len() / hid;
    if weights.len() != ids.len() {
        return Err(format!("ids ({}) and weights ({}) must hold one value per pair", ids.len(), weights.len()));
    }
    let token_of = |p: usize| match tokens {
        PairTokens::Grid => p / (ids.len() / num_tokens),
        PairTokens::List(list) => list[p] as usize,
    };
    match tokens {
        PairTokens::Grid if !ids.len().is_multiple_of(num_tokens) => {
            return Err(format!("ids ({}) must hold top_k values for each of {num_tokens} tokens", ids.len()));
        }
        PairTokens::List(list) if list.len() != ids.len() => {
            return Err(format!("tokens ({}) must hold one token per pair ({})", list.len(), ids.len()));
        }
        PairTokens::List(list) => {
            if let Some(&bad) = list.iter().find(|&&t| t < 0 || t as usize >= num_tokens) {
                return Err(format!("token {bad} is outside 0..{num_tokens}"));
            }
        }
        PairTokens::Grid => {}
    }
    if let Some(&bad) = ids.iter().find(|&&e| e < 0 || e as usize >= experts.num_experts) {
        return Err(format!("expert id {bad} is outside 0..{}", experts.num_experts));
    }
    let pair_token: Vec<u32> = (0..ids.len()).map(|p| token_of(p) as u32).collect();
    // bfloat16 tokens that every chunk reads as the dot products' pairs (run_chunk: even hidden
    // and intermediate sizes) are never read widened: no f32 copy of them
    let pairs_only =
        hid.is_multiple_of(2) && experts.inter.is_multiple_of(2) && dot_products(isa, experts.w13).is_some();
    BUFFERS.with_borrow_mut(|(widened, outputs)| {
        let xf: &[f32] = match W::as_f32s(x) {
            Some(xf) => xf,
            None if pairs_only => &[],
            None => {
                widened.clear();
                widened.extend(x.iter().map(|v| v.to_f32()));
                widened
            }
        };
        let inputs = Inputs { x, xf, pair_token: &pair_token };
        let wide_min = wide_min.unwrap_or_else(|| wide_min_pairs::<W>(isa)).max(1);
        let row_of = grouped_pass(experts, &inputs, ids, weights, threads, isa, wide_min, outputs);
        weighted_sums(outputs, &row_of, &pair_token, weights, hid, out, threads, isa);
    });
    Ok(())
}

thread_local! {
    /// Per-thread buffers reused across calls (the inputs widened to f32, the pairs' outputs):
    /// a prefill's are megabytes, whose fresh pages would each cost a fault and a clear.
    static BUFFERS: std::cell::RefCell<(Vec<f32>, Lines<f32>)> = std::cell::RefCell::default();
}

/// A pair of weight 0 (another rank's expert): no row in the outputs.
const DEAD: u32 = u32::MAX;

/// The tokens an expert pass reads: x as given, x in f32 (x itself for f32 tokens), and each
/// pair's token.
struct Inputs<'a, W> {
    x: &'a [W],
    xf: &'a [f32],
    pair_token: &'a [u32],
}

/// Tokens per unit of work in `weighted_sums`.
const SUM_BLOCK_TOKENS: usize = 32;

/// out[t] = the sum over token t's live pairs p, in pair order (the order the result promises,
/// whatever order the pairs ran in), of weights[p] * outputs[row_of[p]], starting from 0.
/// Threads take blocks of tokens from a shared counter when there is enough work.
#[allow(clippy::too_many_arguments)]
fn weighted_sums<W: Element>(
    outputs: &[f32],
    row_of: &[u32],
    pair_token: &[u32],
    weights: &[f32],
    hid: usize,
    out: &mut [W],
    threads: usize,
    isa: Isa,
) {
    let num_tokens = out.len() / hid;
    // each token's live pairs in pair order
    let live_token = |(&t, &row): (&u32, &u32)| (row != DEAD).then_some(t as usize);
    let (starts, by_token) = group_pairs(num_tokens, pair_token.iter().zip(row_of).map(live_token));
    let blocks = num_tokens.div_ceil(SUM_BLOCK_TOKENS);
    let threads = threads.min(by_token.len() * hid / PARALLEL_MIN_MACS).clamp(1, blocks.max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let dst = SharedRows(out.as_mut_ptr());
    let wide = wide_simd512(isa);
    let work = || {
        let mut acc = vec![0f32; hid];
        loop {
            let b = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if b >= blocks {
                break;
            }
            for t in b * SUM_BLOCK_TOKENS..num_tokens.min((b + 1) * SUM_BLOCK_TOKENS) {
                let pairs = &by_token[starts[t]..starts[t + 1]];
                // SAFETY: each block of tokens is taken once, so no two threads write row t of
                // `out`, which outlives the threads' scope.
                let row = unsafe { dst.row(t, hid) };
                match simd(isa) {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: wide_simd512() checked that this CPU has AVX2, FMA and AVX-512F.
                    true if wide => unsafe { sum_token_avx512(outputs, row_of, pairs, weights, &mut acc, row) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: simd() checked that this CPU has AVX2 and FMA.
                    true => unsafe { sum_token_avx2(outputs, row_of, pairs, weights, &mut acc, row) },
                    _ => sum_token(outputs, row_of, pairs, weights, &mut acc, row),
                }
            }
        }
    };
    crate::workers::run_on_threads(threads, &work);
}

/// One token's row of `weighted_sums` (its live pairs in order), through `acc` in f32.
#[inline(always)]
fn sum_token<W: Element>(
    outputs: &[f32],
    row_of: &[u32],
    pairs: &[u32],
    weights: &[f32],
    acc: &mut [f32],
    out: &mut [W],
) {
    let hid = acc.len();
    acc.fill(0.0);
    for &p in pairs {
        let (w, row) = (weights[p as usize], row_of[p as usize] as usize);
        for (a, &o) in acc.iter_mut().zip(&outputs[row * hid..(row + 1) * hid]) {
            *a += w * o;
        }
    }
    for (dst, &v) in out.iter_mut().zip(acc.iter()) {
        *dst = W::from_f32(v);
    }
}

/// `sum_token` compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_token_avx2<W: Element>(
    outputs: &[f32],
    row_of: &[u32],
    pairs: &[u32],
    weights: &[f32],
    acc: &mut [f32],
    out: &mut [W],
) {
    sum_token(outputs, row_of, pairs, weights, acc, out)
}

/// `sum_token` compiled for AVX-512F: 16 lanes, elementwise, the same bits.
///
/// # Safety
/// The CPU must support AVX2, FMA and AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn sum_token_avx512<W: Element>(
    outputs: &[f32],
    row_of: &[u32],
    pairs: &[u32],
    weights: &[f32],
    acc: &mut [f32],
    out: &mut [W],
) {
    sum_token(outputs, row_of, pairs, weights, acc, out)
}

/// A stable counting sort of the pairs by key (`keys` yields each pair's key in 0..groups, or
/// None for a pair left out): (starts, order), group g's pairs being
/// order[starts[g]..starts[g + 1]], in pair order.
fn group_pairs(groups: usize, keys: impl Iterator<Item = Option<usize>> + Clone) -> (Vec<usize>, Vec<u32>) {
    let mut starts = vec![0usize; groups + 1];
    for g in keys.clone().flatten() {
        starts[g + 1] += 1;
    }
    for g in 0..groups {
        starts[g + 1] += starts[g];
    }
    let mut order = vec![0u32; starts[groups]];
    let mut fill = starts.clone();
    for (p, key) in keys.enumerate() {
        if let Some(g) = key {
            order[fill[g]] = p as u32;
            fill[g] += 1;
        }
    }
    (starts, order)
}

/// Whether to run the elementwise loops below in their AVX2 builds (8 wide instead of SSE's
/// 4; an AVX-512 CPU runs them too). Rust never fuses a multiply and an add on its own, so
/// both builds give the same bits.
fn simd(isa: Isa) -> bool {
    cfg!(target_arch = "x86_64") && isa != Isa::Scalar && isa.runs()
}

/// Whether a wide chunk's elementwise loops take their AVX-512 builds (16 wide): the CPU has
/// AVX-512F and the AVX2 kernel was not asked for (the same bits either way).
fn wide_simd512(isa: Isa) -> bool {
    simd(isa) && isa != Isa::Avx2Fma && Isa::Avx512.runs()
}

/// Pairs of one expert run together, at most this many at a time: each weight row is read
/// once per chunk, and a chunk's scratch (inputs, both projections) stays in the L2 cache.
const CHUNK_PAIRS: usize = 48;
/// From this many pairs on, an expert's chunks are wide (`wide_min_pairs`; float32 ones in
/// pair panels from PANEL_MIN_PAIRS): `matmul`'s packed kernels, which outrun `gemm_nt` once
/// they have this many rows to amortize their packing.
pub(crate) const WIDE_MIN_PAIRS: usize = 64;
/// Where the CPU runs `pair_panels`, a float32 expert's chunks are wide from this many pairs (one
/// panel): the panels, their next weight rows prefetched, outran `gemm_nt` from 16 pairs on
/// (docs/benchmarks.md, "Wide float32 expert chunks in pair panels").
pub(crate) const PANEL_MIN_PAIRS: usize = 16;

/// Where bfloat16 experts' wide chunks run in AMX tiles, they are wide from this many pairs: the
/// tiles outran the narrow dot products from 8 to 16 pairs an expert on (docs/benchmarks.md,
/// "The AMX Xeon").
pub(crate) const TILES_MIN_PAIRS: usize = 16;

/// The pair count from which an expert's chunks are wide, for weights of type `W` under `isa`.
pub fn wide_min_pairs<W: Element>(isa: Isa) -> usize {
    if W::as_f32s(&[]).is_some() && pair_panels::runs(isa) {
        PANEL_MIN_PAIRS
    } else if W::as_bf16s(&[]).is_some()
        && dot_products::<W>(isa, &[]).is_some()
        && crate::matmul_bf16::Products::fastest() == crate::matmul_bf16::Products::Tiles
    {
        TILES_MIN_PAIRS
    } else {
        WIDE_MIN_PAIRS
    }
}

/// Pairs per wide chunk: enough for the packed kernels' full speed (a prefill's experts have
/// hundreds), while the chunks still spread over the threads.
const WIDE_CHUNK_PAIRS: usize = 512;

/// Pairs first..end of `order`, all of one expert, run together.
struct Chunk {
    expert: usize,
    first: usize,
    end: usize,
    /// Through `pair_panels` or `matmul` (see `wide_min_pairs`), else `gemm_nt`.
    wide: bool,
}

/// The fewest multiply-adds worth a thread of their own: waking one costs microseconds, and
/// its share must outweigh that.
pub(crate) const PARALLEL_MIN_MACS: usize = 1 << 18;

/// Every live pair's expert output into `outputs` ([live pairs, H] in expert order, so that a
/// chunk's rows are adjacent and written in place); returns each pair's row (DEAD for a pair
/// of weight 0). The pairs are grouped by expert so that each weight row is read once per
/// chunk of pairs instead of once per pair.
/// The chunks depend only on each expert's pair count, never on `threads`. Up to `threads`
/// threads take chunks from a shared counter, so a thread the OS preempts holds up none of
/// the others' work.
#[allow(clippy::too_many_arguments)]
fn grouped_pass<W: Element>(
    experts: &Experts<W>,
    inputs: &Inputs<W>,
    ids: &[i32],
    weights: &[f32],
    threads: usize,
    isa: Isa,
    wide_min: usize,
    outputs: &mut Lines<f32>,
) -> Vec<u32> {
    let hid = experts.hidden;
    // the live pairs by expert, in pair order within an expert; each pair's row is its place
    let live_expert = |(&e, &w): (&i32, &f32)| (w != 0.0).then_some(e as usize);
    let (starts, order) = group_pairs(experts.num_experts, ids.iter().zip(weights).map(live_expert));
    let mut row_of = vec![DEAD; ids.len()];
    for (row, &p) in order.iter().enumerate() {
        row_of[p as usize] = row as u32;
    }
    let mut chunks: Vec<Chunk> = Vec::new();
    for e in 0..experts.num_experts {
        // equal chunks of at most CHUNK_PAIRS (64 pairs: two of 32, not 48 and 16), or of
        // WIDE_CHUNK_PAIRS for an expert with many pairs
        let count = starts[e + 1] - starts[e];
        let wide = count >= wide_min;
        let pieces = count.div_ceil(if wide { WIDE_CHUNK_PAIRS } else { CHUNK_PAIRS });
        for i in 0..pieces {
            chunks.push(Chunk {
                expert: e,
                first: starts[e] + count * i / pieces,
                end: starts[e] + count * (i + 1) / pieces,
                wide,
            });
        }
    }
    outputs.resize(order.len() * hid, 0.0);
    let macs = order.len() * experts.rows13() * hid * 3 / 2;
    let threads = threads.min(macs / PARALLEL_MIN_MACS).clamp(1, chunks.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let dst = SharedRows(outputs.as_mut_ptr());
    let work = || {
        SCRATCH.with_borrow_mut(|scratch| {
            loop {
                let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(chunk) = chunks.get(c) else { break };
                let pairs = &order[chunk.first..chunk.end];
                // SAFETY: the chunks cover disjoint ranges of rows and each runs once, so no two
                // threads write the same rows of `outputs`, which outlives the scope.
                let o = unsafe { dst.rows(chunk.first, pairs.len(), hid) };
                experts.run_chunk(isa, chunk, inputs, pairs, scratch, o);
            }
        })
    };
    crate::workers::run_on_threads(threads, &work);
    row_of
}

/// A row-major buffer's base, shared by threads that each write their own rows
/// (`grouped_pass`, `weighted_sums`).
#[derive(Clone, Copy)]
struct SharedRows<T>(*mut T);

// SAFETY: the threads write disjoint rows (see the users).
unsafe impl<T: Send> Send for SharedRows<T> {}
unsafe impl<T: Send> Sync for SharedRows<T> {}

impl<T> SharedRows<T> {
    /// Row `row` (of `len` values).
    ///
    /// # Safety
    /// The row lies within the buffer, and no other live reference covers it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, row: usize, len: usize) -> &mut [T] {
        self.rows(row, 1, len)
    }

    /// Rows first..first + count (of `len` values each).
    ///
    /// # Safety
    /// The rows lie within the buffer, and no other live reference covers them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn rows(&self, first: usize, count: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(first * len), count * len)
    }
}

/// a = act(h + b13) for each of a chunk's rows (h [n, r], a [n, i]).
#[inline(always)]
fn activate<W: Element>(act: Activation, b13: Option<&[W]>, r: usize, i: usize, h: &mut [f32], a: &mut [f32]) {
    for (h, a) in h.chunks_exact_mut(r).zip(a.chunks_exact_mut(i)) {
        if let Some(b13) = b13 {
            add(h, b13);
        }
        act.apply(h, a);
    }
}

/// `$name`: `$inner` (an activation loop, inlined) compiled with the target features `$features`,
/// so that its elementwise loops take their vector width; the same bits in every build, as Rust
/// fuses no multiply-add on its own.
macro_rules! activation_build {
    ($(#[$doc:meta])* $name:ident, $inner:ident, $features:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU must support the target features named.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<W: Element>(
            act: Activation,
            b13: Option<&[W]>,
            r: usize,
            i: usize,
            h: &mut [f32],
            a: &mut [f32],
        ) {
            $inner(act, b13, r, i, h, a)
        }
    };
}

activation_build!(
    /// `activate` for AVX2 and FMA.
    activate_avx2, activate, "avx2,fma"
);
activation_build!(
    /// `activate` for AVX-512 (16 lanes: a wide bfloat16 chunk's activation 1.1x faster than the
    /// AVX2 build once the tiles' buffers were aligned, docs/benchmarks.md).
    activate_avx512, activate, "avx512f,avx2,fma"
);
activation_build!(
    /// `activate_panels` for AVX-512 (the pass at 2,048 tokens 1.04x against the AVX2 build,
    /// docs/benchmarks.md).
    activate_panels_avx512, activate_panels, "avx512f,avx2,fma"
);
activation_build!(
    /// `activate_panels` for AVX2 and FMA.
    activate_panels_avx2, activate_panels, "avx2,fma"
);

/// `activate` on panels (`pair_panels`): h [blocks][r][LANES] to a [blocks][i][LANES]. A panel's
/// gate rows then up rows are themselves [gate; up] of LANES-wide rows, so the activation reads
/// them whole; gpt-oss's interleaved rows are paired up lane by lane.
#[inline(always)]
fn activate_panels<W: Element>(act: Activation, b13: Option<&[W]>, r: usize, i: usize, h: &mut [f32], a: &mut [f32]) {
    use pair_panels::LANES;
    for (h, a) in h.chunks_exact_mut(r * LANES).zip(a.chunks_exact_mut(i * LANES)) {
        if let Some(b13) = b13 {
            for (lanes, b) in h.chunks_exact_mut(LANES).zip(b13) {
                let b = b.to_f32();
                lanes.iter_mut().for_each(|v| *v += b);
            }
        }
        if let Activation::ClampedSwiglu { .. } = act {
            let mut pairs = [0.0f32; 2 * LANES];
            for (unit, a) in a.chunks_exact_mut(LANES).enumerate() {
                let (gate, up) = (&h[2 * unit * LANES..][..LANES], &h[(2 * unit + 1) * LANES..][..LANES]);
                for ((pair, &g), &u) in pairs.chunks_exact_mut(2).zip(gate).zip(up) {
                    pair.copy_from_slice(&[g, u]);
                }
                act.apply(&pairs, a);
            }
        } else {
            act.apply(h, a);
        }
    }
}

thread_local! {
    /// Each thread's chunk buffers, kept across calls (the pool's threads live on).
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// One thread's buffers for a chunk: inputs [n, H], h [n, R], a [n, I]; and a wide
/// chunk's expert weights widened to f32 when they are not (w13 [R, H], w2 [H, I]), or
/// packed for the bfloat16 dot-product kernel.
#[derive(Default)]
struct Scratch {
    x: Lines<f32>,
    h: Lines<f32>,
    a: Vec<f32>,
    w13: Vec<f32>,
    w2: Vec<f32>,
    bf16: crate::matmul_bf16::Buffers,
    pairs: Lines<u32>,
}

/// `m` as bfloat16 where its products run in AVX-512 BF16 dot products (`matmul_bf16`): the
/// CPU has them and the kernel asked for is the default (`Auto`); None for float32 weights, and
/// where the caller names a kernel (each keeps its own bits: the tests compare them).
pub(crate) fn dot_products<W: Element>(isa: Isa, m: &[W]) -> Option<&[Bf16]> {
    W::as_bf16s(m).filter(|_| isa == Isa::Auto && crate::matmul_bf16::runs())
}

/// xs rounded to bfloat16 when the weights are (the products the dot-product kernels compute):
/// bfloat16 experts' activations are rounded on every path.
fn round_if_bf16<W: Element>(m: &[W], xs: &mut [f32]) {
    if W::as_bf16s(m).is_some() {
        for v in xs.iter_mut() {
            *v = Bf16::from_f32(*v).to_f32();
        }
    }
}

/// out [n, rows] = xs [n, K] @ m [rows, K]^T for a wide chunk. Bfloat16 weights take the
/// AVX-512 BF16 dot-product kernel where it runs (`dot_products`), which rounds xs to bfloat16;
/// elsewhere xs is rounded here, so that both compute the same products (in their own orders)
/// through `matmul`'s float32 kernels over the weights widened into `widened`.
fn wide_nt<W: Element>(
    isa: Isa,
    m: &[W],
    rows: usize,
    xs: &mut [f32],
    out: &mut [f32],
    widened: &mut Vec<f32>,
    packed: &mut crate::matmul_bf16::Buffers,
) {
    match dot_products(isa, m) {
        Some(m) => crate::matmul_bf16::matmul_nt_bf16(m, rows, xs, out, packed),
        None => wide_nt_widened(m, rows, xs, out, widened),
    }
}

/// `wide_nt` without the dot-product kernel.
fn wide_nt_widened<W: Element>(m: &[W], rows: usize, xs: &mut [f32], out: &mut [f32], widened: &mut Vec<f32>) {
    round_if_bf16(m, xs);
    crate::matmul::matmul_nt(as_f32(m, widened), rows, xs, out)
}

/// out [n, rows] = bf16(xs) [n, K] @ m [rows, K]^T for a narrow chunk of bfloat16 weights
/// (`dot_products` said so; K even), through `pairs`: `matmul_bf16::gemm_nt_bf16`, whose outputs
/// do not depend on the chunk's other pairs.
fn narrow_nt_dot<W: Element>(m: &[W], rows: usize, xs: &[f32], out: &mut [f32], pairs: &mut Lines<u32>) {
    let m = W::as_bf16s(m).expect("bfloat16 weights (dot_products)");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: dot_products checked that the CPU has AVX-512 BF16.
    unsafe {
        crate::matmul_bf16::pack_vectors(xs, m.len() / rows, pairs)
    };
    crate::matmul_bf16::gemm_nt_bf16(m, rows, pairs, out);
}

/// `w` as f32: itself, or widened into `buffer`.
pub(crate) fn as_f32<'a, W: Element>(w: &'a [W], buffer: &'a mut Vec<f32>) -> &'a [f32] {
    if let Some(f) = W::as_f32s(w) {
        return f;
    }
    buffer.clear();
    buffer.extend(w.iter().map(|v| v.to_f32()));
    buffer
}

impl<W: Element> Experts<'_, W> {
    /// o[j] = the chunk's expert of x[pair_token[pairs[j]]] for its pairs (o [n, H]).
    fn run_chunk(&self, isa: Isa, chunk: &Chunk, inputs: &Inputs<W>, pairs: &[u32], s: &mut Scratch, o: &mut [f32]) {
        let (e, hid, r, i, n) = (chunk.expert, self.hidden, self.rows13(), self.inter, pairs.len());
        let (w13, w2) = (&self.w13[e * r * hid..(e + 1) * r * hid], &self.w2[e * hid * i..(e + 1) * hid * i]);
        let tokens = pairs.iter().map(|&p| inputs.pair_token[p as usize] as usize);
        let b13 = self.b13.map(|b| &b[e * r..(e + 1) * r]);
        let (p13, p2) = packed_lens::<W>(r, hid, i);
        if let (Some(PackedExperts::Bf16 { w13: q13, w2: q2 }), true) = (self.packed, packed_runs::<W>(isa)) {
            // bfloat16 experts in their panels: a wide chunk's steps (its tokens as pairs, the
            // activation, the activations rounded to pairs) over the kept panels, for a narrow
            // chunk and a wide one
            s.pairs.clear();
            match W::as_bf16s(inputs.x).filter(|_| hid.is_multiple_of(2)) {
                Some(x) => {
                    tokens.for_each(|t| crate::matmul_bf16::extend_pairs(&x[t * hid..(t + 1) * hid], &mut s.pairs))
                }
                None => {
                    s.x.clear();
                    tokens.for_each(|t| s.x.extend_from_slice(&inputs.xf[t * hid..(t + 1) * hid]));
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: packed_runs checked that this CPU has AVX-512F and AVX-512 BF16.
                    unsafe {
                        crate::matmul_bf16::pack_vectors(&s.x, hid, &mut s.pairs)
                    };
                }
            }
            s.h.resize(n * r, 0.0);
            crate::matmul_bf16::packed_products(&s.pairs, &q13[e * p13..(e + 1) * p13], r, &mut s.h);
            s.a.resize(n * i, 0.0);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above (AVX-512F and, on every AVX-512 CPU, AVX2 and FMA).
            unsafe {
                activate_avx512(self.act, b13, r, i, &mut s.h, &mut s.a);
                crate::matmul_bf16::pack_vectors(&s.a, i, &mut s.pairs);
            };
            crate::matmul_bf16::packed_products(&s.pairs, &q2[e * p2..(e + 1) * p2], hid, o);
            self.add_b2(e, o);
            return;
        }
        if let (Some(PackedExperts::F32 { w13: q13, w2: q2 }), true) = (self.packed, packed_runs::<W>(isa)) {
            // float32 experts in row tiles: the tokens' rows read in place, the outputs' rows
            // written, the same code for a narrow chunk and a wide one
            let x: Vec<&[f32]> = tokens.map(|t| &inputs.xf[t * hid..(t + 1) * hid]).collect();
            s.h.resize(n * r, 0.0);
            crate::row_tiles::packed_product(&x, &q13[e * p13..(e + 1) * p13], r, &mut s.h);
            s.a.resize(n * i, 0.0);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: packed_runs checked that this CPU has AVX-512F and AVX2 (row_tiles::runs),
            // and every AVX-512 CPU has FMA.
            unsafe {
                activate_avx512(self.act, b13, r, i, &mut s.h, &mut s.a)
            };
            let a: Vec<&[f32]> = s.a.chunks_exact(i).collect();
            crate::row_tiles::packed_product(&a, &q2[e * p2..(e + 1) * p2], hid, o);
            self.add_b2(e, o);
            return;
        }
        if let (true, Some(w13), Some(w2)) = (chunk.wide && pair_panels::runs(isa), W::as_f32s(w13), W::as_f32s(w2)) {
            // a wide chunk of float32 experts: both products with the pairs as the lanes
            let blocks = pair_panels::blocks(n);
            pair_panels::gather(isa, tokens.map(|t| &inputs.xf[t * hid..(t + 1) * hid]), hid, &mut s.x);
            pair_panels::product(isa, w13, r, hid, &s.x, blocks, &mut s.h);
            s.a.resize(blocks * i * pair_panels::LANES, 0.0);
            // SAFETY: pair_panels::runs checked that this CPU has AVX2 and FMA, and the AVX-512
            // build runs only where it has AVX-512F too (the AVX2 kernel asked for: the AVX2 build).
            #[cfg(target_arch = "x86_64")]
            unsafe {
                if wide_simd512(isa) {
                    activate_panels_avx512(self.act, b13, r, i, &mut s.h, &mut s.a)
                } else {
                    activate_panels_avx2(self.act, b13, r, i, &mut s.h, &mut s.a)
                }
            };
            pair_panels::product(isa, w2, hid, i, &s.a, blocks, &mut s.x);
            pair_panels::scatter(isa, &s.x, hid, o);
            self.add_b2(e, o);
            return;
        }
        // bfloat16 weights in dot products where they run (even K: pairs); a narrow chunk's
        // second product too where its K is even
        let dot = hid.is_multiple_of(2) && dot_products(isa, w13).is_some();
        let narrow_dot = dot && !chunk.wide && i.is_multiple_of(2);
        // the tokens of a first product in dot products: their bfloat16 rows gathered as the
        // pairs the products read, not widened and rounded back
        let x_pairs = dot && (chunk.wide || narrow_dot);
        s.x.clear();
        s.pairs.clear();
        if x_pairs {
            let x = W::as_bf16s(inputs.x).expect("bfloat16 tokens (dot_products: bfloat16 weights)");
            for t in tokens {
                crate::matmul_bf16::extend_pairs(&x[t * hid..(t + 1) * hid], &mut s.pairs);
            }
        } else {
            for t in tokens {
                s.x.extend_from_slice(&inputs.xf[t * hid..(t + 1) * hid]);
            }
        }
        s.h.resize(n * r, 0.0);
        s.a.resize(n * i, 0.0);
        let bf16_w13 = || W::as_bf16s(w13).expect("bfloat16 weights (dot_products)");
        match (x_pairs, chunk.wide) {
            (true, true) => crate::matmul_bf16::matmul_nt_pairs(bf16_w13(), r, &s.pairs, &mut s.h, &mut s.bf16),
            (true, false) => crate::matmul_bf16::gemm_nt_bf16(bf16_w13(), r, &s.pairs, &mut s.h),
            (false, true) => wide_nt(isa, w13, r, &mut s.x, &mut s.h, &mut s.w13, &mut s.bf16),
            (false, false) => gemm_nt(isa, w13, r, &s.x, &mut s.h),
        }
        match simd(isa) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: simd() checked that this CPU has AVX2 and FMA, Isa::runs AVX-512F.
            true if chunk.wide && wide_simd512(isa) => unsafe {
                activate_avx512(self.act, b13, r, i, &mut s.h, &mut s.a)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: simd() checked that this CPU has AVX2 and FMA.
            true => unsafe { activate_avx2(self.act, b13, r, i, &mut s.h, &mut s.a) },
            _ => activate(self.act, b13, r, i, &mut s.h, &mut s.a),
        }
        if chunk.wide {
            wide_nt(isa, w2, hid, &mut s.a, o, &mut s.w2, &mut s.bf16);
        } else if narrow_dot {
            narrow_nt_dot(w2, hid, &s.a, o, &mut s.pairs);
        } else {
            round_if_bf16(w2, &mut s.a);
            gemm_nt(isa, w2, hid, &s.a, o);
        }
        self.add_b2(e, o);
    }

    /// o [n, H] += expert e's b2, if it has one.
    fn add_b2(&self, e: usize, o: &mut [f32]) {
        let hid = self.hidden;
        if let Some(b2) = self.b2 {
            for o in o.chunks_exact_mut(hid) {
                add(o, &b2[e * hid..(e + 1) * hid]);
            }
        }
    }
}

/// The matrix kernels: AVX-512F (two weight rows per 16-lane register: the AVX2 kernel's sums
/// in its order, so the same bits, at half the instructions), AVX2 with FMA, or portable
/// scalar code; `Auto`, the default on AVX-512 CPUs, takes the AVX-512 kernel for weight blocks
/// of AVX512_MIN_WEIGHTS elements and more and the AVX2 one below (the same bits either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2Fma,
    Scalar,
    Auto,
}

/// The smallest weight block (elements) `Isa::Auto` gives the AVX-512 kernel: on a Zen 4, one to
/// eight rows against blocks of 768 x 768 and up ran in 0.74-0.96x the AVX2 kernel's time, but
/// against 512 x 512 and below in 1.0-1.14x, and a decode step of the built-in model (256-wide
/// blocks) slowed by a fifth in its matrix kernels (docs/benchmarks.md).
pub const AVX512_MIN_WEIGHTS: usize = 1 << 19;

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2Fma => "avx2",
            Isa::Scalar => "scalar",
            Isa::Auto => "auto",
        }
    }

    /// The kernel the engine runs when a caller names none: `Auto` where the CPU has AVX-512,
    /// else the widest kernel it runs.
    pub fn default_kernel() -> Isa {
        if Isa::best() == Isa::Avx512 {
            Isa::Auto
        } else {
            Isa::best()
        }
    }

    /// The kernel for a block of `weights` elements: `Auto` resolved, any other kernel itself.
    pub fn for_weights(self, weights: usize) -> Isa {
        match self {
            Isa::Auto if weights >= AVX512_MIN_WEIGHTS => Isa::Avx512,
            Isa::Auto => Isa::Avx2Fma,
            isa => isa,
        }
    }

    /// The widest kernel this CPU runs, detected once.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                if is_x86_feature_detected!("avx512f") {
                    return Isa::Avx512;
                }
                return Isa::Avx2Fma;
            }
            Isa::Scalar
        })
    }

    /// Whether this CPU runs `self`'s code (the AVX-512 CPUs run the AVX2 code too).
    pub fn runs(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2Fma => Isa::best() != Isa::Scalar,
            Isa::Avx512 | Isa::Auto => Isa::best() == Isa::Avx512,
        }
    }

    /// Every kernel this CPU runs, the portable one first (the tests compare them).
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2Fma, Isa::Avx512].into_iter().filter(|isa| isa.runs()).collect()
    }
}

/// out = m @ v for a row-major m [out.len(), v.len()]; an `isa` this CPU does not run falls
/// back to the next one it does.
pub fn gemv<W: Element>(isa: Isa, m: &[W], v: &[f32], out: &mut [f32]) {
    assert_eq!(m.len(), out.len() * v.len(), "gemv: matrix and vectors disagree");
    let isa = isa.for_weights(m.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // the AVX-512 product of one vector: gemv_avx2's bits (see gemm_nt)
        Isa::Avx512 if Isa::Avx512.runs() && !v.is_empty() => gemm_nt(isa, m, out.len(), v, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the guard checked that this CPU has AVX2 and FMA; the lengths were checked above.
        Isa::Avx2Fma | Isa::Avx512 if Isa::Avx2Fma.runs() => unsafe { gemv_avx2(m, v, out) },
        _ => gemv_scalar(m, v, out),
    }
}

/// K of an out [n, rows] = vs [n, K] @ m [rows, K]^T product (`name`'s lengths checked, a
/// mismatch panics naming it), or None when K or rows is 0: out is then zeros.
pub(crate) fn nt_cols(name: &str, m_len: usize, rows: usize, vs_len: usize, out: &mut [f32]) -> Option<usize> {
    let cols = m_len.checked_div(rows).unwrap_or(0);
    assert_eq!(m_len, rows * cols, "{name}: the matrix is not [rows, K]");
    if cols == 0 || rows == 0 {
        out.fill(0.0);
        return None;
    }
    assert_eq!(vs_len % cols, 0, "{name}: the vectors are not [n, K]");
    assert_eq!(out.len(), vs_len / cols * rows, "{name}: the output is not [n, rows]");
    Some(cols)
}

/// out[j, r] = m[r] . vs[j] for a row-major m [rows, K] and vectors vs [n, K] (out [n, rows]):
/// every weight row read once for all n vectors. Each element is the dot product `gemv`
/// computes, in the same order, so results do not depend on n.
pub fn gemm_nt<W: Element>(isa: Isa, m: &[W], rows: usize, vs: &[f32], out: &mut [f32]) {
    let Some(cols) = nt_cols("gemm_nt", m.len(), rows, vs.len(), out) else { return };
    match isa.for_weights(m.len()) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the guard checked that this CPU has AVX-512F, AVX2 and FMA; the lengths were checked above.
        Isa::Avx512 if Isa::Avx512.runs() => unsafe { gemm_nt_avx512(m, rows, cols, vs, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the guard checked that this CPU has AVX2 and FMA; the lengths were checked above.
        Isa::Avx2Fma | Isa::Avx512 if Isa::Avx2Fma.runs() => unsafe { gemm_nt_avx2(m, rows, cols, vs, out) },
        _ => {
            for (v, o) in vs.chunks_exact(cols).zip(out.chunks_exact_mut(rows)) {
                gemv_scalar(m, v, o);
            }
        }
    }
}

/// The matrix kernels' walk over m [rows, cols] against n vectors: row blocks of
/// `$block_rows(r)` rows at row r and, within each, the vectors in groups of up to `$group`
/// from j; `$body` runs each (block, group) with `left` = n - j vectors left and `ahead`, the
/// rows the block PREFETCH_ROWS_AHEAD later reads (`future_rows`), which a row block's first
/// group asks for while it computes. Each kernel's body is its table of block shapes.
macro_rules! each_block {
    ($m:expr, $rows:expr, $cols:expr, $n:expr, $group:expr, $block_rows:expr,
     |$rows_here:ident, $left:ident, $r:ident, $j:ident, $ahead:ident| $body:expr) => {{
        let (m, rows, cols, n) = ($m, $rows, $cols, $n);
        let mut $r = 0;
        while $r < rows {
            let $rows_here: usize = $block_rows($r);
            let first_ahead = $crate::expert_pairs::future_rows(m, rows, cols, $r, $rows_here);
            let mut $j = 0;
            while $j < n {
                let $left = n - $j;
                let $ahead = if $j == 0 { first_ahead } else { &[] };
                $body;
                $j += $left.min($group);
            }
            $r += $rows_here;
        }
    }};
}
pub(crate) use each_block;

/// Blocks of 4 rows x 3 vectors: 12 accumulators sharing each load, the 4 rows read from
/// memory once and kept in L1 while the vectors pass.
///
/// # Safety
/// The CPU must support AVX2 and FMA; m is [rows, cols], vs [n, cols], out [n, rows], cols > 0.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_nt_avx2<W: Element>(m: &[W], rows: usize, cols: usize, vs: &[f32], out: &mut [f32]) {
    let n = vs.len() / cols;
    each_block!(m, rows, cols, n, 3, |r| if r + 4 <= rows { 4 } else { 1 }, |block_rows, left, r, j, ahead| {
        match (block_rows, left) {
            (4, 3..) => gemm_block::<W, 4, 3>(m, cols, vs, out, rows, r, j, ahead),
            (4, 2) => gemm_block::<W, 4, 2>(m, cols, vs, out, rows, r, j, ahead),
            (4, _) => gemm_block::<W, 4, 1>(m, cols, vs, out, rows, r, j, ahead),
            (_, 3..) => gemm_block::<W, 1, 3>(m, cols, vs, out, rows, r, j, ahead),
            (_, 2) => gemm_block::<W, 1, 2>(m, cols, vs, out, rows, r, j, ahead),
            _ => gemm_block::<W, 1, 1>(m, cols, vs, out, rows, r, j, ahead),
        }
    });
}

/// How far ahead of the block being computed the matrix kernels ask for weight rows: a chunk's
/// first pass over a row block otherwise waits on memory the hardware prefetcher has not
/// guessed (each row block is only a few KiB, and its rows start a new page).
const PREFETCH_ROWS_AHEAD: usize = 16;

/// The `count` rows of m [rows, cols] PREFETCH_ROWS_AHEAD after row r (fewer near the end):
/// what the block at r asks for while it computes.
#[inline]
pub(crate) fn future_rows<W>(m: &[W], rows: usize, cols: usize, r: usize, count: usize) -> &[W] {
    let first = (r + PREFETCH_ROWS_AHEAD).min(rows);
    &m[first * cols..(first + count).min(rows) * cols]
}

/// Stores a block's sums `acc` ([[__m256; V]; R]): each lane vector's horizontal sum plus the
/// row's tail beyond the last whole 8 columns (`gemm_block`; `gemm_nt_avx512` hands its sums
/// over in the same lanes). A macro, not a function: a `#[target_feature]` function may not be
/// `#[inline(always)]`, and out of line the block's sums went through memory on every call.
/// Expands inside an unsafe `#[target_feature(enable = "avx2,fma")]` function, with the
/// bounds of `gemm_block`.
#[cfg(target_arch = "x86_64")]
macro_rules! finish_block {
    ($acc:expr, $m:expr, $cols:expr, $vs:expr, $out:expr, $rows:expr, $r:expr, $j:expr) => {{
        use std::arch::x86_64::*;
        let (acc, m, cols, vs, out, rows, r, j) = ($acc, $m, $cols, $vs, $out, $rows, $r, $j);
        let body = cols / 8 * 8;
        if acc.len() == 4 && body == cols {
            // four rows' sums of each vector reduced together, in hsum's order, stored at once
            let empty = _mm_set1_ps([0f32; 0].iter().sum::<f32>()); // what the tail adds below
            for v in 0..acc[0].len() {
                let sums = _mm_add_ps(hsum4(acc[0][v], acc[1][v], acc[2][v], acc[3][v]), empty);
                let dst = &mut out[(j + v) * rows + r..(j + v) * rows + r + 4];
                _mm_storeu_ps(dst.as_mut_ptr(), sums);
            }
        } else {
            for (l, row) in acc.iter().enumerate() {
                let wrow = &m[(r + l) * cols + body..(r + l + 1) * cols];
                for (v, a) in row.iter().enumerate() {
                    let x = &vs[(j + v) * cols + body..(j + v + 1) * cols];
                    let tail: f32 = wrow.iter().zip(x).map(|(w, x)| w.to_f32() * x).sum();
                    out[(j + v) * rows + r + l] = hsum(*a) + tail;
                }
            }
        }
    }};
}

/// out[j + v, r + l] for l < R, v < V (see `gemm_nt_avx2`), asking for `ahead` on the way.
///
/// # Safety
/// As `gemm_nt_avx2`, with r + R <= rows and j + V <= n.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_block<W: Element, const R: usize, const V: usize>(
    m: &[W],
    cols: usize,
    vs: &[f32],
    out: &mut [f32],
    rows: usize,
    r: usize,
    j: usize,
    ahead: &[W],
) {
    use std::arch::x86_64::*;
    let body = cols / 8 * 8;
    let (mp, vp) = (m.as_ptr(), vs.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); V]; R];
    // `ahead` (the rows a later block reads) asked for as many bytes a step as the step reads
    let step = R * 8 * std::mem::size_of::<W>();
    let mut c = 0;
    while c < body {
        crate::prefetch::prefetch_l2_bytes(ahead, c / 8 * step, step);
        let mut x = [_mm256_setzero_ps(); V];
        for (v, xv) in x.iter_mut().enumerate() {
            *xv = _mm256_loadu_ps(vp.add((j + v) * cols + c));
        }
        for (l, row) in acc.iter_mut().enumerate() {
            let w = W::load8(mp.add((r + l) * cols + c));
            for (a, xv) in row.iter_mut().zip(&x) {
                *a = _mm256_fmadd_ps(w, *xv, *a);
            }
        }
        c += 8;
    }
    finish_block!(&acc, m, cols, vs, out, rows, r, j);
}

/// `gemm_nt_avx2` with AVX-512F: blocks of 8 rows x 3 vectors, two rows per 16-lane register
/// (row r + 2p in the low 8 lanes, r + 2p + 1 in the high 8) against each vector's 8 columns
/// in both halves. Every lane sums the products of its row and column class in the AVX2
/// kernel's order, and the sums are handed to its epilogue as 4-row blocks: the same bits.
/// Leftover rows (fewer than 4) take the AVX2 kernel itself.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA; m is [rows, cols], vs [n, cols], out [n, rows], cols > 0.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn gemm_nt_avx512<W: Element>(m: &[W], rows: usize, cols: usize, vs: &[f32], out: &mut [f32]) {
    let n = vs.len() / cols;
    let block_rows = |r: usize| {
        if r + 8 <= rows {
            8
        } else if r + 4 <= rows {
            4
        } else {
            1
        }
    };
    each_block!(m, rows, cols, n, 3, block_rows, |block_rows, left, r, j, ahead| {
        match (block_rows, left) {
            (8, 3..) => gemm_block_avx512::<W, 4, 3>(m, cols, vs, out, rows, r, j, ahead),
            (8, 2) => gemm_block_avx512::<W, 4, 2>(m, cols, vs, out, rows, r, j, ahead),
            (8, _) => gemm_block_avx512::<W, 4, 1>(m, cols, vs, out, rows, r, j, ahead),
            (4, 3..) => gemm_block_avx512::<W, 2, 3>(m, cols, vs, out, rows, r, j, ahead),
            (4, 2) => gemm_block_avx512::<W, 2, 2>(m, cols, vs, out, rows, r, j, ahead),
            (4, _) => gemm_block_avx512::<W, 2, 1>(m, cols, vs, out, rows, r, j, ahead),
            (_, 3..) => gemm_block::<W, 1, 3>(m, cols, vs, out, rows, r, j, ahead),
            (_, 2) => gemm_block::<W, 1, 2>(m, cols, vs, out, rows, r, j, ahead),
            _ => gemm_block::<W, 1, 1>(m, cols, vs, out, rows, r, j, ahead),
        }
    });
}

/// out[j + v, r + l] for l < 2P, v < V (see `gemm_nt_avx512`), P = 2 or 4, asking for `ahead`
/// on the way.
///
/// # Safety
/// As `gemm_nt_avx512`, with r + 2P <= rows and j + V <= n.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_block_avx512<W: Element, const P: usize, const V: usize>(
    m: &[W],
    cols: usize,
    vs: &[f32],
    out: &mut [f32],
    rows: usize,
    r: usize,
    j: usize,
    ahead: &[W],
) {
    use std::arch::x86_64::*;
    let body = cols / 8 * 8;
    let (mp, vp) = (m.as_ptr(), vs.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); V]; P];
    let step = 2 * P * 8 * std::mem::size_of::<W>(); // `ahead`'s bytes a step, as gemm_block asks
    let mut c = 0;
    while c < body {
        crate::prefetch::prefetch_l2_bytes(ahead, c / 8 * step, step);
        let mut x = [_mm512_setzero_ps(); V];
        for (v, xv) in x.iter_mut().enumerate() {
            // the vector's 8 columns in both halves
            let half = _mm512_castps256_ps512(_mm256_loadu_ps(vp.add((j + v) * cols + c)));
            *xv = _mm512_shuffle_f32x4::<0b01_00_01_00>(half, half);
        }
        for (p, pair) in acc.iter_mut().enumerate() {
            let w = W::load8x2(mp.add((r + 2 * p) * cols + c), mp.add((r + 2 * p + 1) * cols + c));
            for (a, xv) in pair.iter_mut().zip(&x) {
                *a = _mm512_fmadd_ps(w, *xv, *a);
            }
        }
        c += 8;
    }
    // each row's 8 lanes as the AVX2 kernel holds them, then its epilogue, 4 rows at a time
    let halves = |a: __m512| -> [__m256; 2] {
        [_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)))]
    };
    for group in 0..P / 2 {
        let mut four = [[_mm256_setzero_ps(); V]; 4];
        for v in 0..V {
            let [a, b] = halves(acc[2 * group][v]);
            let [c, d] = halves(acc[2 * group + 1][v]);
            four[0][v] = a;
            four[1][v] = b;
            four[2][v] = c;
            four[3][v] = d;
        }
        finish_block!(&four, m, cols, vs, &mut *out, rows, r + 4 * group, j);
    }
}

fn gemv_scalar<W: Element>(m: &[W], v: &[f32], out: &mut [f32]) {
    if v.is_empty() {
        out.fill(0.0);
        return;
    }
    for (o, row) in out.iter_mut().zip(m.chunks_exact(v.len())) {
        // four partial sums, as the vector kernel keeps independent chains
        let mut acc = [0.0f32; 4];
        let body = v.len() / 4 * 4;
        for (w, x) in row[..body].chunks_exact(4).zip(v[..body].chunks_exact(4)) {
            for l in 0..4 {
                acc[l] += w[l].to_f32() * x[l];
            }
        }
        let mut sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        for (w, x) in row[body..].iter().zip(&v[body..]) {
            sum += w.to_f32() * x;
        }
        *o = sum;
    }
}

/// Four rows at a time, each with its own accumulator, sharing every load of `v`: four
/// independent FMA chains, enough to stream the rows from memory at full speed.
///
/// # Safety
/// The CPU must support AVX2 and FMA, and `m.len() == out.len() * v.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv_avx2<W: Element>(m: &[W], v: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let cols = v.len();
    let body = cols / 8 * 8;
    let rows = out.len();
    let (mp, vp) = (m.as_ptr(), v.as_ptr());
    let tail = |r: usize| -> f32 {
        m[r * cols + body..(r + 1) * cols].iter().zip(&v[body..]).map(|(w, x)| w.to_f32() * x).sum()
    };
    let mut r = 0;
    while r + 4 <= rows {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut c = 0;
        while c < body {
            let x = _mm256_loadu_ps(vp.add(c));
            for (l, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(W::load8(mp.add((r + l) * cols + c)), x, *a);
            }
            c += 8;
        }
        for (l, a) in acc.into_iter().enumerate() {
            out[r + l] = hsum(a) + tail(r + l);
        }
        r += 4;
    }
    while r < rows {
        let mut a = _mm256_setzero_ps();
        let mut c = 0;
        while c < body {
            a = _mm256_fmadd_ps(W::load8(mp.add(r * cols + c)), _mm256_loadu_ps(vp.add(c)), a);
            c += 8;
        }
        out[r] = hsum(a) + tail(r);
        r += 1;
    }
}

/// [hsum(a), hsum(b), hsum(c), hsum(d)], each summed in exactly `hsum`'s order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum4(
    a: std::arch::x86_64::__m256,
    b: std::arch::x86_64::__m256,
    c: std::arch::x86_64::__m256,
    d: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    // s = lo + hi of each: [sa | sb] and [sc | sd]
    let ab = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b));
    let cd = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(c, d), _mm256_permute2f128_ps::<0x31>(c, d));
    // s0 + s2 and s1 + s3 of each: [a, a, c, c | b, b, d, d]
    let (ab, cd) = (_mm256_castps_pd(ab), _mm256_castps_pd(cd));
    let u = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ab, cd)), _mm256_castpd_ps(_mm256_unpackhi_pd(ab, cd)));
    // (s0 + s2) + (s1 + s3): [a, c, a, c | b, d, b, d], then [a, b, c, d]
    let h = _mm256_hadd_ps(u, u);
    _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

#[cfg(feature = "python")]
pub(crate) mod python {
    //! `r3srv._core.expert_pairs_cpu`, called by r3srv.kernels.expert_pairs_cpu, which passes
    //! the tensors as data addresses after checking their dtype, device and contiguity.

    use pyo3::exceptions::PyValueError;
    use pyo3::prelude::*;

    use super::{expert_pairs, packed_lens, Activation, Bf16, Element, Experts, Isa, PackedExperts, PairTokens};

    /// The kernel the engine runs here: "auto" (AVX-512 for large weight blocks, AVX2 below), "avx2" or "scalar".
    #[pyfunction]
    pub fn expert_pairs_isa() -> &'static str {
        Isa::default_kernel().name()
    }

    /// The instructions bfloat16 experts' wide chunks run in here: "amx" (AMX tiles), "avx512_bf16"
    /// (AVX-512 BF16 dot products), or "float32" (widened to float32 FMA products).
    #[pyfunction]
    pub fn expert_pairs_bf16_products() -> &'static str {
        use crate::matmul_bf16::Products;
        match Products::fastest() {
            _ if !crate::matmul_bf16::runs() || Isa::default_kernel() != Isa::Auto => "float32",
            Products::Tiles => "amx",
            Products::DotProducts => "avx512_bf16",
        }
    }

    /// Whether bfloat16 experts' wide chunks may run in AMX tiles where the CPU has them (the
    /// default; settings.amx_tiles): process-wide, set when a model's CPU ops are built.
    #[pyfunction]
    pub fn expert_pairs_allow_amx(allowed: bool) {
        crate::matmul_bf16::allow_tiles(allowed)
    }

    /// The pair count from which the engine's kernel runs an expert's pairs of `dtype`
    /// ("float32" or "bfloat16") in wide chunks, whose bits differ from the narrow ones'.
    #[pyfunction]
    pub fn expert_pairs_wide_min_pairs(dtype: &str) -> PyResult<usize> {
        match dtype {
            "float32" => Ok(super::wide_min_pairs::<f32>(Isa::default_kernel())),
            "bfloat16" => Ok(super::wide_min_pairs::<Bf16>(Isa::default_kernel())),
            other => Err(PyValueError::new_err(format!("unsupported expert dtype {other:?}"))),
        }
    }

    /// Whether the default kernel reads packed experts of `dtype` ("float32" or "bfloat16") on
    /// this CPU now (`packed_runs`; for bfloat16 also whether AMX tiles are allowed).
    #[pyfunction]
    pub fn expert_pairs_packed_runs(dtype: &str) -> PyResult<bool> {
        let isa = Isa::default_kernel();
        match dtype {
            "float32" => Ok(super::packed_runs::<f32>(isa)),
            "bfloat16" => Ok(super::packed_runs::<Bf16>(isa)),
            other => Err(PyValueError::new_err(format!("unsupported expert dtype {other:?}"))),
        }
    }

    /// Values of one expert's matrix [n, k] of `dtype` packed (float32 values in row tiles,
    /// bfloat16 pairs as 32-bit values in panels).
    #[pyfunction]
    pub fn expert_pairs_packed_len(dtype: &str, n: usize, k: usize) -> PyResult<usize> {
        match dtype {
            "float32" => Ok(f32::packed_len(n, k)),
            "bfloat16" => Ok(Bf16::packed_len(n, k)),
            other => Err(PyValueError::new_err(format!("unsupported expert dtype {other:?}"))),
        }
    }

    /// # Safety
    /// As `expert_pairs_pack` requires of its caller, with `W` the experts' element type.
    unsafe fn pack<W: Element>(
        py: Python<'_>,
        src: usize,
        dst: usize,
        [experts, n, k]: [usize; 3],
        threads: usize,
    ) -> PyResult<()> {
        let each = W::packed_len(n, k);
        // SAFETY: the caller's contract.
        let (w, out) = unsafe {
            (
                std::slice::from_raw_parts(src as *const W, experts * n * k),
                std::slice::from_raw_parts_mut(dst as *mut W::Packed, experts * each),
            )
        };
        py.detach(|| super::pack_experts(w, experts, n, out, threads)).map_err(PyValueError::new_err)
    }

    /// The tensor at `dst` (experts x the packed length of [n, k]: float32 for float32 experts,
    /// 32-bit values for bfloat16 ones) = the experts [E, n, k] of `dtype` at `src` packed
    /// (`pack_experts`), with the GIL released, on up to `threads` threads.
    #[pyfunction]
    pub fn expert_pairs_pack(
        py: Python<'_>,
        src: usize,
        dst: usize,
        shape: [usize; 3],
        dtype: &str,
        threads: usize,
    ) -> PyResult<()> {
        if src == 0 || dst == 0 {
            return Err(PyValueError::new_err("expert_pairs_pack needs two non-null tensors"));
        }
        // SAFETY: the caller (r3srv.kernels.expert_pairs_cpu) passes the data addresses of a
        // live, contiguous tensor [E, n, k] of `dtype` and a fresh one of E x packed_len(n, k)
        // values of its packed type, kept alive for the call; nothing else touches them meanwhile.
        unsafe {
            match dtype {
                "float32" => pack::<f32>(py, src, dst, shape, threads),
                "bfloat16" => pack::<Bf16>(py, src, dst, shape, threads),
                other => Err(PyValueError::new_err(format!("unsupported expert dtype {other:?}"))),
            }
        }
    }

    /// # Safety
    /// As `expert_pairs_cpu` requires of its caller, with `W` the tensors' element type.
    unsafe fn run<W: Element>(
        py: Python<'_>,
        addresses: [usize; 9],
        shape: [usize; 5],
        act: Activation,
        threads: usize,
        wide_min: Option<usize>,
        packed: Option<(usize, usize)>,
    ) -> PyResult<()> {
        use std::slice::{from_raw_parts, from_raw_parts_mut};
        let [x, w13, w2, b13, b2, tokens, ids, weights, out] = addresses;
        let [num_tokens, num_pairs, num_experts, hidden, inter] = shape;
        let rows13 = inter * act.rows_per_unit();
        let bias = |addr: usize, len: usize| (addr != 0).then(|| from_raw_parts(addr as *const W, len));
        let experts = Experts {
            w13: from_raw_parts(w13 as *const W, num_experts * rows13 * hidden),
            w2: from_raw_parts(w2 as *const W, num_experts * hidden * inter),
            b13: bias(b13, num_experts * rows13),
            b2: bias(b2, num_experts * hidden),
            num_experts,
            hidden,
            inter,
            act,
            packed: packed.map(|(p13, p2)| {
                let (l13, l2) = packed_lens::<W>(rows13, hidden, inter);
                if W::as_bf16s(&[]).is_some() {
                    PackedExperts::Bf16 {
                        w13: from_raw_parts(p13 as *const u32, num_experts * l13),
                        w2: from_raw_parts(p2 as *const u32, num_experts * l2),
                    }
                } else {
                    PackedExperts::F32 {
                        w13: from_raw_parts(p13 as *const f32, num_experts * l13),
                        w2: from_raw_parts(p2 as *const f32, num_experts * l2),
                    }
                }
            }),
        };
        let x = from_raw_parts(x as *const W, num_tokens * hidden);
        let tokens = match tokens {
            0 => PairTokens::Grid,
            list => PairTokens::List(from_raw_parts(list as *const i32, num_pairs)),
        };
        let ids = from_raw_parts(ids as *const i32, num_pairs);
        let weights = from_raw_parts(weights as *const f32, num_pairs);
        let out = from_raw_parts_mut(out as *mut W, num_tokens * hidden);
        let isa = Isa::default_kernel();
        py.detach(|| expert_pairs(&experts, x, tokens, ids, weights, out, threads, isa, wide_min))
            .map_err(PyValueError::new_err)
    }

    /// out [T, H] = the expert pass (see rust/src/expert_pairs.rs) of the tensors at
    /// `addresses` (x, w13, w2, b13, b2, tokens, ids, weights, out), all of `dtype` ("float32"
    /// or "bfloat16") but tokens and ids (int32) and weights (float32), of `shape` (T, P, E,
    /// H, I): x and out [T, H], tokens, ids and weights [P], w13 [E, R, H], w2 [E, H, I], b13
    /// [E, R] and b2 [E, H] (address 0: none; no tokens: every token's P / T slots in order).
    /// activation: "silu_and_mul", "clamped_swiglu" (alpha, limit) or "relu_squared". Runs with
    /// the GIL released, on up to `threads` threads when the work is large enough. An expert's
    /// pairs run in wide chunks from `wide_min_pairs` pairs on (None: the kernel's own
    /// threshold, `expert_pairs_wide_min_pairs`). `packed`: the addresses of the experts' w13
    /// and w2 packed by `expert_pairs_pack` (of this dtype), which every chunk then reads where
    /// the CPU runs their kernel (`expert_pairs_packed_runs`).
    #[pyfunction]
    #[pyo3(signature = (addresses, shape, dtype, activation, alpha=0.0, limit=0.0, threads=1, wide_min_pairs=None, packed=None))]
    #[allow(clippy::too_many_arguments)]
    pub fn expert_pairs_cpu(
        py: Python<'_>,
        addresses: [usize; 9],
        shape: [usize; 5],
        dtype: &str,
        activation: &str,
        alpha: f32,
        limit: f32,
        threads: usize,
        wide_min_pairs: Option<usize>,
        packed: Option<(usize, usize)>,
    ) -> PyResult<()> {
        let act = match activation {
            "silu_and_mul" => Activation::SiluAndMul,
            "clamped_swiglu" => Activation::ClampedSwiglu { alpha, limit },
            "relu_squared" => Activation::ReluSquared,
            other => return Err(PyValueError::new_err(format!("unknown expert activation {other:?}"))),
        };
        let [x, w13, w2, _, _, _, ids, weights, out] = addresses;
        if [x, w13, w2, ids, weights, out].contains(&0) || shape[0] == 0 || shape[1] == 0 {
            return Err(PyValueError::new_err("expert_pairs_cpu needs non-null tensors and at least one pair"));
        }
        if packed.is_some_and(|(p13, p2)| p13 == 0 || p2 == 0) {
            return Err(PyValueError::new_err("packed experts are two non-null tensors (expert_pairs_pack)"));
        }
        // SAFETY: the caller (r3srv.kernels.expert_pairs_cpu) passes the data addresses of
        // live, contiguous CPU tensors of exactly these shapes and dtypes, keeps them alive for
        // the call, and `out` is a fresh tensor that aliases none of the others; nothing else
        // writes to them while the GIL is released (the engine's forward is the only user of
        // a model's tensors).
        unsafe {
            match dtype {
                "float32" => run::<f32>(py, addresses, shape, act, threads, wide_min_pairs, packed),
                "bfloat16" => run::<Bf16>(py, addresses, shape, act, threads, wide_min_pairs, packed),
                other => Err(PyValueError::new_err(format!("unsupported expert dtype {other:?}"))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        crate::testing::noise(n, seed).into_iter().map(|v| v / 2.0).collect()
    }

    /// The AVX-512 build of the activation gives the portable build's bits (no fused
    /// multiply-adds), on generated gates and ups with the extremes among them.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx512_activation_keeps_the_portable_bits() {
        if !wide_simd512(Isa::Avx512) {
            eprintln!("skipped: this CPU lacks AVX-512F");
            return;
        }
        let acts =
            [Activation::SiluAndMul, Activation::ClampedSwiglu { alpha: 1.702, limit: 7.0 }, Activation::ReluSquared];
        let extremes =
            [0.0, -0.0, 88.5, -88.5, 1e-30, -1e-30, 300.0, -300.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
        for act in acts {
            for (seed, (n, i)) in [(1usize, 128usize), (7, 24), (3, 5)].into_iter().enumerate() {
                let r = i * act.rows_per_unit();
                let mut h: Vec<f32> = values(seed as u64, n * r).into_iter().map(|v| v * 40.0).collect();
                h.iter_mut().step_by(7).zip(extremes.iter().cycle()).for_each(|(v, &e)| *v = e);
                let b13: Vec<f32> = values(seed as u64 + 100, r);
                for bias in [None, Some(&b13[..])] {
                    let (mut h1, mut h2) = (h.clone(), h.clone());
                    let (mut a1, mut a2) = (vec![0.0; n * i], vec![0.0; n * i]);
                    activate(act, bias, r, i, &mut h1, &mut a1);
                    // SAFETY: checked above that the CPU has AVX-512F (and so AVX2 and FMA).
                    unsafe { activate_avx512(act, bias, r, i, &mut h2, &mut a2) };
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&a1), bits(&a2), "{act:?} n={n} i={i} bias={}", bias.is_some());
                }
            }
        }
    }

    fn gemv_f64<W: Element>(m: &[W], v: &[f32], rows: usize) -> Vec<f64> {
        (0..rows).map(|r| (0..v.len()).map(|c| m[r * v.len() + c].to_f32() as f64 * v[c] as f64).sum()).collect()
    }

    fn cast<W: Element>(v: Vec<f32>) -> Vec<W> {
        v.into_iter().map(W::from_f32).collect()
    }

    /// The pass by its definition, in float64 (the activation's exp in float32's own formula;
    /// the activation rounded to bfloat16 when `round_act`, as a wide bfloat16 chunk does).
    fn pass_f64<W: Element>(
        experts: &Experts<W>,
        x: &[W],
        tokens: &[i32],
        ids: &[i32],
        weights: &[f32],
        round_act: bool,
    ) -> Vec<f64> {
        let (hid, i, r) = (experts.hidden, experts.inter, experts.rows13());
        let mut out = vec![0.0f64; x.len()];
        for p in 0..ids.len() {
            let (t, e) = (tokens[p] as usize, ids[p] as usize);
            let xt: Vec<f32> = x[t * hid..(t + 1) * hid].iter().map(|v| v.to_f32()).collect();
            let mut h: Vec<f32> =
                gemv_f64(&experts.w13[e * r * hid..(e + 1) * r * hid], &xt, r).iter().map(|&v| v as f32).collect();
            if let Some(b13) = experts.b13 {
                add(&mut h, &b13[e * r..(e + 1) * r]);
            }
            let mut a = vec![0.0f32; i];
            experts.act.apply(&h, &mut a);
            if round_act {
                a.iter_mut().for_each(|v| *v = Bf16::from_f32(*v).to_f32());
            }
            let o = gemv_f64(&experts.w2[e * hid * i..(e + 1) * hid * i], &a, hid);
            for c in 0..hid {
                let bias = experts.b2.map_or(0.0, |b2| b2[e * hid + c].to_f32() as f64);
                out[t * hid + c] += weights[p] as f64 * (o[c] + bias);
            }
        }
        out
    }

    fn isas() -> Vec<Isa> {
        Isa::available()
    }

    /// Every kernel against float64 on every shape (the matrix rounded to `W` first).
    fn gemv_cases<W: Element>() {
        for isa in isas() {
            for rows in [1, 3, 4, 5, 9, 16] {
                for cols in [0, 1, 7, 8, 9, 17, 64, 100] {
                    let m: Vec<W> = cast(values(rows as u64 * 131 + cols as u64, rows * cols));
                    let v = values(cols as u64, cols);
                    let mut out = vec![f32::NAN; rows];
                    gemv(isa, &m, &v, &mut out);
                    for (got, want) in out.iter().zip(gemv_f64(&m, &v, rows)) {
                        assert!(
                            (*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{isa:?} {rows}x{cols}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The whole pass in narrow chunks gives the AVX2 kernel's bits in the AVX-512 one, whose
    /// elementwise loops (the activation, the weighted sums) run 16 wide: float32 and bfloat16,
    /// 37 tokens of top-4 over 6 experts, 16 hidden dims (a whole register) and 40 (not).
    #[test]
    fn the_avx512_pass_gives_the_avx2_bits() {
        fn run<W: Element>() {
            if !Isa::Avx512.runs() {
                eprintln!("skipped: this CPU has no AVX-512F");
                return;
            }
            let (e, inter, tokens, top_k) = (6, 24, 37, 4);
            for hid in [16, 40] {
                let (w13, w2): (Vec<W>, Vec<W>) =
                    (cast(values(11, e * 2 * inter * hid)), cast(values(12, e * hid * inter)));
                let experts = silu_experts(&w13, &w2, e, hid, inter);
                let x: Vec<W> = cast(values(13, tokens * hid));
                let ids: Vec<i32> = (0..tokens * top_k).map(|p| ((p * 7 + p / 5) % e) as i32).collect();
                let weights = values(14, tokens * top_k);
                let pass = |isa: Isa| {
                    let mut out = vec![W::from_f32(f32::NAN); tokens * hid];
                    expert_pairs(&experts, &x, PairTokens::Grid, &ids, &weights, &mut out, 1, isa, Some(usize::MAX))
                        .unwrap();
                    out.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>()
                };
                assert_eq!(pass(Isa::Avx512), pass(Isa::Avx2Fma), "hidden {hid}");
            }
        }
        run::<f32>();
        run::<Bf16>();
    }

    #[test]
    fn gemv_matches_f64_for_every_shape_and_kernel() {
        gemv_cases::<f32>();
        gemv_cases::<Bf16>();
    }

    /// Experts of SiLU-and-mul without biases over these weights.
    fn silu_experts<'a, W: Element>(
        w13: &'a [W],
        w2: &'a [W],
        num_experts: usize,
        hidden: usize,
        inter: usize,
    ) -> Experts<'a, W> {
        experts_with(w13, w2, None, None, num_experts, hidden, inter, Activation::SiluAndMul)
    }

    /// Experts of these weights and biases, read in place (no packed copy).
    #[allow(clippy::too_many_arguments)]
    fn experts_with<'a, W: Element>(
        w13: &'a [W],
        w2: &'a [W],
        b13: Option<&'a [W]>,
        b2: Option<&'a [W]>,
        num_experts: usize,
        hidden: usize,
        inter: usize,
        act: Activation,
    ) -> Experts<'a, W> {
        Experts { w13, w2, b13, b2, num_experts, hidden, inter, act, packed: None }
    }

    fn whole_pass<W: Element>(rel: f64) {
        let (e, hid, inter, tokens, top_k) = (6, 20, 12, 3, 4);
        for act in
            [Activation::SiluAndMul, Activation::ClampedSwiglu { alpha: 1.702, limit: 0.5 }, Activation::ReluSquared]
        {
            let r = inter * act.rows_per_unit();
            let (w13, w2): (Vec<W>, Vec<W>) = (cast(values(1, e * r * hid)), cast(values(2, e * hid * inter)));
            let (b13, b2): (Vec<W>, Vec<W>) = (cast(values(3, e * r)), cast(values(4, e * hid)));
            let experts = experts_with(&w13, &w2, Some(&b13), Some(&b2), e, hid, inter, act);
            let x: Vec<W> = cast(values(5, tokens * hid));
            let ids: Vec<i32> = (0..tokens * top_k).map(|p| ((p * 5) % e) as i32).collect();
            let mut weights = values(6, tokens * top_k);
            weights[1] = 0.0; // a skipped pair: contributes nothing either way
                              // the grid's pairs, then a list of them in another order, missing token 1's
            let grid: Vec<i32> = (0..tokens * top_k).map(|p| (p / top_k) as i32).collect();
            let order: Vec<usize> = (0..grid.len()).rev().filter(|&p| grid[p] != 1).collect();
            let listed = |v: &[i32]| -> Vec<i32> { order.iter().map(|&p| v[p]).collect() };
            let list_weights: Vec<f32> = order.iter().map(|&p| weights[p]).collect();
            let cases = [
                (PairTokens::Grid, grid.clone(), ids.clone(), weights.clone()),
                (PairTokens::List(&listed(&grid)), listed(&grid), listed(&ids), list_weights),
            ];
            for (tokens_arg, pair_tokens, ids, weights) in &cases {
                let want = pass_f64(&experts, &x, pair_tokens, ids, weights, W::as_bf16s(&x).is_some());
                // every named kernel, and the default (bfloat16's dot products where the CPU has them)
                for isa in isas().into_iter().chain([Isa::default_kernel()]) {
                    let mut out = vec![W::from_f32(f32::NAN); tokens * hid];
                    expert_pairs(&experts, &x, *tokens_arg, ids, weights, &mut out, 1, isa, None).unwrap();
                    for (got, want) in out.iter().zip(&want) {
                        let got = got.to_f32() as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()) + rel * want.abs(),
                            "{isa:?} {act:?}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_kernel_matches_the_definition_on_the_whole_pass() {
        whole_pass::<f32>(0.0);
        whole_pass::<Bf16>(1.0 / 256.0); // bfloat16's final rounding: at most half of 2^-7 (the activation rounded too)
    }

    /// `gemm_nt` gives, element for element, the bits `gemv` gives for each vector alone.
    fn gemm_cases<W: Element>() {
        for isa in isas() {
            for rows in [1, 3, 4, 5, 9] {
                for cols in [1, 7, 8, 9, 17, 64] {
                    for n in 1..=8 {
                        let m: Vec<W> = cast(values(rows as u64 * 7 + cols as u64, rows * cols));
                        let vs = values(n as u64 * 3 + 1, n * cols);
                        let mut out = vec![f32::NAN; n * rows];
                        gemm_nt(isa, &m, rows, &vs, &mut out);
                        for (j, v) in vs.chunks_exact(cols).enumerate() {
                            let mut want = vec![f32::NAN; rows];
                            gemv(isa, &m, v, &mut want);
                            let got = &out[j * rows..(j + 1) * rows];
                            assert!(
                                got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                                "{isa:?} {rows}x{cols} n={n} vector {j}: {got:?} vs {want:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every faster kernel this CPU runs gives the AVX2 kernel's bits (AVX-512: two rows per
    /// register in the same lane order), on every block shape and remainder.
    fn same_bits_as_avx2<W: Element>() {
        for isa in isas().into_iter().filter(|&isa| isa != Isa::Scalar && isa != Isa::Avx2Fma) {
            for rows in [1, 3, 4, 5, 8, 9, 12, 13, 16, 19] {
                for cols in [1, 7, 8, 9, 17, 64, 100] {
                    let m: Vec<W> = cast(values(rows as u64 * 5 + cols as u64, rows * cols));
                    for n in 1..=7 {
                        let vs = values(n as u64 * 11 + 2, n * cols);
                        let (mut got, mut want) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
                        gemm_nt(isa, &m, rows, &vs, &mut got);
                        gemm_nt(Isa::Avx2Fma, &m, rows, &vs, &mut want);
                        assert!(
                            got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{isa:?} {rows}x{cols} n={n}"
                        );
                    }
                    let v = values(cols as u64 + 9, cols);
                    let (mut got, mut want) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
                    gemv(isa, &m, &v, &mut got);
                    gemv(Isa::Avx2Fma, &m, &v, &mut want);
                    assert!(
                        got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "gemv {isa:?} {rows}x{cols}"
                    );
                }
            }
        }
    }

    #[test]
    fn faster_kernels_give_the_avx2_bits() {
        same_bits_as_avx2::<f32>();
        same_bits_as_avx2::<Bf16>();
    }

    /// `Auto` takes the AVX-512 kernel from AVX512_MIN_WEIGHTS weights on and the AVX2 one
    /// below, and is the default exactly where the CPU runs AVX-512; its results are the AVX2
    /// kernel's bits on both sides of the threshold.
    #[test]
    fn auto_picks_by_block_size_with_the_avx2_bits() {
        assert_eq!(Isa::Auto.for_weights(AVX512_MIN_WEIGHTS), Isa::Avx512);
        assert_eq!(Isa::Auto.for_weights(AVX512_MIN_WEIGHTS - 1), Isa::Avx2Fma);
        assert_eq!(Isa::Avx512.for_weights(1), Isa::Avx512);
        assert_eq!(Isa::Avx2Fma.for_weights(usize::MAX), Isa::Avx2Fma);
        assert_eq!(Isa::default_kernel() == Isa::Auto, Isa::Avx512.runs());
        if !Isa::Auto.runs() {
            return;
        }
        let cols = 1024;
        for rows in [AVX512_MIN_WEIGHTS / cols - 4, AVX512_MIN_WEIGHTS / cols + 3] {
            let m: Vec<f32> = values(rows as u64, rows * cols);
            for n in [1, 3] {
                let vs = values(n as u64 + 5, n * cols);
                let (mut got, mut want) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
                gemm_nt(Isa::Auto, &m, rows, &vs, &mut got);
                gemm_nt(Isa::Avx2Fma, &m, rows, &vs, &mut want);
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{rows} rows n={n}");
            }
        }
    }

    #[test]
    fn gemm_nt_is_gemv_bit_for_bit_at_every_width() {
        gemm_cases::<f32>();
        gemm_cases::<Bf16>();
    }

    /// Narrow chunks (a few pairs under the kernel's wide threshold per expert: two chunks each
    /// where the threshold is 64) and wide ones (733: two each), on 1-3 threads: the same bits on
    /// any thread count. A token run alone (one narrow chunk) gets exactly its narrow-batch bits;
    /// its wide-batch result is within rounding of them, and in pair panels exactly them too
    /// wherever its expert's chunk is wide alone as well (never at one token: so within rounding).
    #[test]
    fn threads_never_change_a_bit_and_narrow_chunks_are_batch_invariant() {
        let (e, hid, inter, top_k) = (3, 128, 64, 2);
        let act = Activation::SiluAndMul;
        let (w13, w2) = (values(11, e * 2 * inter * hid), values(12, e * hid * inter));
        let b13 = values(13, e * 2 * inter);
        let experts = experts_with(&w13, &w2, Some(&b13), None, e, hid, inter, act);
        for isa in isas() {
            let wide_min = wide_min_pairs::<f32>(isa);
            assert_eq!(wide_min, if pair_panels::runs(isa) { PANEL_MIN_PAIRS } else { WIDE_MIN_PAIRS });
            // per expert: 4 under the threshold (two chunks where it exceeds CHUNK_PAIRS), or 733
            for (tokens, wide) in [((wide_min - 4) * e / top_k, false), (1100, true)] {
                let per_expert = tokens * top_k / e;
                assert_eq!(per_expert >= wide_min, wide);
                let chunk = if wide { WIDE_CHUNK_PAIRS } else { CHUNK_PAIRS };
                assert!(
                    per_expert > chunk && per_expert <= 2 * chunk || !wide && per_expert < chunk,
                    "{isa:?}: every expert needs two chunks, or one narrow chunk under the threshold"
                );
                let x = values(14, tokens * hid);
                let ids: Vec<i32> = (0..tokens * top_k).map(|p| (p % e) as i32).collect();
                let weights = values(15, tokens * top_k);
                let run = |threads: usize| {
                    let mut out = vec![f32::NAN; tokens * hid];
                    expert_pairs(&experts, &x, PairTokens::Grid, &ids, &weights, &mut out, threads, isa, None).unwrap();
                    out
                };
                let one = run(1);
                for threads in [2, 3] {
                    assert!(
                        one.iter().zip(run(threads)).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?} {threads} threads, wide {wide}"
                    );
                }
                for t in [0, 7, tokens - 1] {
                    let mut alone = vec![f32::NAN; hid];
                    let slots = t * top_k..(t + 1) * top_k;
                    expert_pairs(
                        &experts,
                        &x[t * hid..(t + 1) * hid],
                        PairTokens::Grid,
                        &ids[slots.clone()],
                        &weights[slots],
                        &mut alone,
                        1,
                        isa,
                        None,
                    )
                    .unwrap();
                    for (a, b) in alone.iter().zip(&one[t * hid..(t + 1) * hid]) {
                        if wide {
                            // two float32 summation orders over a few hundred terms of order 1
                            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{isa:?} token {t}: {a} vs {b}");
                        } else {
                            assert_eq!(a.to_bits(), b.to_bits(), "{isa:?} token {t}");
                        }
                    }
                }
            }
        }
    }

    /// A pair's output in pair panels is its own chain: the same bits whatever the other pairs of
    /// its chunk, so two batches that both make an expert wide give a shared token the same bits.
    #[test]
    fn pair_panels_keep_a_pairs_bits_whatever_its_chunk() {
        if !pair_panels::runs(Isa::default_kernel()) {
            eprintln!("skipped: this CPU lacks AVX2 with FMA (the pair panels' instruction sets)");
            return;
        }
        let (e, hid, inter, top_k, tokens) = (2, 48, 24, 2, 40);
        let (w13, w2) = (values(61, e * 2 * inter * hid), values(62, e * hid * inter));
        let experts = silu_experts(&w13, &w2, e, hid, inter);
        let x = values(63, tokens * hid);
        let ids: Vec<i32> = (0..tokens * top_k).map(|p| (p % e) as i32).collect();
        let weights = values(64, tokens * top_k);
        let run = |first: usize, end: usize| {
            let mut out = vec![f32::NAN; (end - first) * hid];
            let slots = first * top_k..end * top_k;
            let (ids, weights) = (&ids[slots.clone()], &weights[slots]);
            expert_pairs(
                &experts,
                &x[first * hid..end * hid],
                PairTokens::Grid,
                ids,
                weights,
                &mut out,
                1,
                Isa::default_kernel(),
                None,
            )
            .unwrap();
            out
        };
        let all = run(0, tokens);
        // tokens 10..30 alone: 20 pairs per expert, wide too
        assert!(20 * top_k / e >= wide_min_pairs::<f32>(Isa::default_kernel()));
        assert_eq!(run(10, 30), all[10 * hid..30 * hid]);
    }

    /// Wide float32 chunks (pair panels where the CPU runs them, the packed GEMM on the portable
    /// kernel): the definition for every activation with both biases, with hidden sizes and pair
    /// counts that leave partial panels, and the same bits from the AVX2 and AVX-512 panels.
    #[test]
    fn wide_float32_chunks_match_the_definition_in_every_kernel() {
        let (e, top_k, tokens) = (3, 2, 155);
        for (hid, inter) in [(40, 24), (64, 16)] {
            for act in [
                Activation::SiluAndMul,
                Activation::ClampedSwiglu { alpha: 1.702, limit: 0.5 },
                Activation::ReluSquared,
            ] {
                let r = inter * act.rows_per_unit();
                let (w13, w2) = (values(51, e * r * hid), values(52, e * hid * inter));
                let (b13, b2) = (values(53, e * r), values(54, e * hid));
                let experts = experts_with(&w13, &w2, Some(&b13), Some(&b2), e, hid, inter, act);
                let x = values(55, tokens * hid);
                let ids: Vec<i32> = (0..tokens * top_k).map(|p| ((p + p / 7) % e) as i32).collect();
                let counts: Vec<usize> = (0..e as i32).map(|g| ids.iter().filter(|&&i| i == g).count()).collect();
                assert!(
                    counts.iter().all(|&c| c >= WIDE_MIN_PAIRS && c % pair_panels::LANES != 0),
                    "wide chunks with partial panels: {counts:?}"
                );
                let weights = values(56, tokens * top_k);
                let grid: Vec<i32> = (0..tokens * top_k).map(|p| (p / top_k) as i32).collect();
                let want = pass_f64(&experts, &x, &grid, &ids, &weights, false);
                let mut panel_bits = Vec::new();
                for isa in isas().into_iter().chain([Isa::default_kernel()]) {
                    let mut out = vec![f32::NAN; tokens * hid];
                    expert_pairs(&experts, &x, PairTokens::Grid, &ids, &weights, &mut out, 2, isa, None).unwrap();
                    for (got, want) in out.iter().zip(&want) {
                        // float32 sums against float64 ones, relu^2 doubling h's relative error
                        assert!(
                            (*got as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{isa:?} {act:?} H={hid}: {got} vs {want}"
                        );
                    }
                    if pair_panels::runs(isa) {
                        panel_bits.push(out.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
                    }
                }
                assert!(
                    panel_bits.windows(2).all(|pair| pair[0] == pair[1]),
                    "{act:?} H={hid}: the panels' bits differ by instruction set"
                );
            }
        }
    }

    /// Float32 experts packed in row tiles: every chunk, narrow or wide, on one thread or two,
    /// gives the bits of the AVX2 pair panels (each element the fused chain over k in order,
    /// every pair wide there), for every activation with both biases and with hidden and
    /// intermediate sizes that leave partial 64-output blocks and partial eights of k; a
    /// token's row alone is its row in the batch; and packing checks its shapes.
    #[test]
    fn packed_experts_give_the_panels_bits_in_every_chunk() {
        if !packed_runs::<f32>(Isa::Auto) || !pair_panels::runs(Isa::Avx2Fma) {
            eprintln!("skipped: this CPU lacks AVX-512F (the row tiles the packed experts run in)");
            return;
        }
        let (e, top_k, tokens) = (3, 2, 90);
        for (hid, inter) in [(40, 24), (70, 20), (64, 16)] {
            for act in [
                Activation::SiluAndMul,
                Activation::ClampedSwiglu { alpha: 1.702, limit: 0.5 },
                Activation::ReluSquared,
            ] {
                let r = inter * act.rows_per_unit();
                let (w13, w2) = (values(71, e * r * hid), values(72, e * hid * inter));
                let (b13, b2) = (values(73, e * r), values(74, e * hid));
                let (l13, l2) = packed_lens::<f32>(r, hid, inter);
                let (mut p13, mut p2) = (vec![f32::NAN; e * l13], vec![f32::NAN; e * l2]);
                pack_experts(&w13, e, r, &mut p13, 2).unwrap();
                pack_experts(&w2, e, hid, &mut p2, 1).unwrap();
                let plain = experts_with(&w13, &w2, Some(&b13), Some(&b2), e, hid, inter, act);
                let packed = Experts { packed: Some(PackedExperts::F32 { w13: &p13, w2: &p2 }), ..plain };
                let x = values(75, tokens * hid);
                let ids: Vec<i32> = (0..tokens * top_k).map(|p| ((p + p / 5) % e) as i32).collect();
                let weights = values(76, tokens * top_k);
                let run = |experts: &Experts<f32>,
                           isa: Isa,
                           threads: usize,
                           wide_min: usize,
                           first: usize,
                           end: usize| {
                    let slots = first * top_k..end * top_k;
                    let mut out = vec![f32::NAN; (end - first) * hid];
                    let (ids, weights) = (&ids[slots.clone()], &weights[slots]);
                    let x = &x[first * hid..end * hid];
                    expert_pairs(experts, x, PairTokens::Grid, ids, weights, &mut out, threads, isa, Some(wide_min))
                        .unwrap();
                    out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                let want = run(&plain, Isa::Avx2Fma, 1, 1, 0, tokens);
                for (threads, wide_min) in [(1, 1), (2, 1), (1, usize::MAX), (2, usize::MAX), (1, 20)] {
                    for isa in [Isa::Auto, Isa::Avx512] {
                        let got = run(&packed, isa, threads, wide_min, 0, tokens);
                        assert!(
                            got == want,
                            "{act:?} H={hid} I={inter} {isa:?} threads={threads} wide from {wide_min}"
                        );
                    }
                }
                for t in [0, 17, tokens - 1] {
                    let alone = run(&packed, Isa::Auto, 1, usize::MAX, t, t + 1);
                    assert_eq!(alone, want[t * hid..(t + 1) * hid], "{act:?} H={hid}: token {t} alone");
                }
            }
        }
        let mut short = vec![0.0; 10];
        assert!(pack_experts(&values(1, 2 * 64 * 8), 2, 64, &mut short, 1).is_err(), "a short output");
        assert!(pack_experts(&values(1, 100), 3, 7, &mut short, 1).is_err(), "not [E, n, K]");
        let (w13, w2) = (values(1, 2 * 8 * 4), values(2, 2 * 4 * 4));
        let wrong = vec![0.0f32; 3];
        let experts = Experts {
            w13: &w13,
            w2: &w2,
            b13: None,
            b2: None,
            num_experts: 2,
            hidden: 4,
            inter: 4,
            act: Activation::SiluAndMul,
            packed: Some(PackedExperts::F32 { w13: &wrong, w2: &wrong }),
        };
        assert!(experts.check().unwrap_err().contains("packed w13"));
    }

    /// Bfloat16 experts packed in the dot products' panels: every chunk, narrow or wide, on one
    /// thread or two, gives the bits of the wide chunks that pack the panels each call, for every
    /// activation with both biases and with odd and even hidden sizes (tokens read as pairs, or
    /// rounded to them) and partial panels; a token's row alone is its row in the batch; and
    /// packed experts of the other dtype are refused.
    #[test]
    fn packed_bfloat16_experts_give_the_dot_products_bits_in_every_chunk() {
        if !packed_runs::<Bf16>(Isa::Auto) {
            eprintln!("skipped: this CPU lacks AVX-512 BF16, or its wide bfloat16 chunks run in AMX tiles");
            return;
        }
        let (e, top_k, tokens) = (3, 2, 90);
        for (hid, inter) in [(40, 24), (71, 20), (64, 15)] {
            for act in [
                Activation::SiluAndMul,
                Activation::ClampedSwiglu { alpha: 1.702, limit: 0.5 },
                Activation::ReluSquared,
            ] {
                let r = inter * act.rows_per_unit();
                let (w13, w2): (Vec<Bf16>, Vec<Bf16>) =
                    (cast(values(81, e * r * hid)), cast(values(82, e * hid * inter)));
                let (b13, b2): (Vec<Bf16>, Vec<Bf16>) = (cast(values(83, e * r)), cast(values(84, e * hid)));
                let (l13, l2) = packed_lens::<Bf16>(r, hid, inter);
                let (mut p13, mut p2) = (vec![u32::MAX; e * l13], vec![u32::MAX; e * l2]);
                pack_experts(&w13, e, r, &mut p13, 2).unwrap();
                pack_experts(&w2, e, hid, &mut p2, 1).unwrap();
                let plain = experts_with(&w13, &w2, Some(&b13), Some(&b2), e, hid, inter, act);
                let packed = Experts { packed: Some(PackedExperts::Bf16 { w13: &p13, w2: &p2 }), ..plain };
                let x: Vec<Bf16> = cast(values(85, tokens * hid));
                let ids: Vec<i32> = (0..tokens * top_k).map(|p| ((p + p / 5) % e) as i32).collect();
                let weights = values(86, tokens * top_k);
                let run = |experts: &Experts<Bf16>, threads: usize, wide_min: usize, first: usize, end: usize| {
                    let slots = first * top_k..end * top_k;
                    let mut out = vec![Bf16(0); (end - first) * hid];
                    let (ids, weights) = (&ids[slots.clone()], &weights[slots]);
                    let x = &x[first * hid..end * hid];
                    expert_pairs(
                        experts,
                        x,
                        PairTokens::Grid,
                        ids,
                        weights,
                        &mut out,
                        threads,
                        Isa::Auto,
                        Some(wide_min),
                    )
                    .unwrap();
                    out.iter().map(|v| v.0).collect::<Vec<_>>()
                };
                let want = run(&plain, 1, 1, 0, tokens);
                for (threads, wide_min) in [(1, 1), (2, 1), (1, usize::MAX), (2, usize::MAX), (1, 20)] {
                    let got = run(&packed, threads, wide_min, 0, tokens);
                    assert!(got == want, "{act:?} H={hid} I={inter} threads={threads} wide from {wide_min}");
                }
                for t in [0, 17, tokens - 1] {
                    let alone = run(&packed, 1, usize::MAX, t, t + 1);
                    assert_eq!(alone, want[t * hid..(t + 1) * hid], "{act:?} H={hid}: token {t} alone");
                }
                let floats = vec![0f32; e * l13.max(l2)];
                let wrong = Experts { packed: Some(PackedExperts::F32 { w13: &floats, w2: &floats }), ..plain };
                assert!(wrong.check().unwrap_err().contains("another dtype"));
            }
        }
    }

    /// Wide bfloat16 chunks (the dot-product kernel where the CPU has it): the definition with
    /// the activation rounded to bfloat16, within float32 sums' rounding and the output's
    /// bfloat16 rounding, and the same bits on any thread count.
    #[test]
    fn wide_bfloat16_chunks_round_the_activation_and_keep_their_bits_across_threads() {
        let (e, hid, inter, top_k, tokens) = (3, 96, 40, 2, 200);
        for act in [Activation::SiluAndMul, Activation::ReluSquared] {
            let r = inter * act.rows_per_unit();
            let (w13, w2): (Vec<Bf16>, Vec<Bf16>) = (cast(values(21, e * r * hid)), cast(values(22, e * hid * inter)));
            let b13: Vec<Bf16> = cast(values(23, e * r));
            let experts = experts_with(&w13, &w2, Some(&b13), None, e, hid, inter, act);
            let x: Vec<Bf16> = cast(values(24, tokens * hid));
            let ids: Vec<i32> = (0..tokens * top_k).map(|p| (p % e) as i32).collect();
            assert!(tokens * top_k / e >= WIDE_MIN_PAIRS, "every expert's chunk must be wide");
            let weights = values(25, tokens * top_k);
            let grid: Vec<i32> = (0..tokens * top_k).map(|p| (p / top_k) as i32).collect();
            let want = pass_f64(&experts, &x, &grid, &ids, &weights, true);
            let run = |threads: usize| {
                let mut out = vec![Bf16::from_f32(f32::NAN); tokens * hid];
                expert_pairs(
                    &experts,
                    &x,
                    PairTokens::Grid,
                    &ids,
                    &weights,
                    &mut out,
                    threads,
                    Isa::default_kernel(),
                    None,
                )
                .unwrap();
                out
            };
            let one = run(1);
            for (got, want) in one.iter().zip(&want) {
                let got = got.to_f32() as f64;
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()) + want.abs() / 256.0,
                    "{act:?}: {got} vs {want}"
                );
            }
            assert_eq!(one, run(2), "{act:?}: two threads");
        }
    }

    /// Narrow bfloat16 chunks (in dot products where the CPU has them): a token alone gets its
    /// bits in a batch of 40 pairs per expert, on any thread count.
    #[test]
    fn narrow_bfloat16_chunks_are_batch_invariant() {
        let (e, hid, inter, top_k, tokens) = (3, 96, 40, 2, 60);
        let (w13, w2): (Vec<Bf16>, Vec<Bf16>) =
            (cast(values(41, e * 2 * inter * hid)), cast(values(42, e * hid * inter)));
        let experts = silu_experts(&w13, &w2, e, hid, inter);
        let x: Vec<Bf16> = cast(values(43, tokens * hid));
        let ids: Vec<i32> = (0..tokens * top_k).map(|p| (p % e) as i32).collect();
        assert!(tokens * top_k / e < WIDE_MIN_PAIRS);
        let weights = values(44, tokens * top_k);
        let run = |x: &[Bf16], ids: &[i32], weights: &[f32], threads: usize| {
            let mut out = vec![Bf16(0); x.len()];
            expert_pairs(&experts, x, PairTokens::Grid, ids, weights, &mut out, threads, Isa::default_kernel(), None)
                .unwrap();
            out
        };
        let batch = run(&x, &ids, &weights, 1);
        assert_eq!(batch, run(&x, &ids, &weights, 2));
        for t in [0, 31, tokens - 1] {
            let slots = t * top_k..(t + 1) * top_k;
            let alone = run(&x[t * hid..(t + 1) * hid], &ids[slots.clone()], &weights[slots], 1);
            assert_eq!(alone[..], batch[t * hid..(t + 1) * hid], "token {t}");
        }
    }

    /// The dot-product kernel and the widened path compute the same products (in their orders).
    #[test]
    fn the_bfloat16_kernel_and_the_widened_path_agree() {
        if crate::testing::skips_without_bf16() {
            return;
        }
        let (rows, cols, n) = (130, 200, 70);
        let m: Vec<Bf16> = cast(values(31, rows * cols));
        let xs = values(32, n * cols);
        let (mut dot, mut widened) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        wide_nt(Isa::Auto, &m, rows, &mut xs.clone(), &mut dot, &mut Vec::new(), &mut Default::default());
        wide_nt_widened(&m, rows, &mut xs.clone(), &mut widened, &mut Vec::new());
        for (a, b) in dot.iter().zip(&widened) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
        assert_ne!(dot, widened, "two orders of the sums: the kernel must have run");
    }

    #[test]
    fn bfloat16_rounds_to_nearest_even() {
        for (v, bits) in [(1.0f32, 0x3f80u16), (-2.5, 0xc020), (f32::INFINITY, 0x7f80), (f32::NAN, 0x7fc0)] {
            assert_eq!(Bf16::from_f32(v), Bf16(bits), "{v}");
        }
        let between = |lo: u16, frac: u32| f32::from_bits(((lo as u32) << 16) | frac);
        assert_eq!(Bf16::from_f32(between(0x3f80, 0x8000)), Bf16(0x3f80)); // tie: to the even 0x3f80
        assert_eq!(Bf16::from_f32(between(0x3f81, 0x8000)), Bf16(0x3f82)); // tie: to the even 0x3f82
        assert_eq!(Bf16::from_f32(between(0x3f80, 0x8001)), Bf16(0x3f81));
        assert_eq!(Bf16::from_f32(between(0x3f80, 0x7fff)), Bf16(0x3f80));
        assert_eq!(Bf16(0x4049).to_f32(), f32::from_bits(0x4049_0000));
    }

    /// The branch-free rounding against the definition written with a branch, on every 16th
    /// f32 bit pattern and every NaN, infinity, zero and subnormal edge (signs both ways).
    #[test]
    fn bfloat16_round_is_the_definition() {
        let definition = |v: f32| -> u16 {
            if v.is_nan() {
                return 0x7fc0;
            }
            let bits = v.to_bits();
            (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16
        };
        let edges = [
            0u32,
            1,
            0x7f_ffff,
            0x80_0000,
            0x7f7f_ffff,
            0x7f80_0000,
            0x7f80_0001,
            0x7fc0_0000,
            0x7fff_ffff,
            0x3f80_8000,
            0x3f81_8000,
            0x7f7f_8000,
        ];
        let patterns = (0..=u32::MAX).step_by(16).chain(edges.iter().flat_map(|&e| [e, e | 0x8000_0000]));
        for bits in patterns {
            let v = f32::from_bits(bits);
            let want = definition(v);
            assert_eq!(Bf16::from_f32(v).0, want, "{bits:#x}");
            assert_eq!(<Bf16 as Element>::round(v).to_bits(), (want as u32) << 16, "{bits:#x}");
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let (w13, w2) = (values(1, 2 * 8 * 4), values(2, 2 * 4 * 4));
        let experts = silu_experts(&w13, &w2, 2, 4, 4);
        let (x, mut out) = (values(3, 4), vec![0.0; 4]);
        let grid = PairTokens::Grid;
        let err = expert_pairs(&experts, &x, grid, &[2], &[1.0], &mut out, 1, Isa::Scalar, None).unwrap_err();
        assert!(err.contains("expert id 2"), "{err}");
        let err = expert_pairs(&experts, &x, grid, &[0, 1], &[1.0], &mut out, 1, Isa::Scalar, None).unwrap_err();
        assert!(err.contains("one value per pair"), "{err}");
        let err = expert_pairs(&experts, &x, PairTokens::List(&[1]), &[0], &[1.0], &mut out, 1, Isa::Scalar, None)
            .unwrap_err();
        assert!(err.contains("token 1 is outside 0..1"), "{err}");
        let err = expert_pairs(&experts, &x, PairTokens::List(&[0, 0]), &[0], &[1.0], &mut out, 1, Isa::Scalar, None)
            .unwrap_err();
        assert!(err.contains("one token per pair"), "{err}");
        let short = Experts { w13: &w13[1..], ..experts };
        assert!(expert_pairs(&short, &x, grid, &[0], &[1.0], &mut out, 1, Isa::Scalar, None)
            .unwrap_err()
            .contains("w13"));
    }
}
