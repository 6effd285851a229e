"""Overlapped scheduling (async_scheduling=True) gives the non-overlapped engine's outputs.

The oracle is the same engine with async_scheduling off, on the same workload: tokens, text,
logprobs, prompt logprobs, finish and stop reasons, and routed-experts rows must be equal,
through every way a sequence ends (EOS, stop token, stop string, max_tokens, abort), n > 1,
prefix-cache hits, preemption under a tiny KV pool, a retract mid-generation, penalties, prompt
logprobs over chunked prompts and a hybrid (linear-attention) model; and no KV block may stay
in use. Stop tokens and strings are taken from what the model generates, so they do fire.
"""

import threading

import numpy as np
import pytest

from engine_testing import one_torch_thread, prompt_ids  # noqa: F401 (fixture)
from r3srv.engine.llm_engine import LLMEngine
from r3srv.sampling_params import SamplingParams

BASE = dict(max_model_len=128, max_num_seqs=8, num_kv_blocks=64)
TINY_POOL = dict(max_model_len=64, max_num_seqs=8, block_size=8, num_kv_blocks=12)


def _engine(async_scheduling: bool, **kwargs) -> LLMEngine:
    return LLMEngine.from_kwargs(None, async_scheduling=async_scheduling, seed=7, **kwargs)


def _run(engine: LLMEngine, requests: dict, abort_after: dict | None = None, retract_at: int | None = None) -> dict:
    """Every request to its end; `abort_after`: request id -> abort once its output holds that
    many tokens (seen by the caller: the overlapped engine reports them a step late);
    `retract_at`: retract the running sequences after that many steps."""
    abort_after = dict(abort_after or {})
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finished, steps = {}, 0
    while engine.has_unfinished():
        step = engine.step()
        assert not step.failed
        steps += 1
        for out in step.outputs:
            if out.finished:
                finished[out.request_id] = out
            elif out.request_id in abort_after and len(out.outputs[0].token_ids) >= abort_after[out.request_id]:
                del abort_after[out.request_id]
                finished[out.request_id] = engine.abort_request(out.request_id)
        if steps == retract_at:
            assert engine.retract_running() > 0
    assert not abort_after, "a request ended before its abort"
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert not engine.requests and not engine.block_manager.num_used_blocks
    return finished


def _summary(outputs: dict) -> dict:
    """Everything but the logprobs' values, exactly (those: `_assert_equal`)."""
    return {
        rid: [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs and [list(lp) for lp in c.logprobs],
             None if c.routed_experts is None else c.routed_experts.tobytes(),
             None if c.routed_experts is None else c.routed_experts.shape)
            for c in out.outputs
        ] + [out.prompt_logprobs and [lp and {t: v.rank for t, v in lp.items()} for lp in out.prompt_logprobs]]
        for rid, out in outputs.items()
    }


def _assert_equal(got: dict, want: dict) -> None:
    """Tokens, text, ends, top-logprob ids and rows exactly; logprob values to float32 noise:
    a step's batch differs between the two engines (a request admitted a step later, a step
    queued for a sequence that had ended), and CPU matmuls round differently by batch shape."""
    assert _summary(got) == _summary(want)
    for out in want.values():  # every sequence's rows came back: the prompt's and all but its last token's
        for c in out.outputs:
            if c.finish_reason != "abort":
                assert c.routed_experts.shape[0] == len(out.prompt_token_ids) + len(c.token_ids) - 1
    for rid, out in want.items():
        for c_want, c_got in zip(out.outputs, got[rid].outputs):
            if c_want.logprobs is not None:
                flat = lambda c: [v.logprob for lp in c.logprobs for v in lp.values()]  # noqa: E731
                np.testing.assert_allclose(flat(c_got), flat(c_want), rtol=1e-4, atol=1e-5)
        if out.prompt_logprobs is not None:
            values = lambda o: [v.logprob for lp in o.prompt_logprobs if lp for v in lp.values()]  # noqa: E731
            np.testing.assert_allclose(values(got[rid]), values(out), rtol=1e-4, atol=1e-5)


def _compare(requests: dict, engine_kwargs: dict, **run_kwargs) -> tuple[dict, LLMEngine]:
    plain = _run(_engine(False, **engine_kwargs), requests, **run_kwargs)
    overlapped_engine = _engine(True, **engine_kwargs)
    overlapped = _run(overlapped_engine, requests, **run_kwargs)
    _assert_equal(overlapped, plain)
    return plain, overlapped_engine


def _free_running(n: int, max_tokens: int) -> dict:
    """Greedy and seeded-sampled requests of mixed prompt lengths that run to max_tokens; the
    first six share a 32-token prefix (prefix-cache hits)."""
    shared = prompt_ids(32, base=99)
    requests = {}
    for i in range(n):
        prompt = (shared if i < 6 else []) + prompt_ids(5 + 3 * i, base=i)
        sampled = dict(temperature=0.8, top_p=0.9, seed=100 + i) if i % 2 else dict(temperature=0.0)
        requests[f"r{i}"] = (prompt, SamplingParams(max_tokens=max_tokens - i, ignore_eos=True, logprobs=2,
                                                    return_routed_experts=True, **sampled))
    return requests


def test_every_finish_kind_matches_the_plain_engine():
    requests = _free_running(10, 24)
    reference = _run(_engine(False, **BASE), requests)
    # End some requests early on what they generate: a stop token, a stop string, EOS, a
    # shorter max_tokens; one request asks for n=3 (seeded), one for n=2 greedy.
    ends = {}
    for i, rid in enumerate(sorted(requests)):
        prompt, params = requests[rid]
        tokens, text = reference[rid].outputs[0].token_ids, reference[rid].outputs[0].text
        kind = i % 5
        if kind == 0:
            params.stop_token_ids = [tokens[5]]
        elif kind == 1 and len(text) > 8:
            params.stop = [text[6:8]]
        elif kind == 2:
            ends["eos"] = tokens[4]
            params.ignore_eos = False
        elif kind == 3:
            params.max_tokens = 3
        if rid == "r1":
            params.n = 3
        if rid == "r4":
            params.n = 2
    engine_plain, engine_overlapped = _engine(False, **BASE), _engine(True, **BASE)
    for engine in (engine_plain, engine_overlapped):
        engine.core.eos_token_ids.append(ends["eos"])  # the executor shares the list: EOS for min_tokens too
    plain = _run(engine_plain, requests)
    overlapped = _run(engine_overlapped, requests)
    _assert_equal(overlapped, plain)
    reasons = {(c.finish_reason, type(c.stop_reason).__name__) for out in plain.values() for c in out.outputs}
    assert {("stop", "int"), ("stop", "str"), ("stop", "NoneType"), ("length", "NoneType")} <= reasons
    assert len(plain["r1"].outputs) == 3 and len(plain["r4"].outputs) == 2
    assert engine_overlapped.stats().prefix_cache_hits > 0


def test_preemption_under_a_tiny_pool_matches():
    requests = {
        f"p{i}": (prompt_ids(10 + 2 * i, base=i), SamplingParams(
            max_tokens=30, ignore_eos=True, return_routed_experts=True, logprobs=1,
            **(dict(temperature=0.7, seed=i) if i % 2 else dict(temperature=0.0))))
        for i in range(6)
    }
    requests["p0"][1].stop_token_ids = None
    plain, engine = _compare(requests, TINY_POOL)
    assert engine.stats().num_preemptions > 0
    assert all(len(out.outputs[0].token_ids) == 30 for out in plain.values())


def test_a_sequence_preempted_while_its_last_sample_was_queued_ends_with_its_rows(monkeypatch):
    """Its rows went with its blocks: it ends once they are recomputed (found by a search over
    small pools: here the newest sequence is preempted while the step sampling its last token runs)."""
    from r3srv.engine import stepper

    deferred, booked = [], stepper.Stepper._sampled

    def spy(self, req, seq, pos, res):
        update = booked(self, req, seq, pos, res)
        deferred.extend([seq.request_id] if update is None else [])
        return update

    monkeypatch.setattr(stepper.Stepper, "_sampled", spy)
    requests = {
        f"p{i}": (prompt_ids(n, base=i + 13), SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0, logprobs=1))
        for i, (n, m) in enumerate([(3, 23), (4, 22), (6, 7)])
    }
    _compare(requests, dict(max_model_len=32, max_num_seqs=8, block_size=4, num_kv_blocks=8))
    assert deferred


def test_aborts_and_a_retract_mid_generation_match():
    requests = _free_running(8, 20)
    plain, _ = _compare(requests, BASE, abort_after={"r2": 3, "r5": 7, "r7": 1}, retract_at=6)
    assert {rid for rid, out in plain.items() if out.outputs[0].finish_reason == "abort"} == {"r2", "r5", "r7"}
    assert len(plain["r5"].outputs[0].token_ids) == 7


def test_the_forward_runs_on_the_device_thread_while_the_host_schedules():
    engine = _engine(True, **BASE)
    forward, threads = engine.model.forward, set()

    def recording_forward(batch):
        threads.add(threading.current_thread().name)
        return forward(batch)

    engine.model.forward = recording_forward
    engine.add_request("a", prompt_ids(9), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    first = engine.step()
    assert first.outputs == [] and engine.core.stepper.queued is not None  # the prefill runs; nothing read back
    outputs = [o for _ in range(20) if engine.has_unfinished() for o in engine.step().outputs]
    assert len(outputs[-1].outputs[0].token_ids) == 6 and outputs[-1].finished
    assert threads and all(name.startswith("r3srv-device") for name in threads)
    assert not engine.has_unfinished() and engine.core.stepper.queued is None


def test_off_by_default():
    assert not _engine(False, **BASE).core.stepper.overlapped
    from r3srv.config import EngineConfig

    assert EngineConfig().async_scheduling is False
    from r3srv import engine_options
    from r3srv.cli import build_parser

    args = build_parser().parse_args(["serve", "--async-scheduling"])
    assert engine_options.from_args(args)["async_scheduling"] is True


def test_penalties_and_prompt_logprobs_match_the_plain_engine():
    """Penalties read the output ids, the one in flight included (filled on the device from the
    step before); prompt logprobs over prompts chunked across overlapped steps (positions
    reserved when a step is queued, recorded when it is booked), from several starts."""
    requests = {}
    for i in range(8):
        sampled = dict(temperature=0.8, seed=200 + i) if i % 2 else dict(temperature=0.0)
        penalty = [dict(presence_penalty=0.8), dict(frequency_penalty=-0.6), dict(repetition_penalty=1.6),
                   dict(repetition_penalty=0.7, frequency_penalty=0.4), {}][i % 5]
        prompt = dict(prompt_logprobs=[1, 0, 3][i % 3]) if i % 4 != 3 else {}
        if i == 2:
            prompt["prompt_logprobs_start"] = 9
        if i == 7:
            penalty = dict(penalty, logit_bias={5: 2.5, 77: -1.0})
        requests[f"q{i}"] = (prompt_ids(20 + 9 * i, base=i + 40), SamplingParams(
            max_tokens=18, ignore_eos=True, logprobs=1, return_routed_experts=True, **sampled, **penalty, **prompt))
    chunked = dict(BASE, max_num_batched_tokens=24)  # the longer prompts' logprobs come over several steps
    plain, _ = _compare(requests, chunked)
    assert all(plain[rid].prompt_logprobs for rid in ("q0", "q1", "q2", "q4"))
    assert len(plain["q6"].prompt_logprobs) == len(requests["q6"][0])  # a 74-token prompt in 24-token chunks


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_a_hybrid_model_matches_the_plain_engine(family, tmp_path):
    """Recurrent states in slots, prefix-cache snapshots planned in consecutive overlapped steps
    (chunked prompts, an n = 2 request resuming from its prompt's snapshot) and preemption."""
    from tiny_checkpoints import write_tiny_checkpoint

    path = str(write_tiny_checkpoint(tmp_path / family, family, seed=5, **({} if family == "nemotron_h" else
                                                                           dict(num_layers=3))))
    requests = {
        f"h{i}": (prompt_ids(9 + 7 * i, base=i + 70), SamplingParams(
            max_tokens=14, ignore_eos=True, logprobs=1, return_routed_experts=True, n=2 if i == 1 else 1,
            **(dict(temperature=0.7, seed=i) if i % 2 else dict(temperature=0.0))))
        for i in range(5)
    }
    kwargs = dict(max_model_len=64, max_num_seqs=4, block_size=4, num_kv_blocks=40, max_num_batched_tokens=16)

    def run(async_scheduling: bool):
        engine = LLMEngine.from_kwargs(path, async_scheduling=async_scheduling, seed=7, **kwargs)
        return _run(engine, requests), engine

    plain, _ = run(False)
    overlapped, engine = run(True)
    _assert_equal(overlapped, plain)
    assert engine.stats().prefix_cache_hits > 0  # the n = 2 sibling resumed from a snapshot
    assert engine.stats().state_slots_used == 0


@pytest.mark.parametrize("steps_after_retract", [0, 1, 2])
def test_a_stop_string_handed_over_after_a_retract_keeps_the_kept_tokens_rows(steps_after_retract):
    """AsyncLLM hands the output processor's stop to the core late: here after a retract and
    `steps_after_retract` steps, so the recompute of the kept tokens may be queued, not yet run."""
    from r3srv import LLM
    from r3srv.engine.core import CoreOutputs
    from r3srv.engine.output_processor import OutputProcessor

    params = dict(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True, return_routed_experts=True,
                  routed_experts_prompt_start=3)
    plain = LLM(max_model_len=128, enable_prefix_caching=False)
    free = plain.generate([prompt_ids(12)], SamplingParams(**params))[0].outputs[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    want = plain.generate([prompt_ids(12)], SamplingParams(stop=[stop], **params))[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < len(free.token_ids)

    engine = LLM(max_model_len=128, enable_prefix_caching=False, async_scheduling=True).engine
    core, op = engine.core, OutputProcessor(engine.tokenizer)
    prep = engine.prepare_request("r", prompt_ids(12), SamplingParams(stop=[stop], **params))
    core.add_request(prep)
    op.add_request(prep)
    # step until the output processor finds the stop; retract; step on; then hand the stop over
    stops = []
    while not stops:
        stops = op.process(core.step()).stops
    assert core.retract_running() == 1
    finals = []
    for _ in range(steps_after_retract):
        finals += op.process(core.step()).outputs
    core_out = CoreOutputs()
    for s in stops:
        core_out.extend(core.stop_sequence(s.request_id, s.index, s.num_output_tokens, s.stop))
    finals += op.process(core_out).outputs
    while core.has_unfinished():
        finals += op.process(core.step()).outputs
    finals = [o for o in finals if o.finished]
    assert len(finals) == 1
    got = finals[0].outputs[0]
    assert (got.text, got.token_ids, got.stop_reason) == (want.text, want.token_ids, want.stop_reason)
    np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
    assert not core.requests and core.block_manager.num_used_blocks == 0


def test_async_llm_with_overlap_streams_the_plain_engines_outputs_and_pauses_by_retract(gate):
    """The server's engine: concurrent streams, a retract pause in the middle (a step still
    queued), then a weight update's drain (resume): the same outputs as the offline plain engine."""
    import asyncio

    from step_gate import gate_steps

    from r3srv.engine.async_llm import AsyncLLM

    requests = _free_running(4, 16)
    want = _run(_engine(False, **BASE), requests)
    engine = AsyncLLM(None, async_scheduling=True, seed=7, **BASE)
    gate_steps(engine.core, gate.path)
    try:
        streamed = []

        async def one(rid):
            prompt, params = requests[rid]
            async for out in engine.generate(prompt, params, rid):
                streamed.append(rid)
            return out

        async def main():
            with gate.allowing(6):  # the middle of every request's 13 to 16 tokens, whatever the speed
                tasks = [asyncio.create_task(one(rid)) for rid in requests]
                while len(streamed) < len(requests):  # outputs of the first steps are in
                    await asyncio.sleep(0.001)
                await engine.pause_generation(mode="retract")
                await engine.reset_prefix_cache()
                await engine.continue_generation()
            return {rid: await task for rid, task in zip(requests, tasks)}

        got = asyncio.run(main())
    finally:
        engine.shutdown()
    _assert_equal(got, want)
