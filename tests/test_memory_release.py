"""Releasing and resuming the engine's memory between rollout batches (a colocated trainer
trains meanwhile): SGLang's release/resume_memory_occupation semantics, offline and async."""

import asyncio
import gc

import numpy as np
import pytest
import torch
from tiny_checkpoints import write_tiny_checkpoint

from engine_testing import GREEDY, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from step_gate import gate_steps
from r3srv import LLM, SamplingParams
from r3srv.engine.async_llm import AsyncLLM, EngineDeadError
from r3srv.errors import InvalidRequestError

ENGINE = dict(max_model_len=128, num_kv_blocks=64, enable_return_routed_experts=True)
PARAMS = SamplingParams(max_tokens=12, return_routed_experts=True, **GREEDY)
PROMPT = prompt_ids(40, base=3)  # two full blocks of 16: cacheable


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("release-policies")
    return write_tiny_checkpoint(root / "v0", "qwen3_moe", seed=0), write_tiny_checkpoint(root / "v1", "qwen3_moe", seed=1)


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and np.array_equal(a.routed_experts, b.routed_experts)


def test_release_frees_the_kv_cache_and_resume_serves_as_before(policies):
    llm = LLM(str(policies[0]), **ENGINE)
    before = llm.generate([PROMPT], PARAMS)[0]
    weights = {n: p.clone() for n, p in llm.engine.model.named_parameters()}
    assert llm.release_memory() == ["kv_cache", "weights"]
    assert not llm.engine.model.has_kv_cache
    assert llm.engine.block_manager.reset_prefix_cache() == 0  # the cached prompt went with its K/V
    with pytest.raises(InvalidRequestError, match="kv_cache and weights memory is released"):
        llm.generate([PROMPT], PARAMS)
    assert llm.engine.requests == {}  # the refused request left nothing behind
    assert llm.resume_memory(["weights"]) == ["kv_cache"]
    assert llm.resume_memory() == []
    assert llm.engine.model.has_kv_cache
    for name, param in llm.engine.model.named_parameters():
        assert param.device == llm.engine.device and torch.equal(param, weights[name]), name
    after = llm.generate([PROMPT], PARAMS)[0]
    assert same(after.outputs[0], before.outputs[0]) and after.num_cached_tokens == 0


def test_release_is_idempotent_and_tags_are_checked(policies):
    llm = LLM(str(policies[0]), **ENGINE)
    assert llm.release_memory(["kv_cache"]) == ["kv_cache"]
    assert llm.release_memory(["kv_cache"]) == ["kv_cache"]
    assert llm.resume_memory(["weights"]) == ["kv_cache"]  # nothing to take back: no change
    with pytest.raises(InvalidRequestError, match="unknown memory tags"):
        llm.release_memory(["gpu"])
    assert llm.resume_memory() == []


def test_the_sync_engine_refuses_to_release_under_running_requests(policies):
    llm = LLM(str(policies[0]), **ENGINE)
    llm.engine.add_request("r", PROMPT, PARAMS)
    with pytest.raises(InvalidRequestError, match="1 requests in flight"):
        llm.release_memory()
    assert llm.engine.model.has_kv_cache


def test_weights_updated_while_released_are_served_after_resume(policies):
    """slime's colocated loop: release everything, train, load the new policy, resume."""
    v0, v1 = policies
    fresh_v1 = LLM(str(v1), **ENGINE).generate([PROMPT], PARAMS)[0].outputs[0]
    llm = LLM(str(v0), **ENGINE)
    llm.generate([PROMPT], PARAMS)
    llm.release_memory()
    llm.update_weights(str(v1), weight_version="v1")
    llm.resume_memory()
    out = llm.generate([PROMPT], PARAMS)[0]
    assert same(out.outputs[0], fresh_v1) and out.weight_version == "v1"


def gated_engine(path, gate) -> AsyncLLM:
    """An AsyncLLM of the checkpoint at `path` whose steps `gate` lets through."""
    engine = AsyncLLM(str(path), **ENGINE)
    gate_steps(engine.core, gate.path)
    return engine


async def last_output(engine: AsyncLLM, request_id: str, params: SamplingParams):
    return [o async for o in engine.generate(PROMPT, params, request_id)][-1]


async def start_running(engine: AsyncLLM) -> asyncio.Task:
    """A 60-token request ("running") in flight, once the engine runs it (the caller's gate
    holds it there)."""
    task = asyncio.create_task(last_output(engine, "running", SamplingParams(max_tokens=60, **GREEDY)))
    while engine.stats().num_running == 0:
        await asyncio.sleep(0.001)
    return task


def test_async_release_waits_for_running_requests_and_holds_new_ones_until_resume(policies, gate):
    v0, _ = policies
    want_long = LLM(str(v0), **ENGINE).generate([PROMPT], SamplingParams(max_tokens=60, **GREEDY))[0].outputs[0]
    want = LLM(str(v0), **ENGINE).generate([PROMPT], PARAMS)[0].outputs[0]
    engine = gated_engine(v0, gate)

    async def main():
        with gate.allowing(2):  # "running" is held in flight (2 steps of its 60) until the gate opens
            running = await start_running(engine)
            release = asyncio.create_task(engine.release_memory())
            await asyncio.sleep(0)  # the release's command is queued
            # a command the core thread answers after the release's: had that run at once, memory would be released
            assert await engine.continue_generation() is False
            assert engine.released_memory == [] and not release.done()  # waits for "running" to finish
            held = asyncio.create_task(last_output(engine, "held", PARAMS))
            await asyncio.sleep(0)  # queued behind the release
        assert await release == ["kv_cache", "weights"]
        finished = await running
        async def queued():  # "held" reaches the engine's queue, however slowly, and stays there
            while engine.stats().num_waiting == 0:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(queued(), timeout=60)
        assert not held.done() and engine.stats().num_waiting == 1  # held while released
        assert engine.released_memory == ["kv_cache", "weights"]
        assert await engine.resume_memory() == []
        return finished, await held

    try:
        finished, held = asyncio.run(main())
    finally:
        engine.shutdown()
    assert finished.outputs[0].finish_reason == "length" and same(finished.outputs[0], want_long)
    assert same(held.outputs[0], want)


def test_a_stopping_engine_refuses_the_commands_waiting_for_its_requests_and_starts_those_they_held(policies, gate):
    """What the server does on SIGTERM (ServerState.stop_serving): a release or an update still
    waiting for the request in flight fails with EngineDeadError instead of running once it ends,
    so do later ones; the request it held starts and finishes as it would have; other commands
    and requests are served as before."""
    v0, v1 = policies
    want = LLM(str(v0), **ENGINE).generate([PROMPT], PARAMS)[0].outputs[0]
    engine = gated_engine(v0, gate)

    async def main():
        with gate.allowing(2):  # "running" stays in flight until the gate opens
            running = await start_running(engine)
            release = asyncio.create_task(engine.release_memory())
            await asyncio.sleep(0)  # the release's command is queued
            held = asyncio.create_task(last_output(engine, "held", PARAMS))
            while engine.stats().num_waiting == 0:  # held behind the release
                await asyncio.sleep(0.001)
            engine.refuse_waiting_commands("stopping for the test")
            with pytest.raises(EngineDeadError, match="stopping for the test"):
                await release
            with pytest.raises(EngineDeadError, match="stopping for the test"):
                await engine.update_weights(str(v1))
            assert await engine.continue_generation() is False  # a command that does not wait runs
        await running
        return await held

    try:
        held = asyncio.run(main())
        assert engine.released_memory == []
    finally:
        engine.shutdown()
    assert same(held.outputs[0], want) and held.outputs[0].finish_reason == "length"


@pytest.mark.gpu
def test_release_gives_the_gpu_memory_back(policies):
    gc.collect()
    others = torch.cuda.memory_allocated()  # earlier tests' tensors (a failed one's traceback keeps its model)
    llm = LLM(str(policies[0]), device="cuda", dtype="float32", **ENGINE)
    before = llm.generate([PROMPT], PARAMS)[0]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - others
    assert held > 0
    llm.release_memory()
    assert torch.cuda.memory_allocated() - others < 0.1 * held  # weights and KV left the GPU
    assert all(p.device.type == "cpu" and p.is_pinned() for p in llm.engine.model.parameters())
    llm.resume_memory()
    assert same(llm.generate([PROMPT], PARAMS)[0].outputs[0], before.outputs[0])
