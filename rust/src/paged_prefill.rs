//! Prefill attention on the CPU for a whole step in one call: every prompt (or prompt chunk) of
//! the step attends causally over its context where it lies in the paged KV cache, read through
//! the context's slots, with the decode kernel's semantics (GQA, sliding window, sinks, values
//! that may view the keys' leading dims).
//!
//! One work item is a block of a span's consecutive queries. It walks the keys the block sees in
//! the decode kernel's tiles and online softmax, with every query of the block and every head of
//! a KV head's group as one row of scores: a key row is loaded once for all of them (the decode
//! kernel's inner loops, with up to QUERY_ROWS rows where a decode has one query's group). Keys a
//! query must not see (after it, or before its window) score -inf. Without a window the tiles
//! start at position 0, as a decode's do: a query's row does not depend on how its prompt was
//! chunked or blocked, only on its own context.

use crate::paged_attn::{
    exp, exp_shifted, lane_max, lane_sum, prefetch_slots, score_tile, weigh_values, Element, Isa, PagedDecode, Strided,
    PARALLEL_MIN_MACS, TILE,
};

/// One step's prefill spans over the paged cache.
#[derive(Clone, Copy, Debug)]
pub struct PagedPrefill<'a, T> {
    /// [tokens, heads, head_dim]: the step's queries; span i's are rows q_starts[i]..+q_lens[i].
    pub q: Strided<'a, T>,
    /// [slots, kv_heads, head_dim]: the cache, this step's keys written already.
    pub k: Strided<'a, T>,
    /// [slots, kv_heads, v_dim] (may view the keys' leading dims: MLA's latents).
    pub v: Strided<'a, T>,
    pub q_starts: &'a [i64],
    pub q_lens: &'a [i64],
    /// Each span's context length: its cached tokens and its own, its queries the last.
    pub context_lens: &'a [i64],
    /// The spans' context slots, span after span (span i's context_lens[i] of them).
    pub slots: &'a [i64],
    pub scale: f32,
    /// Keys visible to a query: its last `window` positions.
    pub window: Option<usize>,
    /// Per query head, a logit that joins the softmax's denominator.
    pub sinks: Option<&'a [f32]>,
}

/// Rows of scores (queries x a KV head's group) an item aims for: enough to share each key row's
/// load among many, few enough that the item's accumulators stay near the core.
const QUERY_ROWS: usize = 128;
/// Queries per item at most (the block's last query sees up to this many keys its first does not).
const MAX_BLOCK: usize = 64;

struct Item<'o, T> {
    span: usize,
    /// The item's first query within its span, and how many.
    first: usize,
    count: usize,
    /// Where the span's slots start in `slots`.
    slots_at: usize,
    /// The item's output rows, [count, heads, v_dim], contiguous.
    out: &'o mut [T],
}

/// Prefill attention into `out` ([tokens, heads, v_dim], contiguous): span i's queries go to its
/// rows; other rows are left as they were. Validates every index it will follow (spans in
/// range and disjoint, contexts at least as long as their queries, slots within the cache)
/// before writing anything; splits the work over up to `threads` threads when there is enough.
pub fn paged_prefill<T: Element>(
    p: &PagedPrefill<'_, T>,
    out: &mut [T],
    threads: usize,
    isa: Isa,
) -> Result<(), String> {
    let Validated { order, macs } = validate(p, out.len())?;
    let (heads, kv_heads) = (p.q.heads, p.k.heads);
    let (row_len, group) = (heads * p.v.dim, heads / kv_heads);

    // each item's output rows: disjoint borrows of `out`
    let block = (QUERY_ROWS / group).clamp(1, MAX_BLOCK);
    let mut items = Vec::new();
    let mut rest = out;
    let mut next_row = 0;
    for &(row, span, slots_at) in &order {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut((row - next_row) * row_len);
        rest = tail;
        next_row = row;
        let q_len = p.q_lens[span] as usize;
        for first in (0..q_len).step_by(block) {
            let count = block.min(q_len - first);
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(count * row_len);
            rest = tail;
            next_row += count;
            items.push(Item { span, first, count, slots_at, out: mine });
        }
    }

    let threads = threads.min(macs / PARALLEL_MIN_MACS).clamp(1, items.len().max(1));
    crate::workers::take_in_turn(threads, &mut items, &|items| run(p, items, isa));
    Ok(())
}

/// What `validate` found: the spans as (first row, span, where its slots start) in row order,
/// and the multiply-adds they take.
pub(crate) struct Validated {
    pub order: Vec<(usize, usize, usize)>,
    pub macs: usize,
}

/// Checks every index `paged_prefill` will follow (see there), for an output of `out_len` elements.
pub(crate) fn validate<T>(p: &PagedPrefill<'_, T>, out_len: usize) -> Result<Validated, String> {
    let (heads, kv_heads) = (p.q.heads, p.k.heads);

    let (head_dim, v_dim) = (p.q.dim, p.v.dim);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(format!("{heads} query heads do not divide into {kv_heads} KV heads"));
    }
    if p.k.dim != head_dim || p.v.heads != kv_heads || p.v.rows != p.k.rows {
        return Err(format!(
            "queries [_, {heads}, {head_dim}], keys [{}, {kv_heads}, {}] and values [{}, {}, {v_dim}] do not match",
            p.k.rows, p.k.dim, p.v.rows, p.v.heads
        ));
    }
    let spans = p.q_starts.len();
    if p.q_lens.len() != spans || p.context_lens.len() != spans {
        return Err(format!(
            "{spans} span starts, {} query lengths and {} context lengths do not match",
            p.q_lens.len(),
            p.context_lens.len()
        ));
    }
    if let Some(s) = p.sinks {
        if s.len() != heads {
            return Err(format!("{} sinks for {heads} heads", s.len()));
        }
    }
    if p.window == Some(0) {
        return Err("a window must be positive".into());
    }
    let row_len = heads * v_dim;
    if out_len != p.q.rows * row_len {
        return Err(format!("the output holds {out_len} elements, not [{}, {heads}, {v_dim}]", p.q.rows));
    }
    let mut order: Vec<(usize, usize, usize)> = Vec::with_capacity(spans); // (first row, span, slots_at)
    let (mut slots_at, mut macs) = (0usize, 0usize);
    for i in 0..spans {
        let (start, q_len, ctx) = (p.q_starts[i], p.q_lens[i], p.context_lens[i]);
        if q_len < 1 || ctx < q_len {
            return Err(format!("span {i}: {q_len} queries in a context of {ctx}: must be 1..=context length"));
        }
        if start < 0 || (start + q_len) as usize > p.q.rows {
            return Err(format!("span {i}: rows {start}..{} are outside the {} query rows", start + q_len, p.q.rows));
        }
        let ctx = ctx as usize;
        let Some(mine) = p.slots.get(slots_at..slots_at + ctx) else {
            return Err(format!("span {i}: its {ctx} context slots run past the {} given", p.slots.len()));
        };
        if let Some(bad) = mine.iter().find(|&&s| s < 0 || s as usize >= p.k.rows) {
            return Err(format!("span {i}: slot {bad} is outside the cache's {} slots", p.k.rows));
        }
        let q_len = q_len as usize;
        let seen = match p.window {
            Some(w) => q_len * w.min(ctx),
            None => q_len * (2 * ctx - q_len + 1) / 2,
        };
        macs += seen * heads * (head_dim + v_dim);
        order.push((start as usize, i, slots_at));
        slots_at += ctx;
    }
    if slots_at != p.slots.len() {
        return Err(format!("{} slots for contexts of {slots_at} tokens in all", p.slots.len()));
    }
    order.sort_unstable();
    for w in order.windows(2) {
        if w[0].0 + p.q_lens[w[0].1] as usize > w[1].0 {
            return Err(format!("spans {} and {} share query rows", w[0].1, w[1].1));
        }
    }

    Ok(Validated { order, macs })
}

fn run<'i, 'o: 'i, T: Element + 'o>(
    p: &PagedPrefill<'_, T>,
    items: impl Iterator<Item = &'i mut Item<'o, T>>,
    isa: Isa,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // the prefill fallback has no AVX-512 products of its own: AVX2's where Avx512 (or Avx512Bf16) is asked
        Isa::Avx2Fma | Isa::Avx512 | Isa::Avx512Bf16
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") =>
        {
            // SAFETY: the CPU has AVX2 and FMA (checked just above), all `run_avx2` requires.
            unsafe { run_avx2(p, items) }
        }
        _ => run_items::<T, false>(p, items),
    }
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<'i, 'o: 'i, T: Element + 'o>(
    p: &PagedPrefill<'_, T>,
    items: impl Iterator<Item = &'i mut Item<'o, T>>,
) {
    run_items::<T, true>(p, items)
}

/// Per-thread buffers, reused across items; rows are (query of the block, head of the group),
/// a KV head's rows adjacent.
struct Scratch {
    q: Vec<f32>,      // [kv_heads, rows, head_dim]
    acc: Vec<f32>,    // [kv_heads, rows, v_dim]
    scores: Vec<f32>, // [rows, TILE]
    keys: Vec<f32>,   // [head_dim, TILE]: a tile's keys of one KV head, transposed
    max: Vec<f32>,    // [kv_heads, rows]
    total: Vec<f32>,
}

#[inline(always)]
fn run_items<'i, 'o: 'i, T: Element + 'o, const AVX2: bool>(
    p: &PagedPrefill<'_, T>,
    items: impl Iterator<Item = &'i mut Item<'o, T>>,
) {
    // the decode kernel's loops read the cache and the scale through a PagedDecode with no decodes
    let d = PagedDecode {
        q: p.q,
        k: p.k,
        v: p.v,
        tables: &[],
        max_blocks: 0,
        lens: &[],
        rows: &[],
        page: 1,
        scale: p.scale,
        window: p.window,
        sinks: p.sinks,
    };
    let group = p.q.heads / p.k.heads;
    let rows = MAX_BLOCK.min((QUERY_ROWS / group).max(1)) * group;
    let mut s = Scratch {
        q: vec![0.0; p.k.heads * rows * p.q.dim],
        acc: vec![0.0; p.k.heads * rows * p.v.dim],
        scores: vec![0.0; rows * TILE],
        keys: vec![0.0; p.q.dim * TILE],
        max: vec![0.0; p.k.heads * rows],
        total: vec![0.0; p.k.heads * rows],
    };
    for item in items {
        attend_block::<T, AVX2>(p, &d, item, &mut s);
    }
}

/// The keys [first, end) a query at `pos` sees.
#[inline(always)]
fn visible(pos: usize, window: Option<usize>) -> (usize, usize) {
    (window.map_or(0, |w| (pos + 1).saturating_sub(w)), pos + 1)
}

/// One block of a span's queries, tile by tile over the keys the block sees.
#[inline(always)]
fn attend_block<T: Element, const AVX2: bool>(
    p: &PagedPrefill<'_, T>,
    d: &PagedDecode<'_, T>,
    item: &mut Item<'_, T>,
    s: &mut Scratch,
) {
    let (heads, kv_heads, head_dim, v_dim) = (p.q.heads, p.k.heads, p.q.dim, p.v.dim);
    let group = heads / kv_heads;
    let rows = item.count * group;
    let (q_len, ctx) = (p.q_lens[item.span] as usize, p.context_lens[item.span] as usize);
    let first_row = p.q_starts[item.span] as usize + item.first;
    let first_pos = ctx - q_len + item.first; // the block's first query's position
    let last_pos = first_pos + item.count - 1;
    let slots = &p.slots[item.slots_at..][..ctx];
    // the block's queries in f32, each KV head's rows (query, head of its group) adjacent
    for j in 0..item.count {
        for h in 0..heads {
            let (kv_head, g) = (h / group, h % group);
            let at = ((kv_head * rows) + j * group + g) * head_dim;
            for (dst, &x) in s.q[at..][..head_dim].iter_mut().zip(p.q.at(first_row + j, h)) {
                *dst = x.to_f32();
            }
        }
    }
    s.acc[..kv_heads * rows * v_dim].fill(0.0);
    s.max[..kv_heads * rows].fill(f32::NEG_INFINITY);
    s.total[..kv_heads * rows].fill(0.0);
    let (lo, _) = visible(first_pos, p.window);
    let end = last_pos + 1;
    let (mut tile, mut next_tile) = ([0usize; TILE], [0usize; TILE]);
    let fill = |dst: &mut [usize; TILE], from: usize, n: usize| {
        for (d, &slot) in dst.iter_mut().zip(&slots[from..from + n]) {
            *d = slot as usize; // validated by paged_prefill: within the cache
        }
    };
    let mut at = lo;
    fill(&mut tile, at, TILE.min(end - at));
    while at < end {
        let n = TILE.min(end - at);
        let next_n = TILE.min(end - at - n);
        fill(&mut next_tile, at + n, next_n);
        prefetch_slots(d, &next_tile[..next_n], 0..d.k.heads);
        for kv_head in 0..kv_heads {
            let scores = &mut s.scores[..rows * TILE];
            let q = &s.q[kv_head * rows * head_dim..][..rows * head_dim];
            score_block::<T, AVX2>(d, kv_head, &tile[..n], q, &mut s.keys, scores);
            let state = kv_head * rows;
            for r in 0..rows {
                let row_scores = &mut scores[r * TILE..][..n];
                // the part of the tile this query sees: its softmax runs over that part alone, as
                // a decode's over its last tile; the rest weighs nothing
                let (from, to) = visible(first_pos + r / group, p.window);
                let (a, b) = (from.saturating_sub(at).min(n), to.saturating_sub(at).min(n));
                row_scores[..a].fill(0.0);
                row_scores[b.max(a)..].fill(0.0);
                if a >= b {
                    continue;
                }
                let seen = &mut row_scores[a..b];
                let m_new = lane_max(seen).max(s.max[state + r]);
                let decay = exp(s.max[state + r] - m_new);
                exp_shifted(seen, m_new);
                s.total[state + r] = s.total[state + r] * decay + lane_sum(seen);
                if decay != 1.0 {
                    s.acc[(state + r) * v_dim..][..v_dim].iter_mut().for_each(|a| *a *= decay);
                }
                s.max[state + r] = m_new;
            }
            weigh_values::<T, AVX2, false>(d, kv_head, &tile[..n], scores, &mut s.acc[state * v_dim..][..rows * v_dim]);
        }
        std::mem::swap(&mut tile, &mut next_tile);
        at += n;
    }
    for j in 0..item.count {
        for h in 0..heads {
            let r = (h / group) * rows + j * group + h % group;
            let mut norm = 1.0 / s.total[r];
            if let Some(sinks) = p.sinks {
                let m_new = s.max[r].max(sinks[h]);
                let decay = exp(s.max[r] - m_new);
                norm = decay / (s.total[r] * decay + exp(sinks[h] - m_new));
            }
            let o = &mut item.out[(j * heads + h) * v_dim..][..v_dim];
            for (o, &a) in o.iter_mut().zip(&s.acc[r * v_dim..][..v_dim]) {
                *o = T::from_f32(a * norm);
            }
        }
    }
}

/// The tile's scores for every row of the block (`q`: [rows, head_dim], f32):
/// `scores[r * TILE + j] = q_r . k_j * scale`. With AVX2 the tile's keys are transposed once
/// (`keys`: [head_dim, TILE]) so that each row's scores of 16 keys are two vectors of running
/// sums, with no sum reduced across lanes; else the decode kernel's scoring.
#[inline(always)]
fn score_block<T: Element, const AVX2: bool>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    q: &[f32],
    keys: &mut [f32],
    scores: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        let dim = d.q.dim;
        let n = slots.len();
        for (j, &slot) in slots.iter().enumerate() {
            for (c, &x) in d.k.at(slot, kv_head).iter().enumerate() {
                keys[c * TILE + j] = x.to_f32();
            }
        }
        for c in 0..dim {
            keys[c * TILE + n..(c + 1) * TILE].fill(0.0);
        }
        let rows = q.len() / dim;
        assert!(keys.len() >= dim * TILE && scores.len() >= rows * TILE);
        let mut r0 = 0;
        while r0 < rows {
            let r = ROW_BLOCK.min(rows - r0);
            for half in 0..n.div_ceil(16) {
                // SAFETY: AVX2 is only set by run_avx2, whose caller checked the CPU has AVX2 and
                // FMA; rows r0..r0 + r of q, the keys' 16 columns from half * 16 in every dim and
                // the scores' are inside the slices (the assert above).
                unsafe {
                    match r {
                        1 => score_rows_avx2::<1>(keys, q, dim, d.scale, scores, r0, half * 16),
                        2 => score_rows_avx2::<2>(keys, q, dim, d.scale, scores, r0, half * 16),
                        3 => score_rows_avx2::<3>(keys, q, dim, d.scale, scores, r0, half * 16),
                        _ => score_rows_avx2::<ROW_BLOCK>(keys, q, dim, d.scale, scores, r0, half * 16),
                    }
                }
            }
            r0 += r;
        }
        return;
    }
    let _ = keys;
    score_tile::<T, AVX2, false>(d, kv_head, slots, q, scores);
}

/// Rows scored together: ROW_BLOCK x 2 vectors of running sums, in registers with the key loads.
#[cfg(target_arch = "x86_64")]
const ROW_BLOCK: usize = 4;

/// Scores of rows r0..r0 + R against the transposed keys' columns j0..j0 + 16.
///
/// # Safety
/// The CPU must support AVX2 and FMA; q holds rows r0..r0 + R of `dim`, keys [dim, TILE] and
/// scores the rows' TILE entries, j0 + 16 <= TILE.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn score_rows_avx2<const R: usize>(
    keys: &[f32],
    q: &[f32],
    dim: usize,
    scale: f32,
    scores: &mut [f32],
    r0: usize,
    j0: usize,
) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let mut sums = [[_mm256_setzero_ps(); 2]; R];
        let rows = q.as_ptr().add(r0 * dim);
        for c in 0..dim {
            let column = keys.as_ptr().add(c * TILE + j0);
            let (k0, k1) = (_mm256_loadu_ps(column), _mm256_loadu_ps(column.add(8)));
            for (r, sum) in sums.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*rows.add(r * dim + c));
                sum[0] = _mm256_fmadd_ps(x, k0, sum[0]);
                sum[1] = _mm256_fmadd_ps(x, k1, sum[1]);
            }
        }
        let scale = _mm256_set1_ps(scale);
        for (r, sum) in sums.iter().enumerate() {
            let out = scores.as_mut_ptr().add((r0 + r) * TILE + j0);
            _mm256_storeu_ps(out, _mm256_mul_ps(sum[0], scale));
            _mm256_storeu_ps(out.add(8), _mm256_mul_ps(sum[1], scale));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flash_prefill::{Flash, Prefill, Tiles};
    use crate::paged_attn::Bf16;
    use crate::testing::noise;

    struct Case {
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        v_dim: usize,
        /// (queries, context length) per span
        spans: Vec<(usize, usize)>,
        window: Option<usize>,
        sinks: bool,
    }

    struct Inputs {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        q_starts: Vec<i64>,
        q_lens: Vec<i64>,
        ctx: Vec<i64>,
        slots: Vec<i64>,
        sinks: Vec<f32>,
        tokens: usize,
        cache: usize,
    }

    /// Spans one after the other with a decode-like row between each two; contexts at scattered slots.
    fn inputs(c: &Case, seed: u64) -> Inputs {
        let cache = c.spans.iter().map(|s| s.1).sum::<usize>() + 5;
        let cache = if cache % 7 == 0 { cache + 1 } else { cache }; // 7 and cache coprime
        let (mut q_starts, mut q_lens, mut ctx, mut slots) = (vec![], vec![], vec![], vec![]);
        let (mut row, mut next) = (0usize, 0usize);
        for &(q, n) in &c.spans {
            q_starts.push(row as i64);
            q_lens.push(q as i64);
            ctx.push(n as i64);
            for _ in 0..n {
                slots.push(((next * 7 + 3) % cache) as i64); // distinct slots, scattered
                next += 1;
            }
            row += q + 1;
        }
        Inputs {
            q: noise(row * c.heads * c.head_dim, seed),
            k: noise(cache * c.kv_heads * c.head_dim, seed + 1),
            v: noise(cache * c.kv_heads * c.v_dim, seed + 2),
            q_starts,
            q_lens,
            ctx,
            slots,
            sinks: noise(c.heads, seed + 3),
            tokens: row,
            cache,
        }
    }

    fn prefill<'a, T>(c: &Case, x: &'a Inputs, q: &'a [T], k: &'a [T], v: &'a [T], scale: f32) -> PagedPrefill<'a, T> {
        PagedPrefill {
            q: Strided::new(q, x.tokens, c.heads, c.head_dim, c.heads * c.head_dim, c.head_dim).unwrap(),
            k: Strided::new(k, x.cache, c.kv_heads, c.head_dim, c.kv_heads * c.head_dim, c.head_dim).unwrap(),
            v: Strided::new(v, x.cache, c.kv_heads, c.v_dim, c.kv_heads * c.v_dim, c.v_dim).unwrap(),
            q_starts: &x.q_starts,
            q_lens: &x.q_lens,
            context_lens: &x.ctx,
            slots: &x.slots,
            scale,
            window: c.window,
            sinks: c.sinks.then_some(&x.sinks[..]),
        }
    }

    /// Plain two-pass softmax attention in f64, query by query.
    fn reference(c: &Case, x: &Inputs, q: &[f32], k: &[f32], v: &[f32], scale: f32) -> Vec<f64> {
        let group = c.heads / c.kv_heads;
        let mut out = vec![-7.0f64; x.tokens * c.heads * c.v_dim];
        let mut slots_at = 0;
        for (i, &(q_len, ctx)) in c.spans.iter().enumerate() {
            let slots = &x.slots[slots_at..slots_at + ctx];
            slots_at += ctx;
            for j in 0..q_len {
                let (row, pos) = (x.q_starts[i] as usize + j, ctx - q_len + j);
                let (from, to) = visible(pos, c.window);
                for h in 0..c.heads {
                    let kvh = h / group;
                    let qh = &q[(row * c.heads + h) * c.head_dim..][..c.head_dim];
                    let logits: Vec<f64> = slots[from..to]
                        .iter()
                        .map(|&s| {
                            let kh = &k[(s as usize * c.kv_heads + kvh) * c.head_dim..][..c.head_dim];
                            qh.iter().zip(kh).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64
                        })
                        .collect();
                    let sink = c.sinks.then(|| x.sinks[h] as f64);
                    let m = logits.iter().cloned().chain(sink).fold(f64::NEG_INFINITY, f64::max);
                    let total: f64 = logits.iter().chain(sink.as_ref()).map(|l| (l - m).exp()).sum();
                    let o = &mut out[(row * c.heads + h) * c.v_dim..][..c.v_dim];
                    o.fill(0.0);
                    for (l, &s) in logits.iter().zip(&slots[from..to]) {
                        let vh = &v[(s as usize * c.kv_heads + kvh) * c.v_dim..][..c.v_dim];
                        for (a, b) in o.iter_mut().zip(vh) {
                            *a += (l - m).exp() / total * *b as f64;
                        }
                    }
                }
            }
        }
        out
    }

    fn check(c: &Case, isa: Isa, threads: usize) {
        let x = inputs(c, c.spans.len() as u64 * 31 + c.head_dim as u64);
        let scale = (c.head_dim as f32).powf(-0.5) * 1.3;
        let mut out = vec![-7.0f32; x.tokens * c.heads * c.v_dim];
        paged_prefill(&prefill(c, &x, &x.q, &x.k, &x.v, scale), &mut out, threads, isa).unwrap();
        let want = reference(c, &x, &x.q, &x.k, &x.v, scale);
        for (i, (&got, &w)) in out.iter().zip(&want).enumerate() {
            assert!(
                (got as f64 - w).abs() <= 2e-5 + 2e-5 * w.abs(),
                "{isa:?} threads={threads} element {i}: {got} != {w}"
            );
        }
    }

    fn cases() -> Vec<Case> {
        let mut all = Vec::new();
        for (heads, kv_heads) in [(4, 4), (8, 2), (16, 1), (6, 2), (64, 4)] {
            for (head_dim, v_dim) in [(64, 64), (24, 40), (13, 13)] {
                for (window, sinks) in [(None, false), (Some(5), false), (None, true), (Some(40), true)] {
                    // whole prompts, chunks after cached tokens, one-token prompts, a block's edge
                    let spans = vec![(1, 1), (37, 37), (5, 70), (16, 16), (17, 50), (70, 134)];
                    all.push(Case { heads, kv_heads, head_dim, v_dim, spans, window, sinks });
                }
            }
        }
        all
    }

    #[test]
    fn the_portable_path_equals_the_reference() {
        for c in cases() {
            check(&c, Isa::Scalar, 1);
        }
    }

    #[test]
    fn the_avx2_path_equals_the_reference() {
        if !Isa::Avx2Fma.runs() {
            eprintln!("skipped: this CPU has no AVX2 + FMA");
            return;
        }
        for c in cases() {
            check(&c, Isa::Avx2Fma, 1);
        }
    }

    #[test]
    fn threads_split_the_work_and_give_the_same_result() {
        let c = Case {
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            v_dim: 64,
            spans: vec![(300, 300), (40, 500)],
            window: None,
            sinks: false,
        };
        for threads in [2, 3, 7] {
            check(&c, Isa::detect(), threads);
        }
        let c = Case {
            heads: 32,
            kv_heads: 1,
            head_dim: 96,
            v_dim: 80,
            spans: vec![(1, 1), (700, 700), (3, 9)],
            window: Some(600),
            sinks: true,
        };
        check(&c, Isa::detect(), 2);
    }

    /// Without a window a query's row is the same bits however its prompt is chunked, blocked or
    /// batched: the tiles start at position 0 whatever the block, and keys past a query weigh
    /// exactly nothing.
    #[test]
    fn a_row_does_not_depend_on_chunks_or_batches() {
        for (heads, kv_heads, dim, isa) in
            [(4, 2, 64, Isa::detect()), (8, 1, 24, Isa::detect()), (3, 3, 13, Isa::Scalar)]
        {
            let whole =
                Case { heads, kv_heads, head_dim: dim, v_dim: dim, spans: vec![(90, 90)], window: None, sinks: true };
            let x = inputs(&whole, 11);
            let run = |starts: &[i64], lens: &[i64], ctx: &[i64], slots: &[i64]| {
                let p = PagedPrefill {
                    q_starts: starts,
                    q_lens: lens,
                    context_lens: ctx,
                    slots,
                    ..prefill(&whole, &x, &x.q, &x.k, &x.v, 0.3)
                };
                let mut out = vec![0.0f32; x.tokens * heads * dim];
                paged_prefill(&p, &mut out, 1, isa).unwrap();
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let row = heads * dim;
            let at_once = run(&[0], &[90], &[90], &x.slots);
            // the first 37 tokens, then the other 53 after them as cached tokens
            let first = run(&[0], &[37], &[37], &x.slots[..37]);
            let then = run(&[37], &[53], &[90], &x.slots);
            assert_eq!(first[..37 * row], at_once[..37 * row], "heads {heads}/{kv_heads} dim {dim}: first chunk");
            assert_eq!(
                then[37 * row..90 * row],
                at_once[37 * row..90 * row],
                "heads {heads}/{kv_heads} dim {dim}: second chunk"
            );
            // the last 20 queries beside another span of 10 queries
            let mut slots = x.slots[..10].to_vec();
            slots.extend(&x.slots);
            let batched = run(&[0, 70], &[10, 20], &[10, 90], &slots);
            assert_eq!(
                batched[70 * row..90 * row],
                at_once[70 * row..90 * row],
                "heads {heads}/{kv_heads} dim {dim}: batched"
            );
        }
    }

    #[test]
    fn bfloat16_accumulates_in_f32() {
        let c = Case {
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            v_dim: 32,
            spans: vec![(40, 40), (5, 33)],
            window: None,
            sinks: false,
        };
        let x = inputs(&c, 9);
        let bf = |v: &[f32]| v.iter().map(|&f| Bf16::from_f32(f)).collect::<Vec<_>>();
        let (qb, kb, vb) = (bf(&x.q), bf(&x.k), bf(&x.v));
        let round = |v: &[Bf16]| v.iter().map(|b| b.to_f32()).collect::<Vec<_>>();
        let mut out = vec![Bf16(0); x.tokens * 128];
        paged_prefill(&prefill(&c, &x, &qb, &kb, &vb, 0.2), &mut out, 1, Isa::detect()).unwrap();
        let want = reference(&c, &x, &round(&qb), &round(&kb), &round(&vb), 0.2);
        for (got, w) in out.iter().zip(&want).filter(|(_, w)| **w != -7.0) {
            // one bfloat16 rounding of an f32-accurate result
            assert!((got.to_f32() as f64 - w).abs() <= 4e-3 * w.abs() + 1e-6, "{} != {w}", got.to_f32());
        }
    }

    /// A flash kernel (crate::flash_prefill) in `tiles` on generated steps: the f64 reference
    /// over the element type's values within `tolerance(|want|)`; the same bits in every other
    /// register tiles this CPU runs the kernel in (AMX tiles sum in an order of their own), on
    /// any thread count and however a prompt is chunked or batched; windows and sinks left to
    /// `paged_prefill`.
    fn check_flash_kernel<T: Prefill + Flash + PartialEq + std::fmt::Debug>(
        tiles: Tiles,
        tolerance: impl Fn(f64) -> f64,
    ) {
        let amx = |t: Tiles| t == Tiles::Amx;
        let others: Vec<Tiles> =
            Tiles::ALL.into_iter().filter(|&t| t != tiles && T::runs(t) && amx(t) == amx(tiles)).collect();
        let to = |v: &[f32]| v.iter().map(|&f| T::from_f32(f)).collect::<Vec<_>>();
        let widen = |v: &[T]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
        for (heads, kv_heads) in [(4, 4), (8, 2), (16, 1), (6, 2)] {
            for (head_dim, v_dim) in [(64, 64), (128, 128), (24, 40), (96, 80), (2, 13)] {
                // whole prompts, chunks after cached tokens, one-token prompts, blocks' edges
                let spans = vec![(1, 1), (37, 37), (5, 70), (64, 64), (17, 130), (70, 200)];
                let c = Case { heads, kv_heads, head_dim, v_dim, spans, window: None, sinks: false };
                let x = inputs(&c, heads as u64 * 7 + head_dim as u64);
                let (q, k, v) = (to(&x.q), to(&x.k), to(&x.v));
                let scale = (head_dim as f32).powf(-0.5) * 1.3;
                let run_in = |tiles: Tiles, threads: usize| {
                    let mut out = vec![T::from_f32(-7.0); x.tokens * heads * v_dim];
                    assert!(T::run_flash(&prefill(&c, &x, &q, &k, &v, scale), &mut out, threads, Some(tiles)).unwrap());
                    out
                };
                let run = |threads: usize| run_in(tiles, threads);
                let out = run(1);
                for &other in &others {
                    assert!(
                        run_in(other, 1) == out,
                        "{heads}/{kv_heads} {head_dim}/{v_dim}: {other:?} against {tiles:?}"
                    );
                }
                let want = reference(&c, &x, &widen(&q), &widen(&k), &widen(&v), scale);
                for (i, (got, &w)) in out.iter().zip(&want).enumerate() {
                    let err = (got.to_f32() as f64 - w).abs();
                    assert!(
                        err <= tolerance(w.abs()),
                        "{heads}/{kv_heads} {head_dim}/{v_dim} element {i}: {} != {w}",
                        got.to_f32()
                    );
                }
                assert!(run(3) == out, "{heads}/{kv_heads} {head_dim}/{v_dim}: three threads");
            }
        }
        // a row's bits: the last 20 queries of a 90-token prompt alone, after cached tokens, batched
        let whole =
            Case { heads: 8, kv_heads: 2, head_dim: 64, v_dim: 64, spans: vec![(90, 90)], window: None, sinks: false };
        let x = inputs(&whole, 5);
        let (q, k, v) = (to(&x.q), to(&x.k), to(&x.v));
        let run = |starts: &[i64], lens: &[i64], ctx: &[i64], slots: &[i64]| {
            let p = PagedPrefill {
                q_starts: starts,
                q_lens: lens,
                context_lens: ctx,
                slots,
                ..prefill(&whole, &x, &q, &k, &v, 0.3)
            };
            let mut out = vec![T::from_f32(0.0); x.tokens * 8 * 64];
            assert!(T::run_flash(&p, &mut out, 1, Some(tiles)).unwrap());
            out
        };
        let row = 8 * 64;
        let at_once = run(&[0], &[90], &[90], &x.slots);
        let then = run(&[37], &[53], &[90], &x.slots);
        assert!(then[37 * row..90 * row] == at_once[37 * row..90 * row], "a chunk after cached tokens");
        let mut slots = x.slots[..10].to_vec();
        slots.extend(&x.slots);
        let batched = run(&[0, 70], &[10, 20], &[10, 90], &slots);
        assert!(batched[70 * row..90 * row] == at_once[70 * row..90 * row], "batched");
        // a window or sinks: the portable kernel's (not applied)
        for (window, sinks, v_dim) in [(Some(5), false, 64), (None, true, 40)] {
            let c = Case { heads: 4, kv_heads: 2, head_dim: 64, v_dim, spans: vec![(3, 9)], window, sinks };
            let x = inputs(&c, 3);
            let (q, k, v) = (to(&x.q), to(&x.k), to(&x.v));
            let mut out = vec![T::from_f32(0.0); x.tokens * 4 * v_dim];
            assert!(!T::run_flash(&prefill(&c, &x, &q, &k, &v, 0.3), &mut out, 1, Some(tiles)).unwrap());
            assert!(out.iter().all(|v| v.to_f32() == 0.0), "nothing written");
        }
    }

    /// The AVX-512 BF16 kernel (crate::paged_prefill_bf16): the weights' rounding moves a result
    /// by at most 2^-8 of the values' size (< 2), the result's by 2^-8 of itself.
    #[test]
    fn the_bfloat16_dot_product_kernel_equals_the_reference_and_keeps_a_rows_bits() {
        if crate::testing::skips_without_bf16() {
            return;
        }
        check_flash_kernel::<Bf16>(Tiles::Avx512, |w| 2.0 / 256.0 + w / 256.0);
        check_steep_scores::<Bf16>(Tiles::Avx512, |w| 2.0 / 256.0 + w / 256.0);
        // it has no AVX2 tiles: naming them is an error, nothing written
        let c =
            Case { heads: 4, kv_heads: 2, head_dim: 64, v_dim: 64, spans: vec![(3, 9)], window: None, sinks: false };
        let x = inputs(&c, 3);
        let to = |v: &[f32]| v.iter().map(|&f| Bf16::from_f32(f)).collect::<Vec<_>>();
        let (q, k, v) = (to(&x.q), to(&x.k), to(&x.v));
        let mut out = vec![Bf16::from_f32(-7.0); x.tokens * 4 * 64];
        let err = Bf16::run_flash(&prefill(&c, &x, &q, &k, &v, 0.3), &mut out, 1, Some(Tiles::Avx2)).unwrap_err();
        assert!(err.contains("avx2"), "{err}");
        assert!(out.iter().all(|v| v.to_f32() == -7.0), "nothing written");
    }

    /// The bfloat16 kernel in AMX tiles (crate::flash_amx): as the dot products', whose sums it
    /// takes in another order (within the same tolerance of the reference, not their bits).
    #[test]
    fn the_bfloat16_amx_kernel_equals_the_reference_and_keeps_a_rows_bits() {
        if !Bf16::runs(Tiles::Amx) {
            eprintln!("skipped: this CPU (or Linux) does not run AMX-BF16 tiles");
            return;
        }
        check_flash_kernel::<Bf16>(Tiles::Amx, |w| 2.0 / 256.0 + w / 256.0);
        check_steep_scores::<Bf16>(Tiles::Amx, |w| 2.0 / 256.0 + w / 256.0);
    }

    /// Scores that climb along the context (each key past the running maximum of the keys
    /// before it, by far more than 2^8 between softmax steps) and then fall, in `tiles`: the
    /// f64 reference within `tolerance(|want|)` (the rows' maxima move at every step: the AMX
    /// kernel's lazily kept maximum has to be taken again).
    fn check_steep_scores<T: Prefill + Flash + std::fmt::Debug>(tiles: Tiles, tolerance: impl Fn(f64) -> f64) {
        let c =
            Case { heads: 4, kv_heads: 2, head_dim: 64, v_dim: 64, spans: vec![(40, 700)], window: None, sinks: false };
        let mut x = inputs(&c, 29);
        x.q.iter_mut().for_each(|q| *q = 0.5);
        // key at position j: every dim rises to 16 at position 500 (scores to 512), then falls
        for (j, &slot) in x.slots.iter().enumerate() {
            let height = if j < 500 { j as f32 / 31.25 } else { (700 - j) as f32 / 12.5 };
            x.k[slot as usize * 2 * 64..][..2 * 64].iter_mut().for_each(|k| *k = height);
        }
        let to = |v: &[f32]| v.iter().map(|&f| T::from_f32(f)).collect::<Vec<_>>();
        let widen = |v: &[T]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
        let (q, k, v) = (to(&x.q), to(&x.k), to(&x.v));
        let mut out = vec![T::from_f32(-7.0); x.tokens * 4 * 64];
        assert!(T::run_flash(&prefill(&c, &x, &q, &k, &v, 1.0), &mut out, 1, Some(tiles)).unwrap());
        let want = reference(&c, &x, &widen(&q), &widen(&k), &widen(&v), 1.0);
        for (i, (got, &w)) in out.iter().zip(&want).enumerate().take(40 * 4 * 64) {
            let err = (got.to_f32() as f64 - w).abs();
            assert!(err <= tolerance(w.abs()), "{tiles:?} element {i}: {} != {w}", got.to_f32());
        }
    }

    /// The float32 kernel (crate::paged_prefill_f32) in each of its tiles this CPU runs
    /// (AVX-512F, AVX2 with FMA): within `check`'s tolerance, the two the same bits.
    #[test]
    fn the_float32_flash_kernel_equals_the_reference_and_keeps_a_rows_bits() {
        let tiles: Vec<Tiles> = Tiles::ALL.into_iter().filter(|&t| f32::runs(t)).collect();
        if tiles.is_empty() {
            eprintln!("skipped: this CPU has neither AVX-512F nor AVX2 with FMA (the float32 flash kernel's tiles)");
            return;
        }
        if tiles.len() < 2 {
            eprintln!("this CPU lacks AVX-512F: the float32 flash kernel checked in AVX2 tiles only");
        }
        // at any context length in AVX-512 only (AVX2's take the portable kernel's contexts)
        assert_eq!(f32::flash_applies(64, false, false), tiles.contains(&Tiles::Avx512));
        for t in tiles {
            check_flash_kernel::<f32>(t, |w| 2e-5 + 2e-5 * w);
        }
    }

    #[test]
    fn bad_spans_are_errors_and_nothing_is_written() {
        let (q, kv) = (vec![1.0f32; 6 * 8], vec![1.0f32; 8 * 4]);
        let mut out = vec![-7.0f32; 6 * 8];
        let call = |starts: &[i64], lens: &[i64], ctx: &[i64], slots: &[i64], out: &mut [f32]| {
            let p = PagedPrefill {
                q: Strided::new(&q, 6, 2, 4, 8, 4).unwrap(),
                k: Strided::new(&kv, 8, 1, 4, 4, 4).unwrap(),
                v: Strided::new(&kv, 8, 1, 4, 4, 4).unwrap(),
                q_starts: starts,
                q_lens: lens,
                context_lens: ctx,
                slots,
                scale: 1.0,
                window: None,
                sinks: None,
            };
            paged_prefill(&p, out, 1, Isa::Scalar)
        };
        for (starts, lens, ctx, slots, wanted) in [
            (&[0i64, 2][..], &[3i64, 2][..], &[3i64, 2][..], &[0i64, 1, 2, 3, 4][..], "share query rows"),
            (&[0, 5], &[3, 2], &[3, 2], &[0, 1, 2, 3, 4], "outside the 6 query rows"),
            (&[0, 3], &[3, 2], &[2, 2], &[0, 1, 3, 4], "must be 1..=context length"),
            (&[0, 3], &[3, 0], &[3, 2], &[0, 1, 2, 3, 4], "must be 1..=context length"),
            (&[0, 3], &[3, 2], &[3, 2], &[0, 1, 2, 8, 4], "slot 8"),
            (&[0, 3], &[3, 2], &[3, 2], &[0, 1, 2, -1, 4], "slot -1"),
            (&[0, 3], &[3, 2], &[3, 2], &[0, 1, 2, 3], "run past"),
            (&[0, 3], &[3, 2], &[3, 2], &[0, 1, 2, 3, 4, 5], "6 slots for contexts of 5"),
            (&[0], &[3, 2], &[3, 2], &[0, 1, 2, 3, 4], "do not match"),
        ] {
            let err = call(starts, lens, ctx, slots, &mut out).unwrap_err();
            assert!(err.contains(wanted), "{err}");
        }
        assert!(out.iter().all(|&x| x == -7.0));
        call(&[0, 3], &[3, 2], &[3, 2], &[0, 1, 2, 3, 4], &mut out).unwrap();
        assert!(out[..5 * 8].iter().all(|&x| x == 1.0) && out[5 * 8..].iter().all(|&x| x == -7.0));
    }
}
