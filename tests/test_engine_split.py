"""The engine split's seams: a stop string found by the output processor ends the sequence in
the core with exactly the rows of the kept tokens (also when the core preempted it before the
stop arrived, and when the core ran further steps meanwhile), AsyncLLM's output processing
never runs on the core's thread, and a crash there ends the engine loudly (no hung clients)."""

import asyncio
import threading

import numpy as np
import pytest

from engine_testing import one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams
from r3srv.engine.async_llm import AsyncLLM, EngineDeadError, EngineState
from r3srv.engine.requests import CoreOutputs
from r3srv.engine.output_processor import OutputProcessor

ENGINE = dict(max_model_len=128, enable_prefix_caching=False)


def stop_params(stop: list[str]) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True, stop=stop,
                          return_routed_experts=True, routed_experts_prompt_start=3)


@pytest.fixture(scope="module")
def reference():
    """The offline engine's outputs (stop strings handled at once, on one thread), and a stop
    string that ends the sample after several tokens."""
    llm = LLM(**ENGINE)
    free = llm.generate([prompt_ids(12)], stop_params([]))[0].outputs[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    assert stop and free.text.find(stop) > 0
    out = llm.generate([prompt_ids(12)], stop_params([stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and 0 < len(out.token_ids) < len(free.token_ids)
    return stop, out


def drive(engine, stop: str, steps_before_stop: int, preempt: bool):
    """Run the core and the output processor by hand, handing the output processor's stop to
    the core `steps_before_stop` steps late (as AsyncLLM's threads may), after a retract."""
    core, op = engine.core, OutputProcessor(engine.tokenizer)
    prep = engine.prepare_request("r", prompt_ids(12), stop_params([stop]))
    core.add_request(prep)
    op.add_request(prep)
    finals, pending = [], []
    while not finals:
        processed = op.process(core.step() if core.has_unfinished() else CoreOutputs())
        finals += [o for o in processed.outputs if o.finished]
        pending += processed.stops
        if pending and (steps_before_stop == 0 or not core.has_unfinished()):
            if preempt:
                assert core.retract_running() == 1  # its blocks, and its rows, are gone
            for s in pending:
                processed = op.process(core.stop_sequence(s.request_id, s.index, s.num_output_tokens, s.stop))
                finals += [o for o in processed.outputs if o.finished]
            pending = []
        elif pending:
            steps_before_stop -= 1
    assert not core.requests and core.block_manager.num_used_blocks == 0
    return finals[0].outputs[0]


@pytest.mark.parametrize("late,preempt", [(0, False), (3, False), (0, True), (2, True)])
def test_a_stop_string_found_off_the_core_keeps_exactly_the_kept_tokens_rows(reference, late, preempt):
    stop, want = reference
    got = drive(LLM(**ENGINE).engine, stop, late, preempt)
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
        want.text, want.token_ids, want.finish_reason, want.stop_reason)
    assert got.routed_experts.shape[0] == 12 + len(want.token_ids) - 1 - 3
    np.testing.assert_array_equal(got.routed_experts, want.routed_experts)


def test_async_outputs_are_built_off_the_core_thread_and_equal_the_offline_engine(reference, monkeypatch):
    stop, want = reference
    threads: set[int] = set()
    real = OutputProcessor.process

    def recording(self, core_outputs):
        threads.add(threading.get_ident())
        return real(self, core_outputs)

    monkeypatch.setattr(OutputProcessor, "process", recording)
    engine = AsyncLLM(**ENGINE)
    try:
        async def main():
            return [o async for o in engine.generate(prompt_ids(12), stop_params([stop]), "a")][-1]

        got = asyncio.run(main()).outputs[0]
        core_thread = engine._thread.ident
    finally:
        engine.shutdown()
    assert threads and core_thread not in threads and threading.get_ident() not in threads
    assert (got.text, got.token_ids, got.stop_reason) == (want.text, want.token_ids, want.stop_reason)
    np.testing.assert_array_equal(got.routed_experts, want.routed_experts)


def test_an_output_thread_crash_fails_requests_loudly_and_stops_the_core(monkeypatch):
    def broken(self, core_outputs):
        raise AssertionError("output processor bug")

    monkeypatch.setattr(OutputProcessor, "process", broken)
    engine = AsyncLLM(**ENGINE)

    async def main():
        with pytest.raises(EngineDeadError, match="output processor bug"):
            async for _ in engine.generate(prompt_ids(5), SamplingParams(max_tokens=2), "crash"):
                pass

    asyncio.run(main())
    engine._thread.join(timeout=30)
    assert engine.state is EngineState.DEAD and not engine.is_running and not engine._thread.is_alive()
    engine.shutdown()  # idempotent after a death
