"""Weight-version spans in process: each sample's `weight_versions` says which weights drew which
of its tokens, recorded where the step's tokens are booked; `RequestOutput.weight_version` names
the weights that computed its rows. An update in the middle of a sequence (retract, or AsyncLLM's
keep mode) splits its spans exactly where the new weights began; tokens on either side are what
each checkpoint's greedy decoding gives."""

import asyncio
from types import SimpleNamespace

import pytest

from engine_testing import GREEDY, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from step_gate import gate_steps
from r3srv import LLM, SamplingParams
from r3srv.engine.async_llm import AsyncLLM
from r3srv.engine.output_processor import SeqState
from r3srv.engine.sampler import SampleResult
from r3srv.outputs import OutputKind, WeightVersionSpan
from test_weight_updates import ENGINE, PROMPT, policies  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # an engine per test on two checkpoints

LONG = SamplingParams(max_tokens=30, **GREEDY)


def greedy(path, prompt: list[int], n: int) -> list[int]:
    """The oracle: `path`'s greedy continuation of `prompt`, computed cold by a fresh engine."""
    return LLM(str(path), **ENGINE).generate([prompt], SamplingParams(max_tokens=n, **GREEDY))[0].outputs[0].token_ids


def check_split(old, new, tokens: list[int], split: int) -> None:
    """tokens[:split] are `old`'s greedy picks after PROMPT, the rest `new`'s after them."""
    assert 0 < split < len(tokens)
    assert tokens[:split] == greedy(old, PROMPT, split)
    assert tokens[split:] == greedy(new, PROMPT + tokens[:split], len(tokens) - split)


@pytest.mark.parametrize("async_scheduling", [False, True])  # plain steps, and a step queued ahead
def test_a_retract_and_update_split_the_spans_where_the_new_weights_began(policies, async_scheduling):
    v0, v1, _ = policies
    engine = LLM(str(v0), **ENGINE, async_scheduling=async_scheduling, weight_version="v0").engine
    engine.add_request("long", PROMPT, LONG)
    engine.add_request("short", prompt_ids(20, base=3), SamplingParams(max_tokens=3, **GREEDY))
    finished = {}
    for _ in range(6):  # the prompts and a few tokens on v0: "short" ends, "long" runs on
        finished |= {o.request_id: o for o in engine.step().outputs if o.finished}
    assert engine.retract_running() == 1
    split = engine.core.requests["long"].seqs[0].num_output_tokens  # drawn by v0, queued steps included
    engine.update_weights(str(v1), weight_version="v1")
    while engine.has_unfinished():
        finished |= {o.request_id: o for o in engine.step().outputs if o.finished}
    short, long = finished["short"], finished["long"]
    assert short.outputs[0].weight_versions == [WeightVersionSpan("v0", 0, 3)] and short.weight_version == "v0"
    got = long.outputs[0]
    assert got.weight_versions == [WeightVersionSpan("v0", 0, split), WeightVersionSpan("v1", split, 30)]
    assert long.weight_version == "v1"  # its rows were recomputed on v1
    check_split(v0, v1, got.token_ids, split)


def test_async_keep_abort_and_wait_modes(policies, gate):
    """AsyncLLM: an update under pause mode keep splits a running request's spans; under abort
    and wait the request ends on the old weights, in one span. DELTA outputs carry the spans on
    the final output alone, covering every token."""
    v0, v1, _ = policies
    engine = AsyncLLM(str(v0), **ENGINE, weight_version="v0")
    gate_steps(engine.core, gate.path)

    async def main():
        async def run(rid, params=LONG, kind=OutputKind.CUMULATIVE):
            return [o async for o in engine.generate(PROMPT, params, rid, output_kind=kind)]

        async def produced(rid, n):
            while rid not in engine.core.requests or engine.core.requests[rid].seqs[0].num_output_tokens < n:
                await asyncio.sleep(0.001)

        with gate.allowing(5):  # held short of its 30 tokens until the gate opens
            task = asyncio.create_task(run("keep", kind=OutputKind.DELTA))
            await produced("keep", 3)
            await engine.pause_generation("keep")
            await engine.update_weights(str(v1), weight_version="v1")  # retracts the frozen request
            split = engine.core.requests["keep"].seqs[0].num_output_tokens
        assert await engine.continue_generation() is True
        keep = await task

        with gate.allowing(5):
            task = asyncio.create_task(run("aborted"))
            await produced("aborted", 2)
            await engine.pause_generation("abort")
        aborted = (await task)[-1]
        await engine.continue_generation()

        with gate.allowing(5):
            task = asyncio.create_task(run("waited", SamplingParams(max_tokens=8, **GREEDY)))
            await produced("waited", 2)
            pause = asyncio.create_task(engine.pause_generation("wait"))
            gate.open()  # wait mode pauses once the request has finished
            await pause
        await engine.update_weights(str(v0), weight_version="v0-again")
        await engine.continue_generation()
        return keep, split, aborted, (await task)[-1]

    try:
        keep, split, aborted, waited = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(o.outputs[0].weight_versions is None for o in keep[:-1])
    final = keep[-1]
    tokens = [t for o in keep for t in o.outputs[0].token_ids]
    assert final.outputs[0].weight_versions == [WeightVersionSpan("v0", 0, split), WeightVersionSpan("v1", split, 30)]
    assert final.weight_version == "v1"
    check_split(v0, v1, tokens, split)
    n = len(aborted.outputs[0].token_ids)
    assert aborted.outputs[0].finish_reason == "abort" and 2 <= n < 30
    assert aborted.outputs[0].weight_versions == [WeightVersionSpan("v1", 0, n)] and aborted.weight_version == "v1"
    assert waited.outputs[0].weight_versions == [WeightVersionSpan("v1", 0, 8)] and waited.weight_version == "v1"


def test_a_cut_trims_the_spans_with_the_tokens():
    """A stop string found after the core's last step cuts tokens in the output processor: the
    spans end with the kept tokens, and a span that began after the cut goes."""
    prep = SimpleNamespace(params=SamplingParams(detokenize=False), prompt_token_ids=[1, 2])
    seq = SeqState(0, prep, None)
    for token, version in zip([5, 6, 7, 8, 9], ["a", "a", "b", "b", "c"]):
        seq.append(SampleResult(token, weight_version=version))
    assert seq.weight_versions() == [WeightVersionSpan("a", 0, 2), WeightVersionSpan("b", 2, 4),
                                     WeightVersionSpan("c", 4, 5)]
    seq.cut(0, 3)
    assert seq.weight_versions() == [WeightVersionSpan("a", 0, 2), WeightVersionSpan("b", 2, 3)]
    seq.cut(0, 2)
    assert seq.weight_versions() == [WeightVersionSpan("a", 0, 2)]
