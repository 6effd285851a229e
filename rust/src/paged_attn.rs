//! Paged decode attention on the CPU: each decoding sequence's query token attends over its keys
//! and values where they lie in the paged KV cache, read through its block table, without the
//! gathered copy the torch path makes (python/r3srv/ops/attention.py). The CPU counterpart of
//! python/r3srv/kernels/paged_decode_triton.py, with its semantics: GQA (a KV head's keys are
//! read once for its group of query heads), an optional sliding window (the last `window`
//! positions), optional per-head sink logits in the softmax's denominator.
//!
//! One work item is a sequence: it walks the context in tiles of keys with an online softmax in
//! f32; for each KV head of a tile, the scores of its group of query heads, one rescale of their
//! accumulators, then the values weighted into them (a slot's KV heads, adjacent in the cache,
//! are read together). The dot products, the weighted sums and the
//! exponentials are loops the compiler vectorizes; they are compiled for AVX2 + FMA (chosen at
//! run time when the CPU has them) and for the baseline ISA, and where the CPU has AVX-512F the
//! AVX2 kernel runs its products in AVX-512 registers (the scores in `paged_attn_512.rs`), with
//! the AVX2 kernel's bits; where it has AVX-512 BF16 too, a bfloat16 cache's GQA groups of eight
//! or more heads are scored in dot products (`paged_attn_dots.rs`, Isa::Avx512Bf16): close to
//! those bits, not them.

/// A cache or activation element: f32, or bfloat16 accumulated in f32.
pub trait Element: Copy + Send + Sync {
    /// The query heads that share each key and value row's load in AVX-512 registers
    /// (`in_head_blocks`): a bfloat16 row is widened to f32 at each load, so a GQA group of eight
    /// or more widens it once for eight heads, not twice for two blocks of four; float32 rows,
    /// loaded as they are, ran slower in blocks of eight (docs/benchmarks.md, "Decode attention
    /// in head blocks of eight").
    #[cfg(target_arch = "x86_64")]
    const WIDE_HEAD_BLOCK: usize;
    /// Whether a row's elements are bfloat16, which `Isa::Avx512Bf16` scores in dot products
    /// (crate::paged_attn_dots) in GQA blocks of eight heads.
    const BF16: bool;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// The 8 elements at `src` as f32 lanes. Each impl is compiled for AVX2 itself
    /// (`#[target_feature]`), so that its intrinsics inline into the AVX2 kernels: marked only
    /// `#[inline(always)]`, the bfloat16 widening stayed two calls a load, and bfloat16 decode
    /// attention ran 15-25x slower than float32.
    ///
    /// # Safety
    /// The CPU must support AVX2; `src` must point to 8 readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(src: *const Self) -> std::arch::x86_64::__m256;

    /// `load8` of `lo` in the low 8 lanes and of `hi` in the high 8 (two keys in one register).
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `lo` and `hi` must each point to 8 readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8x2(lo: *const Self, hi: *const Self) -> std::arch::x86_64::__m512;

    /// The 16 elements at `src` as f32 lanes.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `src` must point to 16 readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(src: *const Self) -> std::arch::x86_64::__m512;
}

impl Element for f32 {
    #[cfg(target_arch = "x86_64")]
    const WIDE_HEAD_BLOCK: usize = HEAD_BLOCK;
    const BF16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn load8(src: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: 8 readable f32 at src (the caller's contract); an unaligned load.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(src) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load8x2(lo: *const Self, hi: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: 8 readable f32 at lo and at hi (the caller's contract); unaligned loads.
        unsafe {
            let low = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(lo)));
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(low, _mm256_castps_pd(_mm256_loadu_ps(hi))))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(src: *const Self) -> std::arch::x86_64::__m512 {
        // SAFETY: 16 readable f32 at src (the caller's contract); an unaligned load.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(src) }
    }
}

/// bfloat16 as its bits (torch.bfloat16's layout: the high half of an f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Element for Bf16 {
    #[cfg(target_arch = "x86_64")]
    const WIDE_HEAD_BLOCK: usize = HEAD_BLOCK_WIDE;
    const BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
    /// Round to nearest, ties to even (as torch rounds), NaN kept a (quiet) NaN.
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        let bits = x.to_bits();
        if x.is_nan() {
            return Bf16(((bits >> 16) | 0x40) as u16);
        }
        Bf16(((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn load8(src: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: 8 readable bfloat16 (16 bytes) at src and AVX2 (the caller's contract);
        // widened to 32 bits and shifted into the high half: the f32 of the same value.
        unsafe {
            let half = _mm_loadu_si128(src as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(half)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load8x2(lo: *const Self, hi: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: 8 readable bfloat16 at lo and at hi and AVX-512F (the caller's contract);
        // widened and shifted as load8 widens them.
        unsafe {
            let both = _mm256_inserti128_si256::<1>(
                _mm256_castsi128_si256(_mm_loadu_si128(lo as *const __m128i)),
                _mm_loadu_si128(hi as *const __m128i),
            );
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(both)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(src: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: 16 readable bfloat16 (32 bytes) at src and AVX-512F (the caller's contract).
        unsafe {
            let half = _mm256_loadu_si256(src as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half)))
        }
    }
}

/// A [rows, heads, dim] tensor: element (r, h, i) at `r * row_stride + h * head_stride + i`.
#[derive(Clone, Copy, Debug)]
pub struct Strided<'a, T> {
    pub data: &'a [T],
    pub rows: usize,
    pub heads: usize,
    pub dim: usize,
    pub row_stride: usize,
    pub head_stride: usize,
}

impl<'a, T> Strided<'a, T> {
    /// The elements a [rows, heads, dim] tensor with these strides spans (0 when empty).
    pub fn span(rows: usize, heads: usize, dim: usize, row_stride: usize, head_stride: usize) -> Option<usize> {
        if rows == 0 || heads == 0 || dim == 0 {
            return Some(0);
        }
        (rows - 1).checked_mul(row_stride)?.checked_add((heads - 1).checked_mul(head_stride)?)?.checked_add(dim)
    }

    pub fn new(
        data: &'a [T],
        rows: usize,
        heads: usize,
        dim: usize,
        row_stride: usize,
        head_stride: usize,
    ) -> Result<Self, String> {
        match Self::span(rows, heads, dim, row_stride, head_stride) {
            Some(n) if n <= data.len() => Ok(Strided { data, rows, heads, dim, row_stride, head_stride }),
            _ => Err(format!("a [{rows}, {heads}, {dim}] tensor with strides ({row_stride}, {head_stride}, 1) overruns its {} elements", data.len())),
        }
    }

    #[inline(always)]
    pub(crate) fn at(&self, row: usize, head: usize) -> &'a [T] {
        &self.data[row * self.row_stride + head * self.head_stride..][..self.dim]
    }
}

/// One layer's decodes: query rows, the paged cache and each sequence's place in it.
#[derive(Clone, Copy, Debug)]
pub struct PagedDecode<'a, T> {
    /// [tokens, heads, head_dim]: the step's queries; sequence i's is row `rows[i]`.
    pub q: Strided<'a, T>,
    /// [slots, kv_heads, head_dim]; slot = block * page + offset.
    pub k: Strided<'a, T>,
    /// [slots, kv_heads, v_dim] (may view the keys' leading dims: MLA's latents).
    pub v: Strided<'a, T>,
    /// [sequences, max_blocks] block tables, row-major.
    pub tables: &'a [i64],
    pub max_blocks: usize,
    /// Context lengths (this token included) and rows in q (and in the output).
    pub lens: &'a [i64],
    pub rows: &'a [i64],
    pub page: usize,
    pub scale: f32,
    /// Keys visible to a query: its last `window` positions.
    pub window: Option<usize>,
    /// Per query head, a logit that joins the softmax's denominator.
    pub sinks: Option<&'a [f32]>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Avx512, with bfloat16 rows' scores in AVX-512 BF16 dot products where a GQA group has
    /// eight heads or more (crate::paged_attn_dots: close to Avx512's, not its bits)
    Avx512Bf16,
    /// the AVX2 kernels with the decode kernel's products 16 lanes wide (the same bits)
    Avx512,
    Avx2Fma,
    Scalar,
}

impl Isa {
    /// The fastest this CPU runs.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return if Isa::Avx512Bf16.runs() {
                Isa::Avx512Bf16
            } else if is_x86_feature_detected!("avx512f") {
                Isa::Avx512
            } else {
                Isa::Avx2Fma
            };
        }
        Isa::Scalar
    }

    /// Whether this CPU runs `self`.
    pub fn runs(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            match self {
                Isa::Avx512Bf16 => {
                    Isa::Avx512.runs() && is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512vl")
                }
                Isa::Avx512 => avx2 && is_x86_feature_detected!("avx512f"),
                Isa::Avx2Fma => avx2,
                Isa::Scalar => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Scalar
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Bf16 => "avx512_bf16",
            Isa::Avx512 => "avx512",
            Isa::Avx2Fma => "avx2",
            Isa::Scalar => "portable",
        }
    }
}

/// Keys scored per tile: the softmax's running max rescales the accumulators once per tile.
pub(crate) const TILE: usize = 32;
/// The fewest multiply-adds worth a thread of their own (about 100 us of work): waking one
/// costs microseconds, and its share must outweigh that.
pub(crate) const PARALLEL_MIN_MACS: usize = 1 << 19;

/// Keys per part of a long context: each part of a sequence is an item of its own, so that the
/// threads share one long sequence's keys, each reading whole blocks of them (one KV head's
/// rows a thread, the split this replaced, read every other row of the same blocks and ran
/// slower on two threads than on one: docs/benchmarks.md); the parts' running maxima, sums and
/// weighted values are combined in part order once every item has run. The parts depend only
/// on the context's visible keys, so a row's bits are the same on any number of threads and
/// whatever the batch.
pub(crate) const PART_KEYS: usize = 512;

struct Item<'o, T> {
    seq: usize,
    start: usize,
    end: usize,
    dst: Dst<'o, T>,
}

/// Where an item's result goes.
enum Dst<'o, T> {
    /// The sequence's output row, [heads, v_dim].
    Row(&'o mut [T]),
    /// One part of a long context: each head's (max, total, weighted values [v_dim]), for
    /// `combine_parts`.
    Part(&'o mut [f32]),
}

/// A context's parts (`PART_KEYS`), 1 for a context no longer than one part.
fn parts(start: usize, end: usize) -> usize {
    (end - start).div_ceil(PART_KEYS).max(1)
}

/// Decode attention into `out` ([tokens, heads, v_dim], contiguous): sequence i's heads go to
/// row `rows[i]`; other rows are left as they were. Validates every index it will follow (rows
/// distinct and in range, contexts within their tables, visible blocks within the cache) before
/// writing anything; splits the work over up to `threads` threads when there is enough.
pub fn paged_decode<T: Element>(d: &PagedDecode<'_, T>, out: &mut [T], threads: usize, isa: Isa) -> Result<(), String> {
    let (heads, kv_heads) = (d.q.heads, d.k.heads);
    let (head_dim, v_dim) = (d.q.dim, d.v.dim);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(format!("{heads} query heads do not divide into {kv_heads} KV heads"));
    }
    if d.k.dim != head_dim || d.v.heads != kv_heads || d.v.rows != d.k.rows {
        return Err(format!(
            "queries [_, {heads}, {head_dim}], keys [{}, {kv_heads}, {}] and values [{}, {}, {v_dim}] do not match",
            d.k.rows, d.k.dim, d.v.rows, d.v.heads
        ));
    }
    if d.page == 0 {
        return Err("the page (block size) must be positive".into());
    }
    let seqs = d.rows.len();
    if d.lens.len() != seqs || d.tables.len() < seqs * d.max_blocks {
        return Err(format!(
            "{seqs} rows, {} context lengths and {} table entries for {} blocks each do not match",
            d.lens.len(),
            d.tables.len(),
            d.max_blocks
        ));
    }
    if let Some(s) = d.sinks {
        if s.len() != heads {
            return Err(format!("{} sinks for {heads} heads", s.len()));
        }
    }
    let row_len = heads * v_dim;
    if out.len() != d.q.rows * row_len {
        return Err(format!("the output holds {} elements, not [{}, {heads}, {v_dim}]", out.len(), d.q.rows));
    }
    if d.window == Some(0) {
        return Err("a window must be positive".into());
    }
    let num_blocks = d.k.rows / d.page;
    let mut order: Vec<(usize, usize)> = Vec::with_capacity(seqs); // (row, sequence)
    let mut macs = 0usize;
    for i in 0..seqs {
        let (row, len) = (d.rows[i], d.lens[i]);
        if row < 0 || row as usize >= d.q.rows {
            return Err(format!("sequence {i}: row {row} is outside the {} query rows", d.q.rows));
        }
        if len < 1 || len as usize > d.max_blocks * d.page {
            return Err(format!(
                "sequence {i}: context length {len} is outside 1..={} (its table's {} blocks of {})",
                d.max_blocks * d.page,
                d.max_blocks,
                d.page
            ));
        }
        let (start, end) = visible(len as usize, d.window);
        for b in start / d.page..end.div_ceil(d.page) {
            let block = d.tables[i * d.max_blocks + b];
            if block < 0 || block as usize >= num_blocks {
                return Err(format!(
                    "sequence {i}: block {block} (table entry {b}) is outside the cache's {num_blocks} blocks"
                ));
            }
        }
        macs += (end - start) * heads * (head_dim + v_dim);
        order.push((row as usize, i));
    }
    order.sort_unstable();
    if order.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err("two sequences write the same output row".into());
    }

    // each thread at least PARALLEL_MIN_MACS of work: a many-core host spawns no idle threads
    let threads = threads.min(macs / PARALLEL_MIN_MACS).max(1);
    let part_len = heads * (2 + v_dim);
    let part_count = |seq: usize| {
        let (start, end) = visible(d.lens[seq] as usize, d.window);
        parts(start, end)
    };
    let split: usize = order.iter().map(|&(_, seq)| part_count(seq)).filter(|&n| n > 1).sum();
    let mut partials = vec![0f32; split * part_len];
    // Each sequence's output row, or its parts' slices of `partials`: disjoint borrows.
    let mut items = Vec::with_capacity(seqs + split);
    let mut long: Vec<(&mut [T], usize)> = Vec::new(); // a split sequence's row and its parts
    let (mut rest, mut rest_parts) = (out, &mut partials[..]);
    let mut next_row = 0;
    for &(row, seq) in &order {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut((row - next_row) * row_len);
        let (mine, tail) = tail.split_at_mut(row_len);
        rest = tail;
        next_row = row + 1;
        let (start, end) = visible(d.lens[seq] as usize, d.window);
        let n = parts(start, end);
        if n == 1 {
            items.push(Item { seq, start, end, dst: Dst::Row(mine) });
            continue;
        }
        let (these, tail) = std::mem::take(&mut rest_parts).split_at_mut(n * part_len);
        rest_parts = tail;
        for (i, part) in these.chunks_exact_mut(part_len).enumerate() {
            let first = start + i * PART_KEYS;
            items.push(Item { seq, start: first, end: end.min(first + PART_KEYS), dst: Dst::Part(part) });
        }
        long.push((mine, n));
    }
    let threads = threads.min(items.len().max(1));
    crate::workers::take_in_turn(threads, &mut items, &|items| run(d, items, isa));
    drop(items);
    let mut at = 0;
    for (row, n) in long {
        combine_parts(d, &partials[at..at + n * part_len], row);
        at += n * part_len;
    }
    Ok(())
}

/// A split sequence's row from its parts ([parts][heads][max, total, weighted values]), each
/// head's in part order.
fn combine_parts<T: Element>(d: &PagedDecode<'_, T>, parts: &[f32], row: &mut [T]) {
    let (heads, v_dim) = (d.q.heads, d.v.dim);
    let mut acc = vec![0f32; v_dim];
    for h in 0..heads {
        let of_head = parts.chunks_exact(heads * (2 + v_dim)).map(|p| &p[h * (2 + v_dim)..][..2 + v_dim]);
        let max = of_head.clone().map(|p| p[0]).fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f32;
        acc.fill(0.0);
        for p in of_head {
            let decay = exp(p[0] - max);
            total = p[1].mul_add(decay, total);
            for (a, &x) in acc.iter_mut().zip(&p[2..]) {
                *a = x.mul_add(decay, *a);
            }
        }
        write_head(&mut row[h * v_dim..][..v_dim], &acc, max, total, d.sinks.map(|s| s[h]));
    }
}

/// A head's output: its weighted values over its sum of weights (with its sink's weight, if
/// any), from its running max.
#[inline(always)]
fn write_head<T: Element>(out: &mut [T], acc: &[f32], max: f32, total: f32, sink: Option<f32>) {
    let mut norm = 1.0 / total;
    if let Some(sink) = sink {
        let m_new = max.max(sink);
        let decay = exp(max - m_new);
        norm = decay / (total * decay + exp(sink - m_new));
    }
    for (o, &a) in out.iter_mut().zip(acc) {
        *o = T::from_f32(a * norm);
    }
}

/// Row t of `rows` (each `row_len` elements) copied into row `slots[t]` of `cache`: a decode
/// step's new keys or values into the paged cache, in one call where torch's `index_copy_`
/// costs more to dispatch than the copy of a few rows. Errors, writing nothing, on a slot
/// outside the cache or lengths that do not match.
pub fn write_cache_rows<T: Copy>(rows: &[T], row_len: usize, slots: &[i64], cache: &mut [T]) -> Result<(), String> {
    if row_len == 0 || rows.len() != slots.len() * row_len || !cache.len().is_multiple_of(row_len) {
        return Err(format!(
            "{} values for {} slots of rows of {row_len}, into a cache of {} values",
            rows.len(),
            slots.len(),
            cache.len()
        ));
    }
    let cache_rows = cache.len() / row_len;
    if let Some(&bad) = slots.iter().find(|&&s| s < 0 || s as usize >= cache_rows) {
        return Err(format!("slot {bad} is outside the cache's {cache_rows} rows"));
    }
    for (row, &slot) in rows.chunks_exact(row_len).zip(slots) {
        cache[slot as usize * row_len..][..row_len].copy_from_slice(row);
    }
    Ok(())
}

/// The positions [start, end) a query at the end of a `len`-token context sees.
fn visible(len: usize, window: Option<usize>) -> (usize, usize) {
    (window.map_or(0, |w| len.saturating_sub(w)), len)
}

fn run<'i, 'o: 'i, T: Element + 'o>(
    d: &PagedDecode<'_, T>,
    items: impl Iterator<Item = &'i mut Item<'o, T>>,
    isa: Isa,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 if isa.runs() && takes_dots(d) => {
            // SAFETY: the CPU has AVX2, FMA, AVX-512F, AVX-512 BF16 and AVX-512VL (checked just
            // above), all `run_avx512_bf16` requires.
            unsafe { run_avx512_bf16(d, items) }
        }
        // the rest of Avx512Bf16's work is Avx512's, in its code
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 if Isa::Avx512.runs() => {
            // SAFETY: the CPU has AVX2, FMA and AVX-512F (checked just above), all `run_avx512` requires.
            unsafe { run_avx512(d, items) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma if isa.runs() => {
            // SAFETY: the CPU has AVX2 and FMA (checked just above), all `run_avx2` requires.
            unsafe { run_avx2(d, items) }
        }
        _ => run_items::<T, false, false, false>(d, items),
    }
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<'i, 'o: 'i, T: Element + 'o>(
    d: &PagedDecode<'_, T>,
    items: impl Iterator<Item = &'i mut Item<'o, T>>,
) {
    run_items::<T, true, false, false>(d, items)
}

/// # Safety
/// The CPU must support AVX2, FMA and AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn run_avx512<'i, 'o: 'i, T: Element + 'o>(
    d: &PagedDecode<'_, T>,
    items: impl Iterator<Item = &'i mut Item<'o, T>>,
) {
    run_items::<T, true, true, false>(d, items)
}

/// Whether `Isa::Avx512Bf16` scores some of `d`'s heads in dot products: bfloat16 rows of an
/// even head dim, GQA groups of eight heads or more.
#[cfg(target_arch = "x86_64")]
fn takes_dots<T: Element>(d: &PagedDecode<'_, T>) -> bool {
    T::BF16 && d.q.heads / d.k.heads >= DOT_HEADS && d.q.dim.is_multiple_of(2)
}

/// # Safety
/// The CPU must support AVX2, FMA, AVX-512F, AVX-512 BF16 and AVX-512VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512bf16,avx512vl")]
unsafe fn run_avx512_bf16<'i, 'o: 'i, T: Element + 'o>(
    d: &PagedDecode<'_, T>,
    items: impl Iterator<Item = &'i mut Item<'o, T>>,
) {
    run_items::<T, true, true, true>(d, items)
}

/// `$f::<T, NH>(args.., g0)` (`$f::<T, NH, WIDE>` given WIDE) for the group's heads in
/// blocks g0..g0 + NH (NH a constant, so that the blocks' running sums are registers): of
/// `T::WIDE_HEAD_BLOCK` where `$wide` (AVX-512's registers) and that many heads are left, else
/// of at most HEAD_BLOCK. A block's size changes no bit: each head's sums are its own.
#[cfg(target_arch = "x86_64")]
macro_rules! in_head_blocks {
    ($group:expr, $wide:expr, $f:ident::<$t:ty $(, $w:tt)?>($($arg:expr),*)) => {{
        let (group, mut g0) = ($group, 0);
        let wide_block = if $wide { <$t as Element>::WIDE_HEAD_BLOCK } else { HEAD_BLOCK };
        while g0 < group {
            let heads = if group - g0 >= wide_block { wide_block } else { HEAD_BLOCK.min(group - g0) };
            match heads {
                1 => $f::<$t, 1 $(, $w)?>($($arg,)* g0),
                2 => $f::<$t, 2 $(, $w)?>($($arg,)* g0),
                3 => $f::<$t, 3 $(, $w)?>($($arg,)* g0),
                HEAD_BLOCK => $f::<$t, HEAD_BLOCK $(, $w)?>($($arg,)* g0),
                _ => $f::<$t, HEAD_BLOCK_WIDE $(, $w)?>($($arg,)* g0),
            }
            g0 += heads;
        }
    }};
}

/// Per-thread buffers, reused across items.
struct Scratch {
    q: Vec<f32>,      // [heads, head_dim], the queries in f32
    qt: Vec<u32>,     // DOTS: the queries as bfloat16 pairs (paged_attn_dots::transpose_queries)
    acc: Vec<f32>,    // [heads, v_dim]
    scores: Vec<f32>, // [heads, TILE]
    max: Vec<f32>,
    total: Vec<f32>,
}

#[inline(always)]
fn run_items<'i, 'o: 'i, T: Element + 'o, const AVX2: bool, const WIDE: bool, const DOTS: bool>(
    d: &PagedDecode<'_, T>,
    items: impl Iterator<Item = &'i mut Item<'o, T>>,
) {
    let heads = d.q.heads;
    let mut s = Scratch {
        q: vec![0.0; heads * d.q.dim],
        qt: vec![0; if DOTS { heads * d.q.dim / 2 } else { 0 }],
        acc: vec![0.0; heads * d.v.dim],
        scores: vec![0.0; heads * TILE],
        max: vec![0.0; heads],
        total: vec![0.0; heads],
    };
    for item in items {
        attend_item::<T, AVX2, WIDE, DOTS>(d, item, &mut s);
    }
}

/// One sequence: tile by tile, each KV head's group of query heads scores the tile's keys and
/// weighs its values (a slot's heads, adjacent in the cache, are read together: the tile's
/// blocks are streamed whole). WIDE (with AVX2): the products in AVX-512 registers; DOTS (with
/// WIDE): bfloat16 scores of whole blocks of eight heads in dot products.
#[inline(always)]
fn attend_item<T: Element, const AVX2: bool, const WIDE: bool, const DOTS: bool>(
    d: &PagedDecode<'_, T>,
    item: &mut Item<'_, T>,
    s: &mut Scratch,
) {
    let (heads, head_dim, v_dim) = (d.q.heads, d.q.dim, d.v.dim);
    let group = heads / d.k.heads;
    let kv_heads = 0..d.k.heads;
    let row = d.rows[item.seq] as usize;
    let table = &d.tables[item.seq * d.max_blocks..][..d.max_blocks];
    for h in 0..heads {
        for (dst, &x) in s.q[h * head_dim..][..head_dim].iter_mut().zip(d.q.at(row, h)) {
            *dst = x.to_f32();
        }
    }
    // DOTS: each group's whole blocks of eight heads scored in dot products, their queries as pairs
    #[cfg(target_arch = "x86_64")]
    if DOTS {
        for first in kv_heads.clone().map(|kv_head| kv_head * group) {
            let q = &s.q[first * head_dim..][..group * head_dim];
            crate::paged_attn_dots::transpose_queries(q, head_dim, &mut s.qt[first * head_dim / 2..]);
        }
    }
    s.acc.fill(0.0);
    s.max.fill(f32::NEG_INFINITY);
    s.total.fill(0.0);
    // the slots of the tile at hand and of the next (found once: for its prefetch, then its turn)
    let (mut slots, mut next_slots) = ([0usize; TILE], [0usize; TILE]);
    let mut lo = item.start;
    // the sequence's visible keys: a part's last tile asks for the next part's first
    let (seq_start, seq_end) = visible(d.lens[item.seq] as usize, d.window);
    tile_slots(d, table, lo, TILE.min(item.end - lo), &mut slots);
    // a sequence's first tile asked for at once: its lines arrive together, not one miss after
    // another (a later part's was asked for by the part before it)
    if lo == seq_start {
        prefetch_slots(d, &slots[..TILE.min(item.end - lo)], kv_heads.clone());
    }
    while lo < item.end {
        let n = TILE.min(item.end - lo);
        // past a part's end, the next part's first tile: asked for, not taken
        let asked = TILE.min(seq_end - lo - n);
        tile_slots(d, table, lo + n, asked, &mut next_slots);
        for kv_head in kv_heads.clone() {
            let first = kv_head * group; // the group's first query head
            let scores = &mut s.scores[first * TILE..][..group * TILE];
            // the next tile's rows of this KV head, keys before its scores and values before its
            // weighted sums: one head's keys or values at a time, not all the tile's lines at its
            // start, whose burst stalled the loads behind it (docs/benchmarks.md)
            prefetch_rows(&d.k, &next_slots[..asked], kv_head);
            let q = &s.q[first * head_dim..][..group * head_dim];
            match DOTS {
                #[cfg(target_arch = "x86_64")]
                true => score_tile_in_dots::<T, AVX2, WIDE>(
                    d,
                    kv_head,
                    &slots[..n],
                    q,
                    &s.qt[first * head_dim / 2..],
                    scores,
                ),
                _ => score_tile::<T, AVX2, WIDE>(d, kv_head, &slots[..n], q, scores),
            }
            for g in 0..group {
                let h = first + g;
                let p = &mut scores[g * TILE..][..n];
                let m_new = lane_max(p).max(s.max[h]);
                let decay = exp(s.max[h] - m_new);
                exp_shifted(p, m_new);
                s.total[h] = s.total[h] * decay + lane_sum(p);
                if decay != 1.0 {
                    s.acc[h * v_dim..][..v_dim].iter_mut().for_each(|a| *a *= decay);
                }
                s.max[h] = m_new;
            }
            prefetch_rows(&d.v, &next_slots[..asked], kv_head);
            let acc = &mut s.acc[first * v_dim..][..group * v_dim];
            weigh_values::<T, AVX2, WIDE>(d, kv_head, &slots[..n], scores, acc);
        }
        std::mem::swap(&mut slots, &mut next_slots);
        lo += n;
    }
    match &mut item.dst {
        Dst::Row(out) => {
            for h in 0..heads {
                let (acc, sink) = (&s.acc[h * v_dim..][..v_dim], d.sinks.map(|sinks| sinks[h]));
                write_head(&mut out[h * v_dim..][..v_dim], acc, s.max[h], s.total[h], sink);
            }
        }
        Dst::Part(part) => {
            for (h, head) in part.chunks_exact_mut(2 + v_dim).enumerate() {
                head[0] = s.max[h];
                head[1] = s.total[h];
                head[2..].copy_from_slice(&s.acc[h * v_dim..][..v_dim]);
            }
        }
    }
}

/// slots[..n] = the cache slots of positions lo..lo + n through the block table: one division
/// a tile, not one a key (validated by paged_decode: every visible block is in the cache).
#[inline(always)]
fn tile_slots<T: Element>(d: &PagedDecode<'_, T>, table: &[i64], lo: usize, n: usize, slots: &mut [usize; TILE]) {
    if n == 0 {
        return;
    }
    let (mut entry, mut offset) = (lo / d.page, lo % d.page);
    let mut base = table[entry] as usize * d.page;
    for slot in &mut slots[..n] {
        if offset == d.page {
            entry += 1;
            offset = 0;
            base = table[entry] as usize * d.page;
        }
        *slot = base + offset;
        offset += 1;
    }
}

/// Asks for the key and value rows of KV heads `heads` at `slots` (the next tile's) to be
/// brought into the L2 cache while the tile at hand is computed: a tile's rows sit in scattered
/// blocks, a few KiB each, that the hardware prefetcher does not foresee.
#[inline(always)]
pub(crate) fn prefetch_slots<T: Element>(d: &PagedDecode<'_, T>, slots: &[usize], heads: std::ops::Range<usize>) {
    for h in heads {
        prefetch_rows(&d.k, slots, h);
        prefetch_rows(&d.v, slots, h);
    }
}

/// Asks for the rows of KV head `head` at `slots` to be brought into the L2 cache.
#[inline(always)]
fn prefetch_rows<T: Element>(rows: &Strided<'_, T>, slots: &[usize], head: usize) {
    for &slot in slots {
        crate::prefetch::prefetch_l2(rows.at(slot, head));
    }
}

/// Up to this many query heads share each load of a key or value row (their running sums
/// stay in registers): four heads' sums fill AVX2's 16 registers;
#[cfg(target_arch = "x86_64")]
pub(crate) const HEAD_BLOCK: usize = 4;
/// AVX-512's 32 hold eight (`Element::WIDE_HEAD_BLOCK`: bfloat16 rows take it).
#[cfg(target_arch = "x86_64")]
pub(crate) const HEAD_BLOCK_WIDE: usize = 8;
#[cfg(target_arch = "x86_64")]
use crate::paged_attn_dots::HEADS as DOT_HEADS;

/// score_tile where DOTS applies (run_avx512_bf16, where `takes_dots`): the group's whole blocks
/// of eight heads (`qt`: their queries from paged_attn_dots::transpose_queries) in AVX-512 BF16
/// dot products, the rest as score_tile scores them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn score_tile_in_dots<T: Element, const AVX2: bool, const WIDE: bool>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    q: &[f32],
    qt: &[u32],
    scores: &mut [f32],
) {
    let dim = d.q.dim;
    let dot_heads = q.len() / dim / DOT_HEADS * DOT_HEADS;
    for (b, qt) in qt[..dot_heads * dim / 2].chunks_exact(dim / 2 * DOT_HEADS).enumerate() {
        let scores = &mut scores[b * DOT_HEADS * TILE..][..DOT_HEADS * TILE];
        // SAFETY: DOTS is set only by run_avx512_bf16, whose caller checked the CPU (the rest
        // score_block asserts).
        unsafe { crate::paged_attn_dots::score_block(d, kv_head, slots, qt, scores) };
    }
    let (q, scores) = (&q[dot_heads * dim..], &mut scores[dot_heads * TILE..]);
    if !q.is_empty() {
        score_tile::<T, AVX2, WIDE>(d, kv_head, slots, q, scores);
    }
}

/// The tile's scores: `scores[g * TILE + j] = q_g . k_j * scale` for the KV head's group of
/// query heads g (`q`: [group, head_dim], f32) and the keys at `slots`. AVX2: in AVX2 registers;
/// WIDE too: in AVX-512 ones (crate::paged_attn_512), the same bits.
#[inline(always)]
pub(crate) fn score_tile<T: Element, const AVX2: bool, const WIDE: bool>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    q: &[f32],
    scores: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: AVX2 is only set by run_avx2 and run_avx512, whose callers checked the CPU has
        // AVX2 and FMA; WIDE only by run_avx512, whose caller checked AVX-512F too.
        unsafe { in_head_blocks!(q.len() / d.q.dim, WIDE, score_heads::<T, WIDE>(d, kv_head, slots, q, scores)) };
        return;
    }
    // Lanes of running sums, so that consecutive multiply-adds do not wait on each other.
    const LANES: usize = 8;
    let dim = d.q.dim;
    let whole = dim / LANES * LANES;
    for (j, &slot) in slots.iter().enumerate() {
        let k = d.k.at(slot, kv_head);
        for (g, qg) in q.chunks_exact(dim).enumerate() {
            let mut lanes = [0f32; LANES];
            for (x, y) in qg[..whole].chunks_exact(LANES).zip(k[..whole].chunks_exact(LANES)) {
                for i in 0..LANES {
                    lanes[i] += x[i] * y[i].to_f32();
                }
            }
            let mut sum = lanes.iter().sum::<f32>();
            for (x, y) in qg[whole..].iter().zip(&k[whole..]) {
                sum += x * y.to_f32();
            }
            scores[g * TILE + j] = sum * d.scale;
        }
    }
}

/// The values at `slots`, weighed by the tile's probabilities, added to the group's
/// accumulators (`acc`: [group, v_dim]), key by key in order (AVX2, WIDE: as `score_tile`).
#[inline(always)]
pub(crate) fn weigh_values<T: Element, const AVX2: bool, const WIDE: bool>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    scores: &[f32],
    acc: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: as in `score_tile`.
        unsafe { in_head_blocks!(acc.len() / d.v.dim, WIDE, weigh_heads::<T, WIDE>(d, kv_head, slots, scores, acc)) };
        return;
    }
    let v_dim = d.v.dim;
    for (j, &slot) in slots.iter().enumerate() {
        let v = d.v.at(slot, kv_head);
        for (g, a) in acc.chunks_exact_mut(v_dim).enumerate() {
            let p = scores[g * TILE + j];
            for (a, x) in a.iter_mut().zip(v) {
                *a += p * x.to_f32();
            }
        }
    }
}

/// score_tile for heads g0..g0 + NH (NH at most HEAD_BLOCK_WIDE): each key row loaded once, 8 dims
/// at a time, for all of them; keys taken KB at a time (KB * NH running sums: independent
/// multiply-add chains) and their sums reduced together.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn score_heads<T: Element, const NH: usize, const WIDE: bool>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    q: &[f32],
    scores: &mut [f32],
    g0: usize,
) {
    // 8 sums for one or two heads, 4 for three or four: all of them in the 16 registers
    // beside the key lanes (WIDE: the same keys as pairs in AVX-512 registers)
    // SAFETY: forwarded, the caller's contract.
    unsafe {
        match (WIDE, NH <= 2) {
            (true, true) => crate::paged_attn_512::score_key_pairs::<T, NH, 2>(d, kv_head, slots, q, scores, g0),
            (true, false) => crate::paged_attn_512::score_key_pairs::<T, NH, 1>(d, kv_head, slots, q, scores, g0),
            (false, true) => score_keys_avx2::<T, NH, 4>(d, kv_head, slots, q, scores, g0),
            (false, false) => score_keys_avx2::<T, NH, 2>(d, kv_head, slots, q, scores, g0),
        }
    }
}

/// score_heads with keys KB (2 or 4) at a time; a last group of fewer keys one by one.
/// Each score's sum is reduced in the order the single-key loop reduces it: the same bits.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn score_keys_avx2<T: Element, const NH: usize, const KB: usize>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    q: &[f32],
    scores: &mut [f32],
    g0: usize,
) {
    use std::arch::x86_64::*;
    let dim = d.q.dim;
    let whole = dim / 8 * 8;
    let heads_q = &q[g0 * dim..(g0 + NH) * dim];
    let grouped = slots.len() / KB * KB;
    for j0 in (0..grouped).step_by(KB) {
        let keys: [&[T]; KB] = std::array::from_fn(|i| d.k.at(slots[j0 + i], kv_head));
        // SAFETY: each key holds `dim` elements and each query row `dim` (q is [heads, dim]):
        // every 8-wide load at c < whole stays inside them; AVX2 and FMA by the caller's contract.
        unsafe {
            let mut sums = [[_mm256_setzero_ps(); KB]; NH];
            for c in (0..whole).step_by(8) {
                let kc: [__m256; KB] = std::array::from_fn(|i| T::load8(keys[i].as_ptr().add(c)));
                for (h, row) in sums.iter_mut().enumerate() {
                    let qc = _mm256_loadu_ps(heads_q.as_ptr().add(h * dim + c));
                    for (sum, &k) in row.iter_mut().zip(&kc) {
                        *sum = _mm256_fmadd_ps(qc, k, *sum);
                    }
                }
            }
            for (h, row) in sums.iter().enumerate() {
                let (a, b) = (row[0], row[1]);
                let (c, e) = if KB == 4 { (row[KB / 2], row[KB - 1]) } else { (a, b) };
                let q_h = &heads_q[h * dim..(h + 1) * dim];
                key_scores(d, [a, b, c, e], &keys, q_h, whole, &mut scores[(g0 + h) * TILE + j0..][..KB]);
            }
        }
    }
    // SAFETY: forwarded, the caller's contract.
    unsafe { score_one_by_one_avx2::<T, NH>(d, kv_head, &slots[grouped..], q, &mut scores[grouped..], g0) };
}

/// The scores of up to four keys (`keys`, as many as `scores`) for one query head `q` from their
/// 8-lane sums over dims ..whole (`sums`, reduced by `reduce4`), the dims past `whole` added one
/// by one, scaled.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn key_scores<T: Element>(
    d: &PagedDecode<'_, T>,
    [a, b, c, e]: [std::arch::x86_64::__m256; 4],
    keys: &[&[T]],
    q: &[f32],
    whole: usize,
    scores: &mut [f32],
) {
    let mut totals = [0f32; 4];
    // SAFETY: AVX2 by the caller's contract; four floats stored into four.
    unsafe { std::arch::x86_64::_mm_storeu_ps(totals.as_mut_ptr(), reduce4(a, b, c, e)) };
    for ((total, key), score) in totals.iter().zip(keys).zip(scores.iter_mut()) {
        let mut total = *total;
        for (x, y) in q[whole..].iter().zip(&key[whole..]) {
            total = x.mul_add(y.to_f32(), total);
        }
        *score = total * d.scale;
    }
}

/// The lane sums of four vectors [a, b, c, e], each summed as ((l0 + l4) + (l2 + l6)) +
/// ((l1 + l5) + (l3 + l7)): the order of the single-key reduction in score_one_by_one_avx2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce4(
    a: std::arch::x86_64::__m256,
    b: std::arch::x86_64::__m256,
    c: std::arch::x86_64::__m256,
    e: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    // quads: [a0 + a4, .., a3 + a7 | b0 + b4, ..] and the same of c, e
    let ab = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b));
    let ce = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(c, e), _mm256_permute2f128_ps::<0x31>(c, e));
    // pairs: [qa0 + qa2, qa1 + qa3, qc0 + qc2, qc1 + qc3 | the same of b, e]
    let pairs = _mm256_add_ps(_mm256_shuffle_ps::<0x44>(ab, ce), _mm256_shuffle_ps::<0xEE>(ab, ce));
    // [ta, tc, ta, tc | tb, te, tb, te]
    let totals = _mm256_hadd_ps(pairs, pairs);
    _mm_unpacklo_ps(_mm256_castps256_ps128(totals), _mm256_extractf128_ps::<1>(totals))
}

/// score_tile for heads g0..g0 + NH, key by key.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn score_one_by_one_avx2<T: Element, const NH: usize>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    q: &[f32],
    scores: &mut [f32],
    g0: usize,
) {
    use std::arch::x86_64::*;
    let dim = d.q.dim;
    let whole = dim / 8 * 8;
    let q = &q[g0 * dim..(g0 + NH) * dim];
    for (j, &slot) in slots.iter().enumerate() {
        let k = d.k.at(slot, kv_head);
        // SAFETY: k holds `dim` elements and each query row `dim` (q is [heads, dim]): every
        // 8-wide load at c < whole stays inside them; AVX2 and FMA by the caller's contract.
        unsafe {
            let mut sums = [_mm256_setzero_ps(); NH];
            for c in (0..whole).step_by(8) {
                let kc = T::load8(k.as_ptr().add(c));
                for (h, sum) in sums.iter_mut().enumerate() {
                    *sum = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(h * dim + c)), kc, *sum);
                }
            }
            for (h, sum) in sums.iter().enumerate() {
                let quad = _mm_add_ps(_mm256_castps256_ps128(*sum), _mm256_extractf128_ps::<1>(*sum));
                let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
                let mut total = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps::<1>(pair, pair)));
                for (x, y) in q[h * dim + whole..(h + 1) * dim].iter().zip(&k[whole..]) {
                    total = x.mul_add(y.to_f32(), total);
                }
                scores[(g0 + h) * TILE + j] = total * d.scale;
            }
        }
    }
}

/// weigh_values for heads g0..g0 + NH (NH at most HEAD_BLOCK_WIDE): value dims W * 8 at a time
/// (then 8, then one), their running sums in registers across the tile's keys, each value
/// row's dims loaded once for the NH heads; W = 4 for one or two heads (8 independent
/// multiply-add chains), 2 for three or four (WIDE: 2, then 1 for three to eight). Each dim's
/// sum runs over the keys in order.
/// WIDE: the same dims 16 to an AVX-512 register (`weigh_chunk` on `__m512`), each dim's sum
/// the same (the same bits).
///
/// # Safety
/// The CPU must support AVX2 and FMA; AVX-512F where WIDE.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn weigh_heads<T: Element, const NH: usize, const WIDE: bool>(
    d: &PagedDecode<'_, T>,
    kv_head: usize,
    slots: &[usize],
    scores: &[f32],
    acc: &mut [f32],
    g0: usize,
) {
    use std::arch::x86_64::{__m256, __m512};
    let v_dim = d.v.dim;
    let n = slots.len();
    assert!(n <= TILE && (g0 + NH) * TILE <= scores.len() && (g0 + NH) * v_dim <= acc.len());
    let mut rows = [std::ptr::null::<T>(); TILE];
    for (row, &slot) in rows.iter_mut().zip(slots) {
        *row = d.v.at(slot, kv_head).as_ptr(); // bounds-checked: v_dim readable elements
    }
    let probs: [*const f32; NH] = std::array::from_fn(|h| scores[(g0 + h) * TILE..].as_ptr());
    let sums_at: [*mut f32; NH] = std::array::from_fn(|h| acc[(g0 + h) * v_dim..].as_mut_ptr());
    let rows = &rows[..n];
    let mut c = 0;
    // SAFETY: rows point to v_dim readable elements each, probs[h] to n probabilities and
    // sums_at[h] to v_dim accumulators (the assert and at() above); every chunk's loads and
    // stores end at or before v_dim. AVX2 and FMA (and AVX-512F where WIDE) by the caller's contract.
    unsafe {
        if NH <= 2 {
            while c + 32 <= v_dim {
                match WIDE {
                    true => weigh_chunk::<T, __m512, NH, 2>(rows, &probs, &sums_at, c),
                    false => weigh_chunk::<T, __m256, NH, 4>(rows, &probs, &sums_at, c),
                }
                c += 32;
            }
        }
        while c + 16 <= v_dim {
            match WIDE {
                true => weigh_chunk::<T, __m512, NH, 1>(rows, &probs, &sums_at, c),
                false => weigh_chunk::<T, __m256, NH, 2>(rows, &probs, &sums_at, c),
            }
            c += 16;
        }
        if c + 8 <= v_dim {
            weigh_chunk::<T, __m256, NH, 1>(rows, &probs, &sums_at, c);
            c += 8;
        }
        for i in c..v_dim {
            for h in 0..NH {
                let mut sum = *sums_at[h].add(i);
                for (j, &row) in rows.iter().enumerate() {
                    sum = (*probs[h].add(j)).mul_add((*row.add(i)).to_f32(), sum);
                }
                *sums_at[h].add(i) = sum;
            }
        }
    }
}

/// A register of f32 lanes the weighted sums run in: AVX2's 8 or AVX-512's 16 (`weigh_chunk`).
#[cfg(target_arch = "x86_64")]
trait Lanes: Copy {
    const WIDTH: usize;
    /// # Safety
    /// The CPU runs the register's instructions; WIDTH readable floats at `src`.
    unsafe fn load(src: *const f32) -> Self;
    /// # Safety
    /// As `load`, writable.
    unsafe fn store(self, dst: *mut f32);
    /// # Safety
    /// The CPU runs the register's instructions.
    unsafe fn splat(x: f32) -> Self;
    /// p * x + self, rounded once.
    ///
    /// # Safety
    /// The CPU runs the register's instructions (and FMA).
    unsafe fn mul_add(self, p: Self, x: Self) -> Self;
    /// # Safety
    /// As `load`, WIDTH readable elements at `src`.
    unsafe fn widen<T: Element>(src: *const T) -> Self;
}

#[cfg(target_arch = "x86_64")]
impl Lanes for std::arch::x86_64::__m256 {
    const WIDTH: usize = 8;
    #[inline(always)]
    unsafe fn load(src: *const f32) -> Self {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(src) }
    }
    #[inline(always)]
    unsafe fn store(self, dst: *mut f32) {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_storeu_ps(dst, self) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, p: Self, x: Self) -> Self {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_fmadd_ps(p, x, self) }
    }
    #[inline(always)]
    unsafe fn widen<T: Element>(src: *const T) -> Self {
        // SAFETY: the caller's contract.
        unsafe { T::load8(src) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for std::arch::x86_64::__m512 {
    const WIDTH: usize = 16;
    #[inline(always)]
    unsafe fn load(src: *const f32) -> Self {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(src) }
    }
    #[inline(always)]
    unsafe fn store(self, dst: *mut f32) {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_storeu_ps(dst, self) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, p: Self, x: Self) -> Self {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_fmadd_ps(p, x, self) }
    }
    #[inline(always)]
    unsafe fn widen<T: Element>(src: *const T) -> Self {
        // SAFETY: the caller's contract.
        unsafe { T::load16(src) }
    }
}

/// Dims c..c + W * V::WIDTH of weigh_heads: W * NH running sums in registers over the keys,
/// each dim's sum over the keys in order whatever the register's width (the same bits).
///
/// # Safety
/// The CPU runs V's instructions and FMA; each of `rows` points to c + W * V::WIDTH readable
/// elements, each of `probs` to rows.len() probabilities, each of `sums_at` to c + W * V::WIDTH
/// sums.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn weigh_chunk<T: Element, V: Lanes, const NH: usize, const W: usize>(
    rows: &[*const T],
    probs: &[*const f32; NH],
    sums_at: &[*mut f32; NH],
    c: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut sums: [[V; W]; NH] =
            std::array::from_fn(|h| std::array::from_fn(|w| V::load(sums_at[h].add(c + V::WIDTH * w))));
        for (j, &row) in rows.iter().enumerate() {
            let v: [V; W] = std::array::from_fn(|w| V::widen(row.add(c + V::WIDTH * w)));
            for (h, lanes) in sums.iter_mut().enumerate() {
                let p = V::splat(*probs[h].add(j));
                for (sum, &x) in lanes.iter_mut().zip(&v) {
                    *sum = sum.mul_add(p, x);
                }
            }
        }
        for (h, lanes) in sums.iter().enumerate() {
            for (w, &sum) in lanes.iter().enumerate() {
                sum.store(sums_at[h].add(c + V::WIDTH * w));
            }
        }
    }
}

/// The largest of `p` (NaN only if every element is one), 8 lanes at a time: a chain of one
/// comparison per element would wait on each.
#[inline(always)]
pub(crate) fn lane_max(p: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = p.chunks_exact(8);
    for chunk in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = if x > *m { x } else { *m };
        }
    }
    chunks.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// The sum of `p` in 8 running lanes (then the lanes and the tail): vectorized, in a fixed
/// order whatever the thread count.
#[inline(always)]
pub(crate) fn lane_sum(p: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = p.chunks_exact(8);
    for chunk in &mut chunks {
        for (s, &x) in lanes.iter_mut().zip(chunk) {
            *s += x;
        }
    }
    lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// p[i] = e^(p[i] - shift) for a softmax's weights (shift at least every p[i]): `exp_weight`, a
/// loop the compiler vectorizes (libm's expf is a call per element).
#[inline(always)]
pub(crate) fn exp_shifted(p: &mut [f32], shift: f32) {
    for x in p.iter_mut() {
        *x = exp_weight(*x - shift);
    }
}

/// ln of the smallest normal f32: `exp` and `exp_weight` are 0 below it.
pub const SMALLEST_NORMAL_LN: f32 = -87.336_55;

/// Cephes' expf: x = n ln2 + r (ln2 in two parts, |r| <= ln2 / 2), e^r by a polynomial, 2^n
/// built in the exponent bits.
mod cephes {
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    /// 1.5 * 2^23: adding it rounds to an integer in the low bits.
    pub const ROUND: f32 = 12_582_912.0;
    /// ln of the smallest normal f32: e^x is 0 below it.
    pub const LO: f32 = super::SMALLEST_NORMAL_LN;
    /// 2^n stays finite (e^x is infinite above this, not from 88.72).
    pub const HI: f32 = 88.0;
    /// e^r = POLY(r) r^2 + r + 1.
    pub const POLY: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];
}

/// e^x in f32 within about 2 ulp (`cephes`, `exp_weight`'s fused steps); 0 below the smallest
/// normal's log, so exp(-inf) = 0, and infinite above 88. Branch-free, so a loop of it
/// vectorizes (the same bits on every CPU).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    use cephes::*;
    let y = exp_weight(x.min(HI));
    let y = if x > HI { f32::INFINITY } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// e^x of a softmax weight's exponent x <= 88 (nothing overflows: `exp` guards the rest), each
/// product-sum fused (`f32::mul_add`: one rounding, the same bits on every CPU, vector FMA where
/// the build has it: half the instructions of rounding products and sums apart); within 2 ulp
/// of e^x; 0 below the smallest normal's log (-inf among them), NaN kept.
#[inline(always)]
pub fn exp_weight(x: f32) -> f32 {
    use cephes::*;
    let t = x.mul_add(LOG2E, ROUND);
    let n = t - ROUND;
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut y = POLY[0];
    for &c in &POLY[1..] {
        y = y.mul_add(r, c);
    }
    let e = y.mul_add(r * r, r) + 1.0;
    let two_n = f32::from_bits((t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32 - 127).wrapping_shl(23) as u32);
    if x < LO {
        0.0
    } else {
        e * two_n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::noise;

    struct Case {
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        v_dim: usize,
        page: usize,
        lens: Vec<i64>,
        window: Option<usize>,
        sinks: bool,
    }

    /// q, k, v, tables (scattered blocks), rows (reversed), sinks.
    #[allow(clippy::type_complexity)]
    fn inputs(c: &Case, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<i64>, usize, Vec<i64>, Vec<f32>, usize) {
        let blocks: Vec<usize> = c.lens.iter().map(|&n| (n as usize).div_ceil(c.page)).collect();
        let max_blocks = *blocks.iter().max().unwrap();
        let num_blocks = blocks.iter().sum::<usize>() + 2;
        let mut tables = vec![-1i64; c.lens.len() * max_blocks];
        let mut next = 0;
        for (i, &b) in blocks.iter().enumerate() {
            for j in 0..b {
                tables[i * max_blocks + j] = ((next * 7 + 1) % num_blocks) as i64; // 7 and num_blocks coprime below
                next += 1;
            }
        }
        let slots = num_blocks * c.page;
        let tokens = c.lens.len() + 1;
        let q = noise(tokens * c.heads * c.head_dim, seed);
        let k = noise(slots * c.kv_heads * c.head_dim, seed + 1);
        let v = noise(slots * c.kv_heads * c.v_dim, seed + 2);
        let rows = (0..c.lens.len() as i64).rev().collect();
        let sinks = noise(c.heads, seed + 3);
        (q, k, v, tables, max_blocks, rows, sinks, tokens)
    }

    /// Plain two-pass softmax attention in f64 over the gathered context.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        c: &Case,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        tables: &[i64],
        max_blocks: usize,
        rows: &[i64],
        sinks: &[f32],
        scale: f32,
        out: &mut [f64],
    ) {
        let group = c.heads / c.kv_heads;
        for (i, &len) in c.lens.iter().enumerate() {
            let (start, end) = visible(len as usize, c.window);
            let row = rows[i] as usize;
            for h in 0..c.heads {
                let kvh = h / group;
                let qh = &q[(row * c.heads + h) * c.head_dim..][..c.head_dim];
                let mut logits = Vec::new();
                let mut slots = Vec::new();
                for pos in start..end {
                    let slot = tables[i * max_blocks + pos / c.page] as usize * c.page + pos % c.page;
                    let kh = &k[(slot * c.kv_heads + kvh) * c.head_dim..][..c.head_dim];
                    logits.push(qh.iter().zip(kh).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64);
                    slots.push(slot);
                }
                let mut m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                if c.sinks {
                    m = m.max(sinks[h] as f64);
                }
                let mut total: f64 = logits.iter().map(|l| (l - m).exp()).sum();
                if c.sinks {
                    total += (sinks[h] as f64 - m).exp();
                }
                let o = &mut out[(row * c.heads + h) * c.v_dim..][..c.v_dim];
                for (l, slot) in logits.iter().zip(&slots) {
                    let w = (l - m).exp() / total;
                    let vh = &v[(slot * c.kv_heads + kvh) * c.v_dim..][..c.v_dim];
                    for (a, b) in o.iter_mut().zip(vh) {
                        *a += w * *b as f64;
                    }
                }
            }
        }
    }

    /// The case's decode over q, k, v (of `inputs`' shapes, any element type).
    #[allow(clippy::too_many_arguments)]
    fn decode_of<'a, T: Element>(
        c: &'a Case,
        (q, k, v): (&'a [T], &'a [T], &'a [T]),
        tables: &'a [i64],
        max_blocks: usize,
        rows: &'a [i64],
        sinks: &'a [f32],
        tokens: usize,
        scale: f32,
    ) -> PagedDecode<'a, T> {
        let slots = k.len() / (c.kv_heads * c.head_dim);
        PagedDecode {
            q: Strided::new(q, tokens, c.heads, c.head_dim, c.heads * c.head_dim, c.head_dim).unwrap(),
            k: Strided::new(k, slots, c.kv_heads, c.head_dim, c.kv_heads * c.head_dim, c.head_dim).unwrap(),
            v: Strided::new(v, slots, c.kv_heads, c.v_dim, c.kv_heads * c.v_dim, c.v_dim).unwrap(),
            tables,
            max_blocks,
            lens: &c.lens,
            rows,
            page: c.page,
            scale,
            window: c.window,
            sinks: c.sinks.then_some(sinks),
        }
    }

    fn check(c: &Case, isa: Isa, threads: usize) {
        let (q, k, v, tables, max_blocks, rows, sinks, tokens) =
            inputs(c, c.lens.len() as u64 * 31 + c.head_dim as u64);
        let scale = (c.head_dim as f32).powf(-0.5) * 1.3;
        let d = decode_of(c, (&q, &k, &v), &tables, max_blocks, &rows, &sinks, tokens, scale);
        let mut out = vec![-7.0f32; tokens * c.heads * c.v_dim];
        paged_decode(&d, &mut out, threads, isa).unwrap();
        let mut want = vec![-7.0f64; out.len()];
        for r in 0..c.lens.len() {
            want[r * c.heads * c.v_dim..][..c.heads * c.v_dim].fill(0.0);
        }
        reference(c, &q, &k, &v, &tables, max_blocks, &rows, &sinks, scale, &mut want);
        for (i, (&got, &w)) in out.iter().zip(&want).enumerate() {
            assert!(
                (got as f64 - w).abs() <= 2e-5 + 2e-5 * w.abs(),
                "{isa:?} threads={threads} element {i}: {got} != {w}"
            );
        }
    }

    fn cases() -> Vec<Case> {
        let mut all = Vec::new();
        for (heads, kv_heads) in [(4, 4), (8, 2), (16, 1), (6, 2)] {
            for (head_dim, v_dim) in [(64, 64), (24, 40), (13, 13)] {
                for (window, sinks) in [(None, false), (Some(5), false), (None, true), (Some(70), true)] {
                    let lens = vec![1, 3, 4, 33, 70, 9, 130];
                    all.push(Case { heads, kv_heads, head_dim, v_dim, page: 4, lens, window, sinks });
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

    /// The AVX-512 products (two keys to a register, 16 value dims) give the AVX2 path's bits,
    /// float32 and bfloat16, on every case (GQA groups of 1 to 16, odd head dims, windows, sinks,
    /// contexts from 1 to 130 keys: whole and partial key groups, every chunk width).
    #[test]
    fn the_avx512_path_gives_the_avx2_bits() {
        if !Isa::Avx512.runs() {
            eprintln!("skipped: this CPU has no AVX-512F (the decode kernel's 16-lane products)");
            return;
        }
        fn run<T: Element>(c: &Case, cast: impl Fn(&[f32]) -> Vec<T>, isa: Isa) -> Vec<T> {
            let (q, k, v, tables, max_blocks, rows, sinks, tokens) =
                inputs(c, c.lens.len() as u64 * 31 + c.head_dim as u64);
            let (q, k, v) = (cast(&q), cast(&k), cast(&v));
            let d = decode_of(c, (&q, &k, &v), &tables, max_blocks, &rows, &sinks, tokens, 0.3);
            let mut out = vec![T::from_f32(-7.0); tokens * c.heads * c.v_dim];
            paged_decode(&d, &mut out, 1, isa).unwrap();
            out
        }
        let bits32 = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let bits16 = |v: Vec<Bf16>| v.into_iter().map(|x| x.0).collect::<Vec<_>>();
        let f32s = |x: &[f32]| x.to_vec();
        let bf16s = |x: &[f32]| x.iter().map(|&v| Bf16::from_f32(v)).collect::<Vec<Bf16>>();
        let mut cases = cases();
        cases.push(Case {
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            v_dim: 64,
            page: 16,
            lens: vec![300; 16],
            window: None,
            sinks: false,
        });
        cases.push(Case {
            heads: 32,
            kv_heads: 1,
            head_dim: 96,
            v_dim: 80,
            page: 16,
            lens: vec![1, 2, 700, 3],
            window: Some(600),
            sinks: true,
        });
        // GQA groups of 8 and 12 at head_dim 128 (Qwen3-MoE's, GLM-4.5's): bfloat16's blocks of
        // eight heads (and 8 + 4) against AVX2's of four
        for (heads, kv_heads) in [(32, 4), (24, 2)] {
            let lens = vec![5, 300, 33, 129];
            cases.push(Case { heads, kv_heads, head_dim: 128, v_dim: 128, page: 16, lens, window: None, sinks: false });
        }
        for c in &cases {
            let what = format!(
                "{}/{} heads, dims {}/{}, window {:?}, sinks {}",
                c.heads, c.kv_heads, c.head_dim, c.v_dim, c.window, c.sinks
            );
            assert_eq!(bits32(run(c, f32s, Isa::Avx512)), bits32(run(c, f32s, Isa::Avx2Fma)), "float32, {what}");
            assert_eq!(bits16(run(c, bf16s, Isa::Avx512)), bits16(run(c, bf16s, Isa::Avx2Fma)), "bfloat16, {what}");
        }
    }

    /// Isa::Avx512Bf16 against an f64 reference of the same bfloat16 inputs: GQA groups of 8,
    /// 12 (a block of eight in dot products, four widened), 16 and 32, even head dims from 2 to
    /// 128 and odd ones (scored widened), windows, sinks, contexts of 1 to 300 keys (whole and
    /// partial groups of the scorer's keys). Where it cannot take the dot products (float32
    /// rows, groups under eight, odd head dims) it gives Avx512's bits.
    #[test]
    fn bfloat16_scores_in_dot_products_equal_the_reference() {
        if !Isa::Avx512Bf16.runs() {
            eprintln!("skipped: this CPU has no AVX-512 BF16 (+ VL): the decode kernel's dot products");
            return;
        }
        fn run<T: Element>(c: &Case, cast: impl Fn(&[f32]) -> Vec<T>, isa: Isa) -> Vec<T> {
            let (q, k, v, tables, max_blocks, rows, sinks, tokens) = inputs(c, c.heads as u64 * 7 + c.head_dim as u64);
            let (q, k, v) = (cast(&q), cast(&k), cast(&v));
            let d = decode_of(c, (&q, &k, &v), &tables, max_blocks, &rows, &sinks, tokens, 0.3);
            let mut out = vec![T::from_f32(-7.0); tokens * c.heads * c.v_dim];
            paged_decode(&d, &mut out, 1, isa).unwrap();
            out
        }
        let bf16s = |x: &[f32]| x.iter().map(|&v| Bf16::from_f32(v)).collect::<Vec<Bf16>>();
        let widened = |x: &[f32]| x.iter().map(|&v| Bf16::from_f32(v).to_f32()).collect::<Vec<f32>>();
        let lens = vec![1, 7, 8, 9, 33, 300, 64];
        let mut taken = 0;
        for (heads, kv_heads) in [(16, 2), (24, 2), (32, 4), (32, 1), (4, 2), (12, 3)] {
            for (head_dim, v_dim) in [(128, 128), (64, 48), (2, 8), (13, 13)] {
                for (window, sinks) in [(None, false), (Some(40), true)] {
                    let c = Case { heads, kv_heads, head_dim, v_dim, page: 16, lens: lens.clone(), window, sinks };
                    let what = format!("{heads}/{kv_heads} heads, dims {head_dim}/{v_dim}, window {window:?}");
                    let got = run(&c, bf16s, Isa::Avx512Bf16);
                    let dots = heads / kv_heads >= 8 && head_dim % 2 == 0;
                    if !dots {
                        let bits = |v: Vec<Bf16>| v.into_iter().map(|x| x.0).collect::<Vec<_>>();
                        assert_eq!(bits(got), bits(run(&c, bf16s, Isa::Avx512)), "bfloat16, {what}");
                        continue;
                    }
                    taken += 1;
                    let (q, k, v, tables, max_blocks, rows, sinks_in, _) =
                        inputs(&c, c.heads as u64 * 7 + c.head_dim as u64);
                    let mut want = vec![-7.0f64; got.len()];
                    for r in 0..c.lens.len() {
                        want[r * heads * v_dim..][..heads * v_dim].fill(0.0);
                    }
                    let (q, k, v) = (widened(&q), widened(&k), widened(&v));
                    reference(&c, &q, &k, &v, &tables, max_blocks, &rows, &sinks_in, 0.3, &mut want);
                    for (i, (x, &w)) in got.iter().zip(&want).enumerate() {
                        // the output's own rounding to bfloat16 (2^-9 relative) and the sums'
                        let x = x.to_f32() as f64;
                        assert!((x - w).abs() <= 1e-4 + 5e-3 * w.abs(), "{what}: element {i}: {x} != {w}");
                    }
                }
            }
        }
        assert!(taken > 0);
        // float32 rows: Avx512's bits, whatever the group
        for (heads, kv_heads) in [(16, 2), (32, 4)] {
            let c = Case {
                heads,
                kv_heads,
                head_dim: 128,
                v_dim: 128,
                page: 16,
                lens: lens.clone(),
                window: None,
                sinks: false,
            };
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            let f32s = |x: &[f32]| x.to_vec();
            assert_eq!(
                bits(run(&c, f32s, Isa::Avx512Bf16)),
                bits(run(&c, f32s, Isa::Avx512)),
                "float32, {heads}/{kv_heads}"
            );
        }
    }

    /// `q` ([rows, heads, dim]) over two KV heads of `k` and `v` for the tile kernels alone, which
    /// take slots: no tables or contexts; scale 0.37.
    fn tile_only<'a, T: Element>(q: &'a [T], heads: usize, k: &'a [T], v: &'a [T], dim: usize) -> PagedDecode<'a, T> {
        let slots = k.len() / (2 * dim);
        PagedDecode {
            q: Strided::new(q, q.len() / (heads * dim), heads, dim, heads * dim, dim).unwrap(),
            k: Strided::new(k, slots, 2, dim, 2 * dim, dim).unwrap(),
            v: Strided::new(v, slots, 2, dim, 2 * dim, dim).unwrap(),
            tables: &[],
            max_blocks: 0,
            lens: &[],
            rows: &[],
            page: 4,
            scale: 0.37,
            window: None,
            sinks: None,
        }
    }

    /// One block's dot-product scores against the f64 sums of the same bfloat16 products: every
    /// key of a tile, in groups of the scorer's keys and a partial last group.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_blocks_dot_product_scores_are_its_keys_sums() {
        if !Isa::Avx512Bf16.runs() {
            eprintln!("skipped: this CPU has no AVX-512 BF16 (+ VL): the decode kernel's dot products");
            return;
        }
        use crate::paged_attn_dots::{score_block, transpose_queries, HEADS};
        for (head_dim, n) in [(128, TILE), (64, 13), (2, 1), (40, 8)] {
            let slots_total = 50;
            let q: Vec<Bf16> = noise(HEADS * head_dim, 3).into_iter().map(Bf16::from_f32).collect();
            let k: Vec<Bf16> = noise(slots_total * 2 * head_dim, 4).into_iter().map(Bf16::from_f32).collect();
            let d = tile_only(&q, HEADS, &k, &k, head_dim);
            let widened: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
            let mut qt = vec![0u32; HEADS * head_dim / 2];
            transpose_queries(&widened, head_dim, &mut qt);
            let slots: Vec<usize> = (0..n).map(|j| (j * 7 + 3) % slots_total).collect();
            let mut scores = vec![f32::NAN; HEADS * TILE];
            // SAFETY: the CPU has AVX-512F, BF16 and VL (checked above); bfloat16 rows of an even dim.
            unsafe { score_block(&d, 1, &slots, &qt, &mut scores) };
            for h in 0..HEADS {
                for (j, &slot) in slots.iter().enumerate() {
                    let key = d.k.at(slot, 1);
                    let exact: f64 = widened[h * head_dim..][..head_dim]
                        .iter()
                        .zip(key)
                        .map(|(&a, b)| a as f64 * b.to_f32() as f64)
                        .sum::<f64>()
                        * 0.37;
                    let got = scores[h * TILE + j] as f64;
                    assert!(
                        (got - exact).abs() <= 1e-5 * (1.0 + exact.abs()),
                        "dim {head_dim} head {h} key {j}: {got} != {exact}"
                    );
                }
                // past the keys: untouched
                assert!(scores[h * TILE + n..(h + 1) * TILE].iter().all(|x| x.is_nan()), "dim {head_dim} head {h}");
            }
        }
    }

    #[test]
    fn threads_split_the_work_and_give_the_same_result() {
        let lens = vec![300; 16];
        let c = Case { heads: 4, kv_heads: 2, head_dim: 64, v_dim: 64, page: 16, lens, window: None, sinks: false };
        for threads in [2, 3, 7] {
            check(&c, Isa::detect(), threads);
        }
        let lens = vec![1, 2, 700, 3];
        let c =
            Case { heads: 32, kv_heads: 1, head_dim: 96, v_dim: 80, page: 16, lens, window: Some(600), sinks: true };
        check(&c, Isa::detect(), 2);
    }

    /// Long contexts in parts (PART_KEYS) that threads take in turn: the bits of one thread (the
    /// parts depend only on the context), float32 and bfloat16, every ISA; contexts of one part
    /// exactly, one key more, many parts with a partial last one, windows and sinks.
    #[test]
    fn long_contexts_split_in_parts_keep_the_bits_of_one_thread() {
        fn run<T: Element>(c: &Case, cast: impl Fn(&[f32]) -> Vec<T>, isa: Isa, threads: usize) -> Vec<T> {
            let (q, k, v, tables, max_blocks, rows, sinks, tokens) = inputs(c, 7 + c.kv_heads as u64);
            let (q, k, v) = (cast(&q), cast(&k), cast(&v));
            let d = decode_of(c, (&q, &k, &v), &tables, max_blocks, &rows, &sinks, tokens, 0.2);
            let mut out = vec![T::from_f32(-7.0); tokens * c.heads * c.v_dim];
            paged_decode(&d, &mut out, threads, isa).unwrap();
            out
        }
        let bits32 = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let bits16 = |v: Vec<Bf16>| v.into_iter().map(|x| x.0).collect::<Vec<_>>();
        let f32s = |x: &[f32]| x.to_vec();
        let bf16s = |x: &[f32]| x.iter().map(|&v| Bf16::from_f32(v)).collect::<Vec<Bf16>>();
        let isas = [Isa::Scalar, Isa::Avx2Fma, Isa::Avx512, Isa::Avx512Bf16].into_iter().filter(|isa| isa.runs());
        for isa in isas {
            let part = PART_KEYS as i64;
            for (heads, kv_heads, lens, window, sinks) in [
                (4, 2, vec![3000], None, false),
                (16, 2, vec![2100, 9], None, true), // groups of eight: Avx512Bf16's dot products
                (8, 4, vec![2500, 40], Some(900), true),
                (12, 3, vec![1800], None, true),
                (4, 1, vec![part, part + 1, 7, 2 * part + 33], None, false),
                (2, 2, vec![part + 1, 3 * part], Some(2 * PART_KEYS), true),
            ] {
                let c = Case { heads, kv_heads, head_dim: 64, v_dim: 48, page: 16, lens, window, sinks };
                let (one32, one16) = (run(&c, f32s, isa, 1), run(&c, bf16s, isa, 1));
                for threads in [2, 3, 8] {
                    let what =
                        format!("{isa:?}, {heads}/{kv_heads} heads, {} sequences, {threads} threads", c.lens.len());
                    assert_eq!(bits32(run(&c, f32s, isa, threads)), bits32(one32.clone()), "float32, {what}");
                    assert_eq!(bits16(run(&c, bf16s, isa, threads)), bits16(one16.clone()), "bfloat16, {what}");
                }
                check(&c, isa, 2); // the split's every output written, against the reference
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn scoring_keys_together_gives_the_bits_of_one_by_one() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            eprintln!("skipped: this CPU has no AVX2 + FMA");
            return;
        }
        for (group, head_dim) in [(1, 64), (2, 64), (3, 24), (4, 13), (2, 8)] {
            let c = Case {
                heads: group * 2,
                kv_heads: 2,
                head_dim,
                v_dim: head_dim,
                page: 4,
                lens: vec![TILE as i64 + 3],
                window: None,
                sinks: false,
            };
            let (q, k, v, ..) = inputs(&c, group as u64 * 97 + head_dim as u64);
            let slots_total = k.len() / (c.kv_heads * c.head_dim);
            let d = tile_only(&q, c.heads, &k, &v, head_dim);
            let qs = &q[..group * head_dim];
            // a tile's worth of scattered slots, then a short one (a remainder below KB)
            for n in [TILE, 7, 3] {
                let slots: Vec<usize> = (0..n).map(|j| (j * 5 + 1) % slots_total).collect();
                let (mut together, mut alone) = (vec![0f32; group * TILE], vec![0f32; group * TILE]);
                // SAFETY: the CPU has AVX2 and FMA (checked above).
                unsafe {
                    in_head_blocks!(group, false, score_heads::<f32, false>(&d, 1, &slots, qs, &mut together));
                    in_head_blocks!(group, false, score_one_by_one_avx2::<f32>(&d, 1, &slots, qs, &mut alone));
                }
                assert_eq!(
                    together.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "group {group} dim {head_dim} keys {n}"
                );
            }
        }
    }

    #[test]
    fn cache_rows_land_in_their_slots_and_bad_slots_write_nothing() {
        let rows: Vec<f32> = (0..6).map(|v| v as f32).collect(); // three rows of two
        let mut cache = vec![-1.0f32; 10];
        write_cache_rows(&rows, 2, &[4, 0, 2], &mut cache).unwrap();
        assert_eq!(cache, [2.0, 3.0, -1.0, -1.0, 4.0, 5.0, -1.0, -1.0, 0.0, 1.0]);
        let before = cache.clone();
        assert!(write_cache_rows(&rows, 2, &[1, 5, 0], &mut cache).unwrap_err().contains("slot 5"));
        assert!(write_cache_rows(&rows, 2, &[1, -1, 0], &mut cache).unwrap_err().contains("slot -1"));
        assert!(write_cache_rows(&rows, 2, &[1, 0], &mut cache).is_err());
        assert!(write_cache_rows(&rows, 4, &[1], &mut cache).is_err());
        assert_eq!(cache, before);
    }

    #[test]
    fn the_isas_agree_closely() {
        let c = Case {
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            v_dim: 64,
            page: 16,
            lens: vec![500, 17],
            window: None,
            sinks: true,
        };
        let (q, k, v, tables, max_blocks, rows, sinks, tokens) = inputs(&c, 5);
        let slots = k.len() / (c.kv_heads * c.head_dim);
        let d = PagedDecode {
            q: Strided::new(&q, tokens, 8, 64, 8 * 64, 64).unwrap(),
            k: Strided::new(&k, slots, 2, 64, 2 * 64, 64).unwrap(),
            v: Strided::new(&v, slots, 2, 64, 2 * 64, 64).unwrap(),
            tables: &tables,
            max_blocks,
            lens: &c.lens,
            rows: &rows,
            page: 16,
            scale: 0.125,
            window: None,
            sinks: Some(&sinks),
        };
        let mut a = vec![0.0f32; tokens * 8 * 64];
        let mut b = a.clone();
        paged_decode(&d, &mut a, 1, Isa::Scalar).unwrap();
        paged_decode(&d, &mut b, 1, Isa::detect()).unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6 + 1e-6 * x.abs(), "{x} != {y}");
        }
    }

    #[test]
    fn bfloat16_accumulates_in_f32() {
        let c = Case {
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            v_dim: 32,
            page: 4,
            lens: vec![40, 5],
            window: None,
            sinks: false,
        };
        let (q, k, v, tables, max_blocks, rows, _, tokens) = inputs(&c, 9);
        let bf = |x: &[f32]| x.iter().map(|&f| Bf16::from_f32(f)).collect::<Vec<_>>();
        let (qb, kb, vb) = (bf(&q), bf(&k), bf(&v));
        let round = |x: &[Bf16]| x.iter().map(|b| b.to_f32()).collect::<Vec<_>>();
        let (qr, kr, vr) = (round(&qb), round(&kb), round(&vb));
        let slots = k.len() / 64;
        let view = |data, dim| Strided::new(data, slots, 2, dim, 2 * dim, dim).unwrap();
        let d = PagedDecode {
            q: Strided::new(&qb, tokens, 4, 32, 128, 32).unwrap(),
            k: view(&kb, 32),
            v: view(&vb, 32),
            tables: &tables,
            max_blocks,
            lens: &c.lens,
            rows: &rows,
            page: 4,
            scale: 0.2,
            window: None,
            sinks: None,
        };
        let mut out = vec![Bf16(0); tokens * 128];
        paged_decode(&d, &mut out, 1, Isa::detect()).unwrap();
        let mut want = vec![0.0f64; out.len()];
        reference(&c, &qr, &kr, &vr, &tables, max_blocks, &rows, &[], 0.2, &mut want);
        for (got, w) in out.iter().zip(&want).take(c.lens.len() * 128) {
            // one bfloat16 rounding of an f32-accurate result
            assert!((got.to_f32() as f64 - w).abs() <= 4e-3 * w.abs() + 1e-6, "{} != {w}", got.to_f32());
        }
    }

    #[test]
    fn bfloat16_rounds_to_nearest_even() {
        assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3f80_8000)).0, 0x3f80); // tie: to even
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3f81_8000)).0, 0x3f82); // tie: to even
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3f80_8001)).0, 0x3f81);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(Bf16::from_f32(f32::INFINITY).to_f32(), f32::INFINITY);
    }

    #[test]
    fn exp_is_within_two_ulp_and_exact_at_the_ends() {
        let mut x = -100.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), (x as f64).exp());
            if want >= f32::MIN_POSITIVE as f64 && want <= f32::MAX as f64 {
                let ulp = f32::from_bits((want as f32).to_bits() + 1) as f64 - want as f32 as f64;
                assert!((got as f64 - want).abs() <= 2.0 * ulp, "exp({x}) = {got}, want {want}");
            }
            x += 0.0137;
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn a_weights_exp_is_within_two_ulp_zero_past_the_smallest_normal_and_keeps_nan() {
        let mut x = -100.0f32;
        while x <= 0.0 {
            let (got, want) = (exp_weight(x), (x as f64).exp());
            if x < SMALLEST_NORMAL_LN {
                assert_eq!(got, 0.0, "exp_weight({x})");
            } else {
                let ulp = f32::from_bits((want as f32).to_bits() + 1) as f64 - want as f32 as f64;
                assert!((got as f64 - want).abs() <= 2.0 * ulp, "exp_weight({x}) = {got}, want {want}");
            }
            x += 0.0137;
        }
        assert_eq!(exp_weight(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_weight(0.0), 1.0);
        assert!(exp_weight(f32::NAN).is_nan());
    }

    fn small<'a>(
        q: &'a [f32],
        kv: &'a [f32],
        tables: &'a [i64],
        lens: &'a [i64],
        rows: &'a [i64],
    ) -> PagedDecode<'a, f32> {
        PagedDecode {
            q: Strided::new(q, 2, 2, 4, 8, 4).unwrap(),
            k: Strided::new(kv, 8, 1, 4, 4, 4).unwrap(),
            v: Strided::new(kv, 8, 1, 4, 4, 4).unwrap(),
            tables,
            max_blocks: 2,
            lens,
            rows,
            page: 2,
            scale: 1.0,
            window: None,
            sinks: None,
        }
    }

    #[test]
    fn bad_indices_are_errors_and_nothing_is_written() {
        let (q, kv) = (vec![1.0f32; 16], vec![1.0f32; 32]);
        let mut out = vec![-7.0f32; 16];
        let tables = [0i64, 1, 2, 3];
        for (tables, lens, rows, wanted) in [
            (&tables[..], &[3i64, 2][..], &[0i64, 0][..], "same output row"),
            (&tables[..], &[3, 2], &[0, 2], "outside the 2 query rows"),
            (&tables[..], &[5, 2], &[0, 1], "outside 1..=4"),
            (&tables[..], &[0, 2], &[0, 1], "outside 1..=4"),
            (&[0, 4, 2, 3][..], &[3, 2], &[0, 1], "block 4"),
            (&[0, -1, 2, 3][..], &[3, 2], &[0, 1], "block -1"),
            (&tables[..3], &[3, 2], &[0, 1], "table entries"),
        ] {
            let err = paged_decode(&small(&q, &kv, tables, lens, rows), &mut out, 1, Isa::Scalar).unwrap_err();
            assert!(err.contains(wanted), "{err}");
        }
        assert!(out.iter().all(|&x| x == -7.0));
        // a table entry past the visible part is never read: -1 there is fine
        paged_decode(&small(&q, &kv, &[0, -1, 2, 3], &[2, 2], &[0, 1]), &mut out, 1, Isa::Scalar).unwrap();
        assert!(out.iter().all(|&x| x == 1.0));
        assert!(Strided::new(&q, 3, 2, 4, 8, 4).is_err());
    }
}
