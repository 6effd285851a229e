"""AsyncLLM: continuous batching across coroutines, cumulative outputs, early exit and abort
free every block, step failures fail only their requests, shutdown."""

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from engine_testing import GREEDY, model_of, one_torch_thread, prompt_ids, recording_routers  # noqa: F401 (autouse fixture)
from step_gate import gate_steps
from r3srv import LLM, SamplingParams
from r3srv.engine.async_llm import AsyncLLM, EngineDeadError
from r3srv.errors import InvalidRequestError
from r3srv.outputs import OutputKind

@pytest.fixture(scope="module")
def engine(gate):
    eng = AsyncLLM(max_model_len=256, max_num_seqs=16)
    gate_steps(eng.core, gate.path)  # open: tests that need a request in flight hold it there
    yield eng
    eng.shutdown()


async def collect(engine, prompt, params, rid):
    outs = []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
    return outs


async def wait_idle(engine, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == s.num_waiting == 0 and s.kv_blocks_used == 0:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def test_facts_for_the_server(engine):
    assert engine.max_model_len == 256 and engine.enable_return_routed_experts
    assert engine.routed_experts_info == {
        "num_layers": 4, "top_k": 8, "num_experts": 64, "dtype": "uint8", "moe_layers": [0, 1, 2, 3]
    }
    assert engine.model_config.num_experts == 64
    assert engine.tokenizer.decode(engine.tokenizer.encode("abc")) == "abc"


def test_concurrent_requests_batch_together_and_match_offline(engine, gate):
    """Which requests share a step depends on timing, and a token computed in another batch
    shape may round differently (docs/architecture.md: floating point is not batch-invariant). So the rows
    are checked against the router logits of the steps that actually ran (deterministic
    whatever the batching), and the tokens against an offline run."""
    steps: list[list[tuple[str, int, int]]] = []  # per step: (request_id, first position, tokens)
    router_logits: list[torch.Tensor] = []  # per step and MoE layer, in call order
    runner = engine.core.executor.runner
    real_run = runner.run

    def spy_run(seqs, *args):
        steps.append([(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens) for s in seqs])
        return real_run(seqs, *args)

    runner.run = spy_run
    prompts = [prompt_ids(5 + i, base=i) for i in range(6)]  # under one block: no prefix-cache hits
    params = SamplingParams(max_tokens=12, **GREEDY)

    async def main():
        with gate.allowing(0):  # no step until every request is in: they must share steps
            runs = [asyncio.create_task(collect(engine, p, params, f"c{i}")) for i, p in enumerate(prompts)]
            while len(engine.core.requests) < len(prompts):
                await asyncio.sleep(0.001)
        return await asyncio.gather(*runs)

    try:
        with recording_routers(model_of(engine), router_logits):
            results = asyncio.run(main())
    finally:
        runner.run = real_run
    assert max(len(step) for step in steps) > 1  # requests from different coroutines shared steps
    num_layers, top_k = 4, 8
    assert len(router_logits) == num_layers * len(steps)
    expected: dict[str, dict[int, np.ndarray]] = {}
    for i, step in enumerate(steps):
        picks = np.stack(
            [torch.sort(router_logits[i * num_layers + layer], dim=-1, descending=True, stable=True)
             .indices[:, :top_k].numpy() for layer in range(num_layers)],
            axis=1,
        )  # [tokens of the step, layer, k]
        row = 0
        for rid, first, n in step:
            for offset in range(n):
                expected.setdefault(rid, {})[first + offset] = picks[row + offset]
            row += n
    offline = LLM(max_model_len=256).generate(prompts, params)
    for i, (outs, ref) in enumerate(zip(results, offline)):
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and lengths[-1] == 12  # cumulative
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert all(o.outputs[0].routed_experts is None for o in outs[:-1])  # only the final one
        final = outs[-1].outputs[0]
        assert final.token_ids == ref.outputs[0].token_ids and final.text == ref.outputs[0].text
        num_rows = len(prompts[i]) + 12 - 1
        assert sorted(expected[f"c{i}"]) == list(range(num_rows))  # every token ran exactly once
        want = np.stack([expected[f"c{i}"][pos] for pos in range(num_rows)]).astype(np.uint8)
        np.testing.assert_array_equal(final.routed_experts, want)


def test_invalid_request_raises_before_anything_is_yielded(engine):
    async def main():
        gen = engine.generate(prompt_ids(5), SamplingParams(routed_experts_prompt_start=6), "bad")
        with pytest.raises(InvalidRequestError) as exc:
            await gen.__anext__()
        return exc.value

    err = asyncio.run(main())
    assert err.param == "routed_experts_prompt_start" and "5 tokens" in str(err)
    assert engine.stats().num_waiting == 0


def test_leaving_early_aborts_and_frees_blocks(engine, gate):
    async def main():
        seen = []
        with gate.allowing(4):  # short of its 200 tokens: in flight when the consumer leaves
            gen = engine.generate(prompt_ids(40), SamplingParams(max_tokens=200, n=2, **GREEDY), "early")
            async for out in gen:
                seen.append(out)
                if len(seen) == 2:
                    break
            await gen.aclose()
            return seen, await wait_idle(engine)

    seen, stats = asyncio.run(main())
    assert not seen[-1].finished and stats.kv_blocks_used == 0 and "early" not in engine.core.requests


def test_cancelled_consumer_aborts(engine, gate):
    async def main():
        outs = []

        async def consume():
            async for out in engine.generate(prompt_ids(30, 3), SamplingParams(max_tokens=200, **GREEDY), "cx"):
                outs.append(out)

        with gate.allowing(2):  # generating, and short of its 200 tokens until the gate opens
            task = asyncio.create_task(consume())
            while not outs:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return outs, await wait_idle(engine)

    outs, stats = asyncio.run(main())
    assert not outs[-1].finished and stats.kv_blocks_used == 0 and "cx" not in engine.core.requests


def test_abort_from_another_coroutine_ends_the_stream(engine, gate):
    async def main():
        outs = []

        async def consume():
            async for out in engine.generate(prompt_ids(20, 4), SamplingParams(max_tokens=200, **GREEDY), "ab"):
                outs.append(out)

        with gate.allowing(2):  # short of its 200 tokens until the gate opens
            task = asyncio.create_task(consume())
            while not outs:
                await asyncio.sleep(0.01)
            assert await engine.abort("ab") is True
            await asyncio.wait_for(task, 20)
        assert await engine.abort("ab") is False
        assert await engine.abort("never-seen") is False
        return outs, await wait_idle(engine)

    outs, stats = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 200 and stats.kv_blocks_used == 0


def test_duplicate_request_id_in_flight_is_rejected(engine, gate):
    async def main():
        with gate.allowing(2):  # "dup" is still running at the second call
            gen = engine.generate(prompt_ids(8), SamplingParams(max_tokens=240, **GREEDY), "dup")
            await gen.__anext__()
            with pytest.raises(InvalidRequestError) as exc:
                await engine.generate(prompt_ids(8), SamplingParams(max_tokens=2), "dup").__anext__()
            await gen.aclose()
        await wait_idle(engine)
        return exc.value

    assert asyncio.run(main()).param == "request_id"


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine):
    model = engine.core.executor.model
    real_forward = model.forward

    def broken(batch):
        if int(batch.input_ids[0]) == 250:  # only steps that carry the poisoned prompt
            raise RuntimeError("boom in forward")
        return real_forward(batch)

    model.forward = broken

    async def main():
        with pytest.raises(RuntimeError, match="boom"):
            await collect(engine, [250, 1, 2], SamplingParams(max_tokens=5), "poison")
        await wait_idle(engine)
        return await collect(engine, prompt_ids(6), SamplingParams(max_tokens=4, **GREEDY), "after")

    try:
        outs = asyncio.run(main())
    finally:
        model.forward = real_forward
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


def test_shutdown_is_idempotent_and_final():
    eng = AsyncLLM(max_model_len=64, enable_return_routed_experts=False)
    assert eng.routed_experts_info is None and eng.is_running

    async def main():
        with pytest.raises(InvalidRequestError, match="--enable-return-routed-experts"):
            await eng.generate([1, 2], SamplingParams(return_routed_experts=True), "x").__anext__()
        outs = await collect(eng, [1, 2, 3], SamplingParams(max_tokens=2), "ok")
        assert outs[-1].outputs[0].routed_experts is None
        eng.shutdown()
        eng.shutdown()
        with pytest.raises(EngineDeadError):
            await eng.generate([1, 2, 3], SamplingParams(max_tokens=2), "late").__anext__()

    asyncio.run(main())
    assert not eng._thread.is_alive() and not eng.is_running


def test_streamed_outputs_are_prefixes_of_the_final_one_with_stop_strings(engine):
    prompt = prompt_ids(6, base=9)
    full = LLM(max_model_len=256).generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    stop = full.text[10:13]  # three tokens: the first two stream before the stop completes
    params = SamplingParams(max_tokens=30, stop=[stop], logprobs=0, **GREEDY)
    outs = asyncio.run(collect(engine, prompt, params, "stream-stop"))
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.text == full.text[: full.text.find(stop)]
    assert len(outs) > 2
    for o in outs[:-1]:
        c = o.outputs[0]
        assert final.text.startswith(c.text)
        assert final.token_ids[: len(c.token_ids)] == c.token_ids
        assert len(c.logprobs) == len(c.token_ids)


def test_final_only_yields_only_the_finished_output(engine):
    """A consumer that waits for the end (non-streaming HTTP) gets one output: the finished one,
    the same as the last of a streamed run."""
    prompt = prompt_ids(12, base=4)
    params = SamplingParams(max_tokens=20, n=2, logprobs=1, **GREEDY)

    async def run(kind: OutputKind):
        return [o async for o in engine.generate(prompt, params, f"stream-{kind.value}", output_kind=kind)]

    streamed, quiet = asyncio.run(run(OutputKind.CUMULATIVE)), asyncio.run(run(OutputKind.FINAL_ONLY))
    assert len(streamed) > 2 and len(quiet) == 1 and quiet[0].finished
    for a, b in zip(streamed[-1].outputs, quiet[0].outputs):
        assert (a.token_ids, a.text, a.logprobs, a.finish_reason) == (b.token_ids, b.text, b.logprobs, b.finish_reason)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    asyncio.run(wait_idle(engine))


def test_an_engine_thread_crash_fails_requests_loudly():
    eng = AsyncLLM(max_model_len=64)

    def broken_schedule():
        raise AssertionError("scheduler bug")

    eng.core.scheduler.schedule = broken_schedule

    async def main():
        with pytest.raises(EngineDeadError, match="scheduler bug"):
            await collect(eng, [1, 2, 3], SamplingParams(max_tokens=2), "crash")
        with pytest.raises(EngineDeadError):
            await eng.generate([1, 2, 3], SamplingParams(max_tokens=2), "after-crash").__anext__()

    asyncio.run(main())
    assert not eng.is_running
    eng.shutdown()


def test_large_prompts_are_prepared_off_the_event_loop(engine, monkeypatch):
    """Tokenizing and checking a huge prompt must not stall every other client on the loop."""
    from r3srv.offload import OFFLOAD_MIN_SIZE

    threads: list[int] = []
    prepare = engine.input_processor.process

    def recording_prepare(*args, **kwargs):
        threads.append(threading.get_ident())
        return prepare(*args, **kwargs)

    monkeypatch.setattr(engine.input_processor, "process", recording_prepare)

    async def main():
        loop_thread = threading.get_ident()
        small = [out async for out in engine.generate(prompt_ids(8), SamplingParams(max_tokens=2, **GREEDY), "small")]
        for huge in ([65] * OFFLOAD_MIN_SIZE, "a" * OFFLOAD_MIN_SIZE):
            with pytest.raises(InvalidRequestError, match="max_model_len"):  # too long for this engine
                await engine.generate(huge, SamplingParams(max_tokens=2), f"huge-{type(huge).__name__}").__anext__()
        return loop_thread, small

    loop_thread, small = asyncio.run(main())
    assert small[-1].finished and len(small[-1].outputs[0].token_ids) == 2
    assert threads[0] == loop_thread  # small: inline, no thread hand-off
    assert len(threads) == 3 and loop_thread not in threads[1:]
    asyncio.run(wait_idle(engine))


def test_requests_and_commands_racing_a_shutdown_fail_instead_of_hanging(monkeypatch):
    """A big prompt is prepared on a worker thread; if the engine shuts down meanwhile, the
    request must fail with EngineDeadError, not wait forever for an engine thread that is gone."""
    from r3srv.offload import OFFLOAD_MIN_SIZE

    eng = AsyncLLM(max_model_len=64)
    prepare = eng.input_processor.process
    preparing, shut_down = threading.Event(), threading.Event()

    def held_prepare(request_id, prompt, params, **kwargs):
        preparing.set()
        assert shut_down.wait(timeout=60), "the test never shut the engine down"  # it lands while this runs
        return prepare(request_id, prompt[:8], params, **kwargs)

    monkeypatch.setattr(eng.input_processor, "process", held_prepare)

    async def main():
        gen = eng.generate([65] * OFFLOAD_MIN_SIZE, SamplingParams(max_tokens=2, **GREEDY), "late")
        first = asyncio.ensure_future(gen.__anext__())
        assert await asyncio.to_thread(preparing.wait, 60), "the prompt never reached its worker thread"
        await asyncio.to_thread(eng.shutdown)
        shut_down.set()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(first, timeout=10)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(eng.reset_prefix_cache(), timeout=10)

    asyncio.run(main())
