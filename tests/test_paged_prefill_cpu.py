"""The CPU prefill attention kernel (kernels/paged_prefill_cpu.py, rust/src/paged_prefill.rs) as
the prefill op: against the torch path (SDPA per prompt) on generated steps, its input checks,
the CPU backend's choice, spans it leaves to SDPA, and the models and the engine with it on and
off."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from engine_testing import GREEDY, model_of, one_torch_thread, prompt_ids, rebound  # noqa: F401 (autouse fixture)
from paged_decode_testing import MODEL_CASES
from r3srv import LLM, SamplingParams
from r3srv import settings as settings_module
from r3srv.kernels import cpu_isa, kernel_threads
from r3srv.kernels import paged_prefill_cpu as cpu_kernel
from r3srv.models.batch import ForwardBatch
from r3srv.ops import ops_for
from r3srv.ops.attention import AttentionMetadata, paged_attention, prefill_attention, span_kernel

PAGE = 4


def kernel_op(threads: int = 1, max_context: int | None = None, longer=None, kernel: str | None = None):
    kernel_call = functools.partial(cpu_kernel.paged_prefill_cpu, threads=threads, kernel=kernel)
    return span_kernel(kernel_call, max_context, longer)


def generated_step(g: torch.Generator, sequences: int) -> tuple[ForwardBatch, int]:
    """A step of `sequences` sequences in scattered blocks: whole prompts (one token or more),
    chunks after cached tokens and decodes, in a random order; and the cache's slot count."""
    query_lens, context_lens = [], []
    for _ in range(sequences):
        kind = int(torch.randint(0, 4, (1,), generator=g))
        context = int(torch.randint(1, 140, (1,), generator=g))
        if kind == 0:  # a whole prompt
            query_lens.append(context)
        elif kind == 1:  # a chunk after cached tokens
            context = max(context, 2)
            query_lens.append(int(torch.randint(1, context, (1,), generator=g)))
        elif kind == 2:  # a one-token prompt
            context = 1
            query_lens.append(1)
        else:  # a decode
            context = max(context, 2)
            query_lens.append(1)
        context_lens.append(context)
    blocks = [-(-c // PAGE) for c in context_lens]
    order = torch.randperm(sum(blocks) + 2, generator=g)
    tables = torch.full((sequences, max(blocks)), -1, dtype=torch.int64)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[first : first + n]
        first += n
    slots, positions = [], []
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        pos = torch.arange(c - q, c)
        positions.append(pos)
        slots.append(tables[i, pos // PAGE] * PAGE + pos % PAGE)
    total = sum(query_lens)
    batch = ForwardBatch(
        input_ids=torch.zeros(total, dtype=torch.int64), positions=torch.cat(positions), slot_mapping=torch.cat(slots),
        query_lens=query_lens, context_lens=context_lens, block_tables=tables,
        logits_indices=torch.tensor(np.cumsum(query_lens) - 1),
    )
    return batch, (sum(blocks) + 2) * PAGE


def run_step(seed, heads, kv_heads, head_dim, v_dim, window, sinks, dtype=torch.float32, latent=False, threads=1,
             kernel=None):
    """One layer's attention over a generated step with the kernel (`kernel`: paged_prefill_cpu's)
    as the prefill op and with the torch path, every decode through the torch path in both."""
    g = torch.Generator().manual_seed(seed)
    batch, slots = generated_step(g, 7)
    t = batch.input_ids.shape[0]
    k_cache = torch.randn(slots, kv_heads, max(v_dim, head_dim) if latent else head_dim, generator=g).to(dtype)
    v_cache = k_cache[..., :v_dim] if latent else torch.randn(slots, kv_heads, v_dim, generator=g).to(dtype)
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, k_cache.shape[-1], generator=g).to(dtype)
    v = k[..., :v_dim] if latent else torch.randn(t, kv_heads, v_dim, generator=g).to(dtype)
    sink = torch.randn(heads, generator=g) if sinks else None
    meta = AttentionMetadata.build(batch, PAGE, torch.device("cpu"))
    assert meta.prefills, "a generated step without prompts"
    scale = head_dim**-0.5 * 1.3
    outs = []
    for op in (kernel_op(threads, kernel=kernel), prefill_attention):
        caches = (k_cache.clone(), None) if latent else (k_cache.clone(), v_cache.clone())
        vc = caches[0][..., :v_dim] if latent else caches[1]
        outs.append(paged_attention(q, k[..., : k_cache.shape[-1]] if latent else k, v, caches[0], vc, meta,
                                    scale=scale, window=window, sinks=sink, prefill_kernel=op))
    return outs


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 2), (16, 1), (32, 4)])
@pytest.mark.parametrize("head_dim, v_dim", [(64, 64), (13, 13), (24, 40)])
@pytest.mark.parametrize("window, sinks", [(None, False), (5, False), (None, True), (40, True)],
                         ids=["plain", "window", "sinks", "window-sinks"])
def test_prefill_attention_equals_the_torch_path(heads, kv_heads, head_dim, v_dim, window, sinks):
    for seed in range(3):
        got, want = run_step(seed * 1000 + heads * 10 + head_dim, heads, kv_heads, head_dim, v_dim, window, sinks)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_split_the_work_and_give_the_same_rows(threads):
    one, _ = run_step(7, 8, 2, 64, 64, None, True)
    many, want = run_step(7, 8, 2, 64, 64, None, True, threads=threads)
    assert torch.equal(one, many)  # an item's rows are computed by one thread, in one order
    torch.testing.assert_close(many, want, atol=2e-5, rtol=2e-5)


def test_bfloat16_and_latent_values():
    got, want = run_step(3, 8, 2, 32, 32, None, False, dtype=torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # MLA: one "KV head" for all heads, the values a view of the keys' leading dims
    got, want = run_step(4, 16, 1, 72, 64, None, False, latent=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


FLASH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the flash kernels' tolerance against SDPA: float32's sums in another order; bfloat16's weights
# rounded to bfloat16 (rust/src/paged_prefill_bf16.rs) and the result's rounding
FLASH_TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}


def needs_flash(name: str):
    """Skips where this CPU has no flash kernel for `name` at any context length (float32:
    AVX-512F; bfloat16: AVX-512 BF16), saying so: the portable kernel's tests cover that dtype there."""
    return pytest.mark.skipif(name not in cpu_kernel.FLASH, reason=f"this CPU lacks the {name} flash prefill "
                              "kernel's instructions (float32: AVX-512F, bfloat16: AVX-512 BF16)")


FLASH_PARAMS = [pytest.param(name, marks=needs_flash(name)) for name in FLASH_DTYPES]


@pytest.mark.parametrize("name", FLASH_PARAMS)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (16, 1)])
@pytest.mark.parametrize("head_dim, v_dim", [(64, 64), (128, 128), (24, 40)])
def test_flash_kernel_equals_the_torch_path(name, heads, kv_heads, head_dim, v_dim):
    """Without a window or sinks the dtype's flash kernel runs (rust/src/flash_prefill.rs): SDPA's
    float32 softmax over the same values, within the dtype's tolerance."""
    tolerance = FLASH_TOLERANCE[name]
    for seed in range(2):
        got, want = run_step(seed * 77 + heads + head_dim, heads, kv_heads, head_dim, v_dim, None, False,
                             dtype=FLASH_DTYPES[name])
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def float32_tiles() -> list[str]:
    """The float32 flash kernel's tiles this CPU runs (rust/src/paged_prefill_f32.rs)."""
    flags = cpu_isa.cpu_flags()
    return [t for t, needs in (("avx512", {"avx512f"}), ("avx2", {"avx2", "fma"})) if needs <= flags]


@pytest.mark.skipif(not float32_tiles(), reason="this CPU has neither AVX-512F nor AVX2 with FMA (the float32 "
                    "flash kernel's tiles)")
@pytest.mark.parametrize("heads, kv_heads, head_dim, v_dim", [(4, 2, 64, 64), (8, 2, 128, 128), (6, 3, 24, 40)])
def test_the_float32_flash_tiles_equal_the_torch_path_and_each_other(heads, kv_heads, head_dim, v_dim):
    """Each of the float32 flash kernel's tiles this CPU runs, named, against SDPA; AVX-512's and
    AVX2's the same bits; the portable kernel, named, too."""
    rows = {}
    for kernel in [*float32_tiles(), "portable"]:
        for seed in range(2):
            got, want = run_step(seed * 31 + heads + head_dim, heads, kv_heads, head_dim, v_dim, None, False,
                                 kernel=kernel)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
            rows.setdefault(kernel, []).append(got)
    if len(rows) == 3:
        assert all(torch.equal(a, b) for a, b in zip(rows["avx512"], rows["avx2"]))
    else:
        print("this CPU lacks AVX-512F: the AVX2 tiles checked against SDPA only")


def bfloat16_tiles() -> list[str]:
    """The bfloat16 flash kernel's tiles this CPU runs: AMX (rust/src/flash_amx.rs) where the Rust
    core runs AMX tiles now, AVX-512 BF16 dot products (rust/src/paged_prefill_bf16.rs)."""
    if "bfloat16" not in cpu_kernel.FLASH:
        return []
    return ["amx", "avx512"] if cpu_kernel.flash_tiles(torch.bfloat16) == "amx" else ["avx512"]


@pytest.mark.parametrize("tiles", [
    pytest.param("amx", marks=pytest.mark.skipif("amx" not in bfloat16_tiles(), reason="this CPU (or Linux) "
                                                 "does not run AMX-BF16 tiles (the bfloat16 AMX flash tiles)")),
    pytest.param("avx512", marks=pytest.mark.skipif("avx512" not in bfloat16_tiles(), reason="this CPU lacks "
                                                    "AVX-512 BF16 (the bfloat16 flash kernel)")),
])
@pytest.mark.parametrize("heads, kv_heads, head_dim, v_dim", [(4, 2, 64, 64), (32, 4, 128, 128), (6, 3, 24, 40),
                                                             (8, 8, 96, 80)])
def test_the_bfloat16_flash_tiles_equal_the_torch_path(tiles, heads, kv_heads, head_dim, v_dim):
    """Each of the bfloat16 flash kernel's tiles this CPU runs, named, against SDPA over the same
    values (generated steps: whole prompts, chunks after cached tokens), within bfloat16's
    tolerance; AMX tiles sum in an order of their own, so their rows are checked against SDPA,
    not against the dot products' bits."""
    for seed in range(3):
        got, want = run_step(seed * 13 + heads + head_dim, heads, kv_heads, head_dim, v_dim, None, False,
                             dtype=torch.bfloat16, kernel=tiles)
        tolerance = FLASH_TOLERANCE["bfloat16"]
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype, kernel, match", [
    (torch.float32, "avx1", 'no prefill kernel named "avx1"'),
    (torch.float32, "amx", "does not run the amx flash prefill tiles"),
    (torch.bfloat16, "avx2", "does not run the avx2 flash prefill tiles"),
])
def test_a_kernel_this_cpu_does_not_run_is_a_value_error(dtype, kernel, match):
    with pytest.raises(ValueError, match=match):
        run_step(5, 4, 2, 64, 64, None, False, dtype=dtype, kernel=kernel)


def one_prompt(context: int) -> AttentionMetadata:
    """The metadata of one whole prompt of `context` tokens in consecutive blocks."""
    pos = torch.arange(context)
    batch = ForwardBatch(input_ids=torch.zeros(context, dtype=torch.int64), positions=pos, slot_mapping=pos,
                         query_lens=[context], context_lens=[context],
                         block_tables=torch.arange(-(-context // PAGE)).unsqueeze(0), logits_indices=pos[-1:])
    return AttentionMetadata.build(batch, PAGE, torch.device("cpu"))


@pytest.mark.parametrize("name", FLASH_PARAMS)
def test_a_flash_dtype_takes_the_kernel_at_any_context_length(monkeypatch, name):
    """Past RUST_PREFILL_MAX_CONTEXT a prompt (no window, no sinks) of a dtype with a flash kernel
    here goes to that kernel, which gives SDPA's rows within the dtype's tolerance; a windowed one
    still goes to SDPA there."""
    from r3srv.ops.cpu import RUST_PREFILL_MAX_CONTEXT

    without_amx(monkeypatch)
    context = RUST_PREFILL_MAX_CONTEXT + 100
    meta = one_prompt(context)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(context, h, 64, generator=g) for h in (4, 2, 2))
    dtype, tolerance = FLASH_DTYPES[name], FLASH_TOLERANCE[name]
    for window, kernel_runs in ((None, True), (2000, False)):
        calls = counting_kernel(monkeypatch)
        with settings_module.overridden(cpu_threads=1):
            op = ops_for("cpu", dtype).prefill_attention
        cache = lambda: torch.zeros(context, 2, 64, dtype=dtype)  # noqa: E731
        args = (q.to(dtype), k.to(dtype), v.to(dtype))
        got = paged_attention(*args, cache(), cache(), meta, window=window, prefill_kernel=op)
        want = paged_attention(*args, cache(), cache(), meta, window=window, prefill_kernel=prefill_attention)
        assert bool(calls) == kernel_runs, (name, window)
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_without_a_flash_kernel_long_contexts_go_to_sdpa(monkeypatch):
    """Where a dtype has no flash kernel on this CPU (FLASH says), a prompt past
    RUST_PREFILL_MAX_CONTEXT goes to SDPA: the backend's choice follows the rule, not the dtype."""
    from r3srv.ops.cpu import RUST_PREFILL_MAX_CONTEXT

    monkeypatch.setattr(cpu_kernel, "FLASH", set())
    context = RUST_PREFILL_MAX_CONTEXT + 8
    meta = one_prompt(context)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(context, h, 64, generator=g) for h in (4, 2, 2))
    calls = counting_kernel(monkeypatch)
    with settings_module.overridden(cpu_threads=1):
        op = ops_for("cpu", torch.float32).prefill_attention
    got = paged_attention(q, k, v, torch.zeros(context, 2, 64), torch.zeros(context, 2, 64), meta, prefill_kernel=op)
    want = paged_attention(q, k, v, torch.zeros(context, 2, 64), torch.zeros(context, 2, 64), meta,
                           prefill_kernel=prefill_attention)
    assert not calls
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", FLASH_PARAMS)
def test_the_flash_kernels_rule(name):
    """The backend's choice asks Rust's rule (each kernel's applies_to): no window, no sinks, and
    in bfloat16 an even head_dim."""
    q = torch.zeros(3, 2, 64, dtype=FLASH_DTYPES[name])
    assert cpu_kernel.flash_applies(q, None, None)
    assert not cpu_kernel.flash_applies(q, 128, None)
    assert not cpu_kernel.flash_applies(q, None, torch.zeros(2))
    odd = torch.zeros(3, 2, 63, dtype=FLASH_DTYPES[name])
    assert cpu_kernel.flash_applies(odd, None, None) == (name == "float32")
    assert not cpu_kernel.flash_applies(q.to(torch.float16), None, None)


def test_longer_contexts_go_to_the_other_path(monkeypatch):
    """Spans over max_context are handed to `longer` in one call; the kernel gets the others."""
    for seed in range(5, 100):  # the first generated step with prompts on both sides of 60
        g = torch.Generator().manual_seed(seed)
        batch, slots = generated_step(g, 9)
        meta = AttentionMetadata.build(batch, PAGE, torch.device("cpu"))
        if len({s.context_len > 60 for s in meta.prefills}) == 2:
            break
    seen, handed = [], []

    def counted(q, k_cache, v_cache, columns, ctx_slots, out, **kw):
        seen.extend(columns[2].tolist())
        cpu_kernel.paged_prefill_cpu(q, k_cache, v_cache, columns, ctx_slots, out, **kw)

    def longer(q, k, v, kc, vc, spans, out, **kw):
        handed.extend(s.context_len for s in spans)
        prefill_attention(q, k, v, kc, vc, spans, out, **kw)

    q = torch.randn(batch.input_ids.shape[0], 4, 16, generator=g)
    k, v = (torch.randn(q.shape[0], 2, 16, generator=g) for _ in range(2))
    cache = [torch.randn(slots, 2, 16, generator=g) for _ in range(2)]
    both = paged_attention(q, k, v, cache[0].clone(), cache[1].clone(), meta,
                           prefill_kernel=span_kernel(counted, 60, longer))
    want = paged_attention(q, k, v, cache[0].clone(), cache[1].clone(), meta, prefill_kernel=prefill_attention)
    contexts = [s.context_len for s in meta.prefills]
    assert sorted(seen) == sorted(c for c in contexts if c <= 60)
    assert sorted(handed) == sorted(c for c in contexts if c > 60) and handed
    torch.testing.assert_close(both, want, atol=2e-5, rtol=2e-5)


def small_inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"q": torch.randn(6, 4, 8, generator=g), "k_cache": torch.randn(12, 2, 8, generator=g),
            "v_cache": torch.randn(12, 2, 8, generator=g), "columns": torch.tensor([[0, 3], [3, 2], [3, 4]]),
            "slots": torch.tensor([0, 1, 2, 7, 8, 9, 10]), "out": torch.full((6, 4, 8), -7.0)}


@pytest.mark.parametrize("changed, error, match", [
    (lambda a: {"q": a["q"].double()}, TypeError, "float32 or bfloat16"),
    (lambda a: {"k_cache": a["k_cache"].bfloat16()}, TypeError, "k_cache is torch.bfloat16"),
    (lambda a: {"out": a["out"][:, :, :4]}, ValueError, "out must be contiguous"),
    (lambda a: {"out": a["q"]}, ValueError, "shares memory with q"),
    (lambda a: {"columns": a["columns"][:2]}, ValueError, r"must be \[3, spans\]"),
    (lambda a: {"slots": torch.tensor([0, 1, 2, 7, 8, 9, 12])}, ValueError, "slot 12 is outside"),
    (lambda a: {"slots": torch.tensor([0, 1, 2, 7, 8, 9])}, ValueError, "run past"),
    (lambda a: {"columns": torch.tensor([[0, 2], [3, 2], [3, 4]])}, ValueError, "share query rows"),
    (lambda a: {"columns": torch.tensor([[0, 3], [3, 5], [3, 4]])}, ValueError, "1..=context length"),
], ids=["dtype", "mixed dtypes", "strided out", "aliased out", "columns", "slot", "short slots", "overlap", "queries"])
def test_bad_inputs_are_typed_errors_and_nothing_is_written(changed, error, match):
    args = small_inputs()
    out = args["out"]
    args.update(changed(args))
    with pytest.raises(error, match=match):
        cpu_kernel.paged_prefill_cpu(*args.values(), scale=0.3)
    assert (out == -7.0).all()  # checked before anything is written


def spinning_openmp(monkeypatch) -> None:
    """libgomp's default wait, whatever this shell set."""
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)


def test_cpu_prefills_take_the_kernel_unless_turned_off(monkeypatch):
    assert cpu_kernel.BUILT, "r3srv._core lacks the prefill attention kernel: rebuild the extension (make install)"
    spinning_openmp(monkeypatch)
    without_amx(monkeypatch)

    def chosen(dtype, **switches):
        with settings_module.overridden(**switches):
            return ops_for("cpu", dtype).prefill_attention

    def takes_kernel(op) -> bool:
        return getattr(op, "__qualname__", "").startswith("span_kernel")

    # more threads: the kernel on torch's OpenMP team (where torch runs libgomp: the default);
    # on a pool of its own beside spinning OpenMP threads, large steps only
    on_team = kernel_threads.torch_openmp_library() is not None
    own_pool = dict(cpu_threads=2, openmp_kernel_threads=False)
    for dtype in (torch.float32, torch.bfloat16):
        assert takes_kernel(chosen(dtype, cpu_threads=1))
        assert takes_kernel(chosen(dtype, cpu_threads=2)) == on_team
        assert chosen(dtype, **own_pool).__qualname__.startswith("large_steps_only")
    # torch's OpenMP threads waiting passively (as `r3srv serve` has them): the kernel on any threads
    for passive in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "passive"}, {"GOMP_SPINCOUNT": "0"}):
        spinning_openmp(monkeypatch)
        for name, value in passive.items():
            monkeypatch.setenv(name, value)
        assert takes_kernel(chosen(torch.float32, **own_pool)), passive
    spinning_openmp(monkeypatch)
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    assert chosen(torch.float32, **own_pool).__qualname__.startswith("large_steps_only")
    assert not takes_kernel(chosen(torch.float16, cpu_threads=1))  # float16: the torch path
    assert not takes_kernel(chosen(torch.float32, cpu_threads=1, rust_prefill=False))


def without_amx(monkeypatch) -> None:
    """The backend's choice as on a CPU without AMX, whatever this one has."""
    monkeypatch.setattr(cpu_isa, "torch_has_amx_bfloat16", lambda: False)


@pytest.mark.parametrize("threads", [1, 2])
def test_with_amx_bfloat16_prefills_stay_with_torch(monkeypatch, threads):
    """Where torch runs bfloat16 on AMX tiles and the Rust flash kernel does not (no tiles granted,
    or --no-amx-tiles), torch's flash attention outruns the kernel's dot products: bfloat16
    prefills take the torch path at every length, float32 ones the kernel as before; the rows are
    the torch path's own."""
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}))
    monkeypatch.setattr(cpu_kernel, "flash_tiles", lambda dtype: "avx512")
    assert cpu_isa.torch_has_amx_bfloat16()
    calls = counting_kernel(monkeypatch)
    with settings_module.overridden(cpu_threads=threads):
        bf16, f32 = (ops_for("cpu", dtype).prefill_attention for dtype in (torch.bfloat16, torch.float32))
    assert getattr(f32, "__qualname__", "").startswith("span_kernel")
    g = torch.Generator().manual_seed(11)
    for context in (40, 300):
        meta = one_prompt(context)
        q, k, v = (torch.randn(context, h, 64, generator=g).bfloat16() for h in (4, 2, 2))
        cache = lambda: torch.zeros(context, 2, 64, dtype=torch.bfloat16)  # noqa: E731
        got = paged_attention(q, k, v, cache(), cache(), meta, prefill_kernel=bf16)
        want = paged_attention(q, k, v, cache(), cache(), meta,
                               prefill_kernel=functools.partial(prefill_attention, merged=True))
        assert torch.equal(got, want), context
    assert not calls
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    assert not cpu_isa.torch_has_amx_bfloat16()


@pytest.mark.skipif("amx" not in bfloat16_tiles(), reason="this CPU (or Linux) does not run AMX-BF16 tiles "
                    "(the bfloat16 AMX flash tiles)")
def test_bfloat16_prefills_take_the_amx_flash_tiles_unless_amx_tiles_is_off(monkeypatch):
    """On this AMX CPU the bfloat16 prefill op is the Rust kernel's (its AMX tiles: rows within
    bfloat16's tolerance of SDPA's); with settings.amx_tiles off it is torch's (SDPA on torch's
    AMX), and the flash kernel reports its dot products meanwhile."""
    from r3srv.kernels import expert_pairs_cpu
    meta = one_prompt(300)
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(300, h, 64, generator=g).bfloat16() for h in (4, 2, 2))
    cache = lambda: torch.zeros(300, 2, 64, dtype=torch.bfloat16)  # noqa: E731
    want = paged_attention(q, k, v, cache(), cache(), meta,
                           prefill_kernel=functools.partial(prefill_attention, merged=True))
    try:
        for allowed, tiles in ((True, "amx"), (False, "avx512")):
            calls = counting_kernel(monkeypatch)
            with settings_module.overridden(amx_tiles=allowed):
                op = ops_for("cpu", torch.bfloat16).prefill_attention
            assert cpu_kernel.flash_tiles(torch.bfloat16) == tiles
            got = paged_attention(q, k, v, cache(), cache(), meta, prefill_kernel=op)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
            assert bool(calls) == allowed, (allowed, calls)
    finally:
        expert_pairs_cpu.allow_amx(True)


def test_on_more_threads_only_large_steps_take_the_kernel(monkeypatch):
    """Two threads, the kernels on a pool of their own beside spinning OpenMP threads: a step of
    less attention work than RUST_THREADED_PREFILL_MIN_MACS keeps SDPA, a larger one takes the
    kernel (on both threads); both give the torch path's rows."""
    from r3srv.ops import cpu as cpu_backend

    calls = counting_kernel(monkeypatch)
    spinning_openmp(monkeypatch)
    with settings_module.overridden(cpu_threads=2, openmp_kernel_threads=False):
        op = ops_for("cpu", torch.float32).prefill_attention
    g = torch.Generator().manual_seed(3)
    large = ForwardBatch(input_ids=torch.zeros(400, dtype=torch.int64), positions=torch.arange(400),
                         slot_mapping=torch.arange(400), query_lens=[400], context_lens=[400],
                         block_tables=torch.arange(100).view(1, 100), logits_indices=torch.tensor([399]))
    for (batch, slots), heads, dim, expect in ((generated_step(g, 6), 2, 16, False), ((large, 400), 32, 128, True)):
        meta = AttentionMetadata.build(batch, PAGE, torch.device("cpu"))
        work = sum((s.end - s.start) * s.context_len for s in meta.prefills) * heads * 2 * dim
        assert (work >= cpu_backend.RUST_THREADED_PREFILL_MIN_MACS) == expect, work
        q = torch.randn(batch.input_ids.shape[0], heads, dim, generator=g)
        k, v = (torch.randn(q.shape[0], heads, dim, generator=g) for _ in range(2))
        cache = [torch.randn(slots, heads, dim, generator=g) for _ in range(2)]
        calls.clear()
        got = paged_attention(q, k, v, cache[0].clone(), cache[1].clone(), meta, prefill_kernel=op)
        want = paged_attention(q, k, v, cache[0].clone(), cache[1].clone(), meta, prefill_kernel=prefill_attention)
        assert bool(calls) == expect
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def counting_kernel(monkeypatch) -> list:
    calls = []
    real = cpu_kernel.paged_prefill_cpu

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernel, "paged_prefill_cpu", counted)
    return calls


def prefill_logits(model) -> torch.Tensor:
    """The logits of two prompts' prefill, then a chunk of each after its cached tokens, in a fresh cache."""
    from test_models_paged import BLOCK_SIZE, _batch

    tokens = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    model.init_kv_cache(16, BLOCK_SIZE, 4)
    first = model.forward(_batch(model, [(tokens[:9], 0, [0, 1, 2, 3]), (tokens[:3], 0, [5, 6, 7])]))
    chunk = model.forward(_batch(model, [(tokens[9:16], 9, [0, 1, 2, 3]), (tokens[3:8], 3, [5, 6, 7])]))
    return torch.cat([first, chunk])


@pytest.mark.parametrize("family, layers", MODEL_CASES)
def test_models_prefill_through_the_kernel(family, layers, monkeypatch, tmp_path):
    """The wiring: prompts and chunks after cached tokens (GQA, gpt-oss's sinks and windows,
    Mixtral's window, latent attention) through the kernel give the logits of the torch path."""
    from tiny_checkpoints import write_tiny_checkpoint

    from r3srv.models.loader import load_model

    model, _ = load_model(write_tiny_checkpoint(tmp_path / family, family, seed=4, **layers))
    calls = counting_kernel(monkeypatch)
    with rebound(model, rust_prefill=False):
        off = prefill_logits(model)
    assert not calls
    with rebound(model, rust_prefill=True, cpu_threads=1):
        on = prefill_logits(model)
    torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)
    if family not in ("deepseek_v3", "glm4_moe_lite"):  # latent attention expands its own prompts
        assert calls, "the prefills never took the kernel"


def test_engine_tokens_and_routed_experts_equal_the_torch_path(monkeypatch):
    """The built-in model's greedy tokens and routed-experts rows with prompts (and, through the
    prefix cache and small chunks, chunks after cached tokens) through the kernel and through SDPA."""
    llm = LLM(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True)
    shared = prompt_ids(40, 9)
    prompts = [prompt_ids(3, 1), shared + prompt_ids(50, 2), prompt_ids(17, 3), shared + prompt_ids(90, 4)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    calls = counting_kernel(monkeypatch)
    with rebound(model_of(llm), rust_prefill=False):
        llm.reset_prefix_cache()
        off = llm.generate(prompts, params)
    assert not calls
    with rebound(model_of(llm), rust_prefill=True, cpu_threads=1):
        llm.reset_prefix_cache()
        on = llm.generate(prompts, params)
    assert calls
    for a, b in zip(off, on):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        np.testing.assert_array_equal(b.outputs[0].routed_experts, a.outputs[0].routed_experts)
