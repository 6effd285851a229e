"""verl's own async rollout on r3srv: `rollout.name=r3srv` resolved through the `verl.plugins`
entry point (no VERL_USE_EXTERNAL_MODULES), verl's example agent loop (single_turn_agent) with
routing replay on, then verl's worker-side path between two rollouts (trainer_mode releases the
replica's memory, rollout_mode wakes the weights, pushes the new policy in buckets, wakes the KV
cache). verl runs in its own environment (tools/verl_env.sh: verl 0.9.1, its own ray and
transformers) on a one-node CPU Ray cluster, as a subprocess (tests/verl_agent_loop.py).

Oracle: r3srv's own LLM on each checkpoint, given the prompt ids verl's batch carried: the same
greedy tokens, the same rows (every token but the last, as verl's batch holds them) and the same
sampled-token logprobs. A third, sampled rollout runs with verl's default
rollout.logprobs_mode=processed_logprobs: its logprobs are the float64 oracle's
(tests/sampling_reference.py) filter of the raw logits r3srv's own LLM gives for the same
tokens (prompt logits in raw_logits mode).

A second verl session runs rollout.tensor_model_parallel_size=2 and expert_parallel_size=2 with
four stand-in training workers: verl makes two replicas of two ranks each (r3srv's -tp 2
--enable-expert-parallel, gloo on the CPU). Its batches
equal the same single-device oracle (logprobs within the tolerance an all-reduce's float sums
leave), both replicas serve requests (the rollouts start paused until verl's balancer has routed
them all), and the weight update reaches every rank of both replicas (the second rollout is the
second checkpoint's). About 4 minutes for both sessions on a loaded 2-core machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from framework_rollouts import assert_batch_equals_own
from tiny_checkpoints import write_tiny_checkpoint

from r3srv import LLM, SamplingParams

pytestmark = pytest.mark.slow  # a Ray cluster, verl's actors and two engines

ROOT = Path(__file__).resolve().parent.parent
VERL_PYTHON = ROOT / ".verl_venv" / "bin" / "python"
sys.path.insert(0, str(Path(__file__).parent))
import verl_agent_loop as loop  # noqa: E402  (its constants only: it imports verl lazily)
from sampling_reference import log_softmax, processed_logits  # noqa: E402


def run_verl(root: Path, tp: int, replicas: int) -> tuple[Path, Path, dict]:
    if not VERL_PYTHON.exists():
        pytest.skip("no verl environment at .verl_venv: tools/verl_env.sh creates it (.ci/run does)")
    v0, v1 = write_tiny_checkpoint(root / "v0", seed=0), write_tiny_checkpoint(root / "v1", seed=1)
    out = root / "batch.npz"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    proc = subprocess.run([str(VERL_PYTHON), str(Path(loop.__file__)), str(v0), str(v1), str(out), str(tp),
                           str(replicas)], env=env, cwd=root, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return v0, v1, dict(np.load(out, allow_pickle=True))


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory):
    """tp=1, one training worker: one replica."""
    return run_verl(tmp_path_factory.mktemp("verl"), tp=1, replicas=1)


@pytest.fixture(scope="module")
def verl_tp2_run(tmp_path_factory):
    """tp=2, four training workers: two replicas of two ranks."""
    return run_verl(tmp_path_factory.mktemp("verl_tp2"), tp=2, replicas=2)


def own(checkpoint: Path, prompts: list[list[int]]) -> list:
    """r3srv's own API on a fresh engine, with the agent loop's validation sampling (greedy)."""
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", max_model_len=loop.PROMPT_LENGTH + loop.RESPONSE_LENGTH,
              num_kv_blocks=64, block_size=16, enable_return_routed_experts=True)
    try:
        return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=loop.RESPONSE_LENGTH, logprobs=0))
    finally:
        llm.shutdown()


def test_verl_resolves_r3srv_through_its_entry_point(verl_run):
    _, _, got = verl_run
    assert str(got["replica_class"]) == "r3srv.integrations.verl.replica.R3srvReplica"
    assert str(got["rollout_class"]) == "r3srv.integrations.verl.adapter.ServerAdapter"


def test_trainer_mode_sleeps_and_rollout_mode_wakes_with_the_new_policy(verl_run):
    _, _, got = verl_run
    assert list(got["slept"]) == [True] and list(got["awake"]) == [True]
    assert list(got["first_routed"]) == [loop.NUM_PROMPTS]
    assert list(got["global_steps"]) == [1] * loop.NUM_PROMPTS  # set_global_steps reached the batch
    assert [list(r) for r in got["first_response_ids"]] != [list(r) for r in got["second_response_ids"]]


@pytest.mark.parametrize("which", ["first", "second"])
def test_rollout_batch_equals_r3srvs_own_api(verl_run, which):
    """Tokens, rows and logprobs in verl's batch, before (v0) and after (v1) the weight update."""
    v0, v1, got = verl_run
    prompts = [list(map(int, p)) for p in got[f"{which}_prompt_ids"]]
    assert all(0 < len(p) <= loop.PROMPT_LENGTH for p in prompts)
    want = own(v0 if which == "first" else v1, prompts)
    assert_batch_equals_own(want, prompts, got[f"{which}_response_ids"], got[f"{which}_rows"],
                            got[f"{which}_logprobs"])


@pytest.mark.parametrize("session", ["verl_run", "verl_tp2_run"])
def test_training_rollout_logprobs_are_processed(request, session):
    """verl's default logprobs_mode (processed_logprobs) with its training sampling: each token's
    logprob under the temperature-scaled, top-k/top-p-filtered distribution it was drawn from
    (at tp=2 too: the replicas' processed logprobs against one device's raw logits)."""
    _, v1, got = request.getfixturevalue(session)
    prompts = [list(map(int, p)) for p in got["third_prompt_ids"]]
    responses = [list(map(int, r)) for r in got["third_response_ids"]]
    llm = LLM(str(v1), device="cpu", dtype="float32", max_model_len=loop.PROMPT_LENGTH + loop.RESPONSE_LENGTH,
              num_kv_blocks=64, block_size=16, max_logprobs=-1, logprobs_mode="raw_logits",
              enable_return_routed_experts=False)
    try:
        scored = llm.generate([p + r for p, r in zip(prompts, responses)],
                              SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1))
        eos = llm.engine.core.eos_token_ids
    finally:
        llm.shutdown()
    params = SamplingParams(temperature=loop.TEMPERATURE, top_k=loop.TOP_K, top_p=loop.TOP_P)
    differs = False
    for prompt, response, out, logprobs in zip(prompts, responses, scored, got["third_logprobs"]):
        assert response and len(logprobs) == len(response)
        for i, token in enumerate(response):
            entry = out.prompt_logprobs[len(prompt) + i]  # the logits before response token i
            raw = np.array([entry[t].logprob for t in range(len(entry))])
            want = log_softmax(processed_logits(raw, params, prompt, response[:i], eos))
            assert logprobs[i] == pytest.approx(want[token], abs=1e-4)
            differs |= abs(want[token] - log_softmax(raw)[token]) > 1e-3
    assert differs  # the processing changed what a raw logprob would have said


def test_tp2_replicas_share_the_requests_and_all_sleep_and_wake(verl_tp2_run):
    """verl's balancer (fewest in flight) spreads the paused rollout's three requests 2 and 1;
    each replica serves with its experts split over its two ranks."""
    _, _, got = verl_tp2_run
    assert list(got["ep_sizes"]) == [2, 2]  # verl's expert_parallel_size=2: experts split over each replica's ranks
    assert list(got["slept"]) == [True, True] and list(got["awake"]) == [True, True]
    for which in ("first", "second"):
        routed = list(got[f"{which}_routed"])
        assert sorted(routed) == [1, 2], routed
    assert list(got["global_steps"]) == [1] * loop.NUM_PROMPTS  # each replica's adapter set its step


@pytest.mark.parametrize("which", ["first", "second"])
def test_tp2_rollout_batch_equals_r3srvs_own_single_device_api(verl_tp2_run, which):
    """Both replicas' tokens, rows and logprobs before (v0) and after (v1) verl's weight update:
    a rank left on v0 would change the all-reduced logits, so the second batch equal to v1's
    oracle means the update reached every rank of both replicas."""
    v0, v1, got = verl_tp2_run
    prompts = [list(map(int, p)) for p in got[f"{which}_prompt_ids"]]
    want = own(v0 if which == "first" else v1, prompts)
    assert_batch_equals_own(want, prompts, got[f"{which}_response_ids"], got[f"{which}_rows"],
                            got[f"{which}_logprobs"])
