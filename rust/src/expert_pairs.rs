//! The CPU expert pass for a few (token, expert, weight) pairs, one call per MoE layer: for
//! each pair p of token t, expert e = ids[p] and weight w = weights[p] (every token's k slots,
//! or an expert-parallel rank's own list of pairs, `PairTokens`),
//!     h = w13[e] @ x[t] (+ b13[e]),  a = act(h),  o = w2[e] @ a (+ b2[e]),
//! and out[t] = the sum of its pairs' w * o in pair order. The torch path pays a dispatch per matrix-vector
//! product and per indexing op; here the products read each expert's rows in place and the
//! whole pass is one call (r3srv.kernels.expert_pairs_cpu). Tensors hold float32 or
//! bfloat16 (`Element`); the arithmetic is float32 throughout, bfloat16 rounded once at the end.
//!
//! One thread: splitting the pairs over scoped threads lost on the shared 2-core machine
//! (docs/benchmarks.md), the thread start costing more than a one-token pass saves.

use std::sync::OnceLock;

/// What the experts' and tokens' tensors hold: read as f32, written from f32.
pub trait Element: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;

    /// Eight elements from `p`, widened to f32.
    ///
    /// # Safety
    /// The CPU must support AVX2, and `p` must be valid for reading eight elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Element for f32 {
    fn to_f32(self) -> f32 {
        self
    }

    fn from_f32(v: f32) -> Self {
        v
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

/// A bfloat16: the upper half of an f32's bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Element for Bf16 {
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }

    /// Rounded to nearest, ties to even, as torch rounds (NaN stays a quiet NaN).
    fn from_f32(v: f32) -> Self {
        if v.is_nan() {
            return Bf16(0x7fc0);
        }
        let bits = v.to_bits();
        Bf16((bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
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

    fn apply(self, h: &[f32], a: &mut [f32]) {
        let inter = a.len();
        match self {
            Activation::SiluAndMul => {
                let (gate, up) = h.split_at(inter);
                for ((a, &g), &u) in a.iter_mut().zip(gate).zip(up) {
                    *a = g / (1.0 + (-g).exp()) * u;
                }
            }
            Activation::ClampedSwiglu { alpha, limit } => {
                for (a, pair) in a.iter_mut().zip(h.chunks_exact(2)) {
                    let gate = pair[0].min(limit);
                    let up = pair[1].clamp(-limit, limit);
                    *a = (up + 1.0) * (gate / (1.0 + (-(gate * alpha)).exp()));
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
/// (R = I x `Activation::rows_per_unit`).
pub struct Experts<'a, W: Element> {
    pub w13: &'a [W],
    pub w2: &'a [W],
    pub b13: Option<&'a [W]>,
    pub b2: Option<&'a [W]>,
    pub num_experts: usize,
    pub hidden: usize,
    pub inter: usize,
    pub act: Activation,
}

impl<W: Element> Experts<'_, W> {
    fn rows13(&self) -> usize {
        self.inter * self.act.rows_per_unit()
    }

    fn check(&self) -> Result<(), String> {
        let (e, h, i, r) = (self.num_experts, self.hidden, self.inter, self.rows13());
        let want = |name: &str, got: usize, want: usize| {
            if got == want { Ok(()) } else { Err(format!("{name} holds {got} values, expected {want}")) }
        };
        want("w13", self.w13.len(), e * r * h)?;
        want("w2", self.w2.len(), e * h * i)?;
        if let Some(b13) = self.b13 {
            want("b13", b13.len(), e * r)?;
        }
        if let Some(b2) = self.b2 {
            want("b2", b2.len(), e * h)?;
        }
        Ok(())
    }

    /// o = w2[e] @ act(w13[e] @ x + b13[e]) + b2[e]; `h` and `a` are scratch of R and I values.
    fn run(&self, isa: Isa, e: usize, x: &[f32], h: &mut [f32], a: &mut [f32], o: &mut [f32]) {
        let (hid, r, i) = (self.hidden, self.rows13(), self.inter);
        gemv(isa, &self.w13[e * r * hid..(e + 1) * r * hid], x, h);
        if let Some(b13) = self.b13 {
            add(h, &b13[e * r..(e + 1) * r]);
        }
        self.act.apply(h, a);
        gemv(isa, &self.w2[e * hid * i..(e + 1) * hid * i], a, o);
        if let Some(b2) = self.b2 {
            add(o, &b2[e * hid..(e + 1) * hid]);
        }
    }
}

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
/// skipped. Errors name the first inconsistent input.
pub fn expert_pairs<W: Element>(
    experts: &Experts<W>,
    x: &[W],
    tokens: PairTokens,
    ids: &[i32],
    weights: &[f32],
    out: &mut [W],
    isa: Isa,
) -> Result<(), String> {
    experts.check()?;
    let hid = experts.hidden;
    if hid == 0 || !x.len().is_multiple_of(hid) || out.len() != x.len() || x.is_empty() {
        return Err(format!("x holds {} values and out {}, expected equal nonzero multiples of hidden={hid}", x.len(), out.len()));
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
    let (mut h, mut a, mut o) = (vec![0.0f32; experts.rows13()], vec![0.0f32; experts.inter], vec![0.0f32; hid]);
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let mut sums = vec![0.0f32; x.len()];
    for (p, (&e, &w)) in ids.iter().zip(weights).enumerate() {
        if w != 0.0 {
            let t = token_of(p);
            experts.run(isa, e as usize, &xf[t * hid..(t + 1) * hid], &mut h, &mut a, &mut o);
            for (acc, &o) in sums[t * hid..(t + 1) * hid].iter_mut().zip(&o) {
                *acc += w * o;
            }
        }
    }
    for (dst, &v) in out.iter_mut().zip(&sums) {
        *dst = W::from_f32(v);
    }
    Ok(())
}

/// The matrix-vector kernel: AVX2 with FMA, or portable scalar code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx2Fma,
    Scalar,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx2Fma => "avx2",
            Isa::Scalar => "scalar",
        }
    }

    /// The fastest kernel this CPU runs, detected once.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2Fma;
            }
            Isa::Scalar
        })
    }
}

/// out = m @ v for a row-major m [out.len(), v.len()]; `Isa::Avx2Fma` on a CPU without those
/// features runs the scalar code.
pub fn gemv<W: Element>(isa: Isa, m: &[W], v: &[f32], out: &mut [f32]) {
    assert_eq!(m.len(), out.len() * v.len(), "gemv: matrix and vectors disagree");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the guard checked that this CPU has AVX2 and FMA; the lengths were checked above.
        Isa::Avx2Fma if Isa::best() == Isa::Avx2Fma => unsafe { gemv_avx2(m, v, out) },
        _ => gemv_scalar(m, v, out),
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
    let tail = |r: usize| -> f32 { m[r * cols + body..(r + 1) * cols].iter().zip(&v[body..]).map(|(w, x)| w.to_f32() * x).sum() };
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

    use super::{expert_pairs, Activation, Bf16, Element, Experts, Isa, PairTokens};

    /// The kernel this CPU runs: "avx2" or "scalar".
    #[pyfunction]
    pub fn expert_pairs_isa() -> &'static str {
        Isa::best().name()
    }

    /// # Safety
    /// As `expert_pairs_cpu` requires of its caller, with `W` the tensors' element type.
    unsafe fn run<W: Element>(py: Python<'_>, addresses: [usize; 9], shape: [usize; 5], act: Activation) -> PyResult<()> {
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
        };
        let x = from_raw_parts(x as *const W, num_tokens * hidden);
        let tokens = match tokens {
            0 => PairTokens::Grid,
            list => PairTokens::List(from_raw_parts(list as *const i32, num_pairs)),
        };
        let ids = from_raw_parts(ids as *const i32, num_pairs);
        let weights = from_raw_parts(weights as *const f32, num_pairs);
        let out = from_raw_parts_mut(out as *mut W, num_tokens * hidden);
        let isa = Isa::best();
        py.detach(|| expert_pairs(&experts, x, tokens, ids, weights, out, isa)).map_err(PyValueError::new_err)
    }

    /// out [T, H] = the expert pass (see rust/src/expert_pairs.rs) of the tensors at
    /// `addresses` (x, w13, w2, b13, b2, tokens, ids, weights, out), all of `dtype` ("float32"
    /// or "bfloat16") but tokens and ids (int32) and weights (float32), of `shape` (T, P, E,
    /// H, I): x and out [T, H], tokens, ids and weights [P], w13 [E, R, H], w2 [E, H, I], b13
    /// [E, R] and b2 [E, H] (address 0: none; no tokens: every token's P / T slots in order).
    /// activation: "silu_and_mul", "clamped_swiglu" (alpha, limit) or "relu_squared". Runs with
    /// the GIL released.
    #[pyfunction]
    #[pyo3(signature = (addresses, shape, dtype, activation, alpha=0.0, limit=0.0))]
    pub fn expert_pairs_cpu(
        py: Python<'_>,
        addresses: [usize; 9],
        shape: [usize; 5],
        dtype: &str,
        activation: &str,
        alpha: f32,
        limit: f32,
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
        // SAFETY: the caller (r3srv.kernels.expert_pairs_cpu) passes the data addresses of
        // live, contiguous CPU tensors of exactly these shapes and dtypes, keeps them alive for
        // the call, and `out` is a fresh tensor that aliases none of the others; nothing else
        // writes to them while the GIL is released (the engine's forward is the only user of
        // a model's tensors).
        unsafe {
            match dtype {
                "float32" => run::<f32>(py, addresses, shape, act),
                "bfloat16" => run::<Bf16>(py, addresses, shape, act),
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

    fn gemv_f64<W: Element>(m: &[W], v: &[f32], rows: usize) -> Vec<f64> {
        (0..rows).map(|r| (0..v.len()).map(|c| m[r * v.len() + c].to_f32() as f64 * v[c] as f64).sum()).collect()
    }

    fn cast<W: Element>(v: Vec<f32>) -> Vec<W> {
        v.into_iter().map(W::from_f32).collect()
    }

    /// The pass by its definition, in float64 (the activation's exp in float32's own formula).
    fn pass_f64<W: Element>(experts: &Experts<W>, x: &[W], tokens: &[i32], ids: &[i32], weights: &[f32]) -> Vec<f64> {
        let (hid, i, r) = (experts.hidden, experts.inter, experts.rows13());
        let mut out = vec![0.0f64; x.len()];
        for p in 0..ids.len() {
            let (t, e) = (tokens[p] as usize, ids[p] as usize);
            let xt: Vec<f32> = x[t * hid..(t + 1) * hid].iter().map(|v| v.to_f32()).collect();
            let mut h: Vec<f32> = gemv_f64(&experts.w13[e * r * hid..(e + 1) * r * hid], &xt, r).iter().map(|&v| v as f32).collect();
            if let Some(b13) = experts.b13 {
                add(&mut h, &b13[e * r..(e + 1) * r]);
            }
            let mut a = vec![0.0f32; i];
            experts.act.apply(&h, &mut a);
            let o = gemv_f64(&experts.w2[e * hid * i..(e + 1) * hid * i], &a, hid);
            for c in 0..hid {
                let bias = experts.b2.map_or(0.0, |b2| b2[e * hid + c].to_f32() as f64);
                out[t * hid + c] += weights[p] as f64 * (o[c] + bias);
            }
        }
        out
    }

    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        if Isa::best() == Isa::Avx2Fma {
            v.push(Isa::Avx2Fma);
        }
        v
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
                        assert!((*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "{isa:?} {rows}x{cols}: {got} vs {want}");
                    }
                }
            }
        }
    }

    #[test]
    fn gemv_matches_f64_for_every_shape_and_kernel() {
        gemv_cases::<f32>();
        gemv_cases::<Bf16>();
    }

    fn whole_pass<W: Element>(rel: f64) {
        let (e, hid, inter, tokens, top_k) = (6, 20, 12, 3, 4);
        for act in [Activation::SiluAndMul, Activation::ClampedSwiglu { alpha: 1.702, limit: 0.5 }, Activation::ReluSquared] {
            let r = inter * act.rows_per_unit();
            let (w13, w2): (Vec<W>, Vec<W>) = (cast(values(1, e * r * hid)), cast(values(2, e * hid * inter)));
            let (b13, b2): (Vec<W>, Vec<W>) = (cast(values(3, e * r)), cast(values(4, e * hid)));
            let experts = Experts { w13: &w13, w2: &w2, b13: Some(&b13), b2: Some(&b2), num_experts: e, hidden: hid, inter, act };
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
                let want = pass_f64(&experts, &x, pair_tokens, ids, weights);
                for isa in isas() {
                    let mut out = vec![W::from_f32(f32::NAN); tokens * hid];
                    expert_pairs(&experts, &x, *tokens_arg, ids, weights, &mut out, isa).unwrap();
                    for (got, want) in out.iter().zip(&want) {
                        let got = got.to_f32() as f64;
                        assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()) + rel * want.abs(), "{isa:?} {act:?}: {got} vs {want}");
                    }
                }
            }
        }
    }

    #[test]
    fn every_kernel_matches_the_definition_on_the_whole_pass() {
        whole_pass::<f32>(0.0);
        whole_pass::<Bf16>(1.0 / 256.0); // bfloat16's final rounding: at most half of 2^-7
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

    #[test]
    fn bad_inputs_are_errors() {
        let (w13, w2) = (values(1, 2 * 8 * 4), values(2, 2 * 4 * 4));
        let experts = Experts { w13: &w13, w2: &w2, b13: None, b2: None, num_experts: 2, hidden: 4, inter: 4, act: Activation::SiluAndMul };
        let (x, mut out) = (values(3, 4), vec![0.0; 4]);
        let grid = PairTokens::Grid;
        let err = expert_pairs(&experts, &x, grid, &[2], &[1.0], &mut out, Isa::Scalar).unwrap_err();
        assert!(err.contains("expert id 2"), "{err}");
        let err = expert_pairs(&experts, &x, grid, &[0, 1], &[1.0], &mut out, Isa::Scalar).unwrap_err();
        assert!(err.contains("one value per pair"), "{err}");
        let err = expert_pairs(&experts, &x, PairTokens::List(&[1]), &[0], &[1.0], &mut out, Isa::Scalar).unwrap_err();
        assert!(err.contains("token 1 is outside 0..1"), "{err}");
        let err = expert_pairs(&experts, &x, PairTokens::List(&[0, 0]), &[0], &[1.0], &mut out, Isa::Scalar).unwrap_err();
        assert!(err.contains("one token per pair"), "{err}");
        let short = Experts { w13: &w13[1..], ..experts };
        assert!(expert_pairs(&short, &x, grid, &[0], &[1.0], &mut out, Isa::Scalar).unwrap_err().contains("w13"));
    }
}
