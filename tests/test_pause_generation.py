"""Pausing generation (SGLang's /pause_generation modes) around RL policy updates: "retract"
frees the running sequences' KV so an update runs at once and they resume on the new weights,
recomputing every token (and its routed-experts rows) first; "in_place" stops stepping and
resumes with the same KV; "abort" ends what is in flight. Requests that arrive while paused
wait for continue_generation."""

import asyncio

import numpy as np
import pytest

from engine_testing import GREEDY, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from step_gate import gate_steps
from r3srv import LLM, SamplingParams
from r3srv.engine.async_llm import AsyncLLM
from r3srv.errors import InvalidRequestError
from test_weight_updates import ENGINE, PROMPT, policies  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # an engine per test on several checkpoints

LONG = SamplingParams(max_tokens=40, return_routed_experts=True, **GREEDY)


def _cold(path, output):
    """One cold pass of an engine on `path` over the request's tokens but the last (PROMPT +
    output[:-1]): its rows (which the request's must equal) and its next pick (the last token)."""
    llm = LLM(str(path), **ENGINE)
    tokens = PROMPT + list(output.token_ids)
    return llm.generate([tokens[:-1]], SamplingParams(max_tokens=1, return_routed_experts=True, **GREEDY))[0]


def test_retracted_sequences_resume_with_the_same_tokens_and_rows(policies):
    """Without an update in between, a retract is a preemption: same tokens, same rows, and
    every block given back meanwhile."""
    v0 = policies[0]
    want = LLM(str(v0), **ENGINE).generate([PROMPT, prompt_ids(30, base=5)], LONG)
    llm = LLM(str(v0), **ENGINE)
    engine = llm.engine
    engine.add_request("a", PROMPT, LONG)
    engine.add_request("b", prompt_ids(30, base=5), LONG)
    for _ in range(6):
        engine.step()
    assert engine.retract_running() == 2
    assert engine.scheduler.running == [] and engine.block_manager.num_used_blocks == 0
    outs = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                outs[out.request_id] = out
    for rid, ref in zip("ab", want):
        got = outs[rid].outputs[0]
        assert got.token_ids == ref.outputs[0].token_ids
        np.testing.assert_array_equal(got.routed_experts, ref.outputs[0].routed_experts)


def test_an_update_after_a_retract_serves_every_row_from_the_new_weights(policies):
    v0, v1, _ = policies
    llm = LLM(str(v0), **ENGINE)
    engine = llm.engine
    engine.add_request("r", PROMPT, LONG)
    for _ in range(8):  # the prompt and a few tokens on v0
        engine.step()
    engine.retract_running()
    engine.update_weights(str(v1), weight_version="v1")  # no KV holds v0 any more
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step().outputs if o.finished]
    (out,) = finished
    assert out.weight_version == "v1"
    got = out.outputs[0]
    cold = _cold(v1, got)
    # every row (the prompt's, the v0 tokens', the v1 tokens') is what v1 computes for them
    np.testing.assert_array_equal(got.routed_experts, cold.outputs[0].routed_experts)
    assert got.token_ids[-1] == cold.outputs[0].token_ids[0]  # and the last pick is v1's


def test_async_pause_modes(policies, gate):
    v0, v1, _ = policies
    engine = AsyncLLM(str(v0), **ENGINE)
    gate_steps(engine.core, gate.path)  # each request below is held in flight (2 steps of its 40) until it opens
    paused_at_step = []  # engine.paused at each step call (held ones too), read on the core thread
    gated_step = engine.core.step

    def recorded_step(*args, **kwargs):
        paused_at_step.append(engine.paused)
        return gated_step(*args, **kwargs)

    engine.core.step = recorded_step

    async def main():
        async def run(rid, prompt=PROMPT, params=LONG):
            return [o async for o in engine.generate(prompt, params, rid)][-1]

        async def started(n=1):
            while engine.stats().num_running < n:
                await asyncio.sleep(0.001)

        async def loop_turns():
            """Commands the core thread answers in turn: a loop that stepped while paused would
            step between them (paused_at_step would say so)."""
            for _ in range(3):
                await engine.reset_prefix_cache()

        # in place: nothing moves until continue; an update meanwhile is refused
        with gate.allowing(2):
            task = asyncio.create_task(run("in_place"))
            await started()
            assert await engine.pause_generation("in_place") == {"aborted": 0, "retracted": 0}
        assert engine.paused == "in_place"
        produced = engine.core.requests["in_place"].seqs[0].num_output_tokens
        await loop_turns()  # the gate is open: only the pause holds it
        assert "in_place" not in paused_at_step and engine.core.requests["in_place"].seqs[0].num_output_tokens == produced
        with pytest.raises(InvalidRequestError, match="paused in place"):
            await engine.update_weights(str(v1))
        assert await engine.continue_generation() is True
        in_place = await task

        # abort: what is in flight ends; what arrives while paused waits for continue
        with gate.allowing(2):
            task = asyncio.create_task(run("aborted"))
            await started()
            assert await engine.pause_generation("abort") == {"aborted": 1, "retracted": 0}
        aborted = await task
        later = asyncio.create_task(run("later", params=SamplingParams(max_tokens=4, **GREEDY)))
        while "later" not in engine.core.requests:  # it arrived
            await asyncio.sleep(0.001)
        await loop_turns()  # the gate is open: only the pause holds it
        assert "abort" not in paused_at_step and not later.done() and engine.stats().num_running == 0
        assert await engine.continue_generation() is True
        later = await later

        # retract: an update runs at once, in flight; the request resumes on the new weights
        with gate.allowing(4):
            task = asyncio.create_task(run("retracted"))
            await started()
            while engine.core.requests["retracted"].seqs[0].num_output_tokens < 3:
                await asyncio.sleep(0.001)
            assert await engine.pause_generation("retract") == {"aborted": 0, "retracted": 1}
            await engine.update_weights(str(v1), weight_version="v1")
            # it ran with the request in flight, paused and holding no KV (no wait for it to end)
            assert not task.done() and engine.stats().num_running == 0 and engine.weight_version == "v1"
        assert await engine.continue_generation() is True
        assert await engine.continue_generation() is False  # not paused any more
        with pytest.raises(InvalidRequestError, match="mode must be one of"):
            await engine.pause_generation("sideways")
        return in_place, aborted, later, await task

    try:
        in_place, aborted, later, retracted = asyncio.run(main())
    finally:
        engine.shutdown()
    assert paused_at_step and set(paused_at_step) == {None}  # no step while paused, in any mode
    uninterrupted = LLM(str(v0), **ENGINE).generate([PROMPT], LONG)[0].outputs[0]
    assert in_place.outputs[0].token_ids == uninterrupted.token_ids
    np.testing.assert_array_equal(in_place.outputs[0].routed_experts, uninterrupted.routed_experts)
    assert aborted.outputs[0].finish_reason == "abort" and len(aborted.outputs[0].token_ids) < 40
    assert later.outputs[0].finish_reason == "length" and len(later.outputs[0].token_ids) == 4
    got = retracted.outputs[0]
    assert retracted.weight_version == "v1" and got.finish_reason == "length"
    np.testing.assert_array_equal(got.routed_experts, _cold(v1, got).outputs[0].routed_experts)


@pytest.mark.parametrize("steps_before", [1, 6])  # siblings still deferred, or running beside sample 0
def test_a_retract_keeps_n_samples_whole(policies, steps_before):
    """n = 2 with prefix caching (sample 1 waits for sample 0's prompt, then shares its blocks):
    retracted before or after the sibling started, both samples finish with every row, equal to
    an uninterrupted run (greedy, so both samples are the same)."""
    v0 = policies[0]
    params = SamplingParams(n=2, max_tokens=20, return_routed_experts=True, **GREEDY)
    want = LLM(str(v0), **ENGINE).generate([PROMPT], params)[0]
    engine = LLM(str(v0), **ENGINE).engine
    engine.add_request("r", PROMPT, params)
    for _ in range(steps_before):
        engine.step()
    engine.retract_running()
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step().outputs if o.finished]
    (out,) = finished
    for got, ref in zip(out.outputs, want.outputs):
        assert got.token_ids == ref.token_ids and len(got.routed_experts) == len(PROMPT) + 20 - 1
        np.testing.assert_array_equal(got.routed_experts, ref.routed_experts)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_a_retracted_hybrid_recomputes_its_states(family, tmp_path):
    """A hybrid's running sequences give back their state slots (and snapshots) too, and
    resume with the tokens and rows of an uninterrupted run."""
    from tiny_checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / family, family, seed=3)
    prompts = [PROMPT, prompt_ids(23, base=4)]
    want = LLM(str(path), **ENGINE).generate(prompts, LONG)
    engine = LLM(str(path), **ENGINE).engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, LONG)
    for _ in range(5):
        engine.step()
    assert engine.retract_running() == 2 and engine.block_manager.num_used_state_slots == 0
    finished = {}
    while engine.has_unfinished():
        finished |= {o.request_id: o for o in engine.step().outputs if o.finished}
    for i, ref in enumerate(want):
        got = finished[str(i)].outputs[0]
        assert got.token_ids == ref.outputs[0].token_ids
        np.testing.assert_array_equal(got.routed_experts, ref.outputs[0].routed_experts)
