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
/// second half repeats the first). Errors name the first length that does not match.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope<W: Element>(qkv: &[W], s: Heads, norms: Option<&HeadNorms<W>>, cos: &[W], sin: &[W], q: &mut [W],
                                k: &mut [W], v: &mut [W]) -> Result<(), String> {
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
    let half = s.rotary / 2;
    let kv_len = s.kv_heads * d;
    for t in 0..s.tokens {
        let row = &qkv[t * width..(t + 1) * width];
        let (c, sn) = (&cos[t * s.rotary..t * s.rotary + half], &sin[t * s.rotary..t * s.rotary + half]);
        let (q_src, rest) = row.split_at(s.heads * d);
        let (k_src, v_src) = rest.split_at(kv_len);
        let q_dst = &mut q[t * s.heads * d..(t + 1) * s.heads * d];
        let k_dst = &mut k[t * kv_len..(t + 1) * kv_len];
        for (src, dst, weight) in [(q_src, q_dst, norms.map(|n| n.q)), (k_src, k_dst, norms.map(|n| n.k))] {
            for (head, out) in src.chunks_exact(d).zip(dst.chunks_exact_mut(d)) {
                match weight {
                    Some(w) => normalize_row(head, w, norms.map_or(0.0, |n| n.eps), out),
                    None => out.copy_from_slice(head),
                }
                let (x1, x2) = out[..s.rotary].split_at_mut(half);
                // each op's result rounded to W, as torch's ops on W round it (nothing for f32)
                let r = |v: f32| W::from_f32(v).to_f32();
                for i in 0..half {
                    let (a, b, c, sn) = (x1[i].to_f32(), x2[i].to_f32(), c[i].to_f32(), sn[i].to_f32());
                    x1[i] = W::from_f32(r(a * c) - r(b * sn));
                    x2[i] = W::from_f32(r(b * c) + r(a * sn));
                }
            }
        }
        v[t * kv_len..(t + 1) * kv_len].copy_from_slice(v_src);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::noise;

    /// The definition, head by head, in float64 (the norm) and float32 (the rotation).
    #[test]
    fn every_head_is_normed_then_rotated() {
        for (tokens, heads, kv_heads, d, rotary, normed) in
            [(1, 4, 2, 64, 64, true), (3, 2, 1, 16, 8, true), (2, 3, 3, 10, 0, false), (5, 1, 1, 8, 8, false)] {
            let s = Heads { tokens, heads, kv_heads, head_dim: d, rotary };
            let qkv = noise(tokens * (heads + 2 * kv_heads) * d, 1);
            let (wq, wk) = (noise(d, 2), noise(d, 3));
            let (cos, sin) = (noise(tokens * rotary, 4), noise(tokens * rotary, 5));
            let norms = HeadNorms { q: &wq, k: &wk, eps: 1e-6 };
            let (mut q, mut k, mut v) = (vec![0.0; tokens * heads * d], vec![0.0; tokens * kv_heads * d], vec![0.0; tokens * kv_heads * d]);
            qk_norm_rope(&qkv, s, normed.then_some(&norms), &cos, &sin, &mut q, &mut k, &mut v).unwrap();
            let width = (heads + 2 * kv_heads) * d;
            for t in 0..tokens {
                for (h, w, got, base) in (0..heads).map(|h| (h, &wq, &q[(t * heads + h) * d..][..d], h * d))
                    .chain((0..kv_heads).map(|h| (h, &wk, &k[(t * kv_heads + h) * d..][..d], (heads + h) * d))) {
                    let x = &qkv[t * width + base..][..d];
                    let ms = x.iter().map(|&a| (a as f64).powi(2)).sum::<f64>() / d as f64;
                    let normed_x: Vec<f64> = x.iter().zip(w.iter())
                        .map(|(&a, &g)| if normed { a as f64 / (ms + 1e-6).sqrt() * g as f64 } else { a as f64 }).collect();
                    for i in 0..d {
                        let want = if i < rotary {
                            let (half, j) = (rotary / 2, i % (rotary / 2));
                            let (c, sn) = (cos[t * rotary + j] as f64, sin[t * rotary + j] as f64);
                            if i < half { normed_x[i] * c - normed_x[i + half] * sn } else { normed_x[i] * c + normed_x[i - half] * sn }
                        } else {
                            normed_x[i]
                        };
                        assert!((got[i] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "t{t} head {h} dim {i}: {} vs {want}", got[i]);
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
        let (mut q, mut k, mut v) = (vec![Bf16(0); tokens * heads * d], vec![Bf16(0); tokens * kv_heads * d], vec![Bf16(0); tokens * kv_heads * d]);
        qk_norm_rope(&qkv, s, Some(&norms), &cos, &sin, &mut q, &mut k, &mut v).unwrap();
        let width = (heads + 2 * kv_heads) * d;
        let round = |v: f32| Bf16::from_f32(v).to_f32();
        for t in 0..tokens {
            for (h, w, got) in (0..heads).map(|h| (h, &wq, &q[(t * heads + h) * d..][..d]))
                .chain((0..kv_heads).map(|h| (heads + h, &wk, &k[(t * kv_heads + h) * d..][..d]))) {
                let mut normed = vec![Bf16(0); d];
                crate::rms_norm::rms_norm(&qkv[t * width + h * d..][..d], w, 1e-6, &mut normed).unwrap();
                let half = rotary / 2;
                for i in 0..d {
                    let want = if i < rotary {
                        let j = i % half;
                        let (c, sn) = (cos[t * rotary + j].to_f32(), sin[t * rotary + j].to_f32());
                        let (x1, x2) = (normed[j].to_f32(), normed[j + half].to_f32());
                        if i < half { round(round(x1 * c) - round(x2 * sn)) } else { round(round(x2 * c) + round(x1 * sn)) }
                    } else {
                        normed[i].to_f32()
                    };
                    assert_eq!(got[i].to_f32().to_bits(), want.to_bits(), "t{t} head {h} dim {i}");
                }
            }
        }
        assert_eq!(&v[..kv_heads * d], &qkv[(heads + kv_heads) * d..][..kv_heads * d]);
    }

    #[test]
    fn bad_shapes_are_errors() {
        let s = Heads { tokens: 1, heads: 1, kv_heads: 1, head_dim: 4, rotary: 4 };
        let (mut q, mut k, mut v) = (vec![0.0; 4], vec![0.0; 4], vec![0.0; 4]);
        let ok = qk_norm_rope(&[0.0f32; 12], s, None, &[0.0; 4], &[0.0; 4], &mut q, &mut k, &mut v);
        assert!(ok.is_ok());
        let err = qk_norm_rope(&[0.0f32; 11], s, None, &[0.0; 4], &[0.0; 4], &mut q, &mut k, &mut v).unwrap_err();
        assert!(err.contains("qkv holds 11"), "{err}");
        let odd = Heads { rotary: 3, ..s };
        assert!(qk_norm_rope(&[0.0f32; 12], odd, None, &[0.0; 3], &[0.0; 3], &mut q, &mut k, &mut v).unwrap_err().contains("even"));
        let w = [1.0f32; 3];
        let norms = HeadNorms { q: &w, k: &w, eps: 1e-6 };
        assert!(qk_norm_rope(&[0.0; 12], s, Some(&norms), &[0.0; 4], &[0.0; 4], &mut q, &mut k, &mut v).unwrap_err().contains("norms"));
    }
}
