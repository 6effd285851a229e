"""Cases for the paged decode attention kernel (kernels/paged_decode_triton.py), run on CPU
tensors in Triton's interpreter against the torch path's attention (ops/attention.py).

Like tests/router_triton_cases.py, this file only runs in a process started with
TRITON_INTERPRET=1: tests/test_paged_decode_triton.py starts one.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a process started with TRITON_INTERPRET=1 (see tests/test_paged_decode_triton.py)",
                allow_module_level=True)

from r3srv.kernels import paged_decode_triton  # noqa: E402
from r3srv.kernels.paged_decode_triton import paged_decode_triton as kernel  # noqa: E402
from paged_decode_testing import paged_cache as _cache  # noqa: E402
from paged_decode_testing import torch_path_decode as _reference  # noqa: E402
from paged_decode_testing import MODEL_CASES, two_sequence_decode_logits  # noqa: E402
from interpreter_testing import every_pair  # noqa: E402

PAGE = 4


def test_runs_in_the_interpreter():
    assert paged_decode_triton.interpreter_enabled()


# Pairwise designs (interpreter_testing.every_pair): every value of each axis meets every value
# of each other axis, in a third of the launches of the full product.
@pytest.mark.parametrize("heads_and_kv, window_and_sinks, dims", every_pair(
    [(4, 4), (8, 2), (16, 1), (6, 2)], [(None, False), (5, False), (None, True), (7, True)],
    [(16, 16), (64, 64), (24, 40)]), ids=str)
def test_decode_attention_equals_the_torch_path(heads_and_kv, window_and_sinks, dims):
    """Sequences of 1 to 70 keys in scattered blocks (across tiles; shorter and longer than the
    window) at scattered rows of a step: each row equals the torch path's attention, and the
    rows of other tokens are left as they were."""
    (heads, kv_heads), (window, sinks), (head_dim, v_dim) = heads_and_kv, window_and_sinks, dims
    g = torch.Generator().manual_seed(heads * 100 + head_dim + (window or 0) + sinks)
    lens = [1, 3, 4, 33, 70, 9]
    k_cache, v_cache, tables = _cache(lens, kv_heads, head_dim, v_dim, g)
    t = 9
    rows = torch.tensor([7, 0, 3, 8, 1, 5])
    q = torch.randn(t, heads, head_dim, generator=g)
    sink = torch.randn(heads, generator=g) if sinks else None
    scale = head_dim**-0.5 * 1.3
    out = torch.full((t, heads, v_dim), -7.0)
    kernel(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), rows, out, page=PAGE, scale=scale,
           window=window, sinks=sink)
    want = _reference(q, k_cache, v_cache, tables, lens, rows.tolist(), scale, window, sink)
    torch.testing.assert_close(out[rows], want[rows], atol=2e-5, rtol=2e-5)
    others = [r for r in range(t) if r not in rows.tolist()]
    assert (out[others] == -7.0).all()


@pytest.mark.parametrize("splits, layout, window_and_sinks", every_pair(
    [2, 3, 8], [(8, 2, 32, 32), (20, 1, 40, 32)], [(None, False), (50, True)]), ids=str)
def test_split_contexts_equal_the_torch_path(splits, layout, window_and_sinks):
    """Contexts split into parts (flash-decoding) and combined: equal to the torch path, for
    contexts from 2 keys (later parts empty) to 300 (several tiles a part), windows and sinks
    (which join in the combine), several blocks of 16 heads (the latent case)."""
    (heads, kv_heads, head_dim, v_dim), (window, sinks) = layout, window_and_sinks
    g = torch.Generator().manual_seed(splits * 10 + heads + (window or 0))
    lens = [2, 300, 45, 129, 97]
    k_cache, v_cache, tables = _cache(lens, kv_heads, head_dim, max(head_dim, v_dim), g)
    v_cache = v_cache[..., :v_dim] if kv_heads > 1 else k_cache[..., :v_dim]  # latent: values lead the keys
    rows = torch.tensor([4, 0, 2, 1, 3])
    q = torch.randn(6, heads, head_dim, generator=g)
    sink = torch.randn(heads, generator=g) if sinks else None
    out = torch.full((6, heads, v_dim), -7.0)
    kernel(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), rows, out, page=PAGE, scale=0.2,
           window=window, sinks=sink, splits=splits)
    want = _reference(q, k_cache, v_cache, tables, lens, rows.tolist(), 0.2, window, sink)
    torch.testing.assert_close(out[rows], want[rows], atol=2e-5, rtol=2e-5)
    assert (out[5] == -7.0).all()


def test_a_long_context_splits_by_itself():
    """Without an explicit split the launcher splits a long context at a small batch (the
    interpreter pretends to be a 4-processor GPU), and the result still equals the torch path."""
    assert paged_decode_triton.choose_splits(2, 1000, paged_decode_triton.processor_count(torch.device("cpu"))) > 1
    g = torch.Generator().manual_seed(5)
    lens = [1000, 700]
    k_cache, v_cache, tables = _cache(lens, 1, 16, 16, g)
    rows = torch.tensor([0, 1])
    q = torch.randn(2, 4, 16, generator=g)
    out = torch.empty(2, 4, 16)
    kernel(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), rows, out, page=PAGE, scale=0.25,
           max_context=max(lens))
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, lens, [0, 1], 0.25, None, None),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads", [16, 20, 40])
def test_latent_decodes_equal_the_torch_path(heads):
    """MLA's latent decodes: every head over one "KV head" (the cached latent and its rotary
    part), the values a view of its leading dims; several blocks of 16 heads, the last partial."""
    g = torch.Generator().manual_seed(heads)
    lens = [2, 17, 45]
    k_cache, _, tables = _cache(lens, 1, 40, 40, g)
    v_cache = k_cache[..., :32]  # the latent without its rotary dims
    rows = torch.tensor([2, 0, 1])
    q = torch.randn(3, heads, 40, generator=g)
    out = torch.full((3, heads, 32), -7.0)
    kernel(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), rows, out, page=PAGE, scale=0.3)
    want = _reference(q, k_cache, v_cache, tables, lens, rows.tolist(), 0.3, None, None)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_bfloat16_cache():
    g = torch.Generator().manual_seed(3)
    lens = [5, 40]
    k_cache, v_cache, tables = _cache(lens, 2, 32, 32, g, torch.bfloat16)
    q = torch.randn(2, 8, 32, generator=g).to(torch.bfloat16)
    out = torch.empty(2, 8, 32, dtype=torch.bfloat16)
    rows = torch.tensor([1, 0])
    kernel(q, k_cache, v_cache, tables, torch.tensor(lens), rows, out, page=PAGE, scale=32**-0.5)
    want = _reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, [1, 0], 32**-0.5, None, None)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family, layers", MODEL_CASES)
def test_models_decode_through_the_kernel(family, layers, monkeypatch, tmp_path):
    """The wiring: decode steps (after a prefill; GQA, gpt-oss's sinks and windows, Mixtral's
    window, latent attention) through the kernel give the logits of the gathered torch path."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from r3srv.models.loader import load_model
    from tiny_checkpoints import write_tiny_checkpoint

    model, _ = load_model(write_tiny_checkpoint(tmp_path / family, family, seed=4, **layers))
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return paged_decode_triton.paged_decode_triton(*args, **kwargs)

    def run(kernel: bool):  # the CPU model with the CUDA backend's decode kernel, or none (the torch path)
        model.select_ops(model.ops.replace(decode_attention=counted if kernel else None, fuse_decoder_layer=None))
        return two_sequence_decode_logits(model)

    torch.testing.assert_close(run(True), run(False), atol=1e-5, rtol=1e-5)
    assert calls, "the decodes never took the kernel"


def test_a_model_decode_after_a_long_prefill_takes_split_parts(monkeypatch, tmp_path):
    """The wiring of the split: a decode after a 600-token prefill hands the longest context to
    the launcher, which splits it (2 parts: one sequence, 2 KV heads, a pretend 4-processor
    GPU), and the logits equal the torch path's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_models_paged import BLOCK_SIZE, _batch

    from r3srv.models.loader import load_model
    from tiny_checkpoints import write_tiny_checkpoint

    model, _ = load_model(write_tiny_checkpoint(tmp_path / "long", "qwen3_moe", seed=6, max_position_embeddings=1024))
    tokens = torch.randint(0, 256, (601,), generator=torch.Generator().manual_seed(2)).tolist()
    table = list(range(-(-601 // BLOCK_SIZE)))
    chosen = []
    choose = paged_decode_triton.choose_splits
    monkeypatch.setattr(paged_decode_triton, "choose_splits", lambda *a: chosen.append(choose(*a)) or chosen[-1])

    def decode(kernel: bool):
        launcher = paged_decode_triton.paged_decode_triton if kernel else None
        model.select_ops(model.ops.replace(decode_attention=launcher, fuse_decoder_layer=None))
        model.init_kv_cache(len(table), BLOCK_SIZE, 1)
        model.forward(_batch(model, [(tokens[:600], 0, table)]))
        return model.forward(_batch(model, [(tokens[600:], 600, table)]))

    torch.testing.assert_close(decode(True), decode(False), atol=1e-5, rtol=1e-5)
    assert chosen and set(chosen) == {2}, chosen
