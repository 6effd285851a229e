"""--batch-invariant (ops/invariant.py): a request's tokens, logprobs and routed-experts rows are
bitwise the ones it gets alone, in batches of 2 to 64 of generated prompts, with prefill chunks
of a few tokens, over the prefix cache, after preemption and when sampled with a seed, on a plain
MoE (the built-in model) and an MLA family (a tiny DeepSeek-V3); the ops' rows do not depend on
the other rows; a gated shared expert (Qwen2-MoE) too; layers it does not cover are refused at
load.
The default mode is not asserted invariant (docs/replay.md, "Determinism")."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_testing import one_torch_thread  # noqa: F401  (fixture)
from interpreter_testing import assert_cases_pass_in_interpreter
from r3srv import LLM, SamplingParams
from r3srv.errors import ConfigError
from r3srv.ops import ops_for
from r3srv.ops.experts import SILU_AND_MUL

MAX_TOKENS = 8
TARGET_LENGTHS = (5, 23, 41)  # under, across and over a few blocks and prefill chunks


def generated_prompts(rng: random.Random, lengths) -> list[list[int]]:
    return [[rng.randrange(32, 122) for _ in range(n)] for n in lengths]


TARGETS = generated_prompts(random.Random(30), TARGET_LENGTHS)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, logprobs=2)


def sample(output):
    """(tokens, every returned logprob in order, rows) of a request's one sample."""
    s = output.outputs[0]
    logprobs = [(t, lp.logprob) for step in s.logprobs for t, lp in sorted(step.items())]
    return s.token_ids, logprobs, s.routed_experts


def assert_same(got, want, what: str) -> None:
    assert got[0] == want[0], f"{what}: tokens"
    assert got[1] == want[1], f"{what}: logprobs"  # floats compared exactly
    np.testing.assert_array_equal(got[2], want[2], err_msg=f"{what}: routed experts")


@pytest.fixture(scope="module", params=["builtin", "deepseek_v3"])
def model(request, tmp_path_factory):
    """The built-in model (a plain MoE) or a tiny DeepSeek-V3 (MLA, grouped routing with a bias)."""
    if request.param == "builtin":
        return None
    from tiny_checkpoints import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("mla"), "deepseek_v3", num_layers=2))


@pytest.fixture(scope="module")
def alone(model):
    """Each target alone, cold, one prefill, in an engine of its own."""
    llm = LLM(model, batch_invariant=True, enable_prefix_caching=False)
    return [sample(llm.generate([prompt], greedy())[0]) for prompt in TARGETS]


def mixed_in(targets, others, rng: random.Random):
    """The targets placed at random among the others, with the others' lengths of generation drawn
    (the batch's composition changes as they finish): (prompts, params, each target's index)."""
    prompts = [(p, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(1, 12))) for p in others]
    slots = []
    for target in targets:
        at = rng.randint(0, len(prompts))
        prompts.insert(at, (target, greedy()))
        slots = [s + (s >= at) for s in slots] + [at]
    return [p for p, _ in prompts], [sp for _, sp in prompts], slots


@pytest.mark.slow  # engines over generated batches
@pytest.mark.parametrize("batch_size", [2, 9, 64])
def test_same_in_batches_of_any_composition(model, alone, batch_size):
    rng = random.Random(batch_size)
    llm = LLM(model, batch_invariant=True, enable_prefix_caching=False, max_num_seqs=64)
    others = generated_prompts(rng, [rng.randint(1, 60) for _ in range(batch_size - len(TARGETS))])
    prompts, params, slots = mixed_in(TARGETS, others, rng)
    outputs = llm.generate(prompts, params)
    for i, at in enumerate(slots):
        assert_same(sample(outputs[at]), alone[i], f"target {i} in a batch of {batch_size}")


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_same_with_prefill_chunks_of_any_size(model, alone, chunk):
    """max_num_batched_tokens = chunk: prompts in chunks of at most that many tokens, sharing
    steps with the others' chunks and decodes (and a one-token chunk is a decode's shape)."""
    rng = random.Random(100 + chunk)
    llm = LLM(model, batch_invariant=True, enable_prefix_caching=False, max_num_batched_tokens=chunk,
              max_num_seqs=8)
    prompts, params, slots = mixed_in(TARGETS, generated_prompts(rng, [7, 30]), rng)
    outputs = llm.generate(prompts, params)
    for i, at in enumerate(slots):
        assert_same(sample(outputs[at]), alone[i], f"target {i} in chunks of {chunk}")


@pytest.mark.slow
def test_same_after_a_prefix_hit(model, alone):
    """A target whose prompt's leading blocks are cached (by a prompt sharing them, and by the
    target itself) computes only its tail, in a prefill of another shape."""
    llm = LLM(model, batch_invariant=True, block_size=4)
    longest = TARGETS[-1]
    llm.generate([longest[:30] + [40, 41, 42]], greedy(2))
    warm = llm.generate([longest], greedy())[0]
    assert warm.num_cached_tokens >= 28
    assert_same(sample(warm), alone[-1], "after a prefix hit by another prompt")
    llm.generate(TARGETS[:-1], greedy())
    again = llm.generate(TARGETS, greedy())
    assert all(out.num_cached_tokens > 0 for out in again)
    for i, out in enumerate(again):
        assert_same(sample(out), alone[i], f"target {i} cached")


@pytest.mark.slow
def test_same_after_preemption(model, alone):
    """A pool too small for the batch: sequences are preempted and recomputed, over whatever
    their blocks still hold in the prefix cache."""
    rng = random.Random(7)
    llm = LLM(model, batch_invariant=True, block_size=4, num_kv_blocks=30, max_model_len=64, max_num_seqs=8)
    prompts, params, slots = mixed_in(TARGETS, generated_prompts(rng, [20, 26, 33]), rng)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12) if at not in slots else p
              for at, p in enumerate(params)]
    outputs = llm.generate(prompts, params)
    assert llm.stats().num_preemptions > 0
    for i, at in enumerate(slots):
        assert_same(sample(outputs[at]), alone[i], f"target {i} after preemption")


@pytest.mark.slow
def test_same_when_sampled_with_a_seed(model):
    """Seeded sampling (temperature, top-k, top-p): the same draws alone and among seeded others,
    in chunks of 5 tokens over the prefix cache."""
    rng = random.Random(3)

    def seeded(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True,
                              max_tokens=MAX_TOKENS, logprobs=2)

    cold = LLM(model, batch_invariant=True, enable_prefix_caching=False)
    alone = [sample(cold.generate([prompt], seeded(i))[0]) for i, prompt in enumerate(TARGETS)]
    llm = LLM(model, batch_invariant=True, max_num_batched_tokens=5)
    others = generated_prompts(rng, [rng.randint(1, 50) for _ in range(12)])
    params = [SamplingParams(temperature=1.0, seed=rng.randrange(1000), max_tokens=rng.randint(1, 10)) for _ in others]
    outputs = llm.generate(others + TARGETS, params + [seeded(i) for i in range(len(TARGETS))])
    for i in range(len(TARGETS)):
        assert_same(sample(outputs[len(others) + i]), alone[i], f"seeded target {i}")


@pytest.mark.slow  # writes a transformers checkpoint
def test_same_with_a_gated_shared_expert(tmp_path):
    """Qwen2-MoE (a shared expert scaled by a sigmoid gate): the targets alone, then among 9
    generated prompts in chunks of 3 tokens, twice (the second time over the prefix cache)."""
    from tiny_checkpoints import write_tiny_checkpoint

    path = str(write_tiny_checkpoint(tmp_path / "qwen2_moe", "qwen2_moe"))
    cold = LLM(path, batch_invariant=True, enable_prefix_caching=False)
    alone = [sample(cold.generate([prompt], greedy())[0]) for prompt in TARGETS]
    rng = random.Random(5)
    llm = LLM(path, batch_invariant=True, max_num_batched_tokens=3, block_size=4)
    prompts, params, slots = mixed_in(TARGETS, generated_prompts(rng, [rng.randint(1, 40) for _ in range(6)]), rng)
    for _ in range(2):
        outputs = llm.generate(prompts, params)
        for i, at in enumerate(slots):
            assert_same(sample(outputs[at]), alone[i], f"target {i} with a gated shared expert")
    assert outputs[slots[-1]].num_cached_tokens > 0


@pytest.mark.slow  # writes transformers checkpoints
@pytest.mark.parametrize("family, gap", [("qwen3_next", "linear-attention"), ("deepseek_v32", "sparse-attention indexer")])
def test_uncovered_layers_are_refused_at_load(tmp_path, family, gap):
    from tiny_checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / family, family)
    with pytest.raises(ConfigError, match=f"--batch-invariant does not cover {family}'s .*{gap}"):
        LLM(str(path), batch_invariant=True)


def rows_alone_and_together(op, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    together = op(x)
    return together, torch.cat([op(x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_the_other_rows(dtype):
    gen = torch.Generator().manual_seed(1)
    ops = ops_for("cpu", dtype, batch_invariant=True)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    for rows in (1, 31, 33, 70, 130):  # across the kernel's MAX_ROWS and its packed path's 64
        x = torch.randn(rows, 80, generator=gen).to(dtype)
        together, alone = rows_alone_and_together(lambda t: ops.linear(t, weight, bias), x)
        assert torch.equal(together, alone), rows


def test_expert_pass_rows_do_not_depend_on_the_other_rows():
    """A prefill's tokens crowd experts past the pair count from which the kernel runs wide
    chunks (64, as this mode tells it; 16 by default in float32): the blocked pass keeps each
    token's bits."""
    gen = torch.Generator().manual_seed(2)
    ops = ops_for("cpu", torch.float32, batch_invariant=True)
    experts, hidden, inter, tokens, top_k = 4, 48, 40, 200, 2
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    expert_pass = ops.experts(SILU_AND_MUL)
    together = expert_pass(x, w13, w2, weights, ids)
    alone = torch.cat([expert_pass(x[i : i + 1], w13, w2, weights[i : i + 1], ids[i : i + 1]) for i in range(tokens)])
    assert torch.equal(together, alone)
    pairs = ids.shape[1] * tokens
    token_of_pair = torch.arange(tokens).repeat_interleave(top_k)
    listed = expert_pass(x, w13, w2, weights.reshape(pairs), ids.reshape(pairs), tokens=token_of_pair)
    assert torch.equal(listed, alone)


def test_other_devices_are_refused():
    with pytest.raises(ConfigError, match="no kernels for meta"):
        ops_for("meta", torch.float32, batch_invariant=True)


@pytest.mark.slow  # Triton's interpreter in a subprocess
def test_cuda_backend_is_batch_invariant_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (it ships with torch on Linux)")
    assert_cases_pass_in_interpreter(Path(__file__).with_name("batch_invariant_triton_cases.py"))
