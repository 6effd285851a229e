"""Tensor and expert parallelism on the CPU (float32, gloo, 2 ranks) against one device.

The built-in model at TP=2 (heads, MLP and vocabulary split; one all-reduce per row-parallel
layer) and at EP=2 (32 of its 64 experts per rank) must give the single device's greedy
tokens and routed-experts rows, and logprobs within float32 all-reduce tolerance. A
mismatch is reported as a near-tie when the single device's top-2 margin at that step is
within that tolerance (a flip the split's rounding may legitimately cause), as a real
divergence otherwise: never silently accepted.

One engine per mode for the whole module (its worker starts once).
"""

import numpy as np
import pytest

from engine_testing import GREEDY, one_torch_thread, prompt_ids, run_with_aborts, single_and_split  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams

pytestmark = pytest.mark.slow  # worker processes (torch.distributed ranks)

LOGPROB_TOL = 1e-4  # float32 partial sums added in another order
# a tight pool (preemptions) that still holds one long prompt, whose prefill packet takes a second broadcast
ENGINE = dict(dtype="float32", block_size=16, num_kv_blocks=100, max_model_len=1600, max_num_seqs=4,
              max_num_batched_tokens=2048)
single, split = single_and_split(ENGINE)


def assert_same_generation(one, many) -> None:
    """Same tokens, rows and (within tolerance) logprobs; a flip says whether it was a near-tie."""
    for a, b in zip(one, many):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        if ta != tb:
            step = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
            top = sorted((lp.logprob for lp in a.outputs[0].logprobs[step].values()), reverse=True)
            margin = top[0] - top[1]
            kind = "a near-tie flipped" if margin < 10 * LOGPROB_TOL else "a real divergence"
            pytest.fail(f"{a.request_id}: token {step} differs ({ta[step]} vs {tb[step]}), {kind}: top-2 margin {margin:.2e}")
        ra, rb = a.outputs[0].routed_experts, b.outputs[0].routed_experts
        if not np.array_equal(ra, rb):
            token, layer = np.argwhere((ra != rb).any(axis=-1))[0]
            pytest.fail(f"{a.request_id}: routed experts differ at token {token}, layer {layer}: {ra[token, layer]} vs "
                        f"{rb[token, layer]}")
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for tok in la:
                assert abs(la[tok].logprob - lb[tok].logprob) < LOGPROB_TOL


def test_greedy_tokens_rows_and_logprobs_equal_one_device(single, split):
    prompts = [prompt_ids(20, base=1), prompt_ids(45, base=2), prompt_ids(1450, base=3)]
    params = SamplingParams(max_tokens=10, logprobs=3, **GREEDY)
    assert_same_generation(single.generate(prompts, params), split.generate(prompts, params))


def test_prefix_cache_hit_under_tp(single, split):
    prompt = prompt_ids(45, base=11)
    params = SamplingParams(max_tokens=8, logprobs=2, **GREEDY)
    split.engine.reset_prefix_cache()
    cold = split.generate([prompt], params)
    warm = split.generate([prompt], params)
    assert warm[0].num_cached_tokens == 32
    assert_same_generation(cold, warm)
    assert_same_generation(single.generate([prompt], params), warm)


def test_preemption_and_abort_under_tp(single, split):
    """Four 300-token prompts fit the 100-block pool, their 120 tokens each do not: some are preempted
    and recomputed."""
    prompts = {f"p{i}": (prompt_ids(300 + i, base=30 + i), SamplingParams(max_tokens=120, logprobs=1, **GREEDY))
               for i in range(4)}
    aborted = {"gone": (prompt_ids(60, base=9), SamplingParams(max_tokens=200, **GREEDY))}
    before = split.stats().num_preemptions
    outs = run_with_aborts(split.engine, prompts, aborted, abort_at_step=3)
    assert split.stats().num_preemptions > before
    stats = split.stats()
    assert stats.kv_blocks_used == 0 and not split.engine.has_unfinished()
    expected = single.generate([p for p, _ in prompts.values()], next(iter(prompts.values()))[1])
    assert_same_generation(expected, [outs[rid] for rid in prompts])


def test_memory_release_and_weight_update_from_disk_under_tp(single, split, tmp_path):
    """Every rank releases and resumes its weights and KV, and loads its slices of new weights."""
    from r3srv.models.builtin import builtin_model_dir
    from test_engine import perturbed_builtin_copy

    prompts = [prompt_ids(30, base=4)]
    params = SamplingParams(max_tokens=8, logprobs=2, **GREEDY)
    assert split.engine.release_memory() == ["kv_cache", "weights"]
    assert split.engine.resume_memory() == []
    assert_same_generation(single.generate(prompts, params), split.generate(prompts, params))
    new = perturbed_builtin_copy(tmp_path / "step1")
    split.engine.update_weights(new, weight_version="step1")
    updated = split.generate(prompts, params)
    assert updated[0].weight_version == "step1"
    old = single.generate(prompts, params)[0].outputs[0]
    assert not np.array_equal(updated[0].outputs[0].routed_experts, old.routed_experts)  # other routing
    assert_same_generation(LLM(new, **ENGINE).generate(prompts, params), updated)
    split.engine.update_weights(str(builtin_model_dir()))  # the module's other tests expect the built-in weights
