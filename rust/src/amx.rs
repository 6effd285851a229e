//! AMX tiles for `matmul_bf16`'s wide products: out [n, rows] = vectors as bfloat16 pairs
//! [n, K2] @ a weight packed as panels of [K2, 64] pairs, in TDPBF16PS (16 x 16 float32 sums of
//! 32 bfloat16 products each, per instruction), where the processor has AMX-BF16 and Linux
//! grants the process the tiles' state. On such a Xeon the AVX-512 BF16 dot products run the
//! expert pass's wide chunks several times slower (docs/benchmarks.md, "The AMX Xeon").
//!
//! Rust 1.95's AMX intrinsics are unstable, so the tile instructions are inline assembly: every
//! tile 16 rows x 64 bytes (one configuration), tmm0..tmm3 the sums of 32 vectors x 32 columns,
//! tmm4/tmm5 the vectors' two row blocks, tmm6/tmm7 the panel's two column blocks. The vectors
//! and the panels are padded with zero pairs to whole tiles (`pad_vectors`, a last partial block
//! of vectors copied into a zeroed one, the panels packed so), so no tile reads past its buffer
//! and the padding adds zero products. A tile sums its 16 pairs in an order of its own: within
//! float32 rounding of the dot products, not their bits; a vector's outputs do not depend on the
//! other vectors of the call.

use crate::aligned::Lines;
use std::sync::OnceLock;

/// Vectors (tile rows) and pairs (64 bytes) of one tile.
pub const TILE: usize = 16;
/// The weight panel's columns (`matmul_bf16`'s PANEL_ROWS): its rows are 256 bytes apart.
const PANEL: usize = 64;
/// Vectors and columns of one pass over K: 2 x 2 tiles of sums.
const BLOCK: usize = 2 * TILE;

/// Whether the tile kernel runs here: the CPU reports AMX-TILE and AMX-BF16 (CPUID leaf 7),
/// AVX-512 BF16 runs (the panels' packing), and Linux granted this process the tile data state
/// (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16 and later; the grant covers every thread).
/// Asked once.
pub fn runs() -> bool {
    static RUNS: OnceLock<bool> = OnceLock::new();
    *RUNS.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            use std::arch::x86_64::__cpuid_count;
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // leaf 7 read only where leaf 0 says it exists
            if __cpuid_count(0, 0).eax < 7 {
                return false;
            }
            let edx = __cpuid_count(7, 0).edx;
            let (amx_bf16, amx_tile) = (edx & (1 << 22) != 0, edx & (1 << 24) != 0);
            if !(amx_bf16 && amx_tile && crate::matmul_bf16::runs()) {
                return false;
            }
            // SAFETY: a system call that reads no memory; it fails (non-zero) where the kernel
            // or the CPU does not offer the state.
            return unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) } == 0;
        }
        #[allow(unreachable_code)]
        false
    })
}

/// pairs [n, k2] as [n, rounded_pairs(k2)] in `dst`, zero past k2.
pub fn pad_vectors(pairs: &[u32], k2: usize, dst: &mut Lines<u32>) {
    let n = pairs.len() / k2;
    let k2p = rounded_pairs(k2);
    dst.clear();
    dst.resize(n * k2p, 0);
    for (row, out) in pairs.chunks_exact(k2).zip(dst.chunks_exact_mut(k2p)) {
        out[..k2].copy_from_slice(row);
    }
}

/// K2 rounded up to whole tiles of pairs.
pub fn rounded_pairs(k2: usize) -> usize {
    k2.div_ceil(TILE) * TILE
}

/// The configuration every tile takes: palette 1, 16 rows of 64 bytes.
#[repr(C, align(64))]
pub(crate) struct Config(pub(crate) [u8; 64]);

pub(crate) fn config() -> Config {
    let mut c = [0u8; 64];
    c[0] = 1;
    for t in 0..8 {
        c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
        c[48 + t] = TILE as u8;
    }
    Config(c)
}

/// 2 x 2 tiles of sums from zero: tmm0..tmm3 = the rows at a0 and at a1 (16 each, `sa` bytes
/// apart) @ the pairs at b (16 rows `sb` bytes apart, two column tiles 64 bytes apart), over
/// `steps` steps of 16 pairs (a0 and a1 move 64 bytes a step, b `b_step` bytes), in the order
/// TDPBF16PS adds them; stored to c0 (tmm0, and tmm1 64 bytes on) and c1 (tmm2, tmm3), rows `sc`
/// bytes apart. The tile kernels' one loop: the expert products' and the flash attention's.
///
/// # Safety
/// The tiles configured (`config`, LDTILECFG) on this thread; steps >= 1; every tile read or
/// written lies within its buffer.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn block(
    a0: *const u32,
    a1: *const u32,
    sa: usize,
    b: *const u32,
    sb: usize,
    b_step: usize,
    steps: usize,
    c0: *mut f32,
    c1: *mut f32,
    sc: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tileloadd tmm6, [{b} + {sb}*1]",
            "tileloadd tmm7, [{b} + {sb}*1 + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b}, {b_step}",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{c0} + {sc}*1], tmm0",
            "tilestored [{c0} + {sc}*1 + 64], tmm1",
            "tilestored [{c1} + {sc}*1], tmm2",
            "tilestored [{c1} + {sc}*1 + 64], tmm3",
            a0 = inout(reg) a0 => _,
            a1 = inout(reg) a1 => _,
            b = inout(reg) b => _,
            steps = inout(reg) steps => _,
            sa = in(reg) sa,
            sb = in(reg) sb,
            b_step = in(reg) b_step,
            c0 = in(reg) c0,
            c1 = in(reg) c1,
            sc = in(reg) sc,
            options(nostack),
        );
    }
}

/// out [n, rows] = vectors [n, k2p] (`pad_vectors` where k2 is not whole tiles) @ the weight's
/// panels, each [k2p, 64] pairs (zero past k2), one after another, ceil(rows / 64) of them: 32
/// vectors at a time against every panel, so that their tiles stay in the L1 cache while the
/// panels stream from L2; a last partial block of vectors copied into `tail`, zero past n. Each
/// sum runs over the pairs in order, from zero, as TDPBF16PS adds them; a block of sums goes
/// straight into `out` where all of it lies within, through a scratch block at the edges.
///
/// # Safety
/// `runs()` must hold; the buffers must be as stated (checked).
#[cfg(target_arch = "x86_64")]
pub unsafe fn products(
    vectors: &[u32],
    k2p: usize,
    n: usize,
    panels: &[u32],
    rows: usize,
    out: &mut [f32],
    tail: &mut Lines<u32>,
) {
    use std::arch::asm;
    assert!(k2p > 0 && k2p.is_multiple_of(TILE), "amx::products: pairs not in whole tiles");
    assert!(vectors.len() >= n * k2p && panels.len() >= rows.div_ceil(PANEL) * k2p * PANEL);
    assert!(out.len() >= n * rows);
    let in_place = n / BLOCK * BLOCK;
    if in_place < n {
        tail.clear();
        tail.resize(BLOCK * k2p, 0);
        tail[..(n - in_place) * k2p].copy_from_slice(&vectors[in_place * k2p..n * k2p]);
    }
    let cfg = config();
    // SAFETY: runs() said the CPU has the tiles and the process may use them.
    unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
    let mut sums = [0f32; BLOCK * BLOCK];
    // whether the block at (j, first + half) writes straight into `out`: all of it lies within
    let in_out =
        |j: usize, first: usize, half: usize| j + BLOCK <= n && first + half + BLOCK <= rows.min(first + PANEL);
    // 32 vectors at a time against every panel, 32 of its columns at a time
    let mut blocks = (0..n)
        .step_by(BLOCK)
        .flat_map(|j| {
            (0..rows)
                .step_by(PANEL)
                .flat_map(move |first| (0..PANEL.min(rows - first)).step_by(BLOCK).map(move |half| (j, first, half)))
        })
        .peekable();
    while let Some((j, first, half)) = blocks.next() {
        // the next block's lines of `out` asked for while this one computes: out may be a
        // buffer no cache holds (the expert pass's pair outputs), and the tile stores waited on
        // each line's ownership (docs/benchmarks.md)
        if let Some(&(j, first, half)) = blocks.peek().filter(|&&(j, first, half)| in_out(j, first, half)) {
            for v in j..j + BLOCK {
                crate::prefetch::prefetch_for_write(&out[v * rows + first + half..][..BLOCK]);
            }
        }
        let cols = BLOCK.min(PANEL.min(rows - first) - half);
        let whole = in_out(j, first, half);
        let a0 = if j < in_place { vectors.as_ptr().add(j * k2p) } else { tail.as_ptr() };
        let b0 = panels.as_ptr().add(first / PANEL * k2p * PANEL + half);
        let (c, stride) =
            if whole { (out.as_mut_ptr().add(j * rows + first + half), rows) } else { (sums.as_mut_ptr(), BLOCK) };
        // SAFETY: the tiles read stay within the buffers (asserted above): the vectors' two row
        // blocks at j and j + 16 (of n, or of the tail's 32), pairs kk..kk + 16 of k2p; the
        // panel's rows kk..kk + 16 of k2p, columns half..half + 32 of its 64. A whole block's 32
        // rows of 32 sums lie within out (j + 32 <= n, its columns within the panel's width);
        // else the scratch block holds them.
        unsafe {
            block(
                a0,
                a0.add(TILE * k2p),
                k2p * 4,
                b0,
                PANEL * 4,
                TILE * PANEL * 4,
                k2p / TILE,
                c,
                c.add(TILE * stride),
                stride * 4,
            )
        };
        if !whole {
            for (v, sum) in sums.chunks_exact(BLOCK).take(n - j).enumerate() {
                let at = (j + v) * rows + first + half;
                out[at..at + cols].copy_from_slice(&sum[..cols]);
            }
        }
    }
    // SAFETY: as ldtilecfg above; hands the tile state back.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}
