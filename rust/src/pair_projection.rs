//! Rows projected each by its own matrix: out[p][..rows_p] += m_p @ x[p][..cols_p], for the
//! LoRA expert pass (r3srv.lora.slots): the base projections of a step's (token, expert) pairs
//! (m_p = the pair's expert's weight) and the adapters' low-rank terms (m_p = the pair's
//! (slot, expert) A, then B), every pair of the step in one call. Pairs that share a matrix
//! run together as one small product (`expert_pairs::gemm_nt`), reading each of its rows once,
//! so a call costs one pass over the matrices the step touches, whatever their number; a pair
//! without a matrix (no adapter on it) is left as it is. Below `WIDE_MIN_PAIRS` pairs on one
//! matrix each output element is the dot product `gemm_nt` computes, in its order, so a pair's
//! result does not depend on the other pairs; a group that large (a prefill's expert) runs
//! through `matmul`'s packed kernels, within float32 rounding of those.
//! Matrices hold float32 or bfloat16 (`Element`); rows and outputs are float32.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::expert_pairs::{as_f32, gemm_nt, Element, Isa, PARALLEL_MIN_MACS, WIDE_MIN_PAIRS};

/// A pair's matrix, row-major [rows, m.len() / rows].
#[derive(Clone, Copy)]
pub struct PairMatrix<'a, W: Element> {
    pub m: &'a [W],
    pub rows: usize,
}

/// out [P, out_cols] += for each pair p with a matrix: m_p @ x[p][..cols_p] into
/// out[p][..rows_p] (x [P, x_cols]; cols_p = m_p.len() / rows_p). Pairs without a matrix keep
/// their row. Groups run on up to `threads` threads (each group on one: the thread count never
/// changes a bit) when the call is large enough. Errors name the first inconsistent input.
pub fn project_pairs<W: Element>(
    isa: Isa,
    mats: &[Option<PairMatrix<W>>],
    x: &[f32],
    x_cols: usize,
    out: &mut [f32],
    out_cols: usize,
    threads: usize,
) -> Result<(), String> {
    let pairs = mats.len();
    if x.len() != pairs * x_cols || out.len() != pairs * out_cols {
        return Err(format!(
            "x holds {} values and out {}, expected {pairs} rows of {x_cols} and of {out_cols}",
            x.len(),
            out.len()
        ));
    }
    for (p, mat) in mats.iter().enumerate() {
        if let Some(PairMatrix { m, rows }) = mat {
            let cols = m.len().checked_div(*rows).unwrap_or(0);
            if *rows == 0 || cols * rows != m.len() || cols > x_cols || *rows > out_cols {
                return Err(format!(
                    "pair {p}: a matrix of {} values in {rows} rows does not fit rows of {x_cols} \
                                    into rows of {out_cols}",
                    m.len()
                ));
            }
        }
    }
    // pairs with a matrix, grouped by it (stable: pair order within a group)
    let key = |p: &usize| mats[*p].map(|pm| (pm.m.as_ptr() as usize, pm.m.len()));
    let mut order: Vec<usize> = (0..pairs).filter(|&p| mats[p].is_some()).collect();
    order.sort_by_key(key);
    let groups: Vec<&[usize]> = order.chunk_by(|a, b| key(a) == key(b)).collect();
    let macs: usize = groups.iter().map(|g| g.len() * mats[g[0]].map_or(0, |pm| pm.m.len())).sum();
    let threads = threads.min(macs / PARALLEL_MIN_MACS).clamp(1, groups.len().max(1));
    let next = AtomicUsize::new(0);
    let dst = SharedOut(out.as_mut_ptr());
    let work = || {
        let (mut xs, mut ys, mut widened) = (Vec::new(), Vec::new(), Vec::new());
        while let Some(group) = groups.get(next.fetch_add(1, Ordering::Relaxed)) {
            let PairMatrix { m, rows } = mats[group[0]].expect("grouped pairs have a matrix");
            let cols = m.len() / rows;
            xs.clear();
            for &p in group.iter() {
                xs.extend_from_slice(&x[p * x_cols..p * x_cols + cols]);
            }
            ys.resize(group.len() * rows, 0.0);
            if group.len() >= WIDE_MIN_PAIRS {
                crate::matmul::matmul_nt(as_f32(m, &mut widened), rows, &xs, &mut ys);
            } else {
                gemm_nt(isa, m, rows, &xs, &mut ys);
            }
            for (&p, y) in group.iter().zip(ys.chunks_exact(rows)) {
                // SAFETY: every pair is in one group and each group runs once, so no two
                // threads touch row p of `out`, which outlives the threads' scope.
                let o = unsafe { dst.row(p * out_cols, rows) };
                for (o, &v) in o.iter_mut().zip(y) {
                    *o += v;
                }
            }
        }
    };
    crate::workers::run_on_threads(threads, &work);
    Ok(())
}

/// One slot's adapter on a projection, as r3srv.lora.cpu_kernel's SlotTable holds it: A
/// [rank, in] and B [out, rank] of expert e at `a[e * a_step..]` and `b[e * b_step..]` (a step
/// of 0: one matrix shared by every expert, SGLang's shared-outer form).
#[derive(Clone, Copy)]
pub struct SlotAdapter<'a, W: Element> {
    pub a: &'a [W],
    pub a_step: usize,
    pub b: &'a [W],
    pub b_step: usize,
    pub rank: usize,
}

/// out[p] += B @ (A @ x[p]) for each pair p under an adapter (`slots[pair_slots[p]]`, None: no
/// adapter on this projection), of its expert `pair_experts[p]`: punica's shrink and expand, each
/// one `project_pairs` over the step's pairs, so pairs sharing a (slot, expert) matrix read it
/// once. Whether any pair had one. Errors name the first pair whose slot, expert or matrix does
/// not fit.
#[allow(clippy::too_many_arguments)]
pub fn add_low_rank<W: Element>(
    isa: Isa,
    slots: &[Option<SlotAdapter<W>>],
    pair_slots: &[usize],
    pair_experts: &[usize],
    x: &[f32],
    x_cols: usize,
    out: &mut [f32],
    out_cols: usize,
    threads: usize,
) -> Result<bool, String> {
    let pairs = pair_slots.len();
    if pair_experts.len() != pairs {
        return Err(format!("{pairs} pair slots but {} pair experts", pair_experts.len()));
    }
    let mut shrink = Vec::with_capacity(pairs);
    let mut expand = Vec::with_capacity(pairs);
    let mut max_rank = 0;
    for (p, (&slot, &expert)) in pair_slots.iter().zip(pair_experts).enumerate() {
        let adapter = *slots.get(slot).ok_or_else(|| format!("pair {p}: slot {slot} of {}", slots.len()))?;
        let Some(SlotAdapter { a, a_step, b, b_step, rank }) = adapter.filter(|s| s.rank > 0) else {
            shrink.push(None);
            expand.push(None);
            continue;
        };
        let (a_len, b_len) = (rank * x_cols, out_cols * rank);
        let a = a.get(expert * a_step..expert * a_step + a_len);
        let b = b.get(expert * b_step..expert * b_step + b_len);
        let (Some(a), Some(b)) = (a, b) else {
            return Err(format!("pair {p}: expert {expert}'s matrices lie outside slot {slot}'s adapter"));
        };
        shrink.push(Some(PairMatrix { m: a, rows: rank }));
        expand.push(Some(PairMatrix { m: b, rows: out_cols }));
        max_rank = max_rank.max(rank);
    }
    if max_rank == 0 {
        return Ok(false);
    }
    let mut shrunk = vec![0.0; pairs * max_rank];
    project_pairs(isa, &shrink, x, x_cols, &mut shrunk, max_rank, threads)?;
    project_pairs(isa, &expand, &shrunk, max_rank, out, out_cols, threads)?;
    Ok(true)
}

/// `out`'s base, shared by the threads, which each write their own pairs' rows.
struct SharedOut(*mut f32);

// SAFETY: the threads write disjoint rows (see `project_pairs`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// `len` values from offset `first`.
    ///
    /// # Safety
    /// They lie within `out`, and no other live reference covers them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, first: usize, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(first), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::expert_pairs::Bf16;

    /// A fixed pseudo-random sequence in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The same sums in plain f64 loops, one pair at a time.
    fn reference<W: Element>(
        mats: &[Option<PairMatrix<W>>],
        x: &[f32],
        x_cols: usize,
        out: &mut [f32],
        out_cols: usize,
    ) {
        for (p, mat) in mats.iter().enumerate() {
            let Some(PairMatrix { m, rows }) = mat else { continue };
            let cols = m.len() / rows;
            for r in 0..*rows {
                let dot: f64 = (0..cols).map(|c| m[r * cols + c].to_f32() as f64 * x[p * x_cols + c] as f64).sum();
                out[p * out_cols + r] += dot as f32;
            }
        }
    }

    fn case<W: Element>(isa: Isa, convert: impl Fn(f32) -> W) {
        // three matrices of different shapes, pairs spread over them, some without one
        let shapes = [(5usize, 7usize), (3, 4), (5, 7)];
        let store: Vec<Vec<W>> = shapes
            .iter()
            .enumerate()
            .map(|(i, (r, c))| values(r * c, 10 + i as u64).into_iter().map(&convert).collect())
            .collect();
        let (x_cols, out_cols, pairs) = (9, 6, 23);
        let mats: Vec<Option<PairMatrix<W>>> = (0..pairs)
            .map(|p| (p % 4 != 3).then(|| PairMatrix { m: &store[p * 7 % 3][..], rows: shapes[p * 7 % 3].0 }))
            .collect();
        let x = values(pairs * x_cols, 3);
        let start = values(pairs * out_cols, 4);
        let mut got = start.clone();
        project_pairs(isa, &mats, &x, x_cols, &mut got, out_cols, 1).unwrap();
        let mut want = start.clone();
        reference(&mats, &x, x_cols, &mut want, out_cols);
        for (p, (g, w)) in got.chunks(out_cols).zip(want.chunks(out_cols)).enumerate() {
            for (g, w) in g.iter().zip(w) {
                assert!((g - w).abs() <= 1e-5, "{isa:?} pair {p}: {g} vs {w}");
            }
            if p % 4 == 3 {
                assert_eq!(g, &start[p * out_cols..(p + 1) * out_cols], "a pair without a matrix keeps its row");
            }
        }
    }

    #[test]
    fn matches_per_pair_reference_on_every_isa() {
        for isa in Isa::available() {
            case::<f32>(isa, |v| v);
            case::<Bf16>(isa, Bf16::from_f32);
        }
    }

    #[test]
    fn simd_builds_match_portable_and_rows_stand_alone() {
        // gemm_nt's AVX2 and AVX-512 products sum in one order, the portable one in another:
        // a pair's row equals the result it gets alone in the same build, and the builds agree
        // within float32 rounding
        let m: Vec<f32> = values(6 * 40, 1);
        let x = values(4 * 40, 2);
        let mats = vec![Some(PairMatrix { m: &m[..], rows: 6 }); 4];
        let run = |isa: Isa, mats: &[Option<PairMatrix<f32>>], x: &[f32]| {
            let mut out = vec![0.0; mats.len() * 6];
            project_pairs(isa, mats, x, 40, &mut out, 6, 1).unwrap();
            out
        };
        let portable = run(Isa::Scalar, &mats, &x);
        for isa in Isa::available() {
            let all = run(isa, &mats, &x);
            let alone = run(isa, &mats[..1], &x[40..80]);
            assert_eq!(all[6..12], alone[..], "{isa:?}: a pair's row does not depend on the others");
            for (a, p) in all.iter().zip(&portable) {
                assert!((a - p).abs() <= 1e-5 * (1.0 + p.abs()), "{isa:?}: {a} vs portable {p}");
            }
        }
    }

    #[test]
    fn wide_groups_within_rounding_of_the_small_products() {
        // 80 pairs on one matrix (packed kernels) against each pair alone (gemm_nt)
        let m: Vec<f32> = values(16 * 48, 7);
        let x = values(80 * 48, 8);
        let mats = vec![Some(PairMatrix { m: &m[..], rows: 16 }); 80];
        let mut wide = vec![0.0; 80 * 16];
        project_pairs(Isa::best(), &mats, &x, 48, &mut wide, 16, 1).unwrap();
        for p in 0..80 {
            let mut alone = vec![0.0; 16];
            project_pairs(Isa::best(), &mats[..1], &x[p * 48..(p + 1) * 48], 48, &mut alone, 16, 1).unwrap();
            for (w, a) in wide[p * 16..(p + 1) * 16].iter().zip(&alone) {
                assert!((w - a).abs() <= 1e-5 * (1.0 + a.abs()), "pair {p}: {w} vs {a}");
            }
        }
    }

    #[test]
    fn threads_change_no_bit() {
        // enough work to wake the threads: 8 matrices of 256 x 512, 4 pairs each
        let store: Vec<Vec<f32>> = (0..8).map(|i| values(256 * 512, 20 + i)).collect();
        let mats: Vec<Option<PairMatrix<f32>>> =
            (0..32).map(|p| Some(PairMatrix { m: &store[p % 8][..], rows: 256 })).collect();
        let x = values(32 * 512, 5);
        let run = |threads: usize| {
            let mut out = vec![0.0; 32 * 256];
            project_pairs(Isa::best(), &mats, &x, 512, &mut out, 256, threads).unwrap();
            out
        };
        assert_eq!(run(1), run(4));
    }

    /// add_low_rank against f64 loops over each pair's own A and B: two slots of different
    /// ranks, one per expert and one shared (step 0), a slot without an adapter, pairs of every
    /// slot and expert, on every ISA, in float32 and bfloat16, at 1 and 3 threads.
    fn low_rank_case<W: Element>(isa: Isa, convert: impl Fn(f32) -> W, threads: usize) {
        let (experts, x_cols, out_cols, pairs) = (3usize, 11usize, 7usize, 19usize);
        let ranks = [4usize, 2];
        let a0: Vec<W> = values(experts * ranks[0] * x_cols, 30).into_iter().map(&convert).collect();
        let b0: Vec<W> = values(experts * out_cols * ranks[0], 31).into_iter().map(&convert).collect();
        let a1: Vec<W> = values(ranks[1] * x_cols, 32).into_iter().map(&convert).collect(); // shared
        let b1: Vec<W> = values(experts * out_cols * ranks[1], 33).into_iter().map(&convert).collect();
        let slots = [
            None,
            Some(SlotAdapter {
                a: &a0[..],
                a_step: ranks[0] * x_cols,
                b: &b0[..],
                b_step: out_cols * ranks[0],
                rank: ranks[0],
            }),
            Some(SlotAdapter { a: &a1[..], a_step: 0, b: &b1[..], b_step: out_cols * ranks[1], rank: ranks[1] }),
        ];
        let pair_slots: Vec<usize> = (0..pairs).map(|p| p * 5 % 3).collect();
        let pair_experts: Vec<usize> = (0..pairs).map(|p| p * 7 % experts).collect();
        let x = values(pairs * x_cols, 34);
        let start = values(pairs * out_cols, 35);
        let mut got = start.clone();
        assert!(add_low_rank(isa, &slots, &pair_slots, &pair_experts, &x, x_cols, &mut got, out_cols, threads).unwrap());
        for p in 0..pairs {
            let row = &got[p * out_cols..(p + 1) * out_cols];
            let Some(s) = slots[pair_slots[p]] else {
                assert_eq!(row, &start[p * out_cols..(p + 1) * out_cols], "pair {p} without an adapter keeps its row");
                continue;
            };
            let (e, r) = (pair_experts[p], s.rank);
            let a = &s.a[e * s.a_step..e * s.a_step + r * x_cols];
            let b = &s.b[e * s.b_step..e * s.b_step + out_cols * r];
            let shrunk: Vec<f64> = (0..r)
                .map(|i| (0..x_cols).map(|c| a[i * x_cols + c].to_f32() as f64 * x[p * x_cols + c] as f64).sum())
                .collect();
            for (o, got) in row.iter().enumerate() {
                let delta: f64 = (0..r).map(|i| b[o * r + i].to_f32() as f64 * shrunk[i]).sum();
                let want = start[p * out_cols + o] as f64 + delta;
                assert!((*got as f64 - want).abs() <= 1e-4, "{isa:?} pair {p} row {o}: {got} vs {want}");
            }
        }
        let none = vec![0usize; pairs];
        let mut untouched = start.clone();
        assert!(
            !add_low_rank(isa, &slots, &none, &pair_experts, &x, x_cols, &mut untouched, out_cols, threads).unwrap()
        );
        assert_eq!(untouched, start);
    }

    #[test]
    fn low_rank_terms_match_per_pair_reference() {
        for isa in Isa::available() {
            for threads in [1, 3] {
                low_rank_case::<f32>(isa, |v| v, threads);
                low_rank_case::<Bf16>(isa, Bf16::from_f32, threads);
            }
        }
    }

    #[test]
    fn low_rank_rejects_slots_and_experts_outside_the_table() {
        let (a, b) = ([0f32; 8], [0f32; 6]); // one expert: A [2, 4], B [3, 2]
        let slots = [None, Some(SlotAdapter { a: &a[..], a_step: 8, b: &b[..], b_step: 6, rank: 2 })];
        let x = [0f32; 4];
        let mut out = [0f32; 3];
        let err = add_low_rank(Isa::Scalar, &slots, &[2], &[0], &x, 4, &mut out, 3, 1).unwrap_err();
        assert!(err.contains("slot 2"), "{err}");
        let err = add_low_rank(Isa::Scalar, &slots, &[1], &[1], &x, 4, &mut out, 3, 1).unwrap_err();
        assert!(err.contains("expert 1"), "{err}");
        assert!(add_low_rank(Isa::Scalar, &slots, &[1, 1], &[0], &x, 4, &mut out, 3, 1).is_err());
    }

    #[test]
    fn rejects_matrices_that_do_not_fit() {
        let m = [0f32; 12];
        let x = vec![0f32; 2 * 4];
        let mut out = vec![0f32; 2 * 3];
        let too_wide = [Some(PairMatrix { m: &m[..], rows: 2 }), None]; // 6 columns > 4
        assert!(project_pairs(Isa::Scalar, &too_wide, &x, 4, &mut out, 3, 1).unwrap_err().contains("pair 0"));
        let too_tall = [None, Some(PairMatrix { m: &m[..], rows: 4 })]; // 4 rows > 3
        assert!(project_pairs(Isa::Scalar, &too_tall, &x, 4, &mut out, 3, 1).unwrap_err().contains("pair 1"));
        assert!(project_pairs::<f32>(Isa::Scalar, &[None], &x, 4, &mut out, 3, 1).is_err());
    }
}

#[cfg(feature = "python")]
pub(crate) mod python {
    //! `r3srv._core.project_pairs_cpu`, called by r3srv.kernels.pair_projection_cpu, which
    //! passes the tensors as data addresses after checking their dtype, device and contiguity.

    use pyo3::exceptions::PyValueError;
    use pyo3::prelude::*;

    use super::{add_low_rank, project_pairs, PairMatrix, SlotAdapter};
    use crate::expert_pairs::{Bf16, Element, Isa};

    /// # Safety
    /// As `project_pairs_cpu` requires of its caller, with `W` the matrices' element type.
    unsafe fn run<W: Element>(
        py: Python<'_>,
        addresses: [usize; 5],
        shape: [usize; 3],
        threads: usize,
    ) -> PyResult<()> {
        use std::slice::{from_raw_parts, from_raw_parts_mut};
        let [x, out, mats, rows, cols] = addresses;
        let [pairs, x_cols, out_cols] = shape;
        let (mats, rows, cols) = (
            from_raw_parts(mats as *const i64, pairs),
            from_raw_parts(rows as *const i64, pairs),
            from_raw_parts(cols as *const i64, pairs),
        );
        let mats: Vec<Option<PairMatrix<W>>> = (0..pairs)
            .map(|p| {
                (mats[p] != 0 && rows[p] > 0 && cols[p] > 0).then(|| PairMatrix {
                    m: from_raw_parts(mats[p] as usize as *const W, rows[p] as usize * cols[p] as usize),
                    rows: rows[p] as usize,
                })
            })
            .collect();
        let x = from_raw_parts(x as *const f32, pairs * x_cols);
        let out = from_raw_parts_mut(out as *mut f32, pairs * out_cols);
        py.detach(|| project_pairs(Isa::best(), &mats, x, x_cols, out, out_cols, threads))
            .map_err(PyValueError::new_err)
    }

    /// out [P, out_cols] (float32) += per pair p with a matrix (address mats[p] != 0) the
    /// product of the row-major [rows[p], cols[p]] matrix at mats[p] (`dtype`: "float32" or
    /// "bfloat16") and x[p][..cols[p]] (x float32 [P, x_cols]), into out[p][..rows[p]]; mats,
    /// rows and cols are int64 [P]. `addresses`: (x, out, mats, rows, cols); `shape`: (P,
    /// x_cols, out_cols). Runs with the GIL released, on up to `threads` threads when the work
    /// is large enough.
    #[pyfunction]
    #[pyo3(signature = (addresses, shape, dtype, threads=1))]
    pub fn project_pairs_cpu(
        py: Python<'_>,
        addresses: [usize; 5],
        shape: [usize; 3],
        dtype: &str,
        threads: usize,
    ) -> PyResult<()> {
        if addresses.contains(&0) {
            return Err(PyValueError::new_err("project_pairs_cpu needs non-null tensors"));
        }
        // SAFETY: the caller (r3srv.kernels.pair_projection_cpu) passes the data addresses of
        // live, contiguous CPU tensors of these shapes (x and out float32, the tables int64),
        // each nonzero entry of mats the address of a live contiguous tensor of `dtype` holding
        // at least rows[p] x cols[p] values, keeps them alive for the call, and `out` aliases
        // none of the others.
        unsafe {
            match dtype {
                "float32" => run::<f32>(py, addresses, shape, threads),
                "bfloat16" => run::<Bf16>(py, addresses, shape, threads),
                other => {
                    Err(PyValueError::new_err(format!("project_pairs_cpu reads float32 or bfloat16, not {other:?}")))
                }
            }
        }
    }

    /// # Safety
    /// As `add_low_rank_cpu` requires of its caller, with `W` the adapters' element type.
    unsafe fn run_low_rank<W: Element>(
        py: Python<'_>,
        addresses: [usize; 5],
        shape: [usize; 5],
        threads: usize,
    ) -> PyResult<bool> {
        use std::slice::{from_raw_parts, from_raw_parts_mut};
        let [x, out, fields, pair_slots, pair_experts] = addresses;
        let [pairs, x_cols, out_cols, columns, num_experts] = shape;
        let fields = from_raw_parts(fields as *const i64, 5 * columns);
        let field = |f: usize, s: usize| usize::try_from(fields[f * columns + s]).unwrap_or(0);
        let size = std::mem::size_of::<W>();
        let slots: Vec<Option<SlotAdapter<W>>> = (0..columns)
            .map(|s| {
                let (a, a_step, b, b_step, rank) =
                    (field(0, s), field(1, s) / size, field(2, s), field(3, s) / size, field(4, s));
                let experts = |step: usize| if step == 0 { 1 } else { num_experts };
                (a != 0 && b != 0 && rank > 0).then(|| SlotAdapter {
                    a: from_raw_parts(a as *const W, (experts(a_step) - 1) * a_step + rank * x_cols),
                    a_step,
                    b: from_raw_parts(b as *const W, (experts(b_step) - 1) * b_step + out_cols * rank),
                    b_step,
                    rank,
                })
            })
            .collect();
        let index = |address: usize, what: &str| -> PyResult<Vec<usize>> {
            from_raw_parts(address as *const i64, pairs)
                .iter()
                .map(|&v| usize::try_from(v).map_err(|_| PyValueError::new_err(format!("a negative {what}: {v}"))))
                .collect()
        };
        let (pair_slots, pair_experts) = (index(pair_slots, "slot index")?, index(pair_experts, "expert")?);
        if let Some(e) = pair_experts.iter().find(|&&e| e >= num_experts) {
            return Err(PyValueError::new_err(format!("expert {e} of {num_experts}")));
        }
        let x = from_raw_parts(x as *const f32, pairs * x_cols);
        let out = from_raw_parts_mut(out as *mut f32, pairs * out_cols);
        py.detach(|| add_low_rank(Isa::best(), &slots, &pair_slots, &pair_experts, x, x_cols, out, out_cols, threads))
            .map_err(PyValueError::new_err)
    }

    /// out [P, out_cols] (float32) += B @ (A @ x[p]) for each pair p whose slot (column
    /// pair_slots[p] of the [5, columns] int64 table `fields`: A's address, A's byte step from
    /// one expert to the next, B's address, B's byte step, the rank; a column of zeros: none) has
    /// an adapter, of expert pair_experts[p] (< num_experts); x float32 [P, x_cols]; A
    /// [rank, x_cols] and B [out_cols, rank] of `dtype`. `addresses`: (x, out, fields,
    /// pair_slots, pair_experts); `shape`: (P, x_cols, out_cols, columns, num_experts). Whether
    /// any pair had an adapter. GIL released; up to `threads` threads.
    #[pyfunction]
    #[pyo3(signature = (addresses, shape, dtype, threads=1))]
    pub fn add_low_rank_cpu(
        py: Python<'_>,
        addresses: [usize; 5],
        shape: [usize; 5],
        dtype: &str,
        threads: usize,
    ) -> PyResult<bool> {
        if addresses.contains(&0) {
            return Err(PyValueError::new_err("add_low_rank_cpu needs non-null tensors"));
        }
        if shape[3] == 0 || shape[4] == 0 {
            return Err(PyValueError::new_err("add_low_rank_cpu needs a slot table and an expert"));
        }
        // SAFETY: the caller (r3srv.kernels.pair_projection_cpu) passes the data addresses of
        // live contiguous CPU tensors of these shapes (x and out float32, the tables int64),
        // every nonzero A and B address of `fields` that of a live contiguous tensor of `dtype`
        // holding its experts' (or, at a step of 0, one) [rank, x_cols] and [out_cols, rank]
        // matrices at that byte step, keeps them alive for the call, and `out` aliases none of
        // the others.
        unsafe {
            match dtype {
                "float32" => run_low_rank::<f32>(py, addresses, shape, threads),
                "bfloat16" => run_low_rank::<Bf16>(py, addresses, shape, threads),
                other => {
                    Err(PyValueError::new_err(format!("add_low_rank_cpu reads float32 or bfloat16, not {other:?}")))
                }
            }
        }
    }
}
