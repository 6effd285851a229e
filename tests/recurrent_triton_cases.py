"""Cases for the fused decode steps (kernels/recurrent_triton.py), run on CPU tensors in Triton's
interpreter against the torch steps of models/gated_deltanet.py, models/kda.py and models/mamba2.py.

Like tests/router_triton_cases.py, this file only runs in a process started with
TRITON_INTERPRET=1: tests/test_recurrent_triton.py starts one.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a process started with TRITON_INTERPRET=1 (see tests/test_recurrent_triton.py)",
                allow_module_level=True)

from r3srv.kernels import recurrent_triton  # noqa: E402
from r3srv.models.gated_deltanet import l2_normalize, recurrent_step  # noqa: E402
from r3srv.models.kda import kda_step  # noqa: E402


def test_runs_in_the_interpreter():
    assert recurrent_triton.interpreter_enabled()


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated-deltanet", "kda"])
@pytest.mark.parametrize("dk, dv", [(16, 16), (24, 40), (128, 128)])
def test_in_place_step_equals_the_torch_step(per_channel, dk, dv):
    """Five sequences in scattered slots of a pool (one fresh): outputs and updated states equal
    the gather-step-scatter torch path; every other entry of the pool is left as it was."""
    g = torch.Generator().manual_seed(dk * 1000 + dv + per_channel)
    rows, heads, entries = 5, 3, 9
    pool = torch.randn(entries, heads, dk, dv, generator=g)
    slots = torch.tensor([7, 2, 5, 0, 8])
    keep = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])  # the third starts here: zero state
    q = l2_normalize(torch.randn(rows, heads, dk, generator=g)) * dk**-0.5
    k = l2_normalize(torch.randn(rows, heads, dk, generator=g))
    v = torch.randn(rows, heads, dv, generator=g)
    decay = -torch.rand(rows, heads, *((dk,) if per_channel else ()), generator=g)
    beta = torch.rand(rows, heads, generator=g)

    want_pool = pool.clone()
    s = want_pool[slots] * keep[:, None, None, None]
    want = (kda_step if per_channel else recurrent_step)(s, q, k, v, decay, beta)
    want_pool[slots] = s
    got = recurrent_triton.delta_rule_step_triton(pool, slots, keep, q, k, v, decay, beta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5)  # untouched entries stay bitwise too


def test_strided_inputs_and_no_rows():
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(4, 2, 8, 8, generator=g)
    wide = torch.randn(3, 2, 16, generator=g)
    q, k = wide[..., :8], wide[..., 8:]  # views with a row stride of 32
    v = torch.randn(3, 2, 8, generator=g)
    decay, beta = -torch.rand(3, 2, generator=g), torch.rand(3, 2, generator=g)
    slots, keep = torch.tensor([3, 1, 0]), torch.ones(3)
    want_pool = pool.clone()
    s = want_pool[slots].clone()
    want = recurrent_step(s, q, k, v, decay, beta)
    want_pool[slots] = s
    torch.testing.assert_close(recurrent_triton.delta_rule_step_triton(pool, slots, keep, q, k, v, decay, beta), want,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5)
    empty = recurrent_triton.delta_rule_step_triton(pool, slots[:0], keep[:0], q[:0], k[:0], v[:0], decay[:0], beta[:0])
    assert empty.shape == (0, 2, 8)
    with pytest.raises(ValueError, match="float32"):
        recurrent_triton.delta_rule_step_triton(pool.half(), slots, keep, q, k, v, decay, beta)


@pytest.mark.parametrize("head_dim, state_size", [(8, 8), (24, 40), (64, 128)])
def test_ssm_step_equals_the_torch_step(head_dim, state_size):
    from r3srv.models.mamba2 import ssm_step

    g = torch.Generator().manual_seed(head_dim + state_size)
    rows, heads, entries = 4, 3, 7
    pool = torch.randn(entries, heads, head_dim, state_size, generator=g)
    slots, keep = torch.tensor([6, 1, 3, 0]), torch.tensor([1.0, 0.0, 1.0, 1.0])
    x = torch.randn(rows, heads, head_dim, generator=g)
    dt = torch.rand(rows, heads, generator=g) * 0.5
    a = -torch.rand(heads, generator=g) * 4
    b, c = torch.randn(rows, heads, state_size, generator=g), torch.randn(rows, heads, state_size, generator=g)
    want_pool = pool.clone()
    s = want_pool[slots] * keep[:, None, None, None]
    want = ssm_step(s, x, dt, a, b, c)
    want_pool[slots] = s
    got = recurrent_triton.ssm_step_triton(pool, slots, keep, x, dt, b, c, a)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear", "nemotron_h", "granitemoehybrid"])
def test_layers_decode_through_the_fused_step(family, monkeypatch, tmp_path):
    """The wiring: a hybrid's decode steps (after a prefill) through the fused steps give the
    logits of the gather-step-scatter path."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_models_paged import BLOCK_SIZE, _batch

    from r3srv import settings
    from r3srv.models.loader import load_model
    from r3srv.ops import cuda
    from tiny_checkpoints import write_tiny_checkpoint

    layers = {} if family == "nemotron_h" else {"num_layers": 3}
    model, _ = load_model(write_tiny_checkpoint(tmp_path / family, family, seed=4, **layers))
    tokens = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()

    cpu_ops = model.ops
    cuda_steps = cuda.build(torch.float32, settings.current()).recurrent_steps  # the Triton steps

    def run(fused: bool):  # the CPU model with the CUDA backend's fused steps, or without
        model.select_ops(cpu_ops.replace(recurrent_steps=cuda_steps) if fused else cpu_ops)
        assert all((layer.linear_attn.fused_step is not None) == fused for layer in model.layers
                   if layer.linear_attn is not None and layer.linear_attn.FUSED_STEP is not None)
        model.init_kv_cache(16, BLOCK_SIZE, 4)
        logits = [model.forward(_batch(model, [(tokens[:9], 0, [0, 1, 2, 3])]))]
        for pos in range(9, 12):  # decodes, one crossing a block boundary
            logits.append(model.forward(_batch(model, [(tokens[pos : pos + 1], pos, [0, 1, 2, 3])])))
        return torch.cat(logits)

    torch.testing.assert_close(run(True), run(False), atol=1e-5, rtol=1e-5)
