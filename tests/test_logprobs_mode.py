"""vLLM's --logprobs-mode (EngineConfig.logprobs_mode): what sampled-token logprobs, their top
entries and prompt logprobs hold.

Oracle: tests/sampling_reference.py's independent float64 implementation of vLLM's processing
(bans, logit_bias, penalties, temperature, min_p, top-k, top-p) applied to the full-vocabulary
logits the sampler really received, for generated sampling parameters; in batches that mix
plain greedy, adjusted greedy and sampled rows (the sampler alone), and through the offline
engine (logits recorded at the executor). The raw modes stay bitwise what the sampler computed
before the modes existed: torch's log-softmax of the unmodified logits, or those logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3srv import LLM, SamplingParams
from r3srv.config import LOGPROBS_MODES
from r3srv.engine.sampler import sample
from r3srv.engine.sequence import Sequence
from r3srv.engine_options import options
from r3srv.errors import ConfigError
from engine_testing import one_torch_thread  # noqa: F401  (fixture)
from sampling_reference import log_softmax, processed_logits, recorded  # noqa: F401  (fixture)

EOS = [9]
PREFIX = [1, 2, 3]
PROCESSED = ("processed_logprobs", "processed_logits")


def _seq(params: SamplingParams, seed: int, n_out: int) -> Sequence:
    s = Sequence("r", 0, list(PREFIX), params, max_tokens=100, generator=torch.Generator().manual_seed(seed))
    s.token_ids += [4 + i % 3 for i in range(n_out)]
    return s


def _params(rng: np.random.Generator) -> SamplingParams:
    """Generated sampling parameters: greedy or not, each filter and adjustment on or off."""
    greedy = rng.random() < 0.3
    return SamplingParams(
        temperature=0.0 if greedy else float(rng.uniform(0.3, 3.0)),
        top_k=int(rng.choice([-1, 1, 3, 10, 40])), top_p=float(rng.choice([1.0, 0.95, 0.7, 0.3])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3])),
        repetition_penalty=float(rng.choice([1.0, 1.0, 1.3, 0.8])),
        frequency_penalty=float(rng.choice([0.0, 0.0, 0.5])), presence_penalty=float(rng.choice([0.0, -0.4])),
        logit_bias={int(t): float(rng.uniform(-5, 5)) for t in rng.choice(64, size=int(rng.integers(0, 3)))},
        min_tokens=int(rng.choice([0, 0, 3])), stop_token_ids=[11], logprobs=-1, seed=int(rng.integers(1 << 30)))


def _expected(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int], eos: list[int],
              mode: str) -> np.ndarray:
    """The oracle's full-vocabulary row for `mode`."""
    x = logits if mode.startswith("raw") else processed_logits(logits, p, prompt, output, eos)
    return x if mode.endswith("logits") else log_softmax(x)


def _assert_row(entry: dict, token: int, want: np.ndarray, tol: float) -> None:
    """A full-vocabulary entry (logprobs=-1) against the oracle's row: every value, -inf where
    the oracle filtered the token out, and the sampled token first."""
    assert next(iter(entry)) == token and math.isfinite(entry[token].logprob)
    got = np.array([entry[t].logprob for t in range(len(want))])
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", PROCESSED)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6))
def test_processed_modes_equal_the_oracle_in_mixed_batches(mode, seed, rows):
    rng = np.random.default_rng(seed)
    vocab = 64
    logits = torch.from_numpy(rng.normal(0, 3, (rows, vocab)).astype(np.float32))
    params = [_params(rng) for _ in range(rows)]
    if rows > 1:  # a plain greedy row beside the others (the sampler's shortcut)
        params[0] = SamplingParams(temperature=0.0, logprobs=-1)
    n_out = [int(rng.integers(0, 5)) for _ in range(rows)]
    seqs = [_seq(p, int(rng.integers(1 << 30)), n) for p, n in zip(params, n_out)]
    outputs = [s.output_token_ids for s in seqs]
    results = sample(logits, seqs, EOS, logprobs_mode=mode)
    for r, res in enumerate(results):
        want = _expected(logits[r].numpy(), params[r], PREFIX, outputs[r], EOS, mode)
        _assert_row(res.top_logprobs, res.token_id, want, 2e-5)
        assert res.logprob == res.top_logprobs[res.token_id].logprob
        if params[r].greedy:
            assert res.token_id == int(np.argmax(want))


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_raw_modes_are_bitwise_the_unmodified_logits_or_their_log_softmax(mode):
    """Whatever the processing, the raw modes report torch's own log-softmax (the sampler's
    computation before the modes existed) or the logits, bit for bit."""
    rng = np.random.default_rng(5)
    logits = torch.from_numpy(rng.normal(0, 3, (6, 64)).astype(np.float32))
    params = [_params(rng) for _ in range(6)]
    seqs = [_seq(p, i, 2) for i, p in enumerate(params)]
    want = torch.log_softmax(logits, dim=-1) if mode == "raw_logprobs" else logits
    for r, res in enumerate(sample(logits, seqs, EOS, logprobs_mode=mode)):
        assert [res.top_logprobs[t].logprob for t in range(64)] == want[r].tolist()
    default = sample(logits, [_seq(p, i, 2) for i, p in enumerate(params)], EOS)
    if mode == "raw_logprobs":
        assert [r.top_logprobs for r in default] == [r.top_logprobs for r in sample(
            logits, [_seq(p, i, 2) for i, p in enumerate(params)], EOS, logprobs_mode=mode)]


def test_processed_top_entries_rank_the_filtered_distribution():
    """logprobs=k: the top k of the processed values; tokens top-k dropped come at -inf."""
    logits = torch.arange(20, dtype=torch.float32)[None, :] / 4
    p = SamplingParams(temperature=0.5, top_k=3, logprobs=5, seed=1)
    res = sample(logits, [_seq(p, 1, 0)], EOS, logprobs_mode="processed_logprobs")[0]
    ranked = sorted(res.top_logprobs.items(), key=lambda kv: kv[1].rank)
    assert [t for t, _ in ranked][:3] == [19, 18, 17] and res.token_id in (17, 18, 19)
    assert math.isclose(sum(math.exp(lp.logprob) for _, lp in ranked[:3]), 1.0, rel_tol=1e-6)
    assert all(lp.logprob == -math.inf for _, lp in ranked[3:5])


# -------------------------------------------------------------------------------- the engine

PROMPT = list(b"Processed logprobs")


@pytest.fixture(scope="module")
def engines():
    made = {mode: LLM(max_model_len=96, num_kv_blocks=48, block_size=4, max_logprobs=-1, logprobs_mode=mode)
            for mode in LOGPROBS_MODES}
    yield made
    for llm in made.values():
        llm.shutdown()


# the built-in model's random weights are peaked: temperatures of 2-3 leave many ids to filter
CASES = [dict(temperature=2.5, top_k=12, top_p=0.9, min_p=0.02, seed=3),
         dict(temperature=2.0, top_p=0.6, repetition_penalty=1.2, logit_bias={65: 2.0}, min_tokens=3, seed=4),
         dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3)]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_engine_sampled_logprobs_equal_the_oracle_on_recorded_logits(engines, recorded, mode, case):
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=-1, **CASES[case])
    out = engines[mode].generate([PROMPT], params)[0].outputs[0]
    assert len(recorded) == len(out.token_ids) == 6
    eos = engines[mode].engine.core.eos_token_ids
    filtered = 0
    for t, (tok, logits) in enumerate(zip(out.token_ids, recorded)):
        entry = out.logprobs[t]
        if mode.startswith("raw"):  # bitwise: the recorded float32 row, or torch's log-softmax of it
            raw = torch.from_numpy(logits.astype(np.float32))
            want = (raw if mode == "raw_logits" else torch.log_softmax(raw[None], -1)[0]).tolist()
            assert [entry[i].logprob for i in range(len(want))] == want
        else:
            _assert_row(entry, tok, _expected(logits, params, PROMPT, out.token_ids[:t], eos, mode), 2e-5)
        filtered += sum(not math.isfinite(lp.logprob) for lp in entry.values())
    if mode.startswith("processed") and params.temperature > 0:
        assert filtered > 0  # the filters had something to cut


def test_prompt_logprobs_skip_processing(engines):
    """Prompt tokens are not sampled: processed_* reads as raw_*, bit for bit, and the logits
    modes' rows log-softmax to the logprobs modes'."""
    params = SamplingParams(max_tokens=1, temperature=2.0, top_k=3, prompt_logprobs=-1, seed=1)
    got = {m: engines[m].generate([PROMPT], params)[0].prompt_logprobs for m in LOGPROBS_MODES}
    assert got["processed_logprobs"] == got["raw_logprobs"] and got["processed_logits"] == got["raw_logits"]
    assert got["raw_logprobs"] != got["raw_logits"]
    for logits_entry, logprobs_entry in zip(got["raw_logits"][1:], got["raw_logprobs"][1:]):
        row = np.array([logits_entry[i].logprob for i in range(len(logits_entry))])
        want = log_softmax(row)
        np.testing.assert_allclose([logprobs_entry[i].logprob for i in range(len(want))], want, rtol=0, atol=2e-5)


def test_the_option_is_declared_once_with_vllms_values():
    (opt,) = [o for o in options() if o.name == "logprobs_mode"]
    assert opt.flag == "--logprobs-mode" and opt.default == "raw_logprobs"
    assert set(opt.choices) == {"raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"}
    with pytest.raises(ConfigError, match="logprobs_mode"):
        LLM(max_model_len=32, num_kv_blocks=8, logprobs_mode="processed")


def test_the_serve_flag_reaches_a_fleets_replicas():
    from r3srv.cli import build_parser
    from r3srv.data_parallel import replica_argv
    from r3srv.engine_options import from_args

    parser = build_parser()
    args = parser.parse_args(["serve", "-dp", "2", "--logprobs-mode", "processed_logits"])
    assert from_args(args)["logprobs_mode"] == "processed_logits"
    child = parser.parse_args(replica_argv(parser, args, model=None, port=9, device="cpu", weight_version="0")[3:])
    assert from_args(child)["logprobs_mode"] == "processed_logits"
    default = parser.parse_args(["serve"])
    assert from_args(default)["logprobs_mode"] == "raw_logprobs"


def test_vllm_keyword_reaches_the_engine():
    import r3srv.compat.vllm as vllm

    llm = vllm.LLM(None, device="cpu", max_model_len=32, num_kv_blocks=8, logprobs_mode="processed_logits")
    try:
        assert llm.r3srv.engine.core.config.logprobs_mode == "processed_logits"
    finally:
        llm.shutdown()
