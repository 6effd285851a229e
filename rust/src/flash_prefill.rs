//! The flash prefill attention both fast kernels share: bfloat16 in AMX tiles (`flash_amx`) or
//! AVX-512 BF16 dot products (`paged_prefill_bf16`) and float32 in AVX-512 or AVX2 FMA
//! (`paged_prefill_f32`). Each span's keys and values of each KV head are first packed from the
//! paged cache into blocks of KEYS keys, in the kernel's layout for its tiles (`Flash::pack`);
//! then every ROWS rows of scores (32 in AMX tiles; a query and a head of a KV head's group
//! each) walk their key blocks from position 0 with an online softmax in float32
//! (`Flash::tile`); an item's register tiles walk together, a few blocks at a time, so that the
//! blocks stay near the core while each tile takes them (`run_item`). A row's result depends
//! only on its own context, never on its tile, its chunk, its batch or the thread count. No sliding window and no sinks (each kernel's `takes`);
//! everything else is `paged_prefill`'s contract, which takes every call these kernels do not.

use crate::aligned::Lines;
use crate::paged_attn::{exp, Bf16, Element, Isa};
use crate::paged_prefill::PagedPrefill;

/// Keys per block: four 16-lane registers of scores per row.
pub(crate) const KEYS: usize = 64;
/// Rows of scores per register tile: 6 x 4 accumulators within the 32 registers.
pub(crate) const ROWS: usize = 6;
/// Rows of scores per call in any tiles: the AMX kernel's two row tiles (32).
const MAX_ROWS: usize = crate::flash_amx::ROWS;
/// Queries per work item (its rows: these queries times the group's heads).
const ITEM_QUERIES: usize = 32;

/// The registers a flash kernel's tiles run in, chosen once by what the CPU reports (the widest
/// it runs) or named to measure a narrower one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiles {
    /// AMX tiles (bfloat16 only, crate::flash_amx)
    Amx,
    Avx512,
    Avx2,
}

impl Tiles {
    /// Widest first.
    pub const ALL: [Tiles; 3] = [Tiles::Amx, Tiles::Avx512, Tiles::Avx2];

    pub fn name(self) -> &'static str {
        match self {
            Tiles::Amx => "amx",
            Tiles::Avx512 => "avx512",
            Tiles::Avx2 => "avx2",
        }
    }

    pub fn parse(name: &str) -> Option<Tiles> {
        Tiles::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// v_dim rounded up to whole blocks of four 16-lane registers (the values' packing and the
/// rows' sums hold zero columns past v_dim).
pub(crate) fn padded(v_dim: usize) -> usize {
    v_dim.next_multiple_of(64)
}

/// A flash kernel's element type: how it packs a span's keys and values and walks a tile of rows
/// over them.
pub(crate) trait Flash: Element {
    /// One span's keys and values of one KV head in the kernel's layout for its tiles, positions
    /// past the context zero.
    type Packed: Send + Sync;

    fn pack(p: &PagedPrefill<'_, Self>, slots: &[i64], kv_head: usize, tiles: Tiles) -> Self::Packed;

    /// Whether the kernel computes prefills of heads of `head_dim` (with a window, with sinks).
    fn takes(head_dim: usize, windowed: bool, sinks: bool) -> bool;

    /// Whether this CPU runs the kernel in `tiles`.
    fn runs(tiles: Tiles) -> bool;

    /// Whether `fastest` may choose `tiles` where they run (AMX: settings.amx_tiles).
    fn allowed(tiles: Tiles) -> bool {
        let _ = tiles;
        true
    }

    /// The widest tiles this CPU runs the kernel in and `allowed` lets it choose, if any.
    fn fastest() -> Option<Tiles> {
        Tiles::ALL.into_iter().find(|&t| Self::runs(t) && Self::allowed(t))
    }

    /// R rows' attention over key blocks `blocks` (a walk's: `Running` holds the rows' state
    /// between walks) into their sums `acc` ([R, padded(v_dim)], not yet normalized), in
    /// `tiles`; row i's query is at q[i], its position pos[i].
    ///
    /// # Safety
    /// `runs(tiles)`; q[..R] point at the rows' queries (head_dim elements each); `blocks` lies
    /// within packed and within the blocks of the rows' positions, after the blocks of the rows'
    /// earlier walks.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize>(
        tiles: Tiles,
        p: &PagedPrefill<'_, Self>,
        packed: &Self::Packed,
        q: &[*const Self; ROWS],
        pos: &[usize; ROWS],
        blocks: std::ops::Range<usize>,
        running: &mut Running,
        acc: &mut [f32],
        s: &mut Scratch,
    );

    /// `tile` of q.len() rows (at most MAX_ROWS) in AMX tiles.
    ///
    /// # Safety
    /// As `tile`; runs(Tiles::Amx).
    unsafe fn amx_tile(
        p: &PagedPrefill<'_, Self>,
        packed: &Self::Packed,
        q: &[*const Self],
        pos: &[usize],
        blocks: usize,
        s: &mut Scratch,
    ) {
        let _ = (p, packed, q, pos, blocks, s);
        unreachable!("no AMX tiles for this element type (runs(Tiles::Amx) is false)")
    }
}

/// A block's scores for R rows (`products`: q . k of its KEYS keys, four registers a row) into
/// `scores` [R, KEYS]: scaled, the keys after a row's query (position pos[i]) at -inf; returns
/// each row's new running maximum (at least max[i]).
///
/// # Safety
/// The CPU must support AVX-512F; scores holds R * KEYS floats. Inlined into the kernels' tiles
/// (compiled for AVX-512F), whose products stay in registers across it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn masked_scores<const R: usize>(
    products: &[[std::arch::x86_64::__m512; 4]; R],
    scale: f32,
    pos: &[usize; ROWS],
    b: usize,
    max: &[f32; R],
    scores: &mut [f32],
) -> [f32; R] {
    use std::arch::x86_64::*;
    debug_assert!(scores.len() >= R * KEYS);
    let mut tops = [0f32; R];
    let lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (i, a) in products.iter().enumerate() {
        let visible = _mm512_set1_epi32((pos[i] + 1).saturating_sub(b * KEYS).min(KEYS) as i32);
        let mut top = _mm512_set1_ps(max[i]);
        for (c, a) in a.iter().enumerate() {
            let seen = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * c as i32)), visible);
            let x =
                _mm512_mask_mov_ps(_mm512_set1_ps(f32::NEG_INFINITY), seen, _mm512_mul_ps(*a, _mm512_set1_ps(scale)));
            top = _mm512_max_ps(top, x);
            // SAFETY: row i's 16 lanes from 16 * c lie within scores (the caller's contract).
            unsafe { _mm512_storeu_ps(scores.as_mut_ptr().add(i * KEYS + 16 * c), x) };
        }
        tops[i] = _mm512_reduce_max_ps(top);
    }
    tops
}

/// Rows 0..R of the rows' sums `acc` [R, dv], columns c0..c0 + 64, as four registers a row (the
/// values' product adds to them in registers).
///
/// # Safety
/// The CPU must support AVX-512F; acc holds R rows of dv >= c0 + 64 floats. Inlined into the
/// kernels' tiles (compiled for AVX-512F).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn load_sums<const R: usize>(
    acc: &[f32],
    dv: usize,
    c0: usize,
) -> [[std::arch::x86_64::__m512; 4]; R] {
    use std::arch::x86_64::*;
    let mut sums = [[_mm512_setzero_ps(); 4]; R];
    for (i, row) in sums.iter_mut().enumerate() {
        for (c, v) in row.iter_mut().enumerate() {
            // SAFETY: inside acc (the caller's contract).
            *v = unsafe { _mm512_loadu_ps(acc.as_ptr().add(i * dv + c0 + 16 * c)) };
        }
    }
    sums
}

/// `load_sums`'s registers stored back.
///
/// # Safety
/// As `load_sums`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn store_sums<const R: usize>(
    sums: &[[std::arch::x86_64::__m512; 4]; R],
    acc: &mut [f32],
    dv: usize,
    c0: usize,
) {
    use std::arch::x86_64::*;
    for (i, row) in sums.iter().enumerate() {
        for (c, v) in row.iter().enumerate() {
            // SAFETY: inside acc (the caller's contract).
            unsafe { _mm512_storeu_ps(acc.as_mut_ptr().add(i * dv + c0 + 16 * c), *v) };
        }
    }
}

/// A register tile's rows' online softmax between its walks over the key blocks: each row's
/// running maximum and sum of weights (-inf and 0 before the first block).
pub(crate) struct Running {
    max: [f32; ROWS],
    total: [f32; ROWS],
}

impl Running {
    fn new() -> Self {
        Running { max: [f32::NEG_INFINITY; ROWS], total: [0.0; ROWS] }
    }

    /// The first R rows' maxima and sums, for a walk to carry in registers.
    #[inline(always)]
    pub(crate) fn rows<const R: usize>(&self) -> ([f32; R], [f32; R]) {
        (std::array::from_fn(|i| self.max[i]), std::array::from_fn(|i| self.total[i]))
    }

    /// `rows` kept after a walk.
    #[inline(always)]
    pub(crate) fn keep<const R: usize>(&mut self, max: [f32; R], total: [f32; R]) {
        self.max[..R].copy_from_slice(&max);
        self.total[..R].copy_from_slice(&total);
    }
}

/// Each row of `acc` [rows, dv] divided by its sum of weights: the tile's result.
#[inline(always)]
pub(crate) fn normalize(acc: &mut [f32], totals: &[f32], dv: usize) {
    for (row, total) in acc.chunks_exact_mut(dv).zip(totals) {
        let norm = 1.0 / total;
        row.iter_mut().for_each(|a| *a *= norm);
    }
}

/// A row's block of scores to its weights in place, e^(score - top) (`top`: its new running
/// maximum, `max` its old one); returns the factor its earlier sums take to `top` (`advance_row`).
/// `exp_weight`'s loop, inlined into each tile, so vectorized at the tile's width with fused
/// multiply-adds: the same bits in AVX-512 and AVX2 tiles.
#[inline(always)]
pub(crate) fn exp_row(scores: &mut [f32], top: f32, max: f32) -> f32 {
    crate::paged_attn::exp_shifted(scores, top);
    // a block a row sees none of leaves it exactly as it was
    if top == max {
        1.0
    } else {
        exp(max - top)
    }
}

/// The sum of a row's block of KEYS weights from its halves: `lo` holds lanes 0..8 and `hi`
/// lanes 8..16 of ((c0 + c1) + (c2 + c3)), the block's four 16-lane columns c; lane l and l + 8
/// added, then halves down to one. The one order both float32 tiles sum in (the same bits).
///
/// # Safety
/// The CPU must support AVX. Inlined into the kernels' tiles.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn sum_halves(lo: std::arch::x86_64::__m256, hi: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let eight = _mm256_add_ps(lo, hi);
    let four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps::<1>(eight));
    let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps::<1>(two, two)))
}

/// A row's state after a block whose weights sum to `block_sum`: its sum and accumulators
/// rescaled by `fix` (`exp_row`'s), its running maximum `top`.
#[inline(always)]
pub(crate) fn advance_row(max: &mut f32, total: &mut f32, acc: &mut [f32], top: f32, fix: f32, block_sum: f32) {
    *total = *total * fix + block_sum;
    *max = top;
    if fix != 1.0 {
        acc.iter_mut().for_each(|a| *a *= fix);
    }
}

/// A thread's buffers for a tile: scores [rows, KEYS], bfloat16 weights [rows, KEYS / 2] (pairs),
/// the rows' sums [rows, padded(v_dim)] (an item's rows for register tiles: `run_item` sizes
/// them); for AMX tiles also the rows' queries [rows, key pairs] and a block's sums of values
/// [rows, padded(v_dim)] (rows: the tiles' rows a call).
pub(crate) struct Scratch {
    pub scores: Lines<f32>,
    pub weights: Lines<u32>,
    pub acc: Lines<f32>,
    pub queries: Lines<u32>,
    pub block: Lines<f32>,
}

impl Scratch {
    fn new(head_dim: usize, v_dim: usize, tiles: Tiles) -> Self {
        let (rows, dv) = (rows_per_call(tiles), padded(v_dim));
        let amx = tiles == Tiles::Amx;
        let keys = if amx { crate::flash_amx::STEP * KEYS } else { KEYS };
        Scratch {
            // AMX tiles: two steps' scores (crate::flash_amx's pipeline)
            scores: Lines::filled(if amx { 2 * rows * crate::flash_amx::SCORES_ROW } else { rows * keys }, 0.0),
            weights: Lines::filled(rows * if amx { crate::flash_amx::WEIGHTS_ROW } else { keys / 2 }, 0),
            acc: Lines::filled(rows * dv, 0.0),
            queries: Lines::filled(if amx { rows * crate::flash_amx::key_pairs(head_dim) } else { 0 }, 0),
            block: Lines::filled(if amx { rows * dv } else { 0 }, 0.0),
        }
    }
}

/// The rows one tile call takes in `tiles`.
fn rows_per_call(tiles: Tiles) -> usize {
    if tiles == Tiles::Amx {
        MAX_ROWS
    } else {
        ROWS
    }
}

/// Prefill attention by element type, each on its fastest kernel here: the flash kernel where it
/// applies, everything else in `paged_prefill`'s portable one.
pub trait Prefill: Element + Sized {
    /// Whether `run_flash` takes prefills of heads of `head_dim` (with a window, with sinks) on
    /// this CPU at any context length (past the portable kernel's, where SDPA runs otherwise).
    fn flash_applies(head_dim: usize, windowed: bool, sinks: bool) -> bool;

    /// `paged_prefill` in the flash kernel where it applies, in `tiles` (None: the widest this CPU
    /// runs; a named one it does not run is an error): Ok(false) where it does not apply (nothing
    /// written).
    fn run_flash(
        p: &PagedPrefill<'_, Self>,
        out: &mut [Self],
        threads: usize,
        tiles: Option<Tiles>,
    ) -> Result<bool, String>;

    fn prefill(
        p: &PagedPrefill<'_, Self>,
        out: &mut [Self],
        threads: usize,
        isa: Isa,
        tiles: Option<Tiles>,
    ) -> Result<(), String> {
        if Self::run_flash(p, out, threads, tiles)? {
            return Ok(());
        }
        crate::paged_prefill::paged_prefill(p, out, threads, isa)
    }
}

impl Prefill for f32 {
    fn flash_applies(head_dim: usize, windowed: bool, sinks: bool) -> bool {
        crate::paged_prefill_f32::applies_to(head_dim, windowed, sinks)
    }

    fn run_flash(
        p: &PagedPrefill<'_, Self>,
        out: &mut [Self],
        threads: usize,
        tiles: Option<Tiles>,
    ) -> Result<bool, String> {
        flash_where_it_applies(p, out, threads, tiles)
    }
}

impl Prefill for Bf16 {
    fn flash_applies(head_dim: usize, windowed: bool, sinks: bool) -> bool {
        crate::paged_prefill_bf16::applies_to(head_dim, windowed, sinks)
    }

    fn run_flash(
        p: &PagedPrefill<'_, Self>,
        out: &mut [Self],
        threads: usize,
        tiles: Option<Tiles>,
    ) -> Result<bool, String> {
        flash_where_it_applies(p, out, threads, tiles)
    }
}

fn flash_where_it_applies<T: Flash + Prefill>(
    p: &PagedPrefill<'_, T>,
    out: &mut [T],
    threads: usize,
    tiles: Option<Tiles>,
) -> Result<bool, String> {
    if let Some(t) = tiles.filter(|&t| !T::runs(t)) {
        return Err(format!("this CPU does not run the {} flash prefill tiles for this dtype", t.name()));
    }
    let tiles = match tiles.or_else(T::fastest) {
        Some(t) if T::takes(p.q.dim, p.window.is_some(), p.sinks.is_some()) => t,
        _ => return Ok(false),
    };
    let valid = crate::paged_prefill::validate(p, out.len())?;
    prefill(p, &valid.order, out, threads, valid.macs, tiles);
    Ok(true)
}

/// The output's rows, written by several threads, each (query, head) row by one of them.
#[derive(Clone, Copy)]
struct Out<T>(*mut T);
// SAFETY: the items cover disjoint (query, head) rows (see `prefill`).
unsafe impl<T> Send for Out<T> {}
unsafe impl<T> Sync for Out<T> {}

/// A span's block of queries of one KV head.
struct Item {
    span: usize,
    kv_head: usize,
    first: usize,
    count: usize,
}

/// The flash kernel over validated spans: `order` lists (first row, span, where its slots start).
fn prefill<T: Flash>(
    p: &PagedPrefill<'_, T>,
    order: &[(usize, usize, usize)],
    out: &mut [T],
    threads: usize,
    macs: usize,
    tiles: Tiles,
) {
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
    items.sort_by_key(|(_, item)| {
        std::cmp::Reverse(p.context_lens[item.span] as usize - p.q_lens[item.span] as usize + item.first)
    });
    let threads = threads.min(macs / crate::paged_attn::PARALLEL_MIN_MACS).clamp(1, items.len().max(1));
    // each (span, KV head)'s keys and values packed, by the same threads
    let mut jobs: Vec<(usize, usize, Option<T::Packed>)> =
        (0..order.len()).flat_map(|o| (0..kv_heads).map(move |g| (o, g, None))).collect();
    crate::workers::take_in_turn(threads.min(jobs.len()), &mut jobs, &|jobs| {
        for (o, g, packed) in jobs {
            let (_, span, at) = order[*o];
            *packed = Some(T::pack(p, &p.slots[at..at + p.context_lens[span] as usize], *g, tiles));
        }
    });
    let packed: Vec<T::Packed> = jobs.into_iter().map(|(_, _, packed)| packed.expect("every job ran")).collect();
    let dst = Out(out.as_mut_ptr());
    crate::workers::take_in_turn(threads, &mut items, &|items| {
        let mut scratch = Scratch::new(p.q.dim, p.v.dim, tiles);
        for (o, item) in items {
            // SAFETY: flash_where_it_applies checked that the CPU runs `tiles`; the item's rows
            // of `out` are its own.
            unsafe { run_item(tiles, p, &packed[*o * kv_heads + item.kv_head], item, &mut scratch, dst) };
        }
    });
}

/// The keys and values of the key blocks a walk takes (`run_item`), about an eighth of an L2
/// cache: an item's register tiles take a walk's blocks one after another while they stay near
/// the core, where each tile walking all of a long context read it from L3 every time.
const WALK_BYTES: usize = 256 * 1024;

/// One register tile of an item: its first row (of the item's), its rows' queries and
/// positions (the first n of ROWS), the key blocks they see, and their online softmax between
/// walks.
struct TileRows<T> {
    r0: usize,
    q: [*const T; ROWS],
    pos: [usize; ROWS],
    n: usize,
    blocks: usize,
    running: Running,
}

/// # Safety
/// As `Flash::tile`; `out` is `paged_prefill`'s output, whose rows of this item no other thread writes.
unsafe fn run_item<T: Flash>(
    tiles: Tiles,
    p: &PagedPrefill<'_, T>,
    packed: &T::Packed,
    item: &Item,
    s: &mut Scratch,
    out: Out<T>,
) {
    let group = p.q.heads / p.k.heads;
    let (span, ctx) = (item.span, p.context_lens[item.span] as usize);
    let q_len = p.q_lens[span] as usize;
    let start = p.q_starts[span] as usize;
    let rows = item.count * group;
    let (dv, dvp) = (p.v.dim, padded(p.v.dim));
    // row r: query item.first + r / group, head kv_head * group + r % group
    let query_head = |r: usize| (item.first + r / group, item.kv_head * group + r % group);
    // rows r0..: their queries and positions into q and pos; returns the key blocks they see
    let fill_rows = |r0: usize, q: &mut [*const T], pos: &mut [usize]| {
        for (i, (q, pos)) in q.iter_mut().zip(pos.iter_mut()).enumerate() {
            let (query, head) = query_head(r0 + i);
            *q = p.q.at(start + query, head).as_ptr();
            *pos = ctx - q_len + query;
        }
        pos.iter().max().unwrap() / KEYS + 1
    };
    // the item's rows from 0: their sums (normalized) into their rows of `out`
    let write = |first: usize, sums: &[f32]| {
        for (i, sums) in sums.chunks_exact(dvp).enumerate() {
            let (query, head) = query_head(first + i);
            // SAFETY: the row lies inside `out` (validated spans) and is this item's own.
            let row =
                unsafe { std::slice::from_raw_parts_mut(out.0.add(((start + query) * p.q.heads + head) * dv), dv) };
            for (o, &a) in row.iter_mut().zip(&sums[..dv]) {
                *o = T::from_f32(a);
            }
        }
    };
    if tiles == Tiles::Amx {
        for r0 in (0..rows).step_by(MAX_ROWS) {
            let n = MAX_ROWS.min(rows - r0);
            let (mut q, mut pos) = ([std::ptr::null::<T>(); MAX_ROWS], [0usize; MAX_ROWS]);
            let blocks = fill_rows(r0, &mut q[..n], &mut pos[..n]);
            // SAFETY: forwarded, the caller's contract; q[..n] point at the rows' queries.
            unsafe { T::amx_tile(p, packed, &q[..n], &pos[..n], blocks, s) };
            write(r0, &s.acc[..n * dvp]);
        }
        return;
    }
    let mut tile_rows: Vec<TileRows<T>> = (0..rows)
        .step_by(ROWS)
        .map(|r0| {
            let n = ROWS.min(rows - r0);
            let mut t =
                TileRows { r0, q: [std::ptr::null(); ROWS], pos: [0; ROWS], n, blocks: 0, running: Running::new() };
            t.blocks = fill_rows(r0, &mut t.q[..n], &mut t.pos[..n]);
            t
        })
        .collect();
    let mut acc = std::mem::take(&mut s.acc);
    acc.clear();
    acc.resize(rows * dvp, 0.0);
    // every tile over a walk's blocks before the next walk (each tile's blocks in order, as one
    // walk over all of them would take them: the same sums)
    let walk = (WALK_BYTES / (KEYS * (p.q.dim + dvp) * std::mem::size_of::<T>())).max(1);
    let most = tile_rows.iter().map(|t| t.blocks).max().unwrap_or(0);
    for b0 in (0..most).step_by(walk) {
        for t in tile_rows.iter_mut() {
            let blocks = b0..t.blocks.min(b0 + walk);
            if blocks.is_empty() {
                continue;
            }
            let sums = &mut acc[t.r0 * dvp..(t.r0 + t.n) * dvp];
            // SAFETY: forwarded, the caller's contract; q[..n] point at the rows' queries and
            // the blocks follow the tile's earlier walks'.
            unsafe {
                match t.n {
                    6 => T::tile::<6>(tiles, p, packed, &t.q, &t.pos, blocks, &mut t.running, sums, s),
                    5 => T::tile::<5>(tiles, p, packed, &t.q, &t.pos, blocks, &mut t.running, sums, s),
                    4 => T::tile::<4>(tiles, p, packed, &t.q, &t.pos, blocks, &mut t.running, sums, s),
                    3 => T::tile::<3>(tiles, p, packed, &t.q, &t.pos, blocks, &mut t.running, sums, s),
                    2 => T::tile::<2>(tiles, p, packed, &t.q, &t.pos, blocks, &mut t.running, sums, s),
                    _ => T::tile::<1>(tiles, p, packed, &t.q, &t.pos, blocks, &mut t.running, sums, s),
                }
            }
        }
    }
    for t in &tile_rows {
        let sums = &mut acc[t.r0 * dvp..(t.r0 + t.n) * dvp];
        normalize(sums, &t.running.total[..t.n], dvp);
        write(t.r0, sums);
    }
    s.acc = acc;
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::paged_attn::exp_weight;
    use crate::testing::noise;

    /// `exp_row` inlined at AVX-512's width, as the AVX-512 tiles take it.
    #[target_feature(enable = "avx512f")]
    unsafe fn exp_row_512(scores: &mut [f32], top: f32, max: f32) -> f32 {
        exp_row(scores, top, max)
    }

    /// `exp_row` inlined at AVX2's width, as the AVX2 tiles take it.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_row_256(scores: &mut [f32], top: f32, max: f32) -> f32 {
        exp_row(scores, top, max)
    }

    #[test]
    fn a_rows_weights_are_the_scalar_exponentials_bits_in_avx512_and_avx2() {
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        let avx512 = is_x86_feature_detected!("avx512f");
        if !avx2 {
            eprintln!("skipped: this CPU lacks AVX2 with FMA (the rows' weights in registers)");
            return;
        }
        if !avx512 {
            eprintln!("this CPU lacks AVX-512F: the rows' weights checked in AVX2 registers only");
        }
        for seed in 0..50 {
            // scores over [-100, 0] below a top of 0, and a masked key (-inf), the top itself,
            // a NaN and the smallest normal's log
            let mut scores: Vec<f32> = noise(KEYS, seed).iter().map(|v| (v - 2.0) * 25.0).collect();
            scores[..4].copy_from_slice(&[f32::NEG_INFINITY, 0.0, f32::NAN, crate::paged_attn::SMALLEST_NORMAL_LN]);
            let want: Vec<u32> = scores.iter().map(|&x| exp_weight(x).to_bits()).collect();
            let mut narrow = scores.clone();
            // SAFETY: checked above.
            assert_eq!(unsafe { exp_row_256(&mut narrow, 0.0, 0.0) }, 1.0);
            assert_eq!(narrow.iter().map(|w| w.to_bits()).collect::<Vec<_>>(), want);
            if avx512 {
                let mut wide = scores.clone();
                // SAFETY: checked above.
                assert_eq!(unsafe { exp_row_512(&mut wide, 0.0, -1.0) }, exp(-1.0));
                assert_eq!(wide.iter().map(|w| w.to_bits()).collect::<Vec<_>>(), want);
            }
        }
    }
}
