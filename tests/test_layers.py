"""Rotary helpers against their references: YaRN against transformers' own computation,
interleaved rotation against the complex-number form DeepSeek's reference code uses."""

from __future__ import annotations

import pytest
import torch

from r3srv.ops.rotary import apply_rope, apply_rope_interleaved, rope_cos_sin, rope_inv_freq, yarn_inv_freq


@pytest.mark.parametrize(
    "yarn",
    [
        # DeepSeek-V3 (mscale and mscale_all_dim), gpt-oss (truncate false), Qwen3 long context (factor only)
        dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
             mscale_all_dim=1.0, truncate=True),
        dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False),
        dict(factor=4.0, original_max_position_embeddings=32768, beta_fast=32.0, beta_slow=1.0, truncate=True),
    ],
)
def test_yarn_matches_transformers(yarn):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    dim, theta = 64, 10000.0
    config = transformers.LlamaConfig(
        hidden_size=dim * 4, num_attention_heads=4, head_dim=dim, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, **yarn},
    )
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    inv_freq, factor = yarn_inv_freq(dim, theta, {"mscale": None, "mscale_all_dim": None, **yarn})
    torch.testing.assert_close(inv_freq, want_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def _complex_rotation(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """DeepSeek's reference: pairs (x0, x1), (x2, x3), ... as complex numbers times e^(i pos freq)."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    turn = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.view_as_real(torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * turn).flatten(-2)


def test_interleaved_rotation_gives_the_reference_scores():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 3, 16, generator=gen), torch.randn(7, 3, 16, generator=gen)
    positions = torch.arange(5, 12)
    inv_freq = rope_inv_freq(16, 10000.0)
    cos, sin = rope_cos_sin(positions, inv_freq, torch.float32)
    ours = torch.einsum("thd,shd->hts", apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin))
    ref = torch.einsum("thd,shd->hts", _complex_rotation(q, positions, inv_freq), _complex_rotation(k, positions, inv_freq))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, torch.einsum("thd,shd->hts", apply_rope(q, cos, sin), apply_rope(k, cos, sin)))


@pytest.mark.parametrize("rotate", [apply_rope, apply_rope_interleaved])
def test_partial_rotation_leaves_the_tail_alone(rotate):
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(torch.arange(4), rope_inv_freq(8, 10000.0), torch.float32)
    out = rotate(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:])
    torch.testing.assert_close(out[..., :8], rotate(x[..., :8].contiguous(), cos, sin))
    assert not torch.allclose(out[1:, :, :8], x[1:, :, :8])  # position 0 does not turn; the others do
