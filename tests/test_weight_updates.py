"""RL policy updates: new weights from a checkpoint directory, prefix cache emptied, requests in
flight finish on the weights they started with (or are aborted), bad checkpoints change nothing."""

import asyncio
import shutil

import numpy as np
import pytest
from tiny_checkpoints import FAMILIES, write_tiny_checkpoint

from engine_testing import GREEDY, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from step_gate import gate_steps
from r3srv import LLM, SamplingParams
from r3srv.engine.async_llm import AsyncLLM
from r3srv.errors import ConfigError, InvalidRequestError

pytestmark = pytest.mark.slow  # an engine per test on several checkpoints

ENGINE = dict(max_model_len=128, num_kv_blocks=64, enable_return_routed_experts=True)
PARAMS = SamplingParams(max_tokens=12, return_routed_experts=True, **GREEDY)
PROMPT = prompt_ids(40, base=2)  # two full blocks of 16: cacheable


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """Two checkpoints of one architecture with different weights, and one of another shape."""
    root = tmp_path_factory.mktemp("policies")
    v0 = write_tiny_checkpoint(root / "v0", "qwen3_moe", seed=0)
    v1 = write_tiny_checkpoint(root / "v1", "qwen3_moe", seed=1)
    other = write_tiny_checkpoint(root / "other", "qwen3_moe", seed=1, top_k=3)
    return v0, v1, other


@pytest.fixture(scope="module")
def fresh_v1(policies):
    """What a server started on v1 answers."""
    return LLM(str(policies[1]), **ENGINE).generate([PROMPT], PARAMS)[0].outputs[0]


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and np.array_equal(a.routed_experts, b.routed_experts)


def test_update_serves_the_new_policy_and_empties_the_prefix_cache(policies, fresh_v1):
    v0, v1, _ = policies
    llm = LLM(str(v0), **ENGINE)
    before = llm.generate([PROMPT], PARAMS)[0]
    assert not same(before.outputs[0], fresh_v1)  # the two policies differ
    assert llm.generate([PROMPT], PARAMS)[0].num_cached_tokens == 32  # the prompt's blocks are cached
    llm.update_weights(str(v1))
    after = llm.generate([PROMPT], PARAMS)[0]
    assert (before.weight_version, after.weight_version) == ("0", str(v1))  # default: the path
    assert after.num_cached_tokens == 0  # stale KV and rows are not reused
    assert same(after.outputs[0], fresh_v1)
    assert llm.generate([PROMPT], PARAMS)[0].num_cached_tokens == 32  # caching resumes on the new weights


@pytest.mark.parametrize("break_it", ["other architecture", "missing shard", "not a checkpoint", "truncated header"])
def test_a_bad_checkpoint_raises_and_changes_nothing(policies, tmp_path, break_it):
    v0, v1, other = policies
    llm = LLM(str(v0), **ENGINE)
    before = llm.generate([PROMPT], PARAMS)[0].outputs[0]
    bad = tmp_path / "bad"
    if break_it == "other architecture":
        bad = other
    elif break_it == "missing shard":
        shutil.copytree(v1, bad)
        for shard in bad.glob("*.safetensors"):
            shard.unlink()
    elif break_it == "truncated header":
        shutil.copytree(v1, bad)
        shard = next(bad.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        bad.mkdir()
    with pytest.raises(ConfigError) as err:
        llm.update_weights(str(bad))
    if break_it == "other architecture":
        assert "top_k=3 (served: 2)" in str(err.value)
    again = llm.generate([PROMPT], PARAMS)[0]
    assert same(again.outputs[0], before) and again.num_cached_tokens == 32  # weights and cache untouched


def test_the_sync_engine_refuses_to_update_under_running_requests(policies):
    llm = LLM(str(policies[0]), **ENGINE)
    llm.engine.add_request("r", PROMPT, PARAMS)
    llm.engine.step()  # its prompt's KV now holds the old weights
    with pytest.raises(InvalidRequestError, match="1 requests in flight holding KV"):
        llm.update_weights(str(policies[1]))


def test_reset_prefix_cache(policies):
    llm = LLM(str(policies[0]), **ENGINE)
    llm.generate([PROMPT], PARAMS)
    assert llm.reset_prefix_cache() == 3  # the prompt's two blocks and one of the output
    assert llm.generate([PROMPT], PARAMS)[0].num_cached_tokens == 0


async def held_one(engine) -> None:
    """Until the engine thread has taken the request that arrived during an update (an event,
    however long a loaded machine takes to get there)."""
    for _ in range(30_000):
        if engine.stats().num_waiting == 1:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the request sent during the update never reached the engine")


@pytest.mark.parametrize("abort_running", [False, True])
def test_async_update_drains_or_aborts_running_requests_and_holds_new_ones(policies, fresh_v1, abort_running, gate):
    v0, v1, _ = policies
    on_v0 = LLM(str(v0), **ENGINE).generate([PROMPT], SamplingParams(max_tokens=60, return_routed_experts=True, **GREEDY))[0]
    engine = AsyncLLM(str(v0), **ENGINE)
    gate_steps(engine.core, gate.path)

    async def main():
        async def run(rid, params):
            return [o async for o in engine.generate(PROMPT, params, rid)][-1]

        with gate.allowing(2):  # "old" is held in flight (2 steps of its 60) until the gate opens
            running = asyncio.create_task(run("old", SamplingParams(max_tokens=60, return_routed_experts=True, **GREEDY)))
            while engine.stats().num_running == 0:
                await asyncio.sleep(0.001)
            update = asyncio.create_task(engine.update_weights(str(v1), abort_running=abort_running, weight_version="v1"))
            await asyncio.sleep(0)  # the update is queued: the request below arrives while it waits
            held = asyncio.create_task(run("new", PARAMS))
            if not abort_running:  # still waiting for "old" to finish
                await held_one(engine)  # the held request counts as waiting
                assert not update.done()
                with pytest.raises(InvalidRequestError, match="already under way"):
                    await engine.update_weights(str(v1))
        results = await asyncio.gather(running, update, held)
        return results[0], results[2]

    try:
        old, new = asyncio.run(main())
    finally:
        engine.shutdown()
    if abort_running:
        assert old.outputs[0].finish_reason == "abort"
    else:  # finished on the weights it started with: no mixed policy in its rows
        assert old.outputs[0].finish_reason == "length" and same(old.outputs[0], on_v0.outputs[0])
    assert same(new.outputs[0], fresh_v1) and new.num_cached_tokens == 0
    assert (old.weight_version, new.weight_version) == ("0", "v1")  # each names the weights it ran on


def test_a_request_aborted_while_it_waits_for_an_update_ends_cleanly(policies, gate):
    v0, v1, _ = policies
    engine = AsyncLLM(str(v0), **ENGINE)
    gate_steps(engine.core, gate.path)

    async def main():
        async def run(rid, params):
            return [o async for o in engine.generate(PROMPT, params, rid)][-1]

        with gate.allowing(2):  # "old" is held in flight until the gate opens
            running = asyncio.create_task(run("old", SamplingParams(max_tokens=60, **GREEDY)))
            while engine.stats().num_running == 0:
                await asyncio.sleep(0.001)
            update = asyncio.create_task(engine.update_weights(str(v1)))
            await asyncio.sleep(0)  # the update is queued: the request below arrives while it waits
            held = asyncio.create_task(run("held", PARAMS))
            await held_one(engine)
            assert await engine.abort("held")
            held = await held
        return held, await running, await update

    try:
        held, running, _ = asyncio.run(main())
    finally:
        engine.shutdown()
    assert held.finished and held.outputs[0].finish_reason == "abort" and held.outputs[0].token_ids == []
    assert running.outputs[0].finish_reason == "length"


def test_a_failure_while_copying_is_named_in_every_later_output(policies, monkeypatch):
    """An I/O error after the checks passed leaves a mix of old and new weights: outputs say so."""
    import r3srv.models.loader as loader

    v0, v1, _ = policies
    llm = LLM(str(v0), **ENGINE)

    def copy_then_fail(model, plan):
        (file, names), *_ = plan.shards
        with loader.safe_open(str(file), framework="pt", device="cpu") as f:
            target = model.weight_targets()[names[0]]
            target.copy_(f.get_tensor(names[0]))
        raise OSError("disk vanished")

    monkeypatch.setattr(loader, "_copy_weights", copy_then_fail)
    with pytest.raises(OSError, match="disk vanished"):
        llm.update_weights(str(v1), weight_version="v1")
    out = llm.generate([PROMPT], PARAMS)[0]
    assert out.weight_version == f"incomplete:{v1}" and out.num_cached_tokens == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_updates_to_the_new_policy(family, tmp_path):
    """Each family's checkpoint names (fused, transposed, [1, E] biases, latent attention, ...)
    fill the served model on an update as on a fresh load."""
    v0 = write_tiny_checkpoint(tmp_path / "v0", family, seed=0)
    v1 = write_tiny_checkpoint(tmp_path / "v1", family, seed=1)
    params = SamplingParams(max_tokens=6, return_routed_experts=True, **GREEDY)
    fresh = LLM(str(v1), **ENGINE).generate([PROMPT], params)[0].outputs[0]
    llm = LLM(str(v0), **ENGINE)
    before = llm.generate([PROMPT], params)[0].outputs[0]
    llm.update_weights(str(v1))
    after = llm.generate([PROMPT], params)[0].outputs[0]
    assert same(after, fresh) and not same(before, fresh)
