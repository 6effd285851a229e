//! One attention layer's q, k and v from its fused q/k/v projection on the CPU, in float32 or
//! bfloat16:
//! each token's query and key heads RMS-normalized per head (Qwen3's q_norm / k_norm, when
//! given), then rotated by RoPE's half-split convention over their first `rotary` dims, and
//! the value heads copied, into three contiguous outputs. One call per layer instead of
//! torch's split, reshape, two norms on strided views and two rotations of about eight ops
//! each, whose dispatch costs more than the work at a decode step's few tokens. The rotation
//! is torch's arithmetic op for op (x1 cos - x2 sin and x2 cos + x1 sin, each product and the
//! sum rounded to the element type, as torch's bfloat16 ops round each result), so it gives
//! torch's bits; the norm is `rms_norm::normalize_row`'s.

use crate::expert_pairs::Element;
use crate::rms_norm::normalize_row;

/// The layer's shapes: tokens, this rank's query and KV heads, the head size, and how many
/// leading dims of each head RoPE rotates (0: none; even, at most head_dim).
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rotary: usize,
}

/// The per-head norms' weights ([head_dim] each) and epsilon, when the layer has them.
pub struct HeadNorms<'a, W> {
    pub q: &'a [W],
    pub k: &'a [W],
    pub eps: f32,
}

/// qkv [tokens, (heads + 2 kv_heads) head_dim] into q [tokens, heads, head_dim] and k, v
/// [tokens, kv_heads, head_dim]; cos and sin [tokens, rotary] as rope_cos_sin gives them (the
/// second half repeats the first). Errors name the first length that does not match. The
/// tokens split over up to `threads` threads; each token's bits do not depend on the split.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope<W: Element>(
    qkv: &[W],
    s: Heads,
    norms: Option<&HeadNorms<W>>,
    cos: &[W],
    sin: &[W],
    q: &mut [W],
    k: &mut [W],
    v: &mut [W],
    threads: usize,
) -> Result<(), String> {
    let d = s.head_dim;
    let width = (s.heads + 2 * s.kv_heads) * d;
    if d == 0 || s.rotary > d || !s.rotary.is_multiple_of(2) {
        return Err(format!("qk_norm_rope: rotary {} must be even and at most head_dim {d} (> 0)", s.rotary));
    }
    let lengths = [
        ("qkv", qkv.len(), s.tokens * width),
        ("q", q.len(), s.tokens * s.heads * d),
        ("k", k.len(), s.tokens * s.kv_heads * d),
        ("v", v.len(), s.tokens * s.kv_heads * d),
        ("cos", cos.len(), s.tokens * s.rotary),
        ("sin", sin.len(), s.tokens * s.rotary),
    ];
    for (name, got, want) in lengths {
        if got != want {
            return Err(format!("qk_norm_rope: {name} holds {got} values, expected {want}"));
        }
    }
    if let Some(n) = norms {
        if n.q.len() != d || n.k.len() != d {
            return Err(format!("qk_norm_rope: norms of {} and {} values for heads of {d}", n.q.len(), n.k.len()));
        }
    }
    let rows = Rows { qkv, cos, sin, width, shape: s, norms };
    let (q_row, kv_row) = (s.heads * d, s.kv_heads * d);
    let mut items = Vec::with_capacity(s.tokens.div_ceil(TOKENS_PER_ITEM));
    let (mut q, mut k, mut v) = (q, k, v);
    for first in (0..s.tokens).step_by(TOKENS_PER_ITEM) {
        let n = TOKENS_PER_ITEM.min(s.tokens - first);
        let (q_item, q_rest) = std::mem::take(&mut q).split_at_mut(n * q_row);
        let (k_item, k_rest) = std::mem::take(&mut k).split_at_mut(n * kv_row);
        let (v_item, v_rest) = std::mem::take(&mut v).split_at_mut(n * kv_row);
        (q, k, v) = (q_rest, k_rest, v_rest);
        items.push(Item { first, tokens: n, q: q_item, k: k_item, v: v_item });
    }
    let threads = threads.min(s.tokens / TOKENS_PER_ITEM).max(1);
    crate::workers::take_in_turn(threads, &mut items, &|items| run(&rows, items));
    Ok(())
}

/// Tokens a thread takes at a time: the work of a few microseconds.
const TOKENS_PER_ITEM: usize = 32;

/// What every item reads.
struct Rows<'a, W> {
    qkv: &'a [W],
    cos: &'a [W],
    sin: &'a [W],
    width: usize,
    shape: Heads,
    norms: Option<&'a HeadNorms<'a, W>>,
}

/// Tokens first..first + tokens: their rows of q, k and v.
struct Item<'a, W> {
    first: usize,
    tokens: usize,
    q: &'a mut [W],
    k: &'a mut [W],
    v: &'a mut [W],
}

fn run<'i, 'a: 'i, W: Element + 'a>(rows: &Rows<'_, W>, items: &mut dyn Iterator<Item = &'i mut Item<'a, W>>) {
    #[cfg(target_arch = "x86_64")]
    if bf16_avx512_takes(rows) {
        // SAFETY: bf16_avx512_takes checked the CPU (AVX2, AVX-512F), the element type and the
        // head sizes.
        unsafe { run_bf16_avx512(rows, items) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        unsafe { run_avx2(rows, items) };
        return;
    }
    run_items(rows, items);
}

/// `run_items` compiled for AVX2: its loops vectorize 8 wide (no FMA: the same bits).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn run_avx2<'i, 'a: 'i, W: Element + 'a>(
    rows: &Rows<'_, W>,
    items: &mut dyn Iterator<Item = &'i mut Item<'a, W>>,
) {
    run_items(rows, items);
}

#[inline(always)]
fn run_items<'i, 'a: 'i, W: Element + 'a>(rows: &Rows<'_, W>, items: &mut dyn Iterator<Item = &'i mut Item<'a, W>>) {
    let s = rows.shape;
    let (d, half) = (s.head_dim, s.rotary / 2);
    let kv_len = s.kv_heads * d;
    // a head and the token's cos and sin in f32
    let (mut x, mut c, mut sn) = (vec![0f32; d], vec![0f32; half], vec![0f32; half]);
    for item in items {
        for i in 0..item.tokens {
            let t = item.first + i;
            let row = &rows.qkv[t * rows.width..(t + 1) * rows.width];
            widen(&rows.cos[t * s.rotary..][..half], &mut c);
            widen(&rows.sin[t * s.rotary..][..half], &mut sn);
            let (q_src, rest) = row.split_at(s.heads * d);
            let (k_src, v_src) = rest.split_at(kv_len);
            let q_dst = &mut item.q[i * s.heads * d..(i + 1) * s.heads * d];
            let k_dst = &mut item.k[i * kv_len..(i + 1) * kv_len];
            for (src, dst, weight) in [(q_src, q_dst, rows.norms.map(|n| n.q)), (k_src, k_dst, rows.norms.map(|n| n.k))]
            {
                for (head, out) in src.chunks_exact(d).zip(dst.chunks_exact_mut(d)) {
                    match weight {
                        Some(w) => normalize_row(head, w, rows.norms.map_or(0.0, |n| n.eps), out),
                        None => out.copy_from_slice(head),
                    }
                    rotate(&mut out[..s.rotary], &c, &sn, &mut x[..s.rotary]);
                }
            }
            item.v[i * kv_len..(i + 1) * kv_len].copy_from_slice(v_src);
        }
    }
}

/// Whether `run_bf16_avx512` takes these rows: bfloat16, heads of a multiple of 16 values and a
/// rotated half of a multiple of 16, on a CPU with AVX2 and AVX-512F.
#[cfg(target_arch = "x86_64")]
fn bf16_avx512_takes<W: Element>(rows: &Rows<'_, W>) -> bool {
    let s = rows.shape;
    W::as_bf16s(rows.qkv).is_some()
        && s.head_dim.is_multiple_of(16)
        && s.rotary.is_multiple_of(32)
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("avx512f")
}

/// `run_items` for bfloat16 rows in AVX-512 registers (crate::bf16_512), 16 values at a time:
/// the same bits (the norm's scale and values as rms_norm's AVX-512 row, the rotation rounding
/// every product and sum as `rotate`). A token's heads find their scales first, then are
/// normed and rotated in registers: each head's scale is a long chain of dependent adds, which
/// the heads of a token now run side by side.
///
/// # Safety
/// `bf16_avx512_takes(rows)` must hold.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f")]
unsafe fn run_bf16_avx512<'i, 'a: 'i, W: Element + 'a>(
    rows: &Rows<'_, W>,
    items: &mut dyn Iterator<Item = &'i mut Item<'a, W>>,
) {
    use crate::expert_pairs::Bf16;
    use crate::rms_norm::scale_bf16_avx512;
    // W is Bf16 (the caller's contract): the same slices as such
    fn bf16<W: Element>(x: &[W]) -> &[Bf16] {
        W::as_bf16s(x).expect("bfloat16 rows")
    }
    fn bf16_mut<W: Element>(x: &mut [W]) -> &mut [Bf16] {
        W::as_bf16s_mut(x).expect("bfloat16 rows")
    }
    let s = rows.shape;
    let (d, half) = (s.head_dim, s.rotary / 2);
    let kv_len = s.kv_heads * d;
    let (qkv, cos, sin) = (bf16(rows.qkv), bf16(rows.cos), bf16(rows.sin));
    let norms = rows.norms.map(|n| (bf16(n.q), bf16(n.k), n.eps));
    let (mut c, mut sn) = (vec![0f32; half], vec![0f32; half]);
    let mut scales = vec![1f32; s.heads + s.kv_heads];
    for item in items {
        let (q, k, v) = (bf16_mut(item.q), bf16_mut(item.k), bf16_mut(item.v));
        for i in 0..item.tokens {
            let t = item.first + i;
            let row = &qkv[t * rows.width..(t + 1) * rows.width];
            widen(&cos[t * s.rotary..][..half], &mut c);
            widen(&sin[t * s.rotary..][..half], &mut sn);
            let (heads, v_src) = row.split_at((s.heads + s.kv_heads) * d);
            if let Some((_, _, eps)) = norms {
                for (scale, head) in scales.iter_mut().zip(heads.chunks_exact(d)) {
                    // SAFETY: AVX2 and AVX-512F (the caller's contract); heads of a multiple of 16.
                    *scale = unsafe { scale_bf16_avx512(head, eps) };
                }
            }
            let q_dst = &mut q[i * s.heads * d..(i + 1) * s.heads * d];
            let k_dst = &mut k[i * kv_len..(i + 1) * kv_len];
            let dst = q_dst.chunks_exact_mut(d).chain(k_dst.chunks_exact_mut(d));
            for (h, (head, out)) in heads.chunks_exact(d).zip(dst).enumerate() {
                let weight = norms.map(|n| if h < s.heads { n.0 } else { n.1 });
                // SAFETY: as above; the rotated half a multiple of 16.
                unsafe { norm_rotate_bf16_avx512(head, weight.map(|w| (w, scales[h])), &c, &sn, out) };
            }
            v[i * kv_len..(i + 1) * kv_len].copy_from_slice(v_src);
        }
    }
}

/// One bfloat16 head into `out`: normed (`norm`: its weight and scale, `normalized16`'s values)
/// or copied, its first 2 c.len() values rotated as `rotate` rotates them.
///
/// # Safety
/// The CPU must support AVX-512F; head, out (and the weight) hold the same multiple of 16
/// values, at least 2 c.len() == 2 sn.len(), c.len() a multiple of 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn norm_rotate_bf16_avx512(
    head: &[crate::expert_pairs::Bf16],
    norm: Option<(&[crate::expert_pairs::Bf16], f32)>,
    c: &[f32],
    sn: &[f32],
    out: &mut [crate::expert_pairs::Bf16],
) {
    use crate::bf16_512::{load16, round16, store16};
    use crate::rms_norm::normalized16;
    use std::arch::x86_64::*;
    let (d, half) = (head.len(), c.len());
    assert!(d.is_multiple_of(16) && half.is_multiple_of(16) && 2 * half <= d && sn.len() == half && out.len() == d);
    // SAFETY: 16 values at i < d of the head (and of its weight: norm's contract).
    let value = |i: usize| unsafe {
        match norm {
            Some((w, scale)) => normalized16(head, w, scale, i),
            None => load16(head.as_ptr().add(i)),
        }
    };
    for i in (0..half).step_by(16) {
        let (a, b) = (value(i), value(half + i));
        // SAFETY: i + 16 <= half values of c, sn and each half of out.
        unsafe {
            let (cc, ss) = (_mm512_loadu_ps(c.as_ptr().add(i)), _mm512_loadu_ps(sn.as_ptr().add(i)));
            let o1 = _mm512_sub_ps(round16(_mm512_mul_ps(a, cc)), round16(_mm512_mul_ps(b, ss)));
            let o2 = _mm512_add_ps(round16(_mm512_mul_ps(b, cc)), round16(_mm512_mul_ps(a, ss)));
            store16(out.as_mut_ptr().add(i), round16(o1));
            store16(out.as_mut_ptr().add(half + i), round16(o2));
        }
    }
    for i in (2 * half..d).step_by(16) {
        // SAFETY: i + 16 <= d values of out.
        unsafe { store16(out.as_mut_ptr().add(i), value(i)) };
    }
}

#[inline(always)]
fn widen<W: Element>(src: &[W], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// head[..2 half] rotated in place: x1 cos - x2 sin and x2 cos + x1 sin, each product and sum
/// rounded to W, as torch's ops on W round them (nothing for f32); `x` scratch of its length.
#[inline(always)]
fn rotate<W: Element>(head: &mut [W], c: &[f32], sn: &[f32], x: &mut [f32]) {
    let half = c.len();
    widen(head, x);
    let r = W::round;
    let (x1, x2) = x.split_at(half);
    let (o1, o2) = head.split_at_mut(half);
    // every slice cut to `half` first: no bounds checks inside, so the loop vectorizes
    let (x2, sn, o1, o2) = (&x2[..half], &sn[..half], &mut o1[..half], &mut o2[..half]);
    for i in 0..half {
        let (a, b) = (x1[i], x2[i]);
        o1[i] = W::from_f32(r(a * c[i]) - r(b * sn[i]));
        o2[i] = W::from_f32(r(b * c[i]) + r(a * sn[i]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::noise;

    /// The definition, head by head, in float64 (the norm) and float32 (the rotation).
    #[test]
    fn every_head_is_normed_then_rotated() {
        for (tokens, heads, kv_heads, d, rotary, normed) in
            [(1, 4, 2, 64, 64, true), (3, 2, 1, 16, 8, true), (2, 3, 3, 10, 0, false), (5, 1, 1, 8, 8, false)]
        {
            let s = Heads { tokens, heads, kv_heads, head_dim: d, rotary };
            let qkv = noise(tokens * (heads + 2 * kv_heads) * d, 1);
            let (wq, wk) = (noise(d, 2), noise(d, 3));
            let (cos, sin) = (noise(tokens * rotary, 4), noise(tokens * rotary, 5));
            let norms = HeadNorms { q: &wq, k: &wk, eps: 1e-6 };
            let (mut q, mut k, mut v) =
                (vec![0.0; tokens * heads * d], vec![0.0; tokens * kv_heads * d], vec![0.0; tokens * kv_heads * d]);
            qk_norm_rope(&qkv, s, normed.then_some(&norms), &cos, &sin, &mut q, &mut k, &mut v, 1).unwrap();
            let width = (heads + 2 * kv_heads) * d;
            for t in 0..tokens {
                for (h, w, got, base) in (0..heads)
                    .map(|h| (h, &wq, &q[(t * heads + h) * d..][..d], h * d))
                    .chain((0..kv_heads).map(|h| (h, &wk, &k[(t * kv_heads + h) * d..][..d], (heads + h) * d)))
                {
                    let x = &qkv[t * width + base..][..d];
                    let ms = x.iter().map(|&a| (a as f64).powi(2)).sum::<f64>() / d as f64;
                    let normed_x: Vec<f64> = x
                        .iter()
                        .zip(w.iter())
                        .map(|(&a, &g)| if normed { a as f64 / (ms + 1e-6).sqrt() * g as f64 } else { a as f64 })
                        .collect();
                    for i in 0..d {
                        let want = if i < rotary {
                            let (half, j) = (rotary / 2, i % (rotary / 2));
                            let (c, sn) = (cos[t * rotary + j] as f64, sin[t * rotary + j] as f64);
                            if i < half {
                                normed_x[i] * c - normed_x[i + half] * sn
                            } else {
                                normed_x[i] * c + normed_x[i - half] * sn
                            }
                        } else {
                            normed_x[i]
                        };
                        assert!(
                            (got[i] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "t{t} head {h} dim {i}: {} vs {want}",
                            got[i]
                        );
                    }
                }
                let v_src = &qkv[t * width + (heads + kv_heads) * d..][..kv_heads * d];
                assert_eq!(&v[t * kv_heads * d..][..kv_heads * d], v_src);
            }
        }
    }

    /// bfloat16: each head normed as rms_norm normalizes a bfloat16 row, then rotated with every
    /// product and sum rounded to bfloat16, as torch's bfloat16 ops give them.
    #[test]
    fn bfloat16_heads_round_every_op() {
        use crate::expert_pairs::Bf16;
        let (tokens, heads, kv_heads, d, rotary) = (2, 4, 2, 64, 32);
        let s = Heads { tokens, heads, kv_heads, head_dim: d, rotary };
        let bf = |v: Vec<f32>| -> Vec<Bf16> { v.into_iter().map(Bf16::from_f32).collect() };
        let qkv = bf(noise(tokens * (heads + 2 * kv_heads) * d, 11));
        let (wq, wk) = (bf(noise(d, 12)), bf(noise(d, 13)));
        let (cos, sin) = (bf(noise(tokens * rotary, 14)), bf(noise(tokens * rotary, 15)));
        let norms = HeadNorms { q: &wq, k: &wk, eps: 1e-6 };
        let (mut q, mut k, mut v) = (
            vec![Bf16(0); tokens * heads * d],
            vec![Bf16(0); tokens * kv_heads * d],
            vec![Bf16(0); tokens * kv_heads * d],
        );
        qk_norm_rope(&qkv, s, Some(&norms), &cos, &sin, &mut q, &mut k, &mut v, 1).unwrap();
        let width = (heads + 2 * kv_heads) * d;
        let round = |v: f32| Bf16::from_f32(v).to_f32();
        for t in 0..tokens {
            for (h, w, got) in (0..heads)
                .map(|h| (h, &wq, &q[(t * heads + h) * d..][..d]))
                .chain((0..kv_heads).map(|h| (heads + h, &wk, &k[(t * kv_heads + h) * d..][..d])))
            {
                let mut normed = vec![Bf16(0); d];
                crate::rms_norm::rms_norm(&qkv[t * width + h * d..][..d], w, 1e-6, &mut normed, 1).unwrap();
                let half = rotary / 2;
                for i in 0..d {
                    let want = if i < rotary {
                        let j = i % half;
                        let (c, sn) = (cos[t * rotary + j].to_f32(), sin[t * rotary + j].to_f32());
                        let (x1, x2) = (normed[j].to_f32(), normed[j + half].to_f32());
                        if i < half {
                            round(round(x1 * c) - round(x2 * sn))
                        } else {
                            round(round(x2 * c) + round(x1 * sn))
                        }
                    } else {
                        normed[i].to_f32()
                    };
                    assert_eq!(got[i].to_f32().to_bits(), want.to_bits(), "t{t} head {h} dim {i}");
                }
            }
        }
        assert_eq!(&v[..kv_heads * d], &qkv[(heads + kv_heads) * d..][..kv_heads * d]);
    }

    /// A token's bits do not depend on the threads or on which item it falls in: 100 tokens
    /// (items of 32 and a last of 4) on 1, 2 and 3 threads, float32 and bfloat16.
    #[test]
    fn threads_give_the_same_bits() {
        use crate::expert_pairs::Bf16;
        fn run<W: Element + PartialEq + std::fmt::Debug>(cast: impl Fn(Vec<f32>) -> Vec<W>) {
            let (tokens, heads, kv_heads, d, rotary) = (100, 4, 2, 64, 48);
            let s = Heads { tokens, heads, kv_heads, head_dim: d, rotary };
            let qkv = cast(noise(tokens * (heads + 2 * kv_heads) * d, 21));
            let (wq, wk) = (cast(noise(d, 22)), cast(noise(d, 23)));
            let (cos, sin) = (cast(noise(tokens * rotary, 24)), cast(noise(tokens * rotary, 25)));
            let norms = HeadNorms { q: &wq, k: &wk, eps: 1e-6 };
            let zero = W::from_f32(0.0);
            let outputs: Vec<_> = [1, 2, 3]
                .into_iter()
                .map(|threads| {
                    let (mut q, mut k, mut v) = (
                        vec![zero; tokens * heads * d],
                        vec![zero; tokens * kv_heads * d],
                        vec![zero; tokens * kv_heads * d],
                    );
                    qk_norm_rope(&qkv, s, Some(&norms), &cos, &sin, &mut q, &mut k, &mut v, threads).unwrap();
                    (q, k, v)
                })
                .collect();
            assert!(outputs.iter().all(|o| *o == outputs[0]));
            // the last token alone: the same row as in the batch
            let width = (heads + 2 * kv_heads) * d;
            let one = Heads { tokens: 1, ..s };
            let (mut q, mut k, mut v) = (vec![zero; heads * d], vec![zero; kv_heads * d], vec![zero; kv_heads * d]);
            let t = tokens - 1;
            qk_norm_rope(
                &qkv[t * width..],
                one,
                Some(&norms),
                &cos[t * rotary..],
                &sin[t * rotary..],
                &mut q,
                &mut k,
                &mut v,
                1,
            )
            .unwrap();
            assert_eq!(q, outputs[0].0[t * heads * d..]);
            assert_eq!(k, outputs[0].1[t * kv_heads * d..]);
        }
        run::<f32>(|v| v);
        run::<Bf16>(|v| v.into_iter().map(Bf16::from_f32).collect());
    }

    /// The AVX-512 bfloat16 path gives the portable loop's bits: full, partial and no rotation,
    /// heads of 16 to 128, with and without norms, 37 tokens (a last item of 5) on 1 and 3
    /// threads, and heads holding huge and tiny values, infinities and NaNs.
    #[test]
    fn the_avx512_bfloat16_path_gives_the_portable_bits() {
        use crate::expert_pairs::Bf16;
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avx512f")) {
            eprintln!("skipped: this CPU has no AVX-512F (the bfloat16 heads' kernel)");
            return;
        }
        let bf = |v: Vec<f32>| -> Vec<Bf16> { v.into_iter().map(Bf16::from_f32).collect() };
        let specials = [f32::MAX, 1e-40, f32::INFINITY, f32::NAN, -0.0, 3e38, -2e-39];
        for (seed, (heads, kv_heads, d, rotary, normed)) in [
            (4, 2, 64, 64, true),
            (4, 2, 64, 32, true),
            (2, 1, 128, 64, false),
            (3, 3, 32, 0, true),
            (1, 1, 16, 0, false),
        ]
        .into_iter()
        .enumerate()
        {
            let tokens = 37;
            let s = Heads { tokens, heads, kv_heads, head_dim: d, rotary };
            let mut values = noise(tokens * (heads + 2 * kv_heads) * d, 50 + seed as u64);
            for (i, v) in values.iter_mut().enumerate() {
                match i % 13 {
                    0 => *v *= 1e-38,
                    1 => *v *= 1e30,
                    2 if i % 7 == 0 => *v = specials[i % specials.len()],
                    _ => {}
                }
            }
            let qkv = bf(values);
            let (wq, wk) = (bf(noise(d, 60 + seed as u64)), bf(noise(d, 61 + seed as u64)));
            let (cos, sin) = (bf(noise(tokens * rotary, 62)), bf(noise(tokens * rotary, 63)));
            let norms = HeadNorms { q: &wq, k: &wk, eps: 1e-6 };
            let norms = normed.then_some(&norms);
            let outputs = |fast: bool, threads: usize| {
                let (mut q, mut k, mut v) = (
                    vec![Bf16(7); tokens * heads * d],
                    vec![Bf16(7); tokens * kv_heads * d],
                    vec![Bf16(7); tokens * kv_heads * d],
                );
                if fast {
                    qk_norm_rope(&qkv, s, norms, &cos, &sin, &mut q, &mut k, &mut v, threads).unwrap();
                } else {
                    let rows =
                        Rows { qkv: &qkv, cos: &cos, sin: &sin, width: (heads + 2 * kv_heads) * d, shape: s, norms };
                    let mut item = Item { first: 0, tokens, q: &mut q, k: &mut k, v: &mut v };
                    run_items(&rows, &mut std::iter::once(&mut item));
                }
                (q, k, v)
            };
            let want = outputs(false, 1);
            for threads in [1, 3] {
                assert!(
                    outputs(true, threads) == want,
                    "{heads}/{kv_heads} heads of {d}, rotary {rotary}, normed {normed}"
                );
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let s = Heads { tokens: 1, heads: 1, kv_heads: 1, head_dim: 4, rotary: 4 };
        let (mut q, mut k, mut v) = (vec![0.0; 4], vec![0.0; 4], vec![0.0; 4]);
        let ok = qk_norm_rope(&[0.0f32; 12], s, None, &[0.0; 4], &[0.0; 4], &mut q, &mut k, &mut v, 1);
        assert!(ok.is_ok());
        let err = qk_norm_rope(&[0.0f32; 11], s, None, &[0.0; 4], &[0.0; 4], &mut q, &mut k, &mut v, 1).unwrap_err();
        assert!(err.contains("qkv holds 11"), "{err}");
        let odd = Heads { rotary: 3, ..s };
        assert!(qk_norm_rope(&[0.0f32; 12], odd, None, &[0.0; 3], &[0.0; 3], &mut q, &mut k, &mut v, 1)
            .unwrap_err()
            .contains("even"));
        let w = [1.0f32; 3];
        let norms = HeadNorms { q: &w, k: &w, eps: 1e-6 };
        assert!(qk_norm_rope(&[0.0; 12], s, Some(&norms), &[0.0; 4], &[0.0; 4], &mut q, &mut k, &mut v, 1)
            .unwrap_err()
            .contains("norms"));
    }
}
