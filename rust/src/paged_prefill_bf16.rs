//! `paged_prefill` for bfloat16 caches in AVX-512 BF16 dot products (VDPBF16PS, as
//! `matmul_bf16`): a flash attention whose two products, the scores q.k and the weighted values
//! p.v, run on bfloat16 pairs with float32 sums, twice the float32 FMA's rate. Each span's keys
//! and values are first packed from the paged cache into blocks of KEYS keys (keys as
//! [head_dim / 2, KEYS] pairs, values as [KEYS / 2, v_dim] pairs of adjacent keys, v_dim padded
//! to whole blocks of 64 columns); then every
//! ROWS rows of scores (a query and a head of a KV head's group each) walk their key blocks from
//! position 0 with an online softmax in float32, the weights p rounded to bfloat16 for the
//! second product (as bfloat16 flash attentions do) and the denominator summed from the rounded
//! weights. A row's result depends only on its own context, never on its tile or its chunk.
//! No sliding window and no sinks (`applies`); everything else is `paged_prefill`'s contract.

use crate::matmul_bf16::pair_bits;
use crate::paged_attn::{exp, Bf16, Element, Isa};
use crate::paged_prefill::PagedPrefill;

/// Keys per block: four 16-lane registers of scores per row.
const KEYS: usize = 64;
/// Rows of scores per register tile: 6 x 4 accumulators within the 32 registers.
const ROWS: usize = 6;
/// Queries per work item (its rows: these queries times the group's heads).
const ITEM_QUERIES: usize = 32;

/// Whether this kernel computes `p` (`applies_to` its shape).
pub fn applies(p: &PagedPrefill<'_, Bf16>) -> bool {
    applies_to(p.q.dim, p.window.is_some(), p.sinks.is_some())
}

/// Whether this kernel computes bfloat16 prefills of heads of `head_dim` (with a window, with
/// sinks): the CPU has AVX-512 BF16, no window or sinks, an even head_dim. The one statement of
/// the rule: the CPU backend asks it (paged_prefill_cpu.dot_bf16_applies) to choose this kernel
/// over SDPA for long contexts.
pub fn applies_to(head_dim: usize, windowed: bool, sinks: bool) -> bool {
    crate::matmul_bf16::runs() && !windowed && !sinks && head_dim.is_multiple_of(2)
}

/// v_dim rounded up to whole blocks of four 16-lane registers (the values' packing and the
/// rows' sums hold zero columns past v_dim).
fn padded(v_dim: usize) -> usize {
    v_dim.next_multiple_of(64)
}

/// One span's keys and values of one KV head, packed: k [blocks, D/2, KEYS] and
/// v [blocks, KEYS/2, padded(Dv)], positions past the context zero.
struct Packed {
    k: Vec<u32>,
    v: Vec<u32>,
}

fn pack(p: &PagedPrefill<'_, Bf16>, slots: &[i64], g: usize) -> Packed {
    let (d2, dv) = (p.q.dim / 2, padded(p.v.dim));
    let blocks = slots.len().div_ceil(KEYS);
    let (k_block, v_block) = (d2 * KEYS, KEYS / 2 * dv);
    let mut k = vec![0u32; blocks * k_block];
    let mut v = vec![0u32; blocks * v_block];
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
    Packed { k, v }
}

/// The output's rows, written by several threads, each (query, head) row by one of them.
#[derive(Clone, Copy)]
struct Out(*mut Bf16);
// SAFETY: the items cover disjoint (query, head) rows (see `prefill`).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// A span's block of queries of one KV head.
struct Item {
    span: usize,
    kv_head: usize,
    first: usize,
    count: usize,
}

/// `paged_prefill` for spans that `applies` accepts, validated already (`paged_prefill_bf16`): `order` lists
/// (first row, span, where its slots start).
fn prefill(p: &PagedPrefill<'_, Bf16>, order: &[(usize, usize, usize)], out: &mut [Bf16], threads: usize, macs: usize) {
    let kv_heads = p.k.heads;
    let mut items = Vec::new();
    for (o, &(_, span, _)) in order.iter().enumerate() {
        for kv_head in 0..kv_heads {
            let q_len = p.q_lens[span] as usize;
            for first in (0..q_len).step_by(ITEM_QUERIES) {
                items.push((o, Item { span, kv_head, first, count: ITEM_QUERIES.min(q_len - first) }));
            }
        }
    }
    // the items seeing the most keys first: the threads' last items are short
    items.sort_by_key(|(_, item)| std::cmp::Reverse(p.context_lens[item.span] as usize - p.q_lens[item.span] as usize + item.first));
    let threads = threads.min(macs / crate::paged_attn::PARALLEL_MIN_MACS).clamp(1, items.len().max(1));
    // each (span, KV head)'s keys and values packed, by the same threads
    let mut jobs: Vec<(usize, usize, Option<Packed>)> =
        (0..order.len()).flat_map(|o| (0..kv_heads).map(move |g| (o, g, None))).collect();
    crate::workers::take_in_turn(threads.min(jobs.len()), &mut jobs, &|jobs| {
        for (o, g, packed) in jobs {
            let (_, span, at) = order[*o];
            *packed = Some(pack(p, &p.slots[at..at + p.context_lens[span] as usize], *g));
        }
    });
    let packed: Vec<Packed> = jobs.into_iter().map(|(_, _, packed)| packed.expect("every job ran")).collect();
    let dst = Out(out.as_mut_ptr());
    crate::workers::take_in_turn(threads, &mut items, &|items| {
        let mut scratch = Scratch::new(p);
        for (o, item) in items {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `applies` checked the CPU; the item's rows of `out` are its own.
            unsafe {
                run_item(p, &packed[*o * kv_heads + item.kv_head], item, &mut scratch, dst)
            };
        }
    });
}

/// A thread's buffers for a tile: scores and weights [ROWS, KEYS], the rows' sums [ROWS, padded(Dv)].
struct Scratch {
    scores: Vec<f32>,
    weights: Vec<u32>,
    acc: Vec<f32>,
}

impl Scratch {
    fn new(p: &PagedPrefill<'_, Bf16>) -> Self {
        Scratch { scores: vec![0.0; ROWS * KEYS], weights: vec![0; ROWS * KEYS / 2], acc: vec![0.0; ROWS * padded(p.v.dim)] }
    }
}

/// # Safety
/// The CPU must support AVX-512F and AVX-512 BF16; `out` is `paged_prefill`'s output, whose
/// rows of this item no other thread writes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn run_item(p: &PagedPrefill<'_, Bf16>, packed: &Packed, item: &Item, s: &mut Scratch, out: Out) {
    let group = p.q.heads / p.k.heads;
    let (span, ctx) = (item.span, p.context_lens[item.span] as usize);
    let q_len = p.q_lens[span] as usize;
    let start = p.q_starts[span] as usize;
    let rows = item.count * group;
    let mut r0 = 0;
    while r0 < rows {
        let n = ROWS.min(rows - r0);
        // row r: query item.first + r / group, head kv_head * group + r % group
        let mut q = [std::ptr::null::<u32>(); ROWS];
        let mut pos = [0usize; ROWS];
        let mut heads = [0usize; ROWS];
        for i in 0..n {
            let (query, head) = (item.first + (r0 + i) / group, item.kv_head * group + (r0 + i) % group);
            q[i] = p.q.at(start + query, head).as_ptr() as *const u32;
            pos[i] = ctx - q_len + query;
            heads[i] = head;
        }
        let blocks = pos[..n].iter().max().unwrap() / KEYS + 1;
        match n {
            6 => tile::<6>(p, packed, &q, &pos, blocks, s),
            5 => tile::<5>(p, packed, &q, &pos, blocks, s),
            4 => tile::<4>(p, packed, &q, &pos, blocks, s),
            3 => tile::<3>(p, packed, &q, &pos, blocks, s),
            2 => tile::<2>(p, packed, &q, &pos, blocks, s),
            _ => tile::<1>(p, packed, &q, &pos, blocks, s),
        }
        let (dv, dvp) = (p.v.dim, padded(p.v.dim));
        for (i, head) in heads.iter().enumerate().take(n) {
            let query = item.first + (r0 + i) / group;
            let row = out.0.add(((start + query) * p.q.heads + head) * dv);
            for (c, &a) in s.acc[i * dvp..i * dvp + dv].iter().enumerate() {
                *row.add(c) = Bf16::from_f32(a);
            }
        }
        r0 += n;
    }
}

/// R rows' attention over their key blocks into s.acc (normalized).
///
/// # Safety
/// As `run_item`; q[..R] point at the rows' queries (head_dim bfloat16 each).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn tile<const R: usize>(p: &PagedPrefill<'_, Bf16>, packed: &Packed, q: &[*const u32; ROWS],
                               pos: &[usize; ROWS], blocks: usize, s: &mut Scratch) {
    use std::arch::x86_64::*;
    let (d2, dv) = (p.q.dim / 2, padded(p.v.dim));
    let (k_block, v_block) = (d2 * KEYS, KEYS / 2 * dv);
    let mut max = [f32::NEG_INFINITY; R];
    let mut total = [0f32; R];
    s.acc[..R * dv].fill(0.0);
    for b in 0..blocks {
        // scores: q . k for the block's keys
        let kp = packed.k.as_ptr().add(b * k_block);
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for kk in 0..d2 {
            let w: [__m512bh; 4] = std::array::from_fn(|c| std::mem::transmute(_mm512_loadu_si512(kp.add(kk * KEYS + 16 * c) as *const _)));
            for (a, qr) in acc.iter_mut().zip(q) {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(qr.add(kk).read_unaligned() as i32));
                for (a, w) in a.iter_mut().zip(&w) {
                    *a = _mm512_dpbf16_ps(*a, *w, x);
                }
            }
        }
        // scaled, keys after a row's query at -inf, and each row's running maximum
        let mut tops = [0f32; R];
        let lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        for (i, a) in acc.iter().enumerate() {
            let visible = _mm512_set1_epi32((pos[i] + 1).saturating_sub(b * KEYS).min(KEYS) as i32);
            let mut top = _mm512_set1_ps(max[i]);
            for (c, a) in a.iter().enumerate() {
                let seen = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * c as i32)), visible);
                let x = _mm512_mask_mov_ps(_mm512_set1_ps(f32::NEG_INFINITY), seen, _mm512_mul_ps(*a, _mm512_set1_ps(p.scale)));
                top = _mm512_max_ps(top, x);
                _mm512_storeu_ps(s.scores.as_mut_ptr().add(i * KEYS + 16 * c), x);
            }
            tops[i] = _mm512_reduce_max_ps(top);
        }
        // the online softmax, row by row
        for i in 0..R {
            let scores = &mut s.scores[i * KEYS..(i + 1) * KEYS];
            let top = tops[i];
            // a block a row sees none of leaves it exactly as it was
            let fix = if top == max[i] { 1.0 } else { exp(max[i] - top) };
            for x in scores.iter_mut() {
                *x = exp(*x - top);
            }
            // the weights rounded to bfloat16 pairs, and their sum as rounded
            let sp = scores.as_ptr();
            let mut sum = _mm512_setzero_ps();
            for half in 0..2 {
                let pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sp.add(32 * half + 16)), _mm512_loadu_ps(sp.add(32 * half)));
                let pairs: __m512i = std::mem::transmute(pairs);
                _mm512_storeu_si512(s.weights.as_mut_ptr().add(i * KEYS / 2 + 16 * half) as *mut _, pairs);
                let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(pairs));
                let odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(-65536)));
                sum = _mm512_add_ps(sum, _mm512_add_ps(even, odd));
            }
            total[i] = total[i] * fix + _mm512_reduce_add_ps(sum);
            max[i] = top;
            if fix != 1.0 {
                for a in &mut s.acc[i * dv..(i + 1) * dv] {
                    *a *= fix;
                }
            }
        }
        // values: acc += p . v, 64 columns at a time
        let vp = packed.v.as_ptr().add(b * v_block);
        for c0 in (0..dv).step_by(64) {
            let mut acc = [[_mm512_setzero_ps(); 4]; R];
            for (i, a) in acc.iter_mut().enumerate() {
                for (c, a) in a.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(s.acc.as_ptr().add(i * dv + c0 + 16 * c));
                }
            }
            for kk in 0..KEYS / 2 {
                let w: [__m512bh; 4] = std::array::from_fn(|c| std::mem::transmute(_mm512_loadu_si512(vp.add(kk * dv + c0 + 16 * c) as *const _)));
                for (i, a) in acc.iter_mut().enumerate() {
                    let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(s.weights[i * KEYS / 2 + kk] as i32));
                    for (a, w) in a.iter_mut().zip(&w) {
                        *a = _mm512_dpbf16_ps(*a, *w, x);
                    }
                }
            }
            for (i, a) in acc.iter().enumerate() {
                for (c, a) in a.iter().enumerate() {
                    _mm512_storeu_ps(s.acc.as_mut_ptr().add(i * dv + c0 + 16 * c), *a);
                }
            }
        }
    }
    for (i, total) in total.iter().enumerate() {
        let norm = 1.0 / total;
        for a in &mut s.acc[i * dv..(i + 1) * dv] {
            *a *= norm;
        }
    }
}

/// Prefill attention by element type, each on its fastest kernel here: bfloat16 in this
/// kernel where it `applies`, everything else in `paged_prefill`'s portable one.
pub trait Prefill: Element + Sized {
    fn prefill(p: &PagedPrefill<'_, Self>, out: &mut [Self], threads: usize, isa: Isa) -> Result<(), String> {
        crate::paged_prefill::paged_prefill(p, out, threads, isa)
    }
}

impl Prefill for f32 {}

impl Prefill for Bf16 {
    fn prefill(p: &PagedPrefill<'_, Self>, out: &mut [Self], threads: usize, isa: Isa) -> Result<(), String> {
        if paged_prefill_bf16(p, out, threads)? {
            return Ok(());
        }
        crate::paged_prefill::paged_prefill(p, out, threads, isa)
    }
}

/// `paged_prefill` in this kernel where it `applies`: Ok(false) where it does not (nothing
/// written; the caller runs `paged_prefill`).
pub fn paged_prefill_bf16(p: &PagedPrefill<'_, Bf16>, out: &mut [Bf16], threads: usize) -> Result<bool, String> {
    if !applies(p) {
        return Ok(false);
    }
    let valid = crate::paged_prefill::validate(p, out.len())?;
    prefill(p, &valid.order, out, threads, valid.macs);
    Ok(true)
}
