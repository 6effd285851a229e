"""NeMo-RL's and ROLL's vLLM read and call paths, replayed against r3srv.compat.vllm (neither
framework has a plug-in point: docs/rl.md gives the patch each needs to construct these objects).
Each test names the file and lines it replays; r3srv's own LLM on the same checkpoint is the
oracle for tokens and logprobs.

- NeMo-RL (NVIDIA/NeMo-RL@54bec9d1, nemo_rl/models/generation/vllm.py): the engine keywords
  (317-343), the sampling params (394-402), token-id dict prompts and the first logprob entry of
  each position (461-509), the async path's request_id and `logprobs[i][token].logprob`
  (591-704), text prompts (772-787), prefix-cache reset and sleep level 1 (971-1008), wake_up by
  tags (1013-1049); its collective_rpc methods (348, 834-953) are its worker extension's, refused
  by name.
- ROLL (alibaba/ROLL@8eb27cc2, roll/distributed/strategy/vllm_strategy.py): get_tokenizer
  (147-148), the sampling params
  with FINAL_ONLY output kind (464-478), TokensPrompt (190, 305), generate with request_id and
  lora_request=None (203-207, 314-319), the final output of an aborted request with
  finish_reason "abort" (325-345, 358-360), prefix-cache reset around offload/load (363-374).
"""

from __future__ import annotations

import asyncio

import pytest
from tiny_checkpoints import write_tiny_checkpoint

import r3srv.compat.vllm as vllm
from engine_testing import prompt_ids
from r3srv import LLM as R3srvLLM
from r3srv import SamplingParams as R3srvSamplingParams
from r3srv.errors import InvalidRequestError
from step_gate import gate_steps

pytestmark = pytest.mark.slow  # engines on a tiny transformers checkpoint

ENGINE = dict(max_model_len=128, num_kv_blocks=64, device="cpu")
PROMPTS = [prompt_ids(9, base=5), prompt_ids(14, base=60)]
MAX_NEW = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("contracts") / "v0", seed=3)


@pytest.fixture(scope="module")
def oracle(checkpoint):
    llm = R3srvLLM(str(checkpoint), **ENGINE)
    outs = llm.generate(PROMPTS, R3srvSamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0))
    return [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def nemo_rl_llm_kwargs(checkpoint) -> dict:
    """NeMo-RL's llm_kwargs (vllm.py 317-334) on the CPU; a model owner always has an int seed (configure_worker)."""
    return dict(
        model=str(checkpoint), load_format="auto", skip_tokenizer_init=False, tensor_parallel_size=1,
        pipeline_parallel_size=1, gpu_memory_utilization=0.6, enable_prefix_caching=True, dtype="float32", seed=0,
        enforce_eager=True, max_model_len=ENGINE["max_model_len"], trust_remote_code=True,
        worker_extension_cls="nemo_rl.models.generation.vllm_backend.VllmInternalWorkerExtension",
        enable_sleep_mode=True, disable_log_stats=True, distributed_executor_backend=None,
        device="cpu", num_kv_blocks=ENGINE["num_kv_blocks"],
    )


def nemo_rl_sampling_params(greedy: bool = True) -> vllm.SamplingParams:
    """vllm.py 394-402 (`_build_sampling_params`): greedy is top_k=1 at temperature 0."""
    return vllm.SamplingParams(temperature=0.0 if greedy else 1.0, top_p=1.0, top_k=1 if greedy else -1,
                               max_tokens=MAX_NEW, logprobs=0, stop_token_ids=None, stop=None,
                               include_stop_str_in_output=True)


def test_nemo_rl_sync_worker_reads(checkpoint, oracle):
    llm = vllm.LLM(**nemo_rl_llm_kwargs(checkpoint))
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], nemo_rl_sampling_params())
        for output, (tokens, logprobs) in zip(outputs, oracle):
            generation = output.outputs[0]
            assert list(generation.token_ids) == tokens
            # vllm.py 503-509: the first entry of each position is the sampled token's
            assert [next(iter(d.items()))[1].logprob for d in generation.logprobs] == pytest.approx(logprobs, abs=1e-5)
        texts = [o.outputs[0].text for o in llm.generate(["a b c"], nemo_rl_sampling_params())]  # 786-787
        assert len(texts) == 1 and isinstance(texts[0], str)
        # 971-990: reset_prefix_cache through llm_engine, then sleep(level=1); 1013-1030: wake_up(tags)
        llm.llm_engine.reset_prefix_cache()
        llm.sleep(level=1)
        assert llm.is_sleeping()
        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping()  # the KV cache is still released
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping()
        assert [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                                    nemo_rl_sampling_params())] == [t for t, _ in oracle]
        # 348, 834-953: NeMo-RL's worker-extension methods are not r3srv's table
        for method in ("init_collective", "report_device_id", "update_weights_from_ipc_handles"):
            with pytest.raises(InvalidRequestError) as refused:
                llm.collective_rpc(method, args=())
            assert refused.value.param == "method"
    finally:
        llm.shutdown()


def test_nemo_rl_async_worker_reads(checkpoint, oracle):
    async def run():
        llm = vllm.AsyncLLM.from_engine_args(vllm.AsyncEngineArgs(**nemo_rl_llm_kwargs(checkpoint)))  # 337-341
        try:
            async def one(i, prompt):  # 581-587, 622-626: the final output of each request's generator
                final = None
                async for out in llm.generate(prompt={"prompt_token_ids": prompt},
                                              sampling_params=nemo_rl_sampling_params(), request_id=f"nemo-{i}"):
                    final = out
                return final

            finals = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
            for i, (final, (tokens, logprobs)) in enumerate(zip(finals, oracle)):
                assert final.request_id == f"nemo-{i}"  # 651
                g = final.outputs[0]  # 657-704
                assert list(g.token_ids) == tokens
                assert [d[t].logprob for d, t in zip(g.logprobs, g.token_ids)] == pytest.approx(logprobs, abs=1e-5)
            await llm.reset_prefix_cache()  # 1007-1008
            await llm.sleep(level=1)
            assert await llm.is_sleeping()
            await llm.wake_up()  # 1049, tags None: everything
            assert not await llm.is_sleeping()
        finally:
            llm.shutdown()

    asyncio.run(run())


def roll_sampling_params(**gen_kwargs) -> vllm.SamplingParams:
    """vllm_strategy.py 464-478 (create_sampling_params_for_vllm), collect_unfinished=False."""
    return vllm.SamplingParams(
        max_tokens=gen_kwargs["max_new_tokens"], temperature=0.0, top_p=1.0, top_k=-1, stop_token_ids=None,
        repetition_penalty=1.0, n=1, stop=None, logprobs=0, output_kind=vllm.RequestOutputKind.FINAL_ONLY,
        include_stop_str_in_output=True)


def test_roll_generate_request_abort_and_offload(checkpoint, oracle, gate):
    async def generate_request(llm, prompt, rid, max_new_tokens):  # 290-345
        final = None
        async for result in llm.generate(prompt=vllm.TokensPrompt(prompt_token_ids=prompt),
                                         sampling_params=roll_sampling_params(max_new_tokens=max_new_tokens),
                                         request_id=rid, lora_request=None):
            final = result
        c = final.outputs[0]
        return {"output_token_ids": [c.token_ids], "finish_reasons": ["abort" if c.finish_reason is None
                                                                      else c.finish_reason],
                "output_logprobs": [[float(lps[t].logprob) for t, lps in zip(c.token_ids, c.logprobs)]]}

    async def run():
        llm = vllm.AsyncLLM(str(checkpoint), **ENGINE)
        gate_steps(llm.r3srv.core, gate.path)
        try:
            tokenizer = llm.get_tokenizer()  # 147-148 (vLLM >= 0.15: not awaited)
            assert tokenizer.decode(tokenizer.encode("roll", add_special_tokens=False)) == "roll"
            results = await asyncio.gather(*(generate_request(llm, p, f"roll-{i}", MAX_NEW)
                                             for i, p in enumerate(PROMPTS)))
            for result, (tokens, logprobs) in zip(results, oracle):
                assert result["output_token_ids"] == [tokens]
                assert result["output_logprobs"][0] == pytest.approx(logprobs, abs=1e-5)
            # 358-360: a partial rollout's abort; the request's final output says "abort"
            with gate.allowing(2):  # the request stays in flight until the abort
                pending = asyncio.ensure_future(generate_request(llm, PROMPTS[0], "roll-aborted", 60))
                while llm.r3srv.stats().num_running < 1:
                    await asyncio.sleep(0.01)
                await llm.abort(request_id="roll-aborted")
            aborted = await pending  # the gate is open again: an abort that did nothing would finish on "length"
            assert aborted["finish_reasons"] == ["abort"]
            assert len(aborted["output_token_ids"][0]) < 60
            assert llm.get_num_unfinished_requests() == 0
            assert llm.r3srv.stats().kv_blocks_used == 0  # the abort freed every block
            # 363-374: offload and load bracket a prefix-cache reset (ROLL's own offload_states /
            # load_states are vLLM's sleep(level) / wake_up once patched: docs/rl.md)
            await llm.reset_prefix_cache()
            await llm.sleep(level=1)
            await llm.wake_up()
            again = await generate_request(llm, PROMPTS[1], "roll-after-wake", MAX_NEW)
            assert again["output_token_ids"] == [oracle[1][0]]
        finally:
            llm.shutdown()

    asyncio.run(run())
