"""The replay signals beside the rows under tensor and expert parallelism on the CPU (float32,
gloo, 2 ranks) against one device: sampling masks and processed logprobs (the sampler's support
and what it drew from, computed on rank 0 from the logits the LM head gathers), the weight-version
spans, and the router's weights (captured by rank 0's MoE blocks; the router runs whole on every rank).

Masks and rows are compared bitwise, the masks' logprobs and the router's weights within the
tolerances the single-device tests use: a hidden state under TP is the ranks' partial products
summed by an all-reduce, in another order than one device's matrix products, so the router's
logits and the sampler's logits differ in the last float32 bits. The sets (which ids survive
top-k/top-p, which experts win) do not move unless a margin is that small; a mismatch reports
the margin so a near-tie is told from a real divergence."""

import numpy as np
import pytest

from engine_testing import one_torch_thread, prompt_ids, single_and_split  # noqa: F401 (autouse fixture)
from r3srv import SamplingParams

pytestmark = pytest.mark.slow  # worker processes (torch.distributed ranks)

LOGPROB_TOL = 1e-4  # as tests/test_tensor_parallel.py: float32 partial sums added in another order
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-6  # as tests/test_routed_expert_weights.py against transformers
ENGINE = dict(dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=512, max_num_seqs=4,
              enable_return_routed_expert_weights=True, logprobs_mode="processed_logprobs")
# the built-in model's random weights are peaked: a high temperature gives supports of many ids
SAMPLED = dict(max_tokens=10, temperature=2.0, top_k=30, top_p=0.95, ignore_eos=True,
               return_sampling_mask=True, return_routed_expert_weights=True, logprobs=3)

single, split = single_and_split(ENGINE)


def requests() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [prompt_ids(20, base=1), prompt_ids(45, base=2), prompt_ids(70, base=3)]
    params = [SamplingParams(seed=11 + i, routed_experts_prompt_start=3 * i, **SAMPLED) for i in range(len(prompts))]
    return prompts, params


def assert_same_signals(one, many) -> None:
    for a, b in zip(one, many):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids, f"{a.request_id}: sampled tokens differ"
        assert cb.weight_versions == ca.weight_versions and cb.weight_versions[-1].end == len(cb.token_ids)
        for i, (tops_a, tops_b) in enumerate(zip(ca.logprobs, cb.logprobs)):  # processed: after the filters
            assert tops_a.keys() == tops_b.keys(), f"{a.request_id}: token {i}'s top logprobs name other ids"
            np.testing.assert_allclose([tops_b[t].logprob for t in tops_a], [tops_a[t].logprob for t in tops_a],
                                       atol=LOGPROB_TOL)
        ma, mb = ca.sampling_mask, cb.sampling_mask
        assert len(ma) == len(cb.token_ids) and min(np.diff(ma.offsets)) > 1  # supports wide enough to matter
        for i in range(len(ma)):
            (ids_a, lp_a), (ids_b, lp_b) = ma.row(i), mb.row(i)
            assert np.array_equal(ids_a, ids_b), (
                f"{a.request_id}: token {i}'s mask differs: {sorted(int(t) for t in set(ids_a) ^ set(ids_b))} in one only")
            np.testing.assert_allclose(lp_b, lp_a, atol=LOGPROB_TOL)
        ra, rb = ca.routed_experts, cb.routed_experts
        if not np.array_equal(ra, rb):
            token, layer = np.argwhere((ra != rb).any(axis=-1))[0]
            pytest.fail(f"{a.request_id}: routed experts differ at token {token}, layer {layer}: "
                        f"{ra[token, layer]} vs {rb[token, layer]}")
        wa, wb = ca.routed_expert_weights, cb.routed_expert_weights
        assert wa.dtype == wb.dtype == np.float32 and wa.shape == wb.shape == ra.shape
        assert np.count_nonzero(wa) > 0
        np.testing.assert_allclose(wb, wa, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)


def test_masks_rows_and_router_weights_equal_one_device(single, split):
    prompts, params = requests()
    assert_same_signals(single.generate(prompts, params), split.generate(prompts, params))


def test_over_the_prefix_cache(single, split):
    """A prompt's cached blocks keep their rows' weights (by KV slot) on rank 0 as on one device."""
    prompts, params = requests()
    split.engine.reset_prefix_cache()
    split.generate(prompts[1:2], params[1:2])
    warm = split.generate(prompts[1:2], params[1:2])
    assert warm[0].num_cached_tokens == 32
    assert_same_signals(single.generate(prompts[1:2], params[1:2]), warm)
