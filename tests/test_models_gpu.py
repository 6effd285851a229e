"""The same decoder on CUDA: float32 logits and routing equal the CPU's; the built-in model runs in bfloat16."""

from __future__ import annotations

import pytest
import torch

from engine_testing import full_precision_matmuls  # noqa: F401 (fixture)
from r3srv.models.batch import ForwardBatch
from r3srv.models.loader import load_model
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.gpu


def _prefill(model, ids: list[int], device: str):
    cfg = model.config
    model.init_kv_cache(8, 16)
    t = len(ids)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, device=device),
        positions=torch.arange(t, device=device),
        slot_mapping=torch.arange(t, device=device),
        query_lens=[t],
        context_lens=[t],
        block_tables=torch.arange(8, dtype=torch.int32, device=device)[None],
        logits_indices=torch.arange(t, device=device),
        routing_capture=torch.zeros(t, cfg.num_layers, cfg.top_k, dtype=torch.int32, device=device),
    )
    return model.forward(batch).cpu(), batch.routing_capture.cpu()


# glm4_moe, minimax_m2: the fused kernel's sigmoid + correction-bias (+ scaling) path inside the model;
# deepseek_v3, deepseek_v2: multi-head latent attention on CUDA; gpt_oss: sinks, sliding windows, biased experts;
# qwen3_next, qwen3_5_moe: Gated DeltaNet (triangular solves, state slots) on CUDA; deepseek_v32: sparse attention;
# nemotron_h: Mamba-2; kimi_linear: Kimi Delta Attention; lfm2_moe: short convolutions
@pytest.mark.parametrize(
    "family",
    ["qwen2_moe", "glm4_moe", "minimax_m2", "deepseek_v3", "deepseek_v2", "gpt_oss", "ernie4_5_moe", "glm4_moe_lite", "dots1",
     "qwen3_next", "qwen3_5_moe", "deepseek_v32", "nemotron_h", "kimi_linear", "granitemoehybrid",
     "afmoe", "granitemoe", "lfm2_moe", "qwen3_vl_moe", "granitemoe_swa", "flex_olmo"],
)
def test_cuda_float32_matches_cpu(family, tmp_path, full_precision_matmuls):
    path = write_tiny_checkpoint(tmp_path / "ckpt", family, seed=4)
    ids = list(range(40, 60))
    cpu_logits, cpu_rows = _prefill(load_model(path)[0], ids, "cpu")
    gpu_model, _ = load_model(path, device="cuda", dtype=torch.float32)
    gpu_logits, gpu_rows = _prefill(gpu_model, ids, "cuda")
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=1e-3, rtol=1e-3)
    assert torch.equal(gpu_rows, cpu_rows)


def test_builtin_model_runs_in_bfloat16_on_cuda(tmp_path, r3srv_settings):
    r3srv_settings(cache_dir=tmp_path)
    model, tokenizer = load_model(None, device="cuda")
    assert model.dtype == torch.bfloat16  # "auto": the checkpoint's dtype on CUDA
    logits, rows = _prefill(model, tokenizer.encode("Hello, GPU"), "cuda")
    assert torch.isfinite(logits).all()
    assert all(len(set(r)) == model.config.top_k for r in rows.reshape(-1, model.config.top_k).tolist())


def test_grouped_expert_gemms_on_cuda_match_the_loop(r3srv_settings):
    from r3srv.ops import ops_for
    from r3srv.ops.experts import SILU_AND_MUL, grouped_mm_available

    if not grouped_mm_available():
        pytest.skip("this torch has no grouped_mm: the loop is the only CUDA path")
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(96, 256, generator=gen).to("cuda", torch.bfloat16)
    w13 = (torch.randn(16, 256, 256, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    w2 = (torch.randn(16, 256, 128, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(96, 16, generator=gen), -1), 4)
    weights, ids = weights.cuda(), ids.to("cuda", torch.int32)
    expert_pass = ops_for("cuda", torch.bfloat16).experts(SILU_AND_MUL)
    assert expert_pass.uses_grouped_mm(x, w2)
    grouped = expert_pass(x, w13, w2, weights, ids)
    r3srv_settings(grouped_mm=False)
    expert_pass = ops_for("cuda", torch.bfloat16).experts(SILU_AND_MUL)
    assert not expert_pass.uses_grouped_mm(x, w2)
    looped = expert_pass(x, w13, w2, weights, ids)
    torch.testing.assert_close(grouped.float(), looped.float(), rtol=2e-2, atol=2e-2)
