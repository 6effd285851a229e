"""Gated DeltaNet prefill (models/gated_deltanet.py): the chunked form r3srv runs for prompts,
against the token-by-token recurrence (its decode form, the definition), and against
transformers' own chunked torch implementation (the peer a trainer's reference forward runs).

    .venv/bin/python -m pytest benches/bench_gated_deltanet.py

One 1,024-token prompt through the delta rule of one linear-attention layer of Qwen3-Next's
per-head shape (key and value heads of 128) with 8 value heads, float32, one thread.
benches/conftest.py prints reference / r3srv per group.
"""

from __future__ import annotations

import pytest
import torch

from r3srv.models.gated_deltanet import chunked_delta_rule, l2_normalize, recurrent_step

TOKENS, HEADS, DIM = 1024, 8, 128

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = l2_normalize(torch.randn(HEADS, TOKENS, DIM, generator=g)) * DIM**-0.5
    k = l2_normalize(torch.randn(HEADS, TOKENS, DIM, generator=g))
    v = torch.randn(HEADS, TOKENS, DIM, generator=g)
    decay = -torch.rand(HEADS, TOKENS, generator=g) * 0.1
    beta = torch.rand(HEADS, TOKENS, generator=g)
    return q, k, v, decay, beta


def token_by_token(q, k, v, decay, beta):
    state = torch.zeros(1, HEADS, DIM, DIM)
    return torch.stack(
        [recurrent_step(state, q[None, :, t], k[None, :, t], v[None, :, t], decay[None, :, t], beta[None, :, t])[0]
         for t in range(q.shape[1])], dim=1)


def r3srv_chunked(q, k, v, decay, beta):
    return chunked_delta_rule(torch.zeros(HEADS, DIM, DIM), q, k, v, decay, beta)


def transformers_chunked(q, k, v, decay, beta):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    # its layout: [batch, tokens, heads, dim]; it scales q by dim^-0.5 itself
    out, _ = torch_chunk_gated_delta_rule(
        (q * DIM**0.5).transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        g=decay.T[None], beta=beta.T[None], output_final_state=True,
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(
    "group, candidate",
    [("vs recurrence", "reference"), ("vs recurrence", "r3srv"), ("vs transformers", "reference"),
     ("vs transformers", "r3srv")],
)
def test_delta_rule_prefill(benchmark, group, candidate):
    pytest.importorskip("transformers")
    inputs = _inputs()
    benchmark.group = f"delta rule 1024 tok ({group})"
    fn = r3srv_chunked if candidate == "r3srv" else token_by_token if group == "vs recurrence" else transformers_chunked
    out = benchmark(fn, *inputs)
    torch.testing.assert_close(out, r3srv_chunked(*inputs), atol=2e-4, rtol=1e-4)
