"""r3srv.compat.vllm's AsyncLLM: the calls verl's, NeMo-RL's and ROLL's async vLLM workers make
(generate with each output kind, abort, pause keep then a weight update then resume, sleep and
wake by tags, drain), against r3srv's own API on the same checkpoint as the oracle. Requests
that must still be in flight are held there by a step gate, never by timing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import weight_sync_trainer as trainer
from tiny_checkpoints import write_tiny_checkpoint

import r3srv.compat.vllm as vllm
from engine_testing import GREEDY, prompt_ids
from r3srv import LLM as R3srvLLM
from r3srv import SamplingParams as R3srvSamplingParams
from step_gate import gate_steps

pytestmark = pytest.mark.slow  # engines on tiny transformers checkpoints

ENGINE = dict(max_model_len=128, num_kv_blocks=64, device="cpu", enable_prefix_caching=False)
PROMPT = prompt_ids(20, base=2)
LONG = dict(max_tokens=30, **GREEDY)


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat-async-policies")
    return write_tiny_checkpoint(root / "v0", seed=0), write_tiny_checkpoint(root / "v1", seed=1)


@pytest.fixture
def engine(policies, gate):
    args = vllm.AsyncEngineArgs(str(policies[0]), enable_return_routed_experts=True, gpu_memory_utilization=0.4,
                                **ENGINE)
    llm = vllm.AsyncLLM.from_engine_args(args, usage_context="engine_context")
    gate_steps(llm.r3srv.core, gate.path)
    yield llm
    llm.shutdown()


def own(path, prompt, **params):
    out = R3srvLLM(str(path), **ENGINE).generate([prompt], R3srvSamplingParams(**params))[0]
    return out.outputs[0]


def cold_rows(path, prompt, output):
    """What `path` computes for every token of prompt + output but the last, in one cold pass."""
    tokens = prompt + list(output.token_ids)
    return own(path, tokens[:-1], max_tokens=1, **GREEDY).routed_experts


async def collect(llm, rid, prompt=PROMPT, **params):
    return [o async for o in llm.generate({"prompt_token_ids": prompt}, vllm.SamplingParams(**params), rid)]


async def running(llm, n=1):
    while llm.r3srv.stats().num_running < n:
        await asyncio.sleep(0.001)


def test_output_kinds_match_r3srv_own_final_output(engine, policies):
    want = own(policies[0], PROMPT, max_tokens=8, logprobs=1, **GREEDY)

    async def main():
        kinds = {}
        for kind in vllm.RequestOutputKind:
            kinds[kind] = await collect(engine, kind.name, max_tokens=8, logprobs=1, output_kind=kind, **GREEDY)
        return kinds

    kinds = asyncio.run(main())
    final = kinds[vllm.RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1 and final[0].finished
    for kind, outs in kinds.items():
        last = outs[-1].outputs[0]
        np.testing.assert_array_equal(last.routed_experts, want.routed_experts)
        if kind is vllm.RequestOutputKind.DELTA:
            assert [t for o in outs for t in o.outputs[0].token_ids] == want.token_ids
            assert [e for o in outs for e in o.outputs[0].logprobs] == want.logprobs
        else:
            assert last.token_ids == want.token_ids and last.logprobs == want.logprobs


def test_sampling_masks_come_one_list_per_token_in_every_output_kind(policies):
    """vLLM's sampling_mask.token_ids, one list per token: in cumulative outputs every token so
    far, in DELTA ones the new tokens', the whole equal to r3srv's own rows (test_compat_vllm)."""
    from test_compat_vllm import assert_vllm_masks

    from r3srv.compat.vllm.outputs import SamplingMask

    params = dict(max_tokens=8, temperature=1.0, top_k=6, seed=5)
    want = R3srvLLM(str(policies[0]), return_sampling_mask=True, **ENGINE).generate(
        [PROMPT], R3srvSamplingParams(**params))[0].outputs[0]
    args = vllm.AsyncEngineArgs(str(policies[0]), return_sampling_mask=True, **ENGINE)
    llm = vllm.AsyncLLM.from_engine_args(args)
    try:
        kinds = {kind: asyncio.run(collect(llm, kind.name, output_kind=kind, **params))
                 for kind in vllm.RequestOutputKind}
    finally:
        llm.shutdown()
    for kind, outs in kinds.items():
        for out in outs:
            sample = out.outputs[0]
            assert len(sample.sampling_mask.token_ids) == len(sample.token_ids), kind
        if kind is vllm.RequestOutputKind.DELTA:  # the deltas' rows one after the other
            samples = [o.outputs[0] for o in outs]
            joined = SamplingMask([r for s in samples for r in s.sampling_mask.token_ids],
                                  [r for s in samples for r in s.sampling_mask.logprobs])
            assert_vllm_masks([t for s in samples for t in s.token_ids], joined, want)
        else:
            last = outs[-1].outputs[0]
            assert_vllm_masks(last.token_ids, last.sampling_mask, want)


def test_abort_ends_requests_in_flight_and_frees_their_blocks(engine, gate):
    async def main():
        with gate.allowing(2):
            tasks = [asyncio.create_task(collect(engine, rid, **LONG)) for rid in ("a", "b", "c")]
            await running(engine, 3)
            assert engine.get_num_unfinished_requests() == 3
            await engine.abort("a")
            await engine.abort(["b", "c"])
            return [(await t)[-1] for t in tasks]

    for out in asyncio.run(main()):
        assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 30
    assert engine.r3srv.stats().kv_blocks_used == 0 and engine.get_num_unfinished_requests() == 0


def test_pause_keep_then_a_pushed_update_then_resume_serves_the_new_policy(engine, policies, gate):
    """verl's and NeMo-RL's partial rollout: keep the requests in flight, push new weights
    (collective_rpc buckets), resume. The kept request recomputes on the new weights: every row
    it returns is the new policy's."""
    v0, v1 = policies
    tensors = trainer.checkpoint_tensors(v1)

    async def main():
        with gate.allowing(3):
            task = asyncio.create_task(collect(engine, "kept", **LONG))
            await running(engine)
            await engine.pause_generation(mode="keep", clear_cache=False)
            assert await engine.is_paused()
        await engine.collective_rpc("update_weights_from_tensors", args=(list(tensors.items()),),
                                    kwargs={"weight_version": "v1"})
        assert not task.done()
        await engine.resume_generation()
        assert not await engine.is_paused()
        kept = (await task)[-1]
        later = (await collect(engine, "later", max_tokens=8, **GREEDY))[-1]
        return kept, later

    kept, later = asyncio.run(main())
    got = kept.outputs[0]
    assert kept.weight_version == "v1" and got.finish_reason == "length" and len(got.token_ids) == 30
    np.testing.assert_array_equal(got.routed_experts, cold_rows(v1, PROMPT, got))
    assert later.outputs[0].token_ids == own(v1, PROMPT, max_tokens=8, **GREEDY).token_ids


def test_sleep_holds_requests_and_wake_up_takes_memory_back_by_tag(engine, policies):
    want = own(policies[0], PROMPT, max_tokens=8, **GREEDY)

    async def main():
        await engine.sleep(level=1)
        assert await engine.is_sleeping() and engine.r3srv.released_memory == ["kv_cache", "weights"]
        task = asyncio.create_task(collect(engine, "waits", max_tokens=8, **GREEDY))
        while engine.r3srv.stats().num_waiting < 1:  # held until the engine wakes
            await asyncio.sleep(0.001)
        assert await engine.wake_up(["weights"]) is False and await engine.is_sleeping()
        assert not task.done()
        assert await engine.wake_up(["kv_cache"]) is True and not await engine.is_sleeping()
        out = (await task)[-1]
        await engine.wait_for_requests_to_drain(drain_timeout=60)
        return out

    out = asyncio.run(main())
    assert out.outputs[0].token_ids == want.token_ids
    np.testing.assert_array_equal(out.outputs[0].routed_experts, want.routed_experts)
    assert engine.get_num_unfinished_requests() == 0


def test_drain_waits_for_the_requests_in_flight(engine, gate):
    async def main():
        with gate.allowing(2):
            task = asyncio.create_task(collect(engine, "r", max_tokens=6, **GREEDY))
            await running(engine)
            drained = asyncio.create_task(engine.wait_for_requests_to_drain(drain_timeout=60))
            await asyncio.sleep(0)
            assert not drained.done() and engine.get_num_unfinished_requests() == 1
        await drained
        assert engine.get_num_unfinished_requests() == 0
        assert (await task)[-1].outputs[0].finish_reason == "length"  # drained: its last output is on its way
        with pytest.raises(asyncio.TimeoutError):
            with gate.allowing(0):
                held = asyncio.create_task(collect(engine, "held", max_tokens=6, **GREEDY))
                while engine.get_num_unfinished_requests() < 1:
                    await asyncio.sleep(0.001)
                await engine.wait_for_requests_to_drain(drain_timeout=0.2)
        await held

    asyncio.run(main())
