"""The sampling fields RL rollouts use, through the offline LLM and the sampler, each shown by
its effect: penalties and min_p equal an independent numpy computation on random logits;
logit_bias steers greedy picks; prompt logprobs equal transformers' full forward (also on a
prefix-cache hit, chunked, and from an SGLang-style start); cache salts keep prefix caches
apart; truncate_prompt_tokens keeps the last k tokens (rows follow); a stop token's text is
left out unless include_stop_str_in_output; logprobs=-1 is the whole vocabulary."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3srv import LLM, SamplingParams
from r3srv.engine.sampler import apply_min_p, apply_penalties, sample, token_counts
from r3srv.engine.sequence import Sequence
from r3srv.errors import InvalidRequestError
from tiny_checkpoints import build_hf_model, write_tiny_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------- sampler against numpy


def _reference_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's definition, one row at a time in plain numpy."""
    out = logits.astype(np.float64).copy()
    for r in range(out.shape[0]):
        seen = set(prompt[r]) | set(output[r])
        for t in seen:
            out[r, t] = out[r, t] / repetition[r] if out[r, t] > 0 else out[r, t] * repetition[r]
        for t in set(output[r]):
            out[r, t] -= frequency[r] * output[r].count(t) + presence[r]
    return out


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.data())
def test_penalties_equal_a_numpy_reference(data):
    rows, vocab = data.draw(st.integers(1, 4)), data.draw(st.integers(2, 40))
    seed = data.draw(st.integers(0, 2**31 - 1))
    logits = np.random.default_rng(seed).normal(0, 3, (rows, vocab)).astype(np.float32)
    ids = st.lists(st.integers(0, vocab - 1), max_size=12)
    prompt = [data.draw(ids) for _ in range(rows)]
    output = [data.draw(ids) for _ in range(rows)]
    presence = [data.draw(st.floats(-2, 2)) for _ in range(rows)]
    frequency = [data.draw(st.floats(-2, 2)) for _ in range(rows)]
    repetition = [data.draw(st.floats(0.1, 3.0)) for _ in range(rows)]
    prompt_seen = token_counts(prompt, vocab, torch.device("cpu")) > 0
    got = apply_penalties(torch.from_numpy(logits.copy()), prompt_seen, output, presence, frequency, repetition)
    want = _reference_penalties(logits, prompt, output, presence, frequency, repetition)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(2, 60), st.floats(0.0, 1.0))
def test_min_p_equals_a_numpy_reference(seed, rows, vocab, min_p):
    logits = np.random.default_rng(seed).normal(0, 2, (rows, vocab)).astype(np.float32)
    got = apply_min_p(torch.from_numpy(logits), [min_p] * rows).numpy()
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    keep = probs >= probs.max(-1, keepdims=True) * np.float32(min_p)
    # a token within float rounding of the threshold may go either way
    borderline = np.isclose(probs, probs.max(-1, keepdims=True) * min_p, rtol=1e-5)
    assert np.all((np.isfinite(got) == keep) | borderline)
    assert np.all(np.isfinite(got).any(-1))  # the most likely token always stays
    np.testing.assert_array_equal(got[np.isfinite(got)], logits[np.isfinite(got)])


def _seq(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    s = Sequence("r", 0, prompt, params, max_tokens=100, generator=None)
    s.token_ids += output
    return s


def test_greedy_picks_follow_bias_and_penalties_and_plain_rows_are_untouched():
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    best = int(logits[0].argmax())
    rows = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={best: -100.0}),
        SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0),
    ]
    before = logits.clone()
    seqs = [_seq(p, [1, 2], [best] * 3) for p in rows]
    got = [r.token_id for r in sample(logits, seqs, [29])]
    torch.testing.assert_close(logits, before)  # logprobs read the unmodified logits
    assert got[0] == best and got[1] == 7 and got[2] != best
    penalized = _reference_penalties(logits[3:4].numpy(), [[1, 2]], [[best] * 3], [2.0], [2.0], [2.0])
    assert got[3] == int(penalized.argmax())


def test_min_p_one_keeps_only_the_most_likely_token():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    s = Sequence("r", 0, [1], SamplingParams(temperature=5.0, min_p=1.0, seed=3), 100, torch.Generator().manual_seed(3))
    assert {sample(logits, [s], [0])[0].token_id for _ in range(50)} == {1}


# ---------------------------------------------------------------- through the offline LLM


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, num_kv_blocks=96, block_size=4, max_num_batched_tokens=64)


def test_logit_bias_makes_greedy_pick_the_token(llm):
    prompt = list(b"Routing replay for RL")
    plain = llm.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0].outputs[0].token_ids
    target = next(t for t in range(65, 91) if t not in plain)
    biased = llm.generate([prompt], SamplingParams(max_tokens=6, logit_bias={target: 100.0}, **GREEDY))
    assert biased[0].outputs[0].token_ids == [target] * 6
    banned = llm.generate([prompt], SamplingParams(max_tokens=6, logit_bias={plain[0]: -100.0}, **GREEDY))
    assert banned[0].outputs[0].token_ids[0] != plain[0]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached(llm):
    prompt = list(b"stop here")
    free = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0].token_ids
    stop = free[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[stop], **GREEDY))[0]
    assert stop not in out.outputs[0].token_ids[:3] and len(out.outputs[0].token_ids) >= 3


def test_stop_token_text_is_left_out_unless_asked_for(llm):
    prompt = list(b"Hello there")
    free = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0]
    i = next(i for i, t in enumerate(free.token_ids) if 33 <= t < 127)  # a printable byte
    stop = free.token_ids[i]
    cut = llm.generate([prompt], SamplingParams(max_tokens=8, stop_token_ids=[stop], **GREEDY))[0].outputs[0]
    kept = llm.generate([prompt], SamplingParams(max_tokens=8, stop_token_ids=[stop], include_stop_str_in_output=True,
                                                 **GREEDY))[0].outputs[0]
    assert cut.token_ids == kept.token_ids == free.token_ids[: i + 1]
    assert cut.stop_reason == stop and kept.text == cut.text + chr(stop)
    assert free.text.startswith(kept.text)


def test_cache_salt_separates_prefix_caches(llm):
    prompt = list(b"a shared system prompt, long enough for blocks")
    params = lambda salt: SamplingParams(max_tokens=2, cache_salt=salt, **GREEDY)  # noqa: E731
    first = llm.generate([prompt], params("salt-a"))[0]
    other = llm.generate([prompt], params("salt-b"))[0]
    unsalted = llm.generate([prompt], params(None))[0]
    again = llm.generate([prompt], params("salt-a"))[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, unsalted.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="x" * 129)  # '@' and '/' are fine: SkyRL salts with "<model>@<version>"
    SamplingParams(cache_salt="org/model@global_step_3")


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    prompt = list(range(40, 90))
    out = llm.generate([prompt], SamplingParams(max_tokens=3, truncate_prompt_tokens=10, routed_experts_prompt_start=4,
                                                **GREEDY))[0]
    assert out.prompt_token_ids == prompt[-10:]
    assert out.outputs[0].routed_experts.shape[0] == 10 + 3 - 1 - 4
    same = llm.generate([prompt[-10:]], SamplingParams(max_tokens=3, routed_experts_prompt_start=4, **GREEDY))[0]
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    np.testing.assert_array_equal(same.outputs[0].routed_experts, out.outputs[0].routed_experts)
    right = llm.generate([prompt], SamplingParams(max_tokens=1, truncate_prompt_tokens=10, truncation_side="right",
                                                  **GREEDY))[0]
    assert right.prompt_token_ids == prompt[:10]
    whole = llm.generate([list(range(200))], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1, **GREEDY))[0]
    assert whole.prompt_token_ids == list(range(200))[-127:]  # max_model_len - 1
    # vLLM's order: a size above max_model_len is refused before anything else
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate([prompt], SamplingParams(max_tokens=1, truncate_prompt_tokens=500, routed_experts_prompt_start=99))
    assert exc.value.param == "truncate_prompt_tokens"
    with pytest.raises(InvalidRequestError) as exc:  # the start is checked against the truncated prompt
        llm.generate([prompt], SamplingParams(max_tokens=1, truncate_prompt_tokens=10, routed_experts_prompt_start=11))
    assert exc.value.param == "routed_experts_prompt_start"


def test_logprobs_minus_one_is_the_whole_vocabulary():
    llm = LLM(max_model_len=64, num_kv_blocks=32, max_logprobs=-1)
    vocab = llm.model_config.vocab_size
    out = llm.generate([list(b"abc")], SamplingParams(max_tokens=2, logprobs=-1, prompt_logprobs=-1, **GREEDY))[0]
    assert all(len(entry) == vocab for entry in out.outputs[0].logprobs)
    assert out.prompt_logprobs[0] is None and all(len(e) == vocab for e in out.prompt_logprobs[1:])
    assert math.isclose(sum(math.exp(v) for v in out.outputs[0].logprobs[0].values()), 1.0, rel_tol=1e-4)
    with pytest.raises(InvalidRequestError) as exc:  # the default max_logprobs (20), as vLLM
        LLM(max_model_len=64, num_kv_blocks=32).generate([[1]], SamplingParams(logprobs=-1))
    assert exc.value.param == "logprobs" and "max allowed: 20" in str(exc.value)


# ---------------------------------------------------------------- prompt logprobs against transformers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3_moe", "qwen3_moe", seed=5)
    hf = build_hf_model("qwen3_moe", seed=5)
    # small chunks: a prompt's logprobs come from several steps
    llm = LLM(str(path), block_size=4, num_kv_blocks=128, max_model_len=128, max_num_batched_tokens=16)
    return llm, hf


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), dim=-1)


def _check_against(ref: torch.Tensor, prompt: list[int], entries, k: int, start: int = 0) -> None:
    assert len(entries) == len(prompt) - start and entries[0] is None
    for j, entry in zip(range(start + 1, len(prompt)), entries[1:]):
        row = ref[j - 1]
        token = prompt[j]
        assert list(entry)[0] == token  # the prompt token first, as vLLM
        assert math.isclose(entry[token].logprob, float(row[token]), abs_tol=2e-4)
        assert entry[token].rank == 1 + int((row > row[token] + 1e-6).sum())
        top = [t for t, lp in entry.items() if lp.rank <= k]
        assert sorted(top) == sorted(row.topk(k).indices.tolist())


def test_prompt_logprobs_equal_transformers_full_forward(tiny):
    llm, hf = tiny
    prompt = list(b"Prompt logprobs for on-policy distillation!")
    ref = _hf_prompt_logprobs(hf, prompt)
    first = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY))[0]
    _check_against(ref, prompt, first.prompt_logprobs, 3)
    # the same prompt again: its blocks are cached, yet asking for prompt logprobs recomputes
    warm = llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert warm.num_cached_tokens > 0 and warm.prompt_logprobs is None
    again = llm.generate([prompt, list(b"a plain neighbour in the same batch")],
                         [SamplingParams(max_tokens=2, prompt_logprobs=3, n=2, temperature=1.0, seed=1),
                          SamplingParams(max_tokens=2, **GREEDY)])
    assert again[0].num_cached_tokens == 0 and again[1].prompt_logprobs is None
    _check_against(ref, prompt, again[0].prompt_logprobs, 3)
    # SGLang's logprob_start_len: from token k on, that one without a logprob
    k = 9
    tail = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=k, **GREEDY))[0]
    _check_against(ref, prompt, tail.prompt_logprobs, 0, start=k)
    assert llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=len(prompt),
                                                 **GREEDY))[0].prompt_logprobs == []


@pytest.mark.parametrize("penalties", [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=1.0),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=1.8, repetition_penalty_prompt=False),  # SGLang's: output tokens only
    dict(presence_penalty=-0.5, frequency_penalty=0.7, repetition_penalty=0.8, logit_bias={65: 2.0}),
])
def test_penalized_greedy_equals_transformers_with_reference_penalties(tiny, penalties):
    """Each greedy token is the argmax of transformers' logits after the numpy penalties (and
    bias) of what came before it, and the output differs from the plain greedy one."""
    llm, hf = tiny
    prompt = list(b"the the the cat sat on the mat the")
    plain = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0].token_ids
    out = llm.generate([prompt], SamplingParams(max_tokens=8, **penalties, **GREEDY))[0].outputs[0].token_ids
    assert out != plain
    p = SamplingParams(**penalties)
    for i, token in enumerate(out):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out[:i]])).logits[0, -1].double().numpy()[None]
        for t, b in (p.logit_bias or {}).items():
            logits[0, t] += b
        want = _reference_penalties(logits, [prompt if p.repetition_penalty_prompt else []], [out[:i]],
                                    [p.presence_penalty], [p.frequency_penalty], [p.repetition_penalty])
        assert token == int(want.argmax()) or want[0, token] >= want.max() - 1e-4, (i, token, int(want.argmax()))


def test_eos_under_min_tokens_and_its_text(llm):
    """logit_bias pushes EOS to the top: min_tokens holds it off for two tokens, then the
    sequence stops on it, its text left out unless include_stop_str_in_output."""
    eos = llm.engine.eos_token_ids[0]
    eos_text = llm.tokenizer.decode([eos], skip_special_tokens=False)
    params = dict(max_tokens=8, min_tokens=2, logit_bias={eos: 100.0}, skip_special_tokens=False, temperature=0.0)
    cut = llm.generate([list(b"Hi")], SamplingParams(**params))[0].outputs[0]
    kept = llm.generate([list(b"Hi")], SamplingParams(**params, include_stop_str_in_output=True))[0].outputs[0]
    assert cut.token_ids == kept.token_ids and len(cut.token_ids) == 3 and cut.token_ids[-1] == eos
    assert cut.finish_reason == "stop" and eos_text not in cut.text and kept.text == cut.text + eos_text


def test_prompt_logprobs_survive_preemption(tiny):
    """A pool too small for every request at once preempts some mid-prompt: they recompute,
    and their prompt logprobs come out whole and equal to an unconstrained run's."""
    llm, _ = tiny
    path = llm.engine.config.model
    small = LLM(path, block_size=4, num_kv_blocks=24, max_model_len=64, max_num_batched_tokens=16)
    prompts = [list(bytes(f"request {i} with a prompt of some length", "ascii")) for i in range(3)]
    params = SamplingParams(max_tokens=12, prompt_logprobs=1, **GREEDY)
    want = llm.generate(prompts, params)
    got = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.prompt_logprobs) == len(g.prompt_token_ids)
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert list(a) == list(b) and all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-4) for t in a)
