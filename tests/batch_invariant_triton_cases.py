"""Cases for the batch-invariant CUDA backend (ops/invariant.py's build_cuda: Triton kernels), run
on CPU tensors in Triton's interpreter: its linear layer's rows and its prompt queries do not
depend on the rest of the call, and a model bound to it gives a request the same tokens,
logprobs and rows alone, in a batch, in chunks and over the prefix cache. Bitwise on a device is
the GPU check's to show: the interpreter's tl.dot is numpy's.

Like tests/paged_decode_cases.py, this file only runs in a process started with
TRITON_INTERPRET=1: tests/test_batch_invariant.py starts one.
"""

from __future__ import annotations

import random

import pytest
import torch

from interpreter_testing import skip_unless_interpreted

skip_unless_interpreted("tests/test_batch_invariant.py")

from r3srv import LLM, SamplingParams, settings  # noqa: E402
from r3srv.kernels.linear_triton import linear_triton  # noqa: E402
from r3srv.kernels.paged_decode_triton import interpreter_enabled, paged_decode_triton  # noqa: E402
from r3srv.ops import cuda, invariant  # noqa: E402
from r3srv.ops.attention import PrefillSpan  # noqa: E402
from engine_testing import model_of  # noqa: E402
from paged_decode_testing import paged_cache  # noqa: E402


def test_runs_in_the_interpreter():
    assert interpreter_enabled()


@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_do_not_depend_on_the_other_rows(bias):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(70, 45, generator=g)
    b = torch.randn(70, generator=g) if bias else None
    for rows in (1, 5, 17):  # one row; part of a 16-row block; a full block and one row of the next
        x = torch.randn(rows, 45, generator=g)
        together = linear_triton(x, weight, b)
        alone = torch.cat([linear_triton(x[i : i + 1], weight, b) for i in range(rows)])
        assert torch.equal(together, alone), rows
        torch.testing.assert_close(together, torch.nn.functional.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def test_prompt_queries_get_each_query_alone_as_a_decode():
    """A prompt chunk of 6 queries after 27 cached keys, through prefill_as_decodes (one-slot
    pages, unsplit), equals each query decoded alone over the real block table."""
    g = torch.Generator().manual_seed(4)
    page, heads, kv_heads, dim = 4, 4, 2, 16
    k_cache, v_cache, tables = paged_cache([33], kv_heads, dim, dim, g, page=page)
    q = torch.randn(6, heads, dim, generator=g)
    pos = torch.arange(33)
    slots = tables[0, pos // page].long() * page + pos % page
    span = PrefillSpan(0, 6, slots, 33, slots[27:])
    out = torch.zeros(6, heads, dim)
    decode = lambda *a, **kw: paged_decode_triton(*a, splits=1, **kw)  # noqa: E731
    invariant.prefill_as_decodes(decode, q, None, None, k_cache, v_cache, [span], out, scale=0.3)
    for i in range(6):
        alone = torch.zeros(1, heads, dim)
        paged_decode_triton(q[i : i + 1], k_cache, v_cache, tables, torch.tensor([28 + i]), torch.tensor([0]), alone,
                            page=page, scale=0.3, splits=1)
        assert torch.equal(out[i], alone[0]), i


def cuda_invariant(llm):
    model = model_of(llm)
    model.select_ops(invariant.build_cuda(cuda.build(torch.float32, settings.current())))
    return llm


def test_a_model_bound_to_the_backend_is_batch_invariant(tmp_path):
    from tiny_checkpoints import write_tiny_checkpoint

    path = str(write_tiny_checkpoint(tmp_path / "moe", "qwen3_moe"))
    rng = random.Random(6)
    targets = [[rng.randrange(32, 122) for _ in range(n)] for n in (6, 13)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3, logprobs=1)

    def sample(out):
        s = out.outputs[0]
        return s.token_ids, [(t, lp.logprob) for step in s.logprobs for t, lp in sorted(step.items())], \
            s.routed_experts.tolist()

    cold = cuda_invariant(LLM(path, enable_prefix_caching=False))
    alone = [sample(cold.generate([t], params)[0]) for t in targets]
    llm = cuda_invariant(LLM(path, max_num_batched_tokens=5, block_size=4))
    others = [[rng.randrange(32, 122) for _ in range(n)] for n in (3, 9)]
    for _ in range(2):  # the second time over the prefix cache
        outputs = llm.generate([others[0], targets[0], others[1], targets[1]], params)
        assert [sample(outputs[1]), sample(outputs[3])] == alone
