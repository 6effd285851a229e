"""Sampling masks (return_sampling_mask) from the offline LLM, checked against an independent
numpy implementation of vLLM's filters applied to the full-vocabulary logits each step really
sampled from (recorded by wrapping the executor's sampler): every token's mask holds exactly
the ids the filtered distribution can draw, with that distribution's logprobs, for each filter
alone and combined (min_tokens bans, logit_bias, the three penalties, temperature, min_p,
top-k, top-p); greedy picks are singletons at 0.0; masks are cut with the tokens by a stop
string; a support wider than sampling_mask_max_tokens fails the request with a 400-class error."""

from __future__ import annotations

import numpy as np
import pytest

from r3srv import LLM, SamplingParams
from r3srv.errors import InvalidRequestError
from r3srv.outputs import CompletionOutput, RequestOutput, SamplingMasks, merge_deltas
from engine_testing import one_torch_thread  # noqa: F401  (fixture)
from sampling_reference import recorded, reference_support  # noqa: F401  (fixture)

PROMPT = list(b"Keep the sampling mask")


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)


# The built-in model's random weights are peaked: temperatures of 2-3 make supports of many ids.
CASES = {
    "top_p": dict(temperature=2.5, top_p=0.6),
    "top_k": dict(temperature=2.0, top_k=7),
    "min_p": dict(temperature=3.0, min_p=0.2),
    "bias_and_bans": dict(temperature=2.0, top_k=12, logit_bias={65: 3.0, 66: -100.0}, min_tokens=4,
                          stop_token_ids=[70]),
    "penalties": dict(temperature=2.0, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.5,
                      presence_penalty=0.4),
    "everything": dict(temperature=2.5, top_k=20, top_p=0.85, min_p=0.05, repetition_penalty=0.8,
                       logit_bias={80: 2.0}),
    "greedy_biased": dict(temperature=0.0, logit_bias={90: 1.5}, presence_penalty=0.5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_masks_equal_an_independent_filter_of_the_sampled_logits(llm, recorded, case):
    params = SamplingParams(max_tokens=10, seed=11, ignore_eos=True, return_sampling_mask=True, **CASES[case])
    out = llm.generate([PROMPT], params)[0].outputs[0]
    masks = out.sampling_mask
    assert masks is not None and len(masks) == len(out.token_ids) == len(recorded) == 10
    eos = llm.engine.core.eos_token_ids
    for t, (tok, logits) in enumerate(zip(out.token_ids, recorded)):
        ids, logps = masks.row(t)
        want_ids, want_logps = reference_support(logits, params, PROMPT, out.token_ids[:t], eos)
        assert ids.dtype == np.int32 and logps.dtype == np.float32
        np.testing.assert_array_equal(ids, want_ids, err_msg=f"step {t}")
        np.testing.assert_allclose(logps, want_logps, rtol=0, atol=2e-5, err_msg=f"step {t}")
        assert tok in ids.tolist()
    if params.temperature > 0:  # the filters had something to cut
        assert max(len(masks.row(t)[0]) for t in range(10)) > 1


def test_masks_are_opt_in_and_follow_the_engine_default(llm):
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=3, seed=1))[0].outputs[0]
    assert plain.sampling_mask is None
    on = LLM(max_model_len=64, num_kv_blocks=16, block_size=4, return_sampling_mask=True)
    assert on.generate([PROMPT], SamplingParams(max_tokens=3, seed=1))[0].outputs[0].sampling_mask is not None
    off = on.generate([PROMPT], SamplingParams(max_tokens=3, seed=1, return_sampling_mask=False))[0].outputs[0]
    assert off.sampling_mask is None


def test_greedy_masks_are_the_pick_alone(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                return_sampling_mask=True))[0].outputs[0]
    for t, tok in enumerate(out.token_ids):
        ids, logps = out.sampling_mask.row(t)
        assert ids.tolist() == [tok] and logps.tolist() == [0.0]


def test_a_stop_string_cuts_the_masks_with_the_tokens(llm):
    free = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
    stop = free.text[4:6]
    assert stop, "the built-in model's text is long enough to hold a stop string"
    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop],
                                                return_sampling_mask=True))[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 12
    assert len(out.sampling_mask) == len(out.token_ids)
    assert out.sampling_mask.offsets[-1] == len(out.sampling_mask.token_ids)


def test_a_support_over_the_cap_fails_the_request():
    small = LLM(max_model_len=64, num_kv_blocks=16, block_size=4, sampling_mask_max_tokens=5)
    ok = small.generate([PROMPT], SamplingParams(max_tokens=3, top_k=5, seed=2, return_sampling_mask=True))
    assert all(len(ok[0].outputs[0].sampling_mask.row(t)[0]) <= 5 for t in range(3))
    with pytest.raises(InvalidRequestError) as err:
        small.generate([PROMPT], SamplingParams(max_tokens=3, top_k=6, seed=2, return_sampling_mask=True))
    assert err.value.param == "sampling_mask_max_tokens"
    # the failed request freed its blocks: the engine serves the next one
    assert small.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0].token_ids



def test_merged_stream_outputs_keep_every_mask():
    """A consumer that fell behind gets two DELTA outputs as one (outputs.merge_deltas): its
    masks are both outputs' rows, in order (a lost row once made a stream chunk short)."""
    rows = [(np.array([t, t + 1], np.int32), np.array([-0.5, -1.0], np.float32)) for t in range(3)]

    def delta(first: int, last: int) -> RequestOutput:
        c = CompletionOutput(0, "", list(range(first, last)), sampling_mask=SamplingMasks.of(rows[first:last]))
        return RequestOutput("r", None, [1], [c])

    merged = merge_deltas(delta(0, 1), delta(1, 3)).outputs[0]
    assert merged.token_ids == [0, 1, 2] and len(merged.sampling_mask) == 3
    for t in range(3):
        np.testing.assert_array_equal(merged.sampling_mask.row(t)[0], rows[t][0])
