"""The Triton paged decode kernel on CUDA (kernels/paged_decode_triton.py): engines decoding
through it give the torch path's greedy tokens and routed experts (GQA; gpt-oss's sinks and
sliding windows; DeepSeek-V3's latent decodes), and the kernel is what ran. Skipped (with the reason) without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_testing import GREEDY, full_precision_matmuls, prompt_ids  # noqa: F401 (fixture)
from r3srv import LLM, SamplingParams
from tiny_checkpoints import write_tiny_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family, layers", [("qwen3_moe", {}), ("gpt_oss", {"num_layers": 3}),
                                            ("mixtral", {"sliding_window": 4}), ("deepseek_v3", {})])
def test_cuda_decodes_through_the_kernel_equal_the_torch_path(family, layers, tmp_path, monkeypatch,
                                                              full_precision_matmuls, r3srv_settings):
    from r3srv.kernels import paged_decode_triton

    path = write_tiny_checkpoint(tmp_path / family, family, seed=2, **layers)
    prompts = [prompt_ids(5), prompt_ids(23, base=2), prompt_ids(40, base=5)]
    launcher, calls = paged_decode_triton.paged_decode_triton, []

    def counted(*args, **kwargs):
        calls.append(1)
        return launcher(*args, **kwargs)

    def generate():
        llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=128, block_size=4)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
        return [(o.outputs[0].token_ids, o.outputs[0].routed_experts) for o in outs]

    monkeypatch.setattr(paged_decode_triton, "paged_decode_triton", counted)  # the CUDA backend takes it when built
    r3srv_settings(triton_decode=True)
    kernel = generate()
    assert calls, "the CUDA decodes never took the kernel"
    r3srv_settings(triton_decode=False)
    calls.clear()
    torch_path = generate()
    assert not calls
    for (tokens, rows), (want_tokens, want_rows) in zip(kernel, torch_path):
        assert tokens == want_tokens
        np.testing.assert_array_equal(rows, want_rows)


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window"])
@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2)])
def test_varlen_prefill_equals_the_torch_path(heads, kv_heads, window):
    """kernels/prefill_varlen.py (torch's varlen flash attention) on generated steps of whole
    prompts, chunks after cached tokens (the torch path's) and decodes, bfloat16, against SDPA
    per prompt; and the whole prompts are what it took."""
    from test_paged_prefill_cpu import PAGE, generated_step

    from r3srv.kernels import prefill_varlen
    from r3srv.ops.attention import AttentionMetadata, paged_attention, prefill_attention

    assert prefill_varlen.available(), "this torch lacks torch.nn.attention.varlen"
    taken = []

    def other(q, k, v, kc, vc, spans, out, **kw):
        taken.extend(s.context_slots is not None for s in spans)
        prefill_attention(q, k, v, kc, vc, spans, out, **kw)

    op = prefill_varlen.varlen_prefill(other)
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        batch, slots = generated_step(g, 9)
        cuda = torch.device("cuda")
        meta = AttentionMetadata.build(batch, PAGE, cuda)
        q = torch.randn(batch.input_ids.shape[0], heads, 64, generator=g).to(cuda, torch.bfloat16)
        k, v = (torch.randn(q.shape[0], kv_heads, 64, generator=g).to(cuda, torch.bfloat16) for _ in range(2))
        cache = [torch.randn(slots, kv_heads, 64, generator=g).to(cuda, torch.bfloat16) for _ in range(2)]
        got = paged_attention(q, k, v, cache[0].clone(), cache[1].clone(), meta, window=window, prefill_kernel=op)
        want = paged_attention(q, k, v, cache[0].clone(), cache[1].clone(), meta, window=window,
                               prefill_kernel=prefill_attention)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert all(taken), "a whole prompt went to the torch path"
