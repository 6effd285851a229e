"""The step gate the race-free tests rely on (tests/step_gate.py): an engine takes exactly the
steps granted, holds its requests in flight meanwhile, and still takes commands while held."""

from __future__ import annotations

import asyncio

from step_gate import gate_steps

from engine_testing import GREEDY, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from r3srv import SamplingParams
from r3srv.engine.async_llm import AsyncLLM


def test_an_engine_takes_the_steps_granted_and_takes_commands_while_held(gate):
    engine = AsyncLLM(max_model_len=128, num_kv_blocks=32)
    gate_steps(engine.core, gate.path)

    async def main():
        outputs = []

        async def run(rid):
            async for out in engine.generate(prompt_ids(12), SamplingParams(max_tokens=50, **GREEDY), rid):
                outputs.append(out)

        with gate.allowing(3):  # the prefill and two decode steps
            held = asyncio.create_task(run("held"))
            while not outputs or len(outputs[-1].outputs[0].token_ids) < 3:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.5)  # held: however long, no fourth token
            tokens_while_held = engine.core.requests["held"].seqs[0].num_output_tokens
            assert isinstance(await engine.reset_prefix_cache(), int)  # a command answered while held
            gate.allow(2)
            while len(outputs[-1].outputs[0].token_ids) < 5:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.5)
            tokens_after_two_more = engine.core.requests["held"].seqs[0].num_output_tokens
        await held  # open: it runs to its 50 tokens
        return tokens_while_held, tokens_after_two_more, outputs[-1]

    try:
        while_held, after_two_more, final = asyncio.run(main())
    finally:
        engine.shutdown()
    assert (while_held, after_two_more) == (3, 5)
    assert final.finished and len(final.outputs[0].token_ids) == 50
