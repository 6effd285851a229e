"""Output kinds: DELTA outputs add up to the finished output (also when a slow consumer gets
them merged), and partial outputs never hand out tokens that a stop string later cuts."""

import asyncio

import numpy as np
import pytest

from engine_testing import GREEDY, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
import r3srv.engine.executor as executor_module
from r3srv import SamplingParams
from r3srv.engine.async_llm import AsyncLLM
from r3srv.engine.llm_engine import LLMEngine
from r3srv.engine.sampler import SampleResult
from r3srv.outputs import OutputKind


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM(max_model_len=256, max_num_seqs=16, enable_return_routed_experts=True)
    yield eng
    eng.shutdown()


def add_up(deltas):
    """The choices of a DELTA stream, concatenated."""
    joined = {}
    for out in deltas:
        for c in out.outputs:
            text, ids, lps = joined.get(c.index, ("", [], [] if c.logprobs is not None else None))
            joined[c.index] = (text + c.text, ids + c.token_ids, None if lps is None else lps + c.logprobs)
    return joined


SAMPLED = dict(max_tokens=24, n=2, logprobs=2, seed=11, temperature=1.0, ignore_eos=True, return_routed_experts=True)


async def all_delivered(engine, request_id: str) -> None:
    """Until the output thread has handed over the request's last output (it then drops the
    request's sink): every output not read yet waits in the consumer's queue."""
    while request_id in engine._sinks:
        await asyncio.sleep(0.001)
    # the last output was scheduled onto this loop before the request left _sinks: one turn of
    # the loop runs it ahead of this coroutine
    await asyncio.sleep(0)


@pytest.mark.parametrize("consumer_waits", [False, True])
@pytest.mark.parametrize("params", [SAMPLED, dict(SAMPLED, stop=["e", "t "], n=1)], ids=["n2-sampled", "stop-strings"])
def test_delta_outputs_add_up_to_the_finished_output(engine, params, consumer_waits):
    prompt = prompt_ids(9, base=3)

    async def run(kind, rid):
        outs = []
        async for out in engine.generate(prompt, SamplingParams(**params), rid, output_kind=kind):
            outs.append(out)
            if len(outs) == 1 and consumer_waits:
                await all_delivered(engine, rid)  # the rest piles up: it must be merged, not dropped
        return outs

    deltas = asyncio.run(run(OutputKind.DELTA, f"delta-{consumer_waits}"))
    final = asyncio.run(run(OutputKind.FINAL_ONLY, f"final-{consumer_waits}"))[0]
    assert deltas[-1].finished and all(not o.finished for o in deltas[:-1])
    joined = add_up(deltas)
    for want, got in zip(final.outputs, deltas[-1].outputs):
        text, ids, lps = joined[want.index]
        assert (text, ids, lps) == (want.text, want.token_ids, want.logprobs)
        assert got.finish_reason == want.finish_reason and got.cumulative_logprob == pytest.approx(want.cumulative_logprob)
        np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
    if consumer_waits:  # the first output, then everything after it merged into one
        assert len(deltas) == 2 and max(len(c.token_ids) for c in deltas[1].outputs) > 1


def test_partial_outputs_hold_back_tokens_that_add_no_text_before_a_stop(monkeypatch):
    """Byte-level tokens 'a', 0xC3, 0xA9 ('é' in two tokens), 'z' with stop "éz": after 'é' only
    'a' is safe to hand out; the 0xC3 token adds no text yet, but the stop cuts it too."""
    script = iter([ord("a"), 0xC3, 0xA9, ord("z"), ord("q")])

    def scripted(logits, seqs, eos, generator, logprobs_mode):
        return [SampleResult(t, -0.5, {t: -0.5}) for t in (next(script) for _ in seqs)]

    monkeypatch.setattr(executor_module, "sample", scripted)
    engine = LLMEngine.from_kwargs(None, max_model_len=64, num_kv_blocks=16)
    engine.add_request("r", [104, 105], SamplingParams(max_tokens=5, stop=["éz"], logprobs=0))
    partial = []
    while engine.has_unfinished():
        partial += [o.outputs[0] for o in engine.step().outputs]
    final = partial.pop()
    assert (final.text, final.token_ids, final.finish_reason, final.stop_reason) == ("a", [ord("a")], "stop", "éz")
    assert [p.token_ids for p in partial] == [[], [], [ord("a")]]  # never 0xC3
    for p in partial + [final]:  # each output's cumulative logprob covers exactly its tokens
        assert final.text.startswith(p.text) and len(p.logprobs) == len(p.token_ids)
        assert p.cumulative_logprob == -0.5 * len(p.token_ids)
