"""Control commands are declared once (engine/commands.py): every front has one method per
command, with the command's arguments and docstring, and the same command runs the same way
queued on AsyncLLM's core thread or at once on LLMEngine."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from engine_testing import GREEDY, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams
from r3srv.engine import commands
from r3srv.engine.async_llm import AsyncLLM
from r3srv.engine.llm_engine import LLMEngine
from r3srv.errors import InvalidRequestError

SMALL = dict(max_model_len=64, num_kv_blocks=16)


@pytest.mark.parametrize("front, queued", [(AsyncLLM, True), (LLMEngine, False), (LLM, False)])
def test_every_command_is_a_method_of_every_front_with_its_arguments(front, queued):
    for kind in commands.COMMANDS:
        name = commands.method_name(kind)
        if not (queued or kind.offline):
            assert not hasattr(front, name), name
            continue
        method = getattr(front, name)
        assert inspect.iscoroutinefunction(method) == queued, name
        params = list(inspect.signature(method).parameters.values())
        assert params[0].name == "self" and params[1:] == list(inspect.signature(kind).parameters.values()), name
        assert method.__doc__ == kind.__doc__ and method.__doc__, name


def test_offline_commands_run_at_once():
    llm = LLM(**SMALL)
    llm.generate([prompt_ids(20)], SamplingParams(max_tokens=2, **GREEDY))
    assert llm.reset_prefix_cache() > 0  # the prompt's full blocks were cached
    assert llm.reset_prefix_cache() == 0
    llm.rename_weights("renamed")
    assert llm.generate([prompt_ids(5)], SamplingParams(max_tokens=1))[0].weight_version == "renamed"
    assert llm.release_memory(["kv_cache"]) == ["kv_cache"] and llm.resume_memory() == []


def test_a_command_that_fails_answers_its_caller_and_the_engine_goes_on():
    engine = AsyncLLM(**SMALL)

    def fails(ranks):
        raise RuntimeError(f"no ranks here: {ranks}")

    async def main():
        with pytest.raises(RuntimeError, match="no ranks here: None"):
            await engine.call_ranks(fails)
        with pytest.raises(InvalidRequestError, match="mode must be one of"):
            await engine.pause_generation("sideways")  # refused by the command itself, before it is queued
        outputs = [o async for o in engine.generate(prompt_ids(8), SamplingParams(max_tokens=3, **GREEDY), "after")]
        return outputs[-1]

    try:
        final = asyncio.run(main())
    finally:
        engine.shutdown()
    assert final.finished and len(final.outputs[0].token_ids) == 3 and engine.is_running is False
