"""Sampler: greedy ties, top-k/top-p, seeded generators, min_tokens, logprobs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3srv.engine.sampler import filter_top_k_top_p, sample
from r3srv.engine.sequence import Sequence
from r3srv.sampling_params import SamplingParams

EOS = [9]


def seq(params: SamplingParams, seed: int | None = None, n_out: int = 0) -> Sequence:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    s = Sequence("r", 0, [1, 2, 3], params, max_tokens=100, generator=gen)
    s.token_ids += [4] * n_out
    return s


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [3.0, 3.0, 3.0, 3.0]])
    p = SamplingParams(temperature=0.0)
    assert [r.token_id for r in sample(logits, [seq(p), seq(p)], EOS)] == [1, 0]


def test_top_k_one_and_tiny_top_p_reduce_to_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    want = logits.argmax(-1).tolist()
    for p in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        got = [r.token_id for r in sample(logits, [seq(p, seed=i) for i in range(6)], EOS)]
        assert got == want


def test_top_k_restricts_the_support():
    logits = torch.arange(20, dtype=torch.float32)[None, :].repeat(1, 1)
    p = SamplingParams(temperature=10.0, top_k=3)
    s = seq(p, seed=1)
    got = {sample(logits, [s], EOS)[0].token_id for _ in range(200)}
    assert got == {17, 18, 19}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    p = SamplingParams(temperature=1.0, top_p=0.7)  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: keep ids 0 and 1
    s = seq(p, seed=2)
    got = {sample(probs.log(), [s], EOS)[0].token_id for _ in range(300)}
    assert got == {0, 1}


def test_a_seed_reproduces_the_same_samples():
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0, seed=7)
    runs = []
    for _ in range(2):
        s = seq(p, seed=7)
        runs.append([sample(logits, [s], EOS)[0].token_id for _ in range(20)])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1
    other = seq(p, seed=8)
    assert [sample(logits, [other], EOS)[0].token_id for _ in range(20)] != runs[0]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.full((1, 12), -10.0)
    logits[0, 9] = 10.0  # EOS is the best
    logits[0, 5] = 9.0  # a stop token id is next
    logits[0, 2] = 1.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    assert sample(logits, [seq(p, n_out=1)], EOS)[0].token_id == 2
    assert sample(logits, [seq(p, n_out=2)], EOS)[0].token_id == 9
    # vLLM bans EOS until min_tokens even with ignore_eos (its all_stop_token_ids always hold EOS);
    # after that, with ignore_eos, EOS is an ordinary token
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [seq(ignore, n_out=0)], EOS)[0].token_id == 5
    assert sample(logits, [seq(ignore, n_out=2)], EOS)[0].token_id == 9


def test_logprobs_are_log_softmax_of_the_unmodified_logits():
    torch.manual_seed(3)
    logits = torch.randn(2, 30)
    p = SamplingParams(temperature=0.7, top_k=5, logprobs=3, seed=1)
    res = sample(logits, [seq(p, seed=1), seq(SamplingParams(temperature=0.0, logprobs=0))], EOS)
    ref = torch.log_softmax(logits, dim=-1)
    r0 = res[0]
    assert math.isclose(r0.logprob, float(ref[0, r0.token_id]), rel_tol=1e-6)
    top3 = torch.topk(ref[0], 3).indices.tolist()
    assert set(top3) <= set(r0.top_logprobs) and r0.token_id in r0.top_logprobs
    for tok in top3:
        assert math.isclose(r0.top_logprobs[tok].logprob, float(ref[0, tok]), rel_tol=1e-6)
    r1 = res[1]  # logprobs=0: just the sampled token
    assert list(r1.top_logprobs) == [int(logits[1].argmax())]
    assert math.isclose(r1.logprob, float(ref[1].max()), rel_tol=1e-6)


def test_sampled_logprob_entries_are_vllms_shape():
    """The sampled token first with its rank in the whole vocabulary, then the top k with ranks
    1..k (vLLM's Logprob entries), ranks checked against a plain sort of the row."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 40, generator=gen)
    params = [SamplingParams(temperature=1.5, logprobs=k, seed=20 + k) for k in (0, 1, 2, 3, 5, 40)]
    res = sample(logits, [seq(p, seed=p.seed) for p in params], EOS)
    ref = torch.log_softmax(logits, dim=-1)
    for row, (r, p) in enumerate(zip(res, params)):
        values = ref[row].tolist()
        order = sorted(range(len(values)), key=lambda t: (-values[t], t))
        entries = list(r.top_logprobs.items())
        assert entries[0][0] == r.token_id
        assert entries[0][1].rank == 1 + sum(v > values[r.token_id] for v in values)
        top = {t: lp for t, lp in entries if t != r.token_id or lp.rank <= p.logprobs}
        assert [t for t, lp in sorted(top.items(), key=lambda kv: kv[1].rank)][: p.logprobs] == order[: p.logprobs]
        for t, lp in entries[1:]:
            assert lp.rank == order.index(t) + 1 and math.isclose(lp.logprob, values[t], rel_tol=1e-6)
        assert len(r.top_logprobs) in (p.logprobs, p.logprobs + 1)


def test_no_logprobs_unless_asked():
    res = sample(torch.randn(1, 10), [seq(SamplingParams(temperature=0.0))], EOS)
    assert res[0].logprob is None and res[0].top_logprobs is None


def test_a_temperature_too_small_to_divide_by_is_greedy():
    # logits / 1e-39 overflow float32 to inf, and softmax of inf is NaN: such a request
    # would fail in the sampler. Below 1e-5 sampling is greedy (as vLLM does).
    logits = torch.tensor([[1.0, 30.0, 2.0, 29.0], [5.0, 0.0, 5.0, -1.0]])
    for t in (1e-39, 1e-20, 1e-6):
        p = SamplingParams(temperature=t)
        assert p.greedy
        assert [r.token_id for r in sample(logits, [seq(p, seed=0), seq(p, seed=1)], EOS)] == [1, 0]
    assert not SamplingParams(temperature=1e-5).greedy


def test_non_finite_temperature_or_top_p_is_rejected_up_front():
    # temperature=inf turned a min_tokens-banned logit into -inf / inf = NaN, and the
    # request then failed inside the sampler instead of at validation.
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=bad)


@pytest.mark.parametrize("seeded", [False, True], ids=["shared-generator", "own-generators"])
def test_samples_follow_the_temperature_scaled_softmax(seeded):
    """Pearson's chi-square of 6,000 draws against softmax(logits / T): the exponential race
    picks each token with its probability, whichever generator the noise comes from."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    temperature, draws = 0.7, 6000
    probs = torch.softmax(logits / temperature, dim=-1)
    seqs = [seq(SamplingParams(temperature=temperature, seed=i if seeded else None), seed=i if seeded else None) for i in range(draws)]
    picks = [r.token_id for r in sample(logits.expand(draws, -1).contiguous(), seqs, EOS, torch.Generator().manual_seed(1))]
    counts = torch.bincount(torch.tensor(picks), minlength=len(logits)).double()
    assert counts[-1] == 0  # a zero-probability token is never drawn
    expected = probs[:-1].double() * draws
    chi2 = float(((counts[:-1] - expected) ** 2 / expected).sum())
    # 5 cells, 4 degrees of freedom: P(chi2 > 23.5) = 1e-4. Measured 1.3-3.5; a temperature
    # 10% off gives 53.
    assert chi2 < 23.5, chi2


def test_a_seeded_sequence_samples_the_same_whatever_its_batch():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=1.0, seed=11)
    alone = seq(p, seed=11)
    solo = [sample(logits, [alone], EOS)[0].token_id for _ in range(10)]
    crowded = seq(p, seed=11)
    batch = torch.cat([torch.randn(3, 500), logits, torch.randn(2, 500)])
    mates = [seq(SamplingParams(temperature=1.0)) for _ in range(5)]
    in_batch = [sample(batch, mates[:3] + [crowded] + mates[3:], EOS)[3].token_id for _ in range(10)]
    assert in_batch == solo and len(set(solo)) > 1


def one_row_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The definition, one row at a time (the sampler's previous per-row code)."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(-1, 14), st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.1, 1e-4]), st.integers(0, 2**31 - 1)),
        min_size=1, max_size=6,
    ),
    vocab=st.integers(2, 12),
)
def test_batched_top_k_top_p_equals_the_per_row_definition(rows, vocab):
    # integer-valued logits: many ties at the k-th value and in the sort
    logits = torch.stack([torch.randint(-3, 4, (vocab,), generator=torch.Generator().manual_seed(s)).float() for _, _, s in rows])
    got = filter_top_k_top_p(logits, [k for k, _, _ in rows], [p for _, p, _ in rows])
    want = torch.stack([one_row_filter(logits[i], k, p) for i, (k, p, _) in enumerate(rows)])
    assert torch.equal(got, want)


# ---------------------------------------------------------------- every accepted value is safe to draw with

# vLLM accepts any repetition penalty above 0: these are 0 or inf in float32, or overflow a logit
EXTREME_PENALTIES = [5e-324, 1e-308, 1e-231, 1e-108, 1e-45, 1e38, 1e300, 1.7976931348623157e308]


@settings(max_examples=300, deadline=None)
@given(
    repetition=st.sampled_from(EXTREME_PENALTIES) | st.floats(min_value=5e-324, max_value=1.7e308),
    temperature=st.sampled_from([0.0, 1e-5, 1e-3, 1.0, 1e30]),
    bias=st.sampled_from([None, 100.0, -100.0]),
    frequency=st.sampled_from([0.0, 2.0, -2.0]),
    min_p=st.sampled_from([0.0, 0.5, 1.0]),
    top_k=st.sampled_from([0, 1, 5]),
    top_p=st.sampled_from([1.0, 0.5, 1e-9]),
    scale=st.sampled_from([1.0, 30.0, 1e30]),
    seed=st.integers(0, 2**31),
)
def test_every_accepted_parameter_value_draws_a_token(repetition, temperature, bias, frequency, min_p, top_k, top_p,
                                                      scale, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 40, generator=gen) * scale
    logits[:, :6] = logits[:, :6].abs()  # the prompt's and the output's tokens (1..4) are positive...
    logits[1, :6] = -logits[1, :6]  # ...or negative...
    logits[2, :6] = 0.0  # ...or exactly 0 (0 * inf is NaN)
    params = SamplingParams(repetition_penalty=repetition, temperature=temperature, frequency_penalty=frequency,
                            presence_penalty=-frequency, min_p=min_p, top_k=top_k, top_p=top_p, min_tokens=3,
                            logit_bias=None if bias is None else {3: bias, 7: -bias})
    seqs = [seq(params, seed=seed + i, n_out=2) for i in range(3)]
    for result in sample(logits, seqs, EOS):
        assert 0 <= result.token_id < 40 and result.token_id not in EOS  # min_tokens still bans EOS


def test_a_vanishing_repetition_penalty_picks_among_the_seen_positive_tokens():
    """1/1e-108 overflows every seen positive logit: they tie at the top, and the draw stays among them."""
    logits = torch.full((1, 30), 0.5)
    logits[0, 10] = 50.0  # unseen, far ahead before the penalty
    params = SamplingParams(repetition_penalty=1e-108, temperature=0.7)
    s = seq(params, seed=3, n_out=1)  # seen: 1, 2, 3 (prompt), 4 (output)
    drawn = {sample(logits.clone(), [s], EOS)[0].token_id for _ in range(200)}
    assert drawn == {1, 2, 3, 4}
    greedy = SamplingParams(repetition_penalty=1e-108, temperature=0.0)
    assert sample(logits.clone(), [seq(greedy, n_out=1)], EOS)[0].token_id == 1  # ties: the lowest id


def test_a_huge_repetition_penalty_takes_the_seen_tokens_lead_away():
    """Positive logits are divided towards 0 (never below it, as vLLM's penalty), negative ones
    multiplied past float32's range: a mask."""
    logits = torch.zeros(1, 30)
    logits[0, 1:5] = torch.tensor([9.0, -9.0, 0.0, 20.0])  # seen tokens, one of each sign and 0
    plain = seq(SamplingParams(temperature=1.0), seed=4, n_out=1)
    assert {sample(logits.clone(), [plain], EOS)[0].token_id for _ in range(50)} == {4}
    s = seq(SamplingParams(repetition_penalty=1e300, temperature=1.0), seed=4, n_out=1)
    drawn = [sample(logits.clone(), [s], EOS)[0].token_id for _ in range(300)]
    assert 2 not in drawn and drawn.count(4) < 60 and len(set(drawn)) > 15
