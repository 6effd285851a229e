//! Top-k expert selection of router logits on the CPU in one call: the common case of
//! python/r3srv/kernels/router_reference.py's `route_reference` (no correction bias, one expert
//! group), which there takes about ten small torch ops per MoE layer, more than routing a
//! decode step's few rows costs (docs/benchmarks.md).
//!
//! The contract is the reference's: experts ranked by their float32 logits (softmax and sigmoid
//! are monotone), NaN as +inf, descending, ties to the lower expert id; the weights are the
//! chosen experts' scores, optionally renormalized to sum 1, times `scaling`. The ids are the
//! reference's exactly; the weights differ from torch's by rounding only (another exp, another
//! order of summation). With renormalization the softmax's denominator cancels, so only the
//! chosen experts' exponentials are computed.

use crate::paged_attn::Element;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    Softmax,
    Sigmoid,
}

impl Scoring {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "softmax" => Some(Scoring::Softmax),
            "sigmoid" => Some(Scoring::Sigmoid),
            _ => None,
        }
    }
}

/// What to pick and how to weight it (route_reference's keyword arguments this kernel takes).
#[derive(Clone, Copy, Debug)]
pub struct Routing {
    pub top_k: usize,
    pub scoring: Scoring,
    pub renormalize: bool,
    pub scaling: f32,
}

/// Routes each `experts`-long row of `logits` into its `top_k` slots of `weights` and `ids`,
/// the rows split over up to `threads` threads where there are enough of them (a row's result
/// does not depend on it). Errors on a `top_k` outside 1..=experts or lengths that do not match.
pub fn route<L: Element>(
    logits: &[L],
    experts: usize,
    routing: &Routing,
    weights: &mut [f32],
    ids: &mut [i32],
    threads: usize,
) -> Result<(), String> {
    let k = routing.top_k;
    if experts == 0 || k == 0 || k > experts || experts > i32::MAX as usize {
        return Err(format!("route: top_k={k} must be in [1, num_experts={experts}]"));
    }
    let rows = logits.len() / experts;
    if !logits.len().is_multiple_of(experts) || weights.len() != rows * k || ids.len() != rows * k {
        return Err(format!(
            "route: {} logits, {} weights and {} ids do not make rows of {experts} experts and {k} slots",
            logits.len(),
            weights.len(),
            ids.len()
        ));
    }
    let avx2 = k <= 8 && experts <= AVX2_MAX_EXPERTS && avx2_available();
    let threads = threads.min(rows / ROWS_PER_ITEM).max(1);
    if threads == 1 {
        route_rows(logits, experts, routing, weights, ids, avx2);
        return Ok(());
    }
    let (logit_rows, slot_rows) = (ROWS_PER_ITEM * experts, ROWS_PER_ITEM * k);
    let mut items: Vec<_> =
        logits.chunks(logit_rows).zip(weights.chunks_mut(slot_rows)).zip(ids.chunks_mut(slot_rows)).collect();
    crate::workers::take_in_turn(threads, &mut items, &|items| {
        for ((logits, weights), ids) in items {
            route_rows(logits, experts, routing, weights, ids, avx2);
        }
    });
    Ok(())
}

/// Rows a thread takes at a time: a few microseconds of work.
const ROWS_PER_ITEM: usize = 64;

/// Up to this many experts the branch-free AVX2 top-k beats the scalar insertion, whose
/// mispredicted branches cost more than the vector pass over every expert (docs/benchmarks.md).
const AVX2_MAX_EXPERTS: usize = 256;

fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `route` on checked lengths; `avx2`: the vector top-k (k <= 8, an AVX2 CPU).
fn route_rows<L: Element>(
    logits: &[L],
    experts: usize,
    routing: &Routing,
    weights: &mut [f32],
    ids: &mut [i32],
    avx2: bool,
) {
    let k = routing.top_k;
    if avx2 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `avx2` is true only where the CPU has AVX2; k <= 8 and experts <=
        // AVX2_MAX_EXPERTS (route checked them).
        unsafe {
            route_rows_avx2(logits, experts, routing, weights, ids)
        };
        return;
    }
    let mut keys = vec![0f32; k];
    for ((row, w), slot_ids) in
        logits.chunks_exact(experts).zip(weights.chunks_exact_mut(k)).zip(ids.chunks_exact_mut(k))
    {
        top_k(row, &mut keys, slot_ids);
        weigh(row, key(row[slot_ids[0] as usize].to_f32()), slot_ids, routing, w);
    }
}

/// Rows `avx2::top_k_rows` ranks side by side: each row's insertions are one chain of dependent
/// vector ops, which four rows' chains hide.
#[cfg(target_arch = "x86_64")]
const AVX2_ROWS: usize = 4;

/// `route_rows` with the vector top-k, AVX2_ROWS rows at a time (a last group of fewer).
///
/// # Safety
/// The CPU must support AVX2; k <= 8; experts <= AVX2_MAX_EXPERTS; lengths as `route` checks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn route_rows_avx2<L: Element>(
    logits: &[L],
    experts: usize,
    routing: &Routing,
    weights: &mut [f32],
    ids: &mut [i32],
) {
    let k = routing.top_k;
    let mut sortable = [[0i32; AVX2_MAX_EXPERTS]; AVX2_ROWS];
    for ((rows, w), slot_ids) in
        logits.chunks(AVX2_ROWS * experts).zip(weights.chunks_mut(AVX2_ROWS * k)).zip(ids.chunks_mut(AVX2_ROWS * k))
    {
        let n = rows.len() / experts;
        for (keys, row) in sortable.iter_mut().zip(rows.chunks_exact(experts)) {
            for (s, &logit) in keys.iter_mut().zip(row) {
                *s = sortable_key(logit.to_f32());
            }
        }
        // SAFETY: the caller's contract (AVX2, k <= 8).
        unsafe { avx2::top_k_rows(&sortable, experts, n, slot_ids) };
        for ((row, w), slot_ids) in rows.chunks_exact(experts).zip(w.chunks_exact_mut(k)).zip(slot_ids.chunks_exact(k))
        {
            weigh(row, key(row[slot_ids[0] as usize].to_f32()), slot_ids, routing, w);
        }
    }
}

/// An i32 whose order is the keys' order: NaN as +inf, -0.0 equal to 0.0 (the key plus 0.0 is
/// +0.0), negative floats' magnitude bits flipped so that larger magnitudes sort lower.
#[inline(always)]
fn sortable_key(logit: f32) -> i32 {
    let bits = (key(logit) + 0.0).to_bits() as i32;
    if bits < 0 {
        bits ^ 0x7fff_ffff
    } else {
        bits
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// For each of the first `n` rows of `keys` (its first `experts` sortable keys), the best k
    /// (at most 8; `ids` holds n rows of k) experts by `sortable_key`, best first, as
    /// `super::top_k` ranks them: eight (key, id) lanes kept sorted, each expert inserted
    /// without a branch (the lanes below its key shift down one, the last falls out, its key
    /// takes the first of them), so a later expert with an equal key goes after the earlier
    /// ones. The keys' update is max(lane, min(key, lane above)), a chain of dependent ops from
    /// one expert to the next: the rows' chains run side by side.
    ///
    /// # Safety
    /// The CPU must support AVX2; k <= 8; n <= ROWS; experts <= each row's length.
    #[target_feature(enable = "avx2")]
    #[allow(clippy::needless_range_loop)] // expert e of every row's keys in turn
    pub unsafe fn top_k_rows<const ROWS: usize>(
        keys: &[[i32; super::AVX2_MAX_EXPERTS]; ROWS],
        experts: usize,
        n: usize,
        ids: &mut [i32],
    ) {
        let k = ids.len() / n.max(1);
        let mut best = [_mm256_set1_epi32(i32::MIN); ROWS]; // below every sortable key
        let mut best_ids = [_mm256_set1_epi32(-1); ROWS];
        let down = _mm256_setr_epi32(0, 0, 1, 2, 3, 4, 5, 6);
        let top = _mm256_set1_epi32(i32::MAX); // above every sortable key
        for e in 0..experts {
            let expert = _mm256_set1_epi32(e as i32);
            for r in 0..ROWS {
                let v = _mm256_set1_epi32(keys[r][e]);
                let above = _mm256_blend_epi32::<1>(_mm256_permutevar8x32_epi32(best[r], down), top); // lane i: best[i - 1]
                let after = _mm256_cmpgt_epi32(v, above); // the lanes past v's slot
                let at = _mm256_andnot_si256(after, _mm256_cmpgt_epi32(v, best[r]));
                best[r] = _mm256_max_epi32(best[r], _mm256_min_epi32(v, above));
                let placed = _mm256_blendv_epi8(best_ids[r], expert, at);
                best_ids[r] = _mm256_blendv_epi8(placed, _mm256_permutevar8x32_epi32(best_ids[r], down), after);
            }
        }
        for (row, lanes_of) in ids.chunks_exact_mut(k).zip(&best_ids).take(n) {
            let mut lanes = [0i32; 8];
            // SAFETY: `lanes` is 32 writable bytes; an unaligned store.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, *lanes_of) };
            row.copy_from_slice(&lanes[..k]);
        }
    }
}

/// The expert ranking key: the logit, NaN as +inf (first, where torch's descending sort puts it).
#[inline(always)]
fn key(logit: f32) -> f32 {
    if logit.is_nan() {
        f32::INFINITY
    } else {
        logit
    }
}

/// The `ids.len()` best experts of `row` into `ids`, their keys into `keys`, best first; an
/// expert goes after every earlier one with an equal key (a stable descending sort's order).
#[inline]
fn top_k<L: Element>(row: &[L], keys: &mut [f32], ids: &mut [i32]) {
    let k = ids.len();
    let mut filled = 0;
    for (e, &logit) in row.iter().enumerate() {
        let v = key(logit.to_f32());
        if filled == k && v <= keys[k - 1] {
            continue; // the common case once k are in: no better than the worst kept
        }
        let mut i = filled.min(k - 1);
        while i > 0 && keys[i - 1] < v {
            keys[i] = keys[i - 1];
            ids[i] = ids[i - 1];
            i -= 1;
        }
        keys[i] = v;
        ids[i] = e as i32;
        filled = (filled + 1).min(k);
    }
}

/// The chosen experts' weights. `best` is the row's best key, its maximum with NaN as +inf.
#[inline]
fn weigh<L: Element>(row: &[L], best: f32, ids: &[i32], routing: &Routing, weights: &mut [f32]) {
    let logit = |e: i32| row[e as usize].to_f32();
    match routing.scoring {
        Scoring::Softmax if !best.is_finite() => {
            // torch's softmax of a row with NaN or +inf (max - max is NaN) or only -inf: all NaN
            weights.fill(f32::NAN);
            return;
        }
        Scoring::Softmax => {
            for (w, &e) in weights.iter_mut().zip(ids) {
                *w = (logit(e) - best).exp();
            }
            if !routing.renormalize {
                let scale = 1.0 / exp_sum(row, best);
                weights.iter_mut().for_each(|w| *w *= scale);
            }
        }
        Scoring::Sigmoid => {
            for (w, &e) in weights.iter_mut().zip(ids) {
                *w = 1.0 / (1.0 + (-logit(e)).exp());
            }
        }
    }
    if routing.renormalize {
        let sum: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    if routing.scaling != 1.0 {
        weights.iter_mut().for_each(|w| *w *= routing.scaling);
    }
}

/// Lanes of running sums, so that consecutive additions do not wait on each other.
const LANES: usize = 8;

/// sum(exp(row - max)): the softmax's denominator.
fn exp_sum<L: Element>(row: &[L], max: f32) -> f32 {
    let mut lanes = [0f32; LANES];
    let whole = row.len() / LANES * LANES;
    for chunk in row[..whole].chunks_exact(LANES) {
        for i in 0..LANES {
            lanes[i] += (chunk[i].to_f32() - max).exp();
        }
    }
    let tail: f32 = row[whole..].iter().map(|v| (v.to_f32() - max).exp()).sum();
    lanes.iter().sum::<f32>() + tail
}

/// An integer element of a capture buffer (r3srv's routed-experts rows: any torch integer dtype
/// wide enough for the expert ids, which are never negative, so the same bits signed or not).
pub trait CaptureId: Copy {
    fn from_id(id: i32) -> Self;
}

macro_rules! capture_id {
    ($($t:ty),*) => {$(
        impl CaptureId for $t {
            #[inline(always)]
            fn from_id(id: i32) -> Self {
                id as $t
            }
        }
    )*};
}
capture_id!(u8, u16, u32, u64);

/// Copies the ids [rows, k] into `capture`'s rows, `row_stride` elements apart (one layer of a
/// [tokens, layers, k] buffer). Errors where the rows would overlap or not fit.
pub fn capture_ids<C: CaptureId>(ids: &[i32], k: usize, capture: &mut [C], row_stride: usize) -> Result<(), String> {
    let rows = ids.len() / k.max(1);
    if k == 0 || rows == 0 {
        return Ok(());
    }
    if rows > 1 && row_stride < k || capture_len(rows, k, row_stride) != Some(capture.len()) {
        return Err(format!(
            "capture: {} elements do not hold {rows} rows of {k} ids {row_stride} apart",
            capture.len()
        ));
    }
    for (r, row) in ids.chunks_exact(k).enumerate() {
        let dst = &mut capture[r * row_stride..r * row_stride + k];
        for (d, &id) in dst.iter_mut().zip(row) {
            *d = C::from_id(id);
        }
    }
    Ok(())
}

/// Elements from a capture's first id to its last: (rows - 1) * row_stride + k; None on overflow.
pub fn capture_len(rows: usize, k: usize, row_stride: usize) -> Option<usize> {
    if rows == 0 {
        return Some(0);
    }
    (rows - 1).checked_mul(row_stride)?.checked_add(k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paged_attn::Bf16;
    use crate::testing::noise;

    /// The ranking by definition: a stable sort of the experts by key, descending.
    fn naive_ids(row: &[f32], k: usize) -> Vec<i32> {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| key(row[b]).partial_cmp(&key(row[a])).unwrap());
        order[..k].iter().map(|&e| e as i32).collect()
    }

    /// The weights by definition, in float64.
    fn naive_weights(row: &[f32], ids: &[i32], routing: &Routing) -> Vec<f64> {
        let x: Vec<f64> = row.iter().map(|&v| v as f64).collect();
        let scores: Vec<f64> = match routing.scoring {
            Scoring::Softmax => {
                let max = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = x.iter().map(|v| (v - max).exp()).sum();
                x.iter().map(|v| (v - max).exp() / sum).collect()
            }
            Scoring::Sigmoid => x.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
        };
        let mut w: Vec<f64> = ids.iter().map(|&e| scores[e as usize]).collect();
        if routing.renormalize {
            let sum: f64 = w.iter().sum();
            w.iter_mut().for_each(|v| *v /= sum);
        }
        w.iter().map(|v| v * routing.scaling as f64).collect()
    }

    fn run<L: Element>(logits: &[L], experts: usize, routing: &Routing) -> (Vec<f32>, Vec<i32>) {
        let rows = logits.len() / experts;
        let (mut w, mut ids) = (vec![0f32; rows * routing.top_k], vec![0i32; rows * routing.top_k]);
        route(logits, experts, routing, &mut w, &mut ids, 1).unwrap();
        (w, ids)
    }

    fn routing(top_k: usize, scoring: Scoring, renormalize: bool, scaling: f32) -> Routing {
        Routing { top_k, scoring, renormalize, scaling }
    }

    fn check(logits: &[f32], experts: usize, routing: &Routing) {
        let (w, ids) = run(logits, experts, routing);
        let k = routing.top_k;
        for (r, row) in logits.chunks(experts).enumerate() {
            assert_eq!(ids[r * k..(r + 1) * k], naive_ids(row, k)[..], "row {r} of {experts} experts, {routing:?}");
            for (got, want) in w[r * k..(r + 1) * k].iter().zip(naive_weights(row, &ids[r * k..(r + 1) * k], routing)) {
                assert!((*got as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "{got} vs {want}, {routing:?}");
            }
        }
    }

    #[test]
    fn ranking_and_weights_equal_the_definition() {
        for (seed, (rows, experts)) in [(5, 64), (3, 4), (7, 60), (2, 128), (1, 1), (4, 9)].into_iter().enumerate() {
            let logits: Vec<f32> = noise(rows * experts, seed as u64).iter().map(|v| v * 3.0).collect();
            for k in [1, 2, 8, experts].into_iter().filter(|&k| k <= experts) {
                for scoring in [Scoring::Softmax, Scoring::Sigmoid] {
                    for renormalize in [true, false] {
                        check(&logits, experts, &routing(k, scoring, renormalize, 1.0));
                    }
                }
                check(&logits, experts, &routing(k, Scoring::Sigmoid, true, 2.5));
            }
        }
    }

    #[test]
    fn ties_go_to_the_lower_expert_id() {
        // small integers: many equal logits per row, -0.0 equal to 0.0
        let logits: Vec<f32> = noise(40 * 16, 11).iter().map(|v| (v * 1.5).round()).collect();
        let logits: Vec<f32> = logits.iter().enumerate().map(|(i, &v)| if i % 7 == 0 { -0.0 } else { v }).collect();
        for k in [1, 3, 8, 16] {
            check(&logits, 16, &routing(k, Scoring::Softmax, true, 1.0));
        }
        let (_, ids) = run(&[1.0f32, 2.0, 2.0, 1.0, 2.0, -0.0, 0.0], 7, &routing(5, Scoring::Sigmoid, false, 1.0));
        assert_eq!(ids, [1, 2, 4, 0, 3]);
        let (_, ids) = run(&[0.0f32, -0.0, 0.0], 3, &routing(3, Scoring::Sigmoid, false, 1.0));
        assert_eq!(ids, [0, 1, 2]);
    }

    #[test]
    fn nan_ranks_first_and_non_finite_softmax_rows_are_nan() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let row = [0.5f32, nan, -inf, inf, nan, 2.0];
        let (w, ids) = run(&row, 6, &routing(4, Scoring::Softmax, true, 1.0));
        assert_eq!(ids, [1, 3, 4, 5]);
        assert!(w.iter().all(|v| v.is_nan()));
        let (w, ids) = run(&row, 6, &routing(6, Scoring::Sigmoid, false, 1.0));
        assert_eq!(ids, [1, 3, 4, 5, 0, 2]);
        assert!(w[0].is_nan() && w[1] == 1.0 && w[2].is_nan() && w[5] == 0.0);
        // +inf alone (no NaN) and a row of -inf: NaN softmax rows too
        let (w, ids) = run(&[-inf, inf, 0.0], 3, &routing(2, Scoring::Softmax, false, 1.0));
        assert_eq!(ids, [1, 2]);
        assert!(w.iter().all(|v| v.is_nan()));
        let (w, ids) = run(&[-inf; 4], 4, &routing(2, Scoring::Softmax, true, 1.0));
        assert_eq!(ids, [0, 1]);
        assert!(w.iter().all(|v| v.is_nan()));
        // -inf beside finite logits: a zero score, picked last
        check(&[-inf, 1.0, -inf, 0.5], 4, &routing(3, Scoring::Softmax, false, 1.0));
        check(&[-inf, 1.0, -inf, 0.5], 4, &routing(3, Scoring::Sigmoid, true, 1.0));
    }

    #[test]
    fn sigmoid_weights_without_renormalization_are_the_scores() {
        let logits = noise(3 * 8, 9);
        let (w, ids) = run(&logits, 8, &routing(3, Scoring::Sigmoid, false, 1.0));
        for (i, (&wi, &e)) in w.iter().zip(&ids).enumerate() {
            let x = logits[i / 3 * 8 + e as usize] as f64;
            assert!((wi as f64 - 1.0 / (1.0 + (-x).exp())).abs() < 1e-7);
        }
    }

    #[test]
    fn bfloat16_logits_route_as_their_float32_values() {
        let logits = noise(12 * 60, 21);
        let bf: Vec<Bf16> = logits.iter().map(|&v| Bf16::from_f32(v)).collect();
        let widened: Vec<f32> = bf.iter().map(|v| v.to_f32()).collect();
        let r = routing(8, Scoring::Softmax, false, 1.0);
        assert_eq!(run(&bf, 60, &r), run(&widened, 60, &r));
    }

    #[test]
    fn the_vector_top_k_equals_the_scalar_one() {
        if !avx2_available() {
            return;
        }
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        for (seed, experts) in [(1u64, 64usize), (2, 4), (3, 60), (4, 128), (5, 256), (6, 9)] {
            let mut logits = noise(50 * experts, seed);
            for (i, v) in logits.iter_mut().enumerate() {
                *v = match (i * 7 + seed as usize) % 13 {
                    0 => (*v * 1.5).round(), // ties
                    1 => [nan, inf, -inf, -0.0, 0.0][i % 5],
                    _ => *v,
                };
            }
            logits[..experts].fill(-inf); // a row of -inf: every key equal
            logits[experts..2 * experts].fill(-0.0);
            for k in 1..=experts.min(8) {
                let r = routing(k, Scoring::Softmax, true, 1.0);
                let rows = logits.len() / experts;
                let mut got = (vec![0f32; rows * k], vec![0i32; rows * k]);
                let mut want = got.clone();
                route_rows(&logits, experts, &r, &mut got.0, &mut got.1, true);
                route_rows(&logits, experts, &r, &mut want.0, &mut want.1, false);
                assert_eq!(got.1, want.1, "{experts} experts, top-{k}");
                for (a, b) in got.0.iter().zip(&want.0) {
                    assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
                }
            }
        }
    }

    /// A row's ids and weights do not depend on the threads: 300 rows (items of 64 and a last
    /// of 44) on 1, 2 and 3 threads.
    #[test]
    fn threads_give_the_same_routes() {
        let (rows, experts) = (300, 64);
        let logits: Vec<f32> = noise(rows * experts, 80).iter().map(|v| v * 3.0).collect();
        for r in [routing(8, Scoring::Softmax, true, 1.0), routing(4, Scoring::Sigmoid, false, 2.5)] {
            let runs = |threads: usize| {
                let (mut w, mut ids) = (vec![0f32; rows * r.top_k], vec![0i32; rows * r.top_k]);
                route(&logits, experts, &r, &mut w, &mut ids, threads).unwrap();
                (w.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), ids)
            };
            let one = runs(1);
            for threads in [2, 3] {
                assert!(runs(threads) == one, "{threads} threads");
            }
        }
    }

    #[test]
    fn sortable_keys_order_as_the_keys() {
        let values = [f32::NEG_INFINITY, -3.5, -1.0, -1e-30, -0.0, 0.0, 1e-30, 2.0, f32::MAX, f32::INFINITY];
        for w in values.windows(2) {
            assert!(sortable_key(w[0]) <= sortable_key(w[1]));
            assert_eq!(sortable_key(w[0]) == sortable_key(w[1]), w[0] == w[1]);
        }
        assert_eq!(sortable_key(f32::NAN), sortable_key(f32::INFINITY));
        assert!(sortable_key(f32::NEG_INFINITY) > i32::MIN);
    }

    #[test]
    fn bad_arguments_are_errors() {
        let (mut w, mut ids) = (vec![0f32; 4], vec![0i32; 4]);
        let r = routing(2, Scoring::Softmax, true, 1.0);
        assert!(route(&[0f32; 8], 4, &r, &mut w, &mut ids, 1).is_ok());
        assert!(route(&[0f32; 8], 0, &r, &mut w, &mut ids, 1).is_err());
        assert!(route(&[0f32; 9], 4, &r, &mut w, &mut ids, 1).is_err());
        assert!(route(&[0f32; 8], 4, &r, &mut w[..3], &mut ids, 1).is_err());
        assert!(route(&[0f32; 8], 4, &routing(0, Scoring::Softmax, true, 1.0), &mut w, &mut ids, 1).is_err());
        assert!(route(&[0f32; 8], 1, &r, &mut w, &mut ids, 1).is_err()); // top_k > experts
    }

    #[test]
    fn capture_rows_take_the_ids_at_their_stride() {
        let ids = [3, 1, 0, 2, 5, 4];
        let mut capture = vec![9u16; 2 * 5];
        capture_ids(&ids, 3, &mut capture[..8], 5).unwrap();
        assert_eq!(capture, [3, 1, 0, 9, 9, 2, 5, 4, 9, 9]);
        let mut one = vec![0u8; 3];
        capture_ids(&ids[..3], 3, &mut one, 0).unwrap(); // one row: any stride
        assert_eq!(one, [3, 1, 0]);
        assert!(capture_ids(&ids, 3, &mut [0u64; 6], 2).is_err()); // overlapping rows
        assert!(capture_ids(&ids, 3, &mut [0u32; 7], 3).is_err()); // wrong span
        assert_eq!(capture_len(4, 8, usize::MAX), None);
    }
}
